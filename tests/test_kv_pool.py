"""The KV pool on the CPU: backend choice and its safety checks, residency and spill
bookkeeping (pinned on CPU tensors, um through a stand-in for cuda-bindings), exact
data round trips, and re-quantization with its byte accounting."""

import pytest
import torch

from lowvram.errors import ConfigError, KernelError, OutOfMemoryError
from lowvram.kernels.kv_quant import gather_kv, store_kv
from lowvram.kv.backend import plan_pool
from lowvram.kv.pool import DeviceKVPool, KVShape
from lowvram.kv.tiers import ManagedKVPool, PinnedKVPool

GIB = 2**30
# 2 layers, pages of 4 tokens, 2 KV heads of 8; fp16 pages hold float32 on the CPU.
SHAPE = KVShape(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float32)
CODE_BYTES_FP32 = 4 * 2 * 8 * 4  # one page of one layer's K: B * Hkv * D * 4


class FakeManagedMemory:
    """Stands in for cuda-bindings: allocations are CPU tensors, placements are recorded."""

    def __init__(self, free_bytes: int = GIB, page_bytes: int = 512):
        self.page_bytes = page_bytes
        self._free_bytes = free_bytes
        self.placements: list[tuple[int, int, bool]] = []  # (start, num_bytes, on_host), moves only
        self.num_allocated_bytes = 0

    def free_bytes(self) -> int:
        return self._free_bytes

    def is_concurrent(self) -> bool:
        return True

    def allocate(self, num_bytes: int) -> torch.Tensor:
        self.num_allocated_bytes += num_bytes
        return torch.zeros(num_bytes, dtype=torch.uint8)

    def _check(self, start: int, num_bytes: int) -> None:
        assert start % self.page_bytes == 0 and num_bytes % self.page_bytes == 0, "ranges must be whole OS pages"

    def place(self, tensor, start_bytes, num_bytes, *, on_host, stream):
        self._check(start_bytes, num_bytes)
        assert stream is None
        self.placements.append((start_bytes, num_bytes, on_host))

    def advise_preferred(self, tensor, start_bytes, num_bytes, *, on_host):
        self._check(start_bytes, num_bytes)


def _block_data(block: int, num_layers: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Distinct K, V rows [B, Hkv, D] of one page in every layer."""
    gen = torch.Generator().manual_seed(1000 + block)
    shape = (SHAPE.block_size, SHAPE.num_kv_heads, SHAPE.head_dim)
    return [(torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)) for _ in range(num_layers)]


def _slots(row: int) -> torch.Tensor:
    return torch.arange(row * SHAPE.block_size, (row + 1) * SHAPE.block_size)


def _write(pool, block: int) -> None:
    pool.ensure_resident([block])
    row = pool.device_table([block])[0]
    for pages, (k, v) in zip(pool.pages, _block_data(block)):
        store_kv(pages, _slots(row), k, v)


def _read(pool, block: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    pool.ensure_resident([block])
    row = pool.device_table([block])[0]
    return [gather_kv(pages, _slots(row)) for pages in pool.pages]


# ---------------------------------------------------------------- choosing the backend


def _plan(**changes):
    args = dict(
        backend="auto",
        device_type="cuda",
        num_device_blocks=100,
        max_num_blocks=1000,
        block_bytes=GIB // 100,
        host_spill_bytes=2 * GIB,
        allow_oversubscription=False,
        has_runtime=True,
        is_concurrent=True,
        free_bytes=40 * GIB,
    )
    args.update(changes)
    return plan_pool(**args)


def test_auto_picks_um_and_adds_the_host_share_to_the_device_share():
    plan = _plan()
    assert plan.backend == "um" and plan.num_device_blocks == 100
    assert plan.num_blocks == 100 + 2 * GIB // (GIB // 100)  # 2 GiB of spill in pages of ~10 MiB
    assert plan.num_blocks == 300
    capped = _plan(max_num_blocks=150)  # never more pages than every sequence at full length needs
    assert capped.num_blocks == 150


@pytest.mark.parametrize(
    "changes, why",
    [
        ({"has_runtime": False}, "cuda-bindings"),
        ({"is_concurrent": False}, "concurrentManagedAccess = 0"),
        ({"free_bytes": 2 * GIB}, "exceed the 2.00 GiB free"),
    ],
)
def test_auto_falls_back_to_pinned_and_says_why(changes, why):
    plan = _plan(**changes)
    assert plan.backend == "pinned" and why in plan.reason
    assert plan.num_host_blocks == 200 and plan.num_blocks == 300


def test_explicit_um_larger_than_free_memory_is_refused_with_the_numbers():
    with pytest.raises(OutOfMemoryError) as info:
        _plan(backend="um", free_bytes=2 * GIB)
    message = str(info.value)
    assert "3.00 GiB" in message and "2.00 GiB free" in message and "allow_oversubscription" in message
    assert _plan(backend="um", free_bytes=2 * GIB, allow_oversubscription=True).backend == "um"


def test_explicit_um_without_cuda_bindings_or_concurrency_says_what_to_do():
    with pytest.raises(ConfigError, match="pip install cuda-bindings"):
        _plan(backend="um", has_runtime=False)
    with pytest.raises(ConfigError, match="kv_backend 'pinned'"):
        _plan(backend="um", is_concurrent=False)


def test_cpu_and_device_backends_never_spill():
    for backend in ("auto", "um", "pinned", "device"):
        plan = _plan(backend=backend, device_type="cpu")
        assert (plan.backend, plan.num_blocks, plan.num_host_blocks) == ("device", 100, 0)
    plan = _plan(backend="device")
    assert (plan.backend, plan.num_blocks) == ("device", 100)
    with pytest.raises(ConfigError, match="kv_backend"):
        _plan(backend="swap")


def test_managed_pool_refuses_to_allocate_beyond_free_memory():
    memory = FakeManagedMemory(free_bytes=1000)
    with pytest.raises(OutOfMemoryError, match="GiB free"):
        ManagedKVPool(SHAPE, 16, "fp16", "cpu", max_device_blocks=8, memory=memory, budget_bytes=GIB)
    assert memory.num_allocated_bytes == 0


# ---------------------------------------------------------------- pinned: slots and a host tier


def test_pinned_pages_survive_spill_and_return_bit_for_bit():
    pool = PinnedKVPool(SHAPE, 12, "fp16", "cpu", max_device_blocks=4, num_host_blocks=8)
    for block in range(12):  # 12 pages through 4 slots: every write after the 4th evicts one
        _write(pool, block)
    assert pool.num_blocks_on_host() == 8
    for block in [11, 0, 5, 3, 7, 1, 10, 2, 9, 4, 8, 6]:
        for (k, v), (k_ref, v_ref) in zip(_read(pool, block), _block_data(block)):
            assert torch.equal(k, k_ref) and torch.equal(v, v_ref)
    assert pool.spilled_bytes > 0 and pool.fetched_bytes > 0
    assert pool.device_bytes == 4 * SHAPE.block_bytes("fp16")


def test_pinned_evicts_free_pages_without_copying_then_lru():
    pool = PinnedKVPool(SHAPE, 8, "fp16", "cpu", max_device_blocks=3, num_host_blocks=5)
    pool.record_step({1: [0, 1]})
    pool.record_step({2: [2]})
    pool.ensure_resident([0, 1, 2])
    # Page 1 is free (its sequence finished): it goes first, and takes no host slot.
    pool.record_step({3: [3]})
    pool.ensure_resident([3], free_block_ids={1})
    assert not pool.is_resident(1) and pool.num_blocks_on_host() == 0
    # Next, the least recently used page with data: 0.
    pool.record_step({3: [3, 4]})
    pool.ensure_resident([3, 4])
    assert [pool.is_resident(b) for b in range(5)] == [False, False, True, True, True]
    assert pool.num_blocks_on_host() == 1


def test_pinned_host_slots_of_freed_pages_are_reclaimed_when_the_tier_is_full():
    pool = PinnedKVPool(SHAPE, 7, "fp16", "cpu", max_device_blocks=2, num_host_blocks=4)
    for block in range(6):
        _write(pool, block)
    assert pool.num_blocks_on_host() == 4  # host tier full, pages 4 and 5 on the device
    pool.ensure_resident([6], free_block_ids={0, 1})  # pages 0 and 1 were freed meanwhile
    assert pool.num_blocks_on_host(range(2)) == 0 and pool.num_blocks_on_host() == 3
    for block in (2, 3, 4, 5):
        for (k, v), (k_ref, v_ref) in zip(_read(pool, block), _block_data(block)):
            assert torch.equal(k, k_ref) and torch.equal(v, v_ref)


def test_prefetch_brings_back_what_fits_without_touching_protected_pages():
    pool = PinnedKVPool(SHAPE, 10, "fp16", "cpu", max_device_blocks=4, num_host_blocks=6)
    for block in range(10):
        _write(pool, block)  # pages 6-9 end on the device
    pool.record_step({1: [6, 7]})
    pool.prefetch([0, 1, 2], protected=[6, 7, 8])
    # Only page 9 can make room. None of 0-2 was read, and admission is the reverse of
    # eviction order (never-read pages by id), so page 2 gets the slot.
    assert [b for b in range(10) if pool.is_resident(b)] == [2, 6, 7, 8]
    for block in (2, 9):
        for (k, v), (k_ref, v_ref) in zip(_read(pool, block), _block_data(block)):
            assert torch.equal(k, k_ref) and torch.equal(v, v_ref)


def test_pinned_step_larger_than_the_device_share_is_an_error():
    pool = PinnedKVPool(SHAPE, 8, "fp16", "cpu", max_device_blocks=3, num_host_blocks=5)
    with pytest.raises(OutOfMemoryError, match="reads 4 KV pages but at most 3"):
        pool.ensure_resident([0, 1, 2, 3])
    assert pool.max_blocks_per_step == 3
    with pytest.raises(KernelError, match="ensure_resident"):
        pool.device_table([5])


def test_pinned_shrinking_the_device_share_really_frees_slots_and_keeps_data():
    pool = PinnedKVPool(SHAPE, 10, "fp16", "cpu", max_device_blocks=6, num_host_blocks=4)
    for block in range(6):
        _write(pool, block)
    freed = pool.set_max_device_blocks(2)
    assert freed == 4 * SHAPE.block_bytes("fp16")
    assert pool.pages[0].k.shape[0] == 2 and pool.num_blocks_on_host() == 4
    with pytest.raises(OutOfMemoryError, match="host tier"):
        pool.set_max_device_blocks(1)  # a 5th page cannot fit the 4 host slots
    assert pool.set_max_device_blocks(6) == -4 * SHAPE.block_bytes("fp16")
    for block in range(6):
        for (k, v), (k_ref, v_ref) in zip(_read(pool, block), _block_data(block)):
            assert torch.equal(k, k_ref) and torch.equal(v, v_ref)


def test_pinned_spill_moves_pages_to_host_until_the_tier_is_full():
    pool = PinnedKVPool(SHAPE, 6, "fp16", "cpu", max_device_blocks=4, num_host_blocks=2)
    for block in range(4):
        _write(pool, block)
    assert pool.spill([0, 1, 2]) == 0  # slots stay allocated: spilling frees them for other pages
    assert pool.num_blocks_on_host() == 2 and pool.is_resident(2)


# ---------------------------------------------------------------- um: managed memory, through the stand-in


def _managed(num_blocks=16, max_device_blocks=8, **kwargs):
    memory = FakeManagedMemory(**kwargs)
    pool = ManagedKVPool(
        SHAPE, num_blocks, "fp16", "cpu", max_device_blocks=max_device_blocks, memory=memory, budget_bytes=GIB
    )
    return pool, memory


def test_managed_pages_move_in_units_of_whole_os_pages():
    pool, memory = _managed()
    # 256-byte K pages per layer, 512-byte OS pages: pages move in pairs.
    assert pool.unit_size == 2 and pool.num_units == 8 and pool.max_device_units == 4
    unit_bytes = 2 * SHAPE.num_layers * 2 * CODE_BYTES_FP32
    assert pool.device_bytes == 4 * unit_bytes and pool.host_bytes == 4 * unit_bytes
    pool.record_step({1: [0, 1, 2, 3, 4, 5]})
    pool.ensure_resident(range(6))
    assert memory.placements == [] and pool.num_page_hits == 3
    pool.record_step({2: [8, 9, 10, 11]})
    pool.ensure_resident(range(8, 12))
    # Unit 3 (pages 6-7) was never read, so it goes first; then unit 0, the least recently used.
    half = 16 * CODE_BYTES_FP32  # V codes start after the K codes of all 16 pages
    assert memory.placements == [
        (0, 512, True),
        (half, 512, True),
        (0, 512, True),
        (half, 512, True),  # unit 0, both layers
        (1536, 512, True),
        (half + 1536, 512, True),
        (1536, 512, True),
        (half + 1536, 512, True),  # unit 3
        (2048, 1024, False),
        (half + 2048, 1024, False),
        (2048, 1024, False),
        (half + 2048, 1024, False),  # 4-5
    ]
    assert [pool.is_resident(b) for b in range(0, 16, 2)] == [False, True, True, False, True, True, False, False]
    assert pool.num_page_misses == 2 and pool.spilled_bytes == 2 * unit_bytes


def test_hits_and_pages_on_host_count_each_distinct_page_once():
    pool, _ = _managed(num_blocks=8, max_device_blocks=3, page_bytes=CODE_BYTES_FP32)  # pages move one by one
    assert pool.unit_size == 1 and [pool.is_resident(b) for b in range(8)] == [True] * 3 + [False] * 5
    pool.ensure_resident([0, 1, 0, 2, 1])  # shared pages appear once per table that holds them
    assert (pool.num_page_hits, pool.num_page_misses) == (3, 0)
    pool.ensure_resident([2, 5, 2])
    assert (pool.num_page_hits, pool.num_page_misses) == (4, 1)
    pool.prefetch([6, 6])  # not required: counts nothing
    assert (pool.num_page_hits, pool.num_page_misses) == (4, 1)
    on_host = [b for b in range(8) if not pool.is_resident(b)]
    assert len(on_host) == 5
    for pages in ([0, 1, 2, 3], [5, 6, 7], list(range(8))):
        expected = sum(1 for b in pages if b in on_host)
        assert pool.num_blocks_on_host(set(pages)) == pool.num_blocks_on_host(pages) == expected


def test_managed_context_longer_than_the_device_share_keeps_its_newest_pages_there():
    pool, _ = _managed()
    pool.record_step({1: list(range(16))})  # one sequence reads all 16 pages; 8 fit
    pool.ensure_resident(range(16))
    assert [pool.is_resident(b) for b in range(16)] == [False] * 8 + [True] * 8
    assert pool.num_blocks_on_host() == 8
    assert pool.device_bytes == 4 * 2 * SHAPE.num_layers * 2 * CODE_BYTES_FP32


def test_managed_data_is_where_the_kernels_read_it_after_moves():
    pool, _ = _managed()
    for block in range(16):
        _write(pool, block)
    pool.set_max_device_blocks(2)
    assert pool.num_blocks_on_host() == 14
    for block in range(16):
        for (k, v), (k_ref, v_ref) in zip(_read(pool, block), _block_data(block)):
            assert torch.equal(k, k_ref) and torch.equal(v, v_ref)


def test_managed_precision_change_releases_memory_and_keeps_data_close():
    pool, memory = _managed()
    for block in range(16):
        _write(pool, block)
    pool.record_step({1: list(range(8, 16))})
    pool.ensure_resident(range(8, 16))
    before = pool.device_bytes
    freed = pool.set_precision("int8")
    # int8: 64-byte K pages, so 8 pages per 512-byte OS page; the 8 resident pages become one unit.
    assert pool.unit_size == 8 and pool.max_device_units == 1
    scale_bytes = SHAPE.num_layers * 16 * 4 * (4 * 2 * 2)  # 4 fp16 tensors of [B, Hkv] per page
    assert pool.device_bytes == scale_bytes + SHAPE.num_layers * 2 * 8 * 64
    assert freed == before - pool.device_bytes > 0
    assert [pool.is_resident(b) for b in (0, 15)] == [False, True]
    for block in range(16):
        for (k, v), (k_ref, v_ref) in zip(_read(pool, block), _block_data(block)):
            assert (k - k_ref).abs().max() < 0.03 and (v - v_ref).abs().max() < 0.03


# ---------------------------------------------------------------- re-quantization on the device backend


def test_device_pool_precision_ladder_frees_the_expected_bytes():
    pool = DeviceKVPool(SHAPE, 10, "fp16", "cpu")
    for block in range(10):
        _write(pool, block)
    per_block = {p: SHAPE.block_bytes(p) for p in ("fp16", "int8", "int4")}
    # layers * (K, V) * B * Hkv * (codes + scale and zero) per page
    assert per_block == {
        "fp16": 2 * 2 * 4 * 2 * (8 * 4),
        "int8": 2 * 2 * 4 * 2 * (8 + 4),
        "int4": 2 * 2 * 4 * 2 * (4 + 4),
    }
    assert pool.set_precision("int8") == 10 * (per_block["fp16"] - per_block["int8"])
    assert pool.set_precision("int4", range(5)) == 10 * (per_block["int8"] - per_block["int4"])
    assert pool.device_bytes == 10 * per_block["int4"] and pool.pages[0].k.dtype == torch.uint8
    worst = max(
        (k - k_ref).abs().max().item()
        for block in range(5)
        for (k, _), (k_ref, _) in zip(_read(pool, block), _block_data(block))
    )
    assert 0.01 < worst < 0.6  # INT4 steps of about range / 15
    # Back up to fp16 fits the bytes the pool started with.
    assert pool.set_precision("fp16") == -10 * (per_block["fp16"] - per_block["int4"])


def test_precision_above_the_starting_budget_is_refused_and_nothing_changes():
    pool = DeviceKVPool(SHAPE, 4, "int8", "cpu")
    with pytest.raises(OutOfMemoryError, match="fp16"):
        pool.set_precision("fp16")
    assert pool.precision == "int8" and pool.device_bytes == 4 * SHAPE.block_bytes("int8")
    with pytest.raises(ConfigError, match="int2"):
        pool.set_precision("int2")
