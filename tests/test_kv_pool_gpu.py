"""The um and pinned KV pools on a CUDA GPU: pages survive spill and return bit for bit,
spilled managed pages really leave the device, and the engine over either pool gives
the device pool's greedy output. Skipped without CUDA."""

import pytest
import torch
from tiny_models import finished_token_ids

from lowvram.config import load_profile
from lowvram.core.sampling_params import SamplingParams
from lowvram.engine.engine import LLMEngine
from lowvram.kernels.kv_quant import gather_kv, store_kv
from lowvram.kv.backend import create_kv_pool
from lowvram.kv.pool import KVShape
from lowvram.kv.tiers import ManagedKVPool, PinnedKVPool

pytestmark = pytest.mark.gpu
GIB = 2**30
# Four layers of the R1-Distill-Qwen-1.5B KV shape: 8 KiB of K per page and layer in FP16.
SHAPE = KVShape(num_layers=4, block_size=16, num_kv_heads=2, head_dim=128, dtype=torch.float16)
PROMPTS = ["Hello world, this is a test of", "def add(a, b):\n    return", "The quick brown fox"]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _last_prefetch_is_host(memory, tensor, start_bytes: int, num_bytes: int) -> bool:
    from lowvram.kv.managed_memory import check

    attr = memory.rt.cudaMemRangeAttribute.cudaMemRangeAttributeLastPrefetchLocation
    result = memory.rt.cudaMemRangeGetAttribute(4, attr, tensor.data_ptr() + start_bytes, num_bytes)
    return int(check(result, "cudaMemRangeGetAttribute")) == int(memory.rt.cudaCpuDeviceId)


def _memory():
    pytest.importorskip("cuda.bindings")
    from lowvram.kv.managed_memory import ManagedMemory

    return ManagedMemory(torch.device("cuda"))


def _block_data(block: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator(device="cuda").manual_seed(1000 + block)
    shape = (SHAPE.block_size, SHAPE.num_kv_heads, SHAPE.head_dim)
    return [
        (
            torch.randn(shape, generator=gen, device="cuda", dtype=torch.float16),
            torch.randn(shape, generator=gen, device="cuda", dtype=torch.float16),
        )
        for _ in range(SHAPE.num_layers)
    ]


def _slots(row: int) -> torch.Tensor:
    return torch.arange(row * SHAPE.block_size, (row + 1) * SHAPE.block_size, device="cuda")


def _write(pool, block: int) -> None:
    pool.ensure_resident([block])
    row = pool.device_table([block])[0]
    for pages, (k, v) in zip(pool.pages, _block_data(block)):
        store_kv(pages, _slots(row), k, v)


def _assert_block_equal(pool, block: int) -> None:
    pool.ensure_resident([block])
    row = pool.device_table([block])[0]
    for pages, (k_ref, v_ref) in zip(pool.pages, _block_data(block)):
        k, v = gather_kv(pages, _slots(row))
        assert torch.equal(k, k_ref.float()) and torch.equal(v, v_ref.float()), f"page {block} changed"


def _managed_pool(num_blocks=64, max_device_blocks=16, precision="fp16") -> ManagedKVPool:
    return ManagedKVPool(
        SHAPE,
        num_blocks,
        precision,
        "cuda",
        max_device_blocks=max_device_blocks,
        memory=_memory(),
        budget_bytes=4 * GIB,
    )


def _written_pool(backend: str):
    """A 64-page FP16 pool with a 16-page device share ("um" or "pinned"), every page written in order."""
    if backend == "um":
        pool = _managed_pool()
    else:
        pool = PinnedKVPool(SHAPE, 64, "fp16", "cuda", max_device_blocks=16, num_host_blocks=48)
    for block in range(64):
        _write(pool, block)
    return pool


def test_managed_pages_are_managed_memory_viewed_by_torch():
    pool = _managed_pool()
    from cuda.bindings import runtime as rt

    err, attrs = rt.cudaPointerGetAttributes(pool.pages[0].k.data_ptr())
    assert err == rt.cudaError_t.cudaSuccess and attrs.type == rt.cudaMemoryType.cudaMemoryTypeManaged
    assert pool.pages[0].v.data_ptr() == pool.pages[0].k.data_ptr() + pool.pages[0].k.numel() * 2
    assert pool.unit_size == 1


@pytest.mark.parametrize("backend", ["um", "pinned"])
def test_pages_survive_spill_and_return_bit_for_bit(backend):
    pool = _written_pool(backend)  # 64 pages through a 16-page device share
    pool.synchronize()
    assert pool.num_blocks_on_host() == 48
    for block in list(range(63, -1, -1)) + [0, 40, 7]:
        _assert_block_equal(pool, block)
    assert pool.spilled_bytes > 0 and pool.fetched_bytes > 0


@pytest.mark.parametrize("backend", ["um", "pinned"])
def test_prefetch_overlaps_and_ensure_resident_orders_the_read(backend):
    pool = _written_pool(backend)
    pool.prefetch(range(8), protected=range(56, 64))
    busy = torch.randn(4096, 4096, device="cuda", dtype=torch.float16)
    for _ in range(4):  # compute the copies can overlap with
        busy = busy @ busy
    for block in range(8):
        _assert_block_equal(pool, block)
    for block in range(56, 64):
        assert pool.is_resident(block)


@pytest.mark.xfail(
    strict=True,
    reason=(
        "on the H200 test VM (driver 580.159, 2026-11-30) cudaMemGetInfo does not change when 64 MiB of "
        "managed memory is touched on the GPU nor when it is prefetched to the host, so the free-memory "
        "rise this test expects cannot be observed there; open item of the KV-pool issue"
    ),
)
def test_spilled_managed_pages_are_prefetched_to_host_and_leave_the_device():
    pool = _managed_pool(num_blocks=1024, max_device_blocks=1024)  # 8 MiB x 4 layers x 2 = 64 MiB of codes
    for pages in pool.pages:  # touch every page on the GPU
        pages.k.fill_(1.0)
        pages.v.fill_(2.0)
    torch.cuda.synchronize()
    free_before = pool.memory.free_bytes()
    freed = pool.set_max_device_blocks(128)
    pool.synchronize()
    torch.cuda.synchronize()
    assert freed == (1024 - 128) * 4 * 2 * 16 * 2 * 128 * 2
    assert _last_prefetch_is_host(pool.memory, pool._flats[0], 0, 8192)
    assert pool.memory.free_bytes() - free_before >= 0.8 * freed
    assert torch.equal(pool.pages[3].v[5], torch.full_like(pool.pages[3].v[5], 2.0))  # still readable in place


def _gather_us(tensors: list[torch.Tensor], rows: torch.Tensor) -> float:
    """Device time, µs, of the GPU gathering `rows` of each tensor (its SMs read the bytes)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for tensor in tensors:
        tensor.index_select(0, rows)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000


def test_spilled_managed_pages_are_read_from_the_host():
    # Where free device memory cannot be observed (above), where a page lives can: the GPU
    # reads a page in device memory at HBM speed and a page on the host over the bus. The
    # same pages, read before the spill and after it, must come at least 4x slower after.
    pool = _managed_pool(num_blocks=1024, max_device_blocks=1024)
    for pages in pool.pages:
        pages.k.fill_(1.0)
        pages.v.fill_(2.0)
    tensors = [t for pages in pool.pages for t in (pages.k, pages.v)]
    rows = torch.arange(1024, device="cuda")
    _gather_us(tensors, rows)  # kernels loaded, pages on the GPU
    before_us = sorted(_gather_us(tensors, rows) for _ in range(3))[1]
    pool.set_max_device_blocks(128)
    pool.synchronize()
    torch.cuda.synchronize()
    spilled = [block for block in range(1024) if not pool.is_resident(block)]
    assert len(spilled) == 1024 - 128
    rows = torch.tensor(spilled, device="cuda")
    before_spilled_us = before_us * len(spilled) / 1024
    after_us = _gather_us(tensors, rows)
    again_us = _gather_us(tensors, rows)
    num_bytes = sum(t[0].numel() * t.element_size() for t in tensors) * len(spilled)
    print(
        f"\n{num_bytes / 2**20:.0f} MiB of spilled pages read by the GPU: {before_spilled_us:.0f} µs on the device "
        f"before the spill, {after_us:.0f} µs after it ({num_bytes / after_us / 1e3:.1f} GB/s), "
        f"{again_us:.0f} µs read again"
    )
    assert after_us >= 4 * before_spilled_us, (
        f"spilled pages read in {after_us:.0f} µs against {before_spilled_us:.0f} µs on the device: "
        "they did not leave device memory"
    )
    assert torch.equal(pool.pages[3].v[spilled[5]], torch.full_like(pool.pages[3].v[0], 2.0))


@pytest.mark.parametrize("backend", ["um", "pinned"])
def test_precision_change_frees_bytes_and_keeps_pages_close(backend):
    pool = _written_pool(backend)
    before = pool.device_bytes
    freed = pool.set_precision("int8")
    assert freed == before - pool.device_bytes > 0
    if backend == "um":  # 16 resident pages of codes; the scales of all 64 pages stay on the device
        layers = SHAPE.num_layers
        expected = 16 * layers * 2 * (8192 - 4096) - 64 * layers * 4 * SHAPE.block_size * SHAPE.num_kv_heads * 2
    else:  # 16 device slots
        expected = 16 * (SHAPE.block_bytes("fp16") - SHAPE.block_bytes("int8"))
    assert freed == expected
    for block in range(64):
        pool.ensure_resident([block])
        row = pool.device_table([block])[0]
        for pages, (k_ref, _) in zip(pool.pages, _block_data(block)):
            k, _ = gather_kv(pages, _slots(row))
            assert (k - k_ref.float()).abs().max() < 0.05
    assert pool.set_precision("int4") > 0
    assert pool.unit_size == (2 if backend == "um" else 1)  # 2 KiB INT4 pages share a 4 KiB OS page


@pytest.mark.parametrize("backend", ["um", "pinned"])
def test_pages_kept_in_fp16_stay_exact_through_spill_and_refetch(backend):
    pool = _written_pool(backend)  # pages 48-63 end on the device
    window = [63, 62, 61]
    before = pool.device_bytes
    freed = pool.set_precision("int8", fp16_block_ids=window)
    assert pool.window_block_ids == window and freed == before - pool.device_bytes
    for block in list(range(64)) + window:  # every page through the 16-page share, the kept ones twice
        pool.ensure_resident([block])
        row = pool.device_table([block])[0]
        for pages, (k_ref, v_ref) in zip(pool.pages, _block_data(block)):
            k, v = gather_kv(pages, _slots(row))
            if block in window:
                assert torch.equal(k, k_ref.float()) and torch.equal(v, v_ref.float()), f"page {block} changed"
            else:
                assert 0 < (k - k_ref.float()).abs().max() < 0.05


def _generate(engine, rounds=2):
    results = []
    for _ in range(rounds):  # the second round reads prompt pages back through the prefix cache
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(f"{len(results)}-{i}", prompt, GREEDY)
        final = finished_token_ids(engine)
        results.append([final[f"{len(results)}-{i}"] for i in range(len(PROMPTS))])
    return results


def _engine(model_dir, backend: str) -> LLMEngine:
    profile = load_profile("4gb").replace(kv_backend=backend, max_model_len=256)
    return LLMEngine(str(model_dir), profile, emulate_vram_gib=4.0)


@pytest.mark.parametrize("backend", ["um", "pinned"])
def test_engine_over_a_spilling_pool_matches_the_device_pool(tiny_qwen2_dir, backend):
    pytest.importorskip("cuda.bindings")
    expected = _generate(_engine(tiny_qwen2_dir, "device"))
    engine = _engine(tiny_qwen2_dir, backend)
    assert engine.kv_pool.backend == backend
    # Three sequences of three pages: nine fit, so no step is split; older pages spill.
    engine.kv_pool.set_max_device_blocks(9 if backend == "pinned" else 4)
    assert _generate(engine) == expected
    assert engine.kv_pool.spilled_bytes > 0 and engine.kv_pool.fetched_bytes > 0


def test_pinned_engine_runs_batches_larger_than_the_device_share_in_parts(tiny_qwen2_dir):
    reference = _engine(tiny_qwen2_dir, "device")
    engine = _engine(tiny_qwen2_dir, "pinned")
    engine.kv_pool.set_max_device_blocks(4)
    logits = {}
    for eng, name in ((reference, "device"), (engine, "pinned")):
        run = eng.runner.run
        rows = logits.setdefault(name, [])

        def recording_run(batch, run=run, rows=rows, **kwargs):
            out = run(batch, **kwargs)
            rows.append(out.float().cpu())
            return out

        eng.runner.run = recording_run
    expected = _generate(reference, rounds=1)
    got = _generate(engine, rounds=1)
    assert [g[:4] for g in got[0]] == [e[:4] for e in expected[0]]
    worst = max((a - b).abs().max().item() / b.abs().max().item() for a, b in zip(logits["pinned"], logits["device"]))
    print(f"largest relative logit difference, split vs whole batches: {worst:.2e}")
    assert worst < 1e-2


def test_auto_backend_on_this_gpu_is_um_and_fits_free_memory(tiny_qwen2_dir):
    pytest.importorskip("cuda.bindings")
    engine = _engine(tiny_qwen2_dir, "auto")
    assert engine.kv_pool.backend == "um"
    assert engine.kv_pool.memory.free_bytes() > 0


def test_explicit_um_over_free_memory_is_refused_before_allocating(tiny_qwen2_dir):
    pytest.importorskip("cuda.bindings")
    from lowvram.errors import OutOfMemoryError

    engine = _engine(tiny_qwen2_dir, "device")

    class TinyFreeMemory(type(_memory())):
        def free_bytes(self):
            return 1

    profile = engine.profile.replace(kv_backend="um")
    with pytest.raises(OutOfMemoryError, match="GiB free"):
        create_kv_pool(
            engine.config,
            profile,
            engine.kv_plan.num_blocks,
            engine.device,
            engine.dtype,
            "fp16",
            max_model_len=engine.max_model_len,
            memory=TinyFreeMemory(engine.device),
        )
