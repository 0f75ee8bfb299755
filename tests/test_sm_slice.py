"""Work on a slice of the GPU's SMs (scripts/lab/sm_slice.py): the kernels size their grids for the
slice, its stream's kernels (eager and replayed from a CUDA graph) reach only its SMs, and
decode attention there gives the whole GPU's result. The GPU tests skip without CUDA."""

import pytest
import torch
from script_modules import load_script

from lowvram.errors import ConfigError
from lowvram.kernels import paged_attention, w4a16
from lowvram.kernels.dispatch import num_sms, sm_limits
from lowvram.kernels.kv_quant import allocate_pages

LAB = load_script("sm_slice")  # scripts/lab/sm_slice.py
SLICE_SMS = 16  # an RTX 3050 laptop GPU's count, and a whole number of Hopper's groups of 8


@pytest.fixture
def sm_limit_cleared():
    yield
    sm_limits.clear()


def test_an_sm_limit_sizes_the_kernels_grids(sm_limit_cleared):
    """With 16 SMs set for device 0, decode attention splits a 32K sequence for 16 SMs (four
    programs an SM over 2 KV heads: 32 partitions, not the 264 of 132 SMs) and the W4A16
    kernels, which take the same count, see 16; other devices and the CPU keep their own counts. No GPU is touched."""
    cuda0, cuda1 = torch.device("cuda", 0), torch.device("cuda", 1)
    sm_limits[0] = SLICE_SMS
    assert num_sms(cuda0) == SLICE_SMS and w4a16.num_sms(cuda0) == SLICE_SMS
    num_splits, partition_tokens = paged_attention.plan_decode_partitions(1, 2, 32768, cuda0, block_n=64)
    assert (num_splits, partition_tokens) == (32, 1024)
    # One sequence of 8K tokens fills 128 programs: a latency-bound grid on 132 SMs, not on 16.
    config = paged_attention.DecodeConfig(block_n=64, num_warps=2, num_stages=3)
    assert paged_attention.fit_decode_config(config, 1, 2, 8192, 132) == paged_attention.LATENCY_DECODE_CONFIG
    assert paged_attention.fit_decode_config(config, 1, 2, 8192, num_sms(cuda0)) == config
    assert num_sms(torch.device("cpu")) == 4
    sm_limits[1] = 8
    assert num_sms(cuda1) == 8


@pytest.mark.skipif(torch.cuda.is_available(), reason="the error of a machine without CUDA")
def test_a_slice_without_a_gpu_says_so():
    open_sm_slice, sm_ids = LAB.open_sm_slice, LAB.sm_ids

    with pytest.raises(ConfigError, match="needs a CUDA GPU"):
        open_sm_slice(SLICE_SMS)
    with pytest.raises(ConfigError, match="CUDA GPU"):
        sm_ids(4)


class _DriverFailingStreamDestroy:
    """cuda-bindings' driver as SmSlice.close uses it, its cuStreamDestroy failing."""

    class CUresult:
        CUDA_SUCCESS = 0

    def __init__(self):
        self.destroyed = []

    def cuGetErrorName(self, error):
        return 0, b"CUDA_ERROR_INVALID_HANDLE"

    def cuStreamDestroy(self, stream):
        return (400,)

    def cuGreenCtxDestroy(self, green_ctx):
        self.destroyed.append(green_ctx)
        return (0,)


class _IdleStream:
    def synchronize(self):
        pass


def test_a_slice_that_fails_to_close_names_the_call_and_still_frees_its_context(monkeypatch):
    """A failure while closing names the call and the error, not a driver without green
    contexts (the slice was made, so the driver has them), and the context is destroyed anyway."""
    sm_slice = LAB

    driver = _DriverFailingStreamDestroy()
    monkeypatch.setattr(sm_slice, "_driver", lambda: driver)
    piece = sm_slice.SmSlice(0, SLICE_SMS, _IdleStream(), _green_ctx="green", _raw_stream="stream")
    with pytest.raises(ConfigError) as caught:
        piece.close()
    message = str(caught.value)
    assert "closing the slice: cuStreamDestroy failed: CUDA_ERROR_INVALID_HANDLE" in message
    assert "12.4" not in message
    assert driver.destroyed == ["green"]


def test_the_bench_refuses_a_slice_of_no_sms(capsys, monkeypatch):
    bench = load_script("bench_paged_attention")
    monkeypatch.setattr("sys.argv", ["bench_paged_attention.py", "--sms", "0"])
    with pytest.raises(SystemExit):
        bench.main()
    assert "--sms takes a number of SMs of 1 or more, got 0" in capsys.readouterr().err


def _open(num_sms):
    pytest.importorskip("cuda.bindings")
    return LAB.sm_slice(num_sms)


@pytest.mark.gpu
def test_a_slice_reaches_only_its_sms():
    """Programs launched on the slice's stream, eagerly and from a CUDA graph captured there,
    run on at most its SMs; on the default stream the same launch spreads over more of them
    (so the check can fail). Inside the slice the kernels size their grids for it."""
    sm_ids = LAB.sm_ids

    full_sms = torch.cuda.get_device_properties(0).multi_processor_count
    if full_sms < 2 * SLICE_SMS:
        pytest.skip(f"a GPU of {full_sms} SMs has no room for a slice of {SLICE_SMS} to differ from")
    num_programs = 8 * full_sms
    assert torch.unique(sm_ids(num_programs)).numel() > SLICE_SMS
    with _open(SLICE_SMS) as piece:
        assert SLICE_SMS <= piece.num_sms < full_sms
        assert num_sms(torch.device("cuda")) == piece.num_sms
        eager = sm_ids(num_programs)
        stream = torch.cuda.current_stream()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            replayed = sm_ids(num_programs)
        graph.replay()
        stream.synchronize()
        print(
            f"slice of {piece.num_sms} SMs: eager launch on {torch.unique(eager).numel()} SMs, "
            f"graph replay on {torch.unique(replayed).numel()}"
        )
        assert 0 < torch.unique(eager).numel() <= piece.num_sms
        assert 0 < torch.unique(replayed).numel() <= piece.num_sms
    assert num_sms(torch.device("cuda")) == full_sms


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp16", "int4"])
def test_decode_attention_on_a_slice_matches_the_whole_gpu(precision):
    """Decode attention over 32K tokens on the slice (32 partitions, sized for its SMs) gives the
    reference's result, as the whole GPU's run (264 partitions) does."""
    generator = torch.Generator(device="cuda").manual_seed(7)
    context_len, block_size = 32768, 16
    pages = allocate_pages(context_len // block_size, block_size, 2, 128, precision, device="cuda")
    if precision == "fp16":
        pages.k.normal_(generator=generator)
        pages.v.normal_(generator=generator)
    else:
        pages.k.random_(0, 256, generator=generator)
        pages.v.random_(0, 256, generator=generator)
        for scale, zero in ((pages.k_scale, pages.k_zero), (pages.v_scale, pages.v_zero)):
            scale.uniform_(0.005, 0.02, generator=generator)
            zero.uniform_(0.0, 15.0, generator=generator)
    table = torch.randperm(context_len // block_size, device="cuda", generator=generator).to(torch.int32)[None, :]
    lens = torch.tensor([context_len], dtype=torch.int32, device="cuda")
    q = torch.randn(1, 12, 128, device="cuda", dtype=torch.float16, generator=generator)
    args = (q, pages, table, lens, 128**-0.5)
    whole = paged_attention.paged_decode_attention(*args)
    reference = paged_attention.paged_decode_attention_ref(*args).float()
    with _open(SLICE_SMS) as piece:
        num_splits, _ = paged_attention.plan_decode_partitions(1, 2, context_len, q.device, block_n=64)
        assert num_splits == 2 * piece.num_sms
        sliced = paged_attention.paged_decode_attention(*args)
        torch.cuda.current_stream().synchronize()
    scale = reference.abs().max()
    for name, out in (("whole GPU", whole), ("slice", sliced)):
        error = ((out.float() - reference).abs().max() / scale).item()
        print(f"{precision} {name}: largest difference {error:.2e} of the reference's largest value")
        assert error < 2e-3
