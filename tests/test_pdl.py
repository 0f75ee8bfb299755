"""Programmatic dependent launch (kernels/pdl.py): when it is used, how the L2 prefetch is
shared out, and on an sm_90 GPU that a chain of dependent decode kernels, launched so each
starts while the one before runs, gives the same bits as plain launches."""

import pytest
import torch

from lowvram.kernels import pdl
from lowvram.kernels import w4a16_gemv as gemv
from lowvram.kernels.w4a16 import InputNorm
from tests.test_w4a16 import random_awq, random_x

L2_BYTES = 50 * 2**20


@pytest.mark.parametrize(
    "num_bytes, num_programs", [(1, 1), (128, 1), (129, 1), (1536 * 1024, 48), (1536 * 8960, 280), (3 * 2**20 + 16, 7)]
)
def test_the_programs_prefetch_lines_cover_the_buffer_in_the_fewest_powers_of_two(num_bytes, num_programs):
    lines = pdl.prefetch_lines(num_bytes, num_programs, L2_BYTES)
    assert lines & (lines - 1) == 0
    assert lines * num_programs * pdl.LINE_BYTES >= num_bytes
    assert lines == 1 or (lines // 2) * num_programs * pdl.LINE_BYTES < num_bytes


def test_no_prefetch_of_an_empty_buffer_or_one_too_large_for_its_share_of_l2():
    assert pdl.prefetch_lines(0, 4, L2_BYTES) == 0
    assert pdl.prefetch_lines(int(pdl.MAX_L2_SHARE * L2_BYTES), 4, L2_BYTES) > 0
    assert pdl.prefetch_lines(int(pdl.MAX_L2_SHARE * L2_BYTES) + 1, 4, L2_BYTES) == 0  # an INT4 head


def test_only_nvidia_gpus_from_compute_capability_9_use_it(monkeypatch):
    pdl._device_has_pdl.cache_clear()
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (8, 6))  # RTX 30xx
    assert not pdl._device_has_pdl(0)
    pdl._device_has_pdl.cache_clear()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (9, 0))  # H100, H200
    assert pdl._device_has_pdl(0)
    pdl._device_has_pdl.cache_clear()
    monkeypatch.setattr(torch.version, "hip", "6.2")  # MI300 reports gfx942 as (9, 4)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (9, 4))
    assert not pdl._device_has_pdl(0)
    pdl._device_has_pdl.cache_clear()


def test_the_cpu_and_the_interpreter_launch_plainly():
    weights = (torch.zeros(64, 8, dtype=torch.int32), torch.zeros(1, 64, dtype=torch.float16))
    assert not pdl.uses_pdl(torch.device("cpu"))
    assert pdl.launch_prefetch(torch.device("cpu"), weights, 4) == {"PDL": False, "PREFETCH_0": 0, "PREFETCH_1": 0}
    assert pdl.dependent_launch(torch.device("cpu")) == {"PDL": False}


def test_a_layer_asks_l2_for_its_weights_only_while_they_fit_its_share(monkeypatch):
    # As on an H200 (50 MiB of L2): gate/up's 14 MB are shared out over the programs; an INT4
    # head's 117 MB would evict what the kernel before reads, so it launches early with none.
    monkeypatch.setattr(pdl, "uses_pdl", lambda device: True)
    monkeypatch.setattr(pdl, "_l2_bytes", lambda index: L2_BYTES)
    device = torch.device("cuda", 0)
    gate_up = (
        torch.empty(1536, 17920 // 8, dtype=torch.int32),
        torch.empty(12, 17920, dtype=torch.float16),
        torch.empty(12, 17920 // 8, dtype=torch.int32),
    )
    options = pdl.launch_prefetch(device, gate_up, 140)
    assert options["PDL"] and options["launch_pdl"]
    assert [options[f"PREFETCH_{i}"] for i in range(3)] == [
        pdl.prefetch_lines(t.numel() * t.element_size(), 140, L2_BYTES) for t in gate_up
    ]
    assert options["PREFETCH_0"] * 140 * pdl.LINE_BYTES >= 1536 * 17920 // 2
    head = (
        torch.empty(1536, 151936 // 8, dtype=torch.int32),
        torch.empty(12, 151936, dtype=torch.float16),
        torch.empty(12, 151936 // 8, dtype=torch.int32),
    )
    options = pdl.launch_prefetch(device, head, 1187)
    assert options["PDL"] and [options[f"PREFETCH_{i}"] for i in range(3)] == [0, 0, 0]


needs_sm90 = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < pdl.MIN_CAPABILITY,
    reason="programmatic dependent launch needs a CUDA GPU of compute capability 9.0+",
)


def decoder_chain(num_layers, hidden, intermediate, seed):
    """num_layers of (RMSNorm -> hidden x hidden lane GEMV, split over K; RMSNorm -> the
    K-in-thread GEMV to gate and up; silu(gate) * up -> down), each reading the last one's
    output: the dependencies of a decode step. Returns run(x) -> every layer's output."""
    layers = []
    for layer in range(num_layers):
        weight = (torch.rand(hidden, generator=torch.Generator().manual_seed(seed + layer)) + 0.5).half().cuda()
        layers.append(
            (
                weight,
                random_awq(hidden, hidden, 128, seed=seed + 10 * layer),
                random_awq(hidden, 2 * intermediate, 128, seed=seed + 10 * layer + 1),
                random_awq(intermediate, hidden, 128, seed=seed + 10 * layer + 2),
            )
        )
    lanes = {"block_n": 64, "block_k": 128, "split_k": 4, "num_warps": 4, "unpack": "lanes", "reduce": "end"}
    rows = gemv.choose_rows_config(
        2 * intermediate, hidden, 128, torch.cuda.get_device_properties(0).multi_processor_count
    )

    def run(x):
        outputs, residual = [], torch.zeros_like(x)
        for weight, attention, gate_up, down in layers:
            total = torch.empty_like(x)
            h = gemv.launch_awq_gemv(
                x,
                *attention[:3],
                128,
                attention[3],
                torch.empty_like(x),
                lanes,
                norm=InputNorm(weight, 1e-6, residual, total),
            )
            g = gemv.launch_awq_gemv(
                h,
                *gate_up[:3],
                128,
                None,
                x.new_empty(1, 2 * intermediate),
                rows,
                norm=InputNorm(weight, 1e-6, None, None),
            )
            x = gemv.launch_awq_gemv(g, *down[:3], 128, down[3], torch.empty_like(x), lanes, is_gated=True)
            residual = total
            outputs += [h, g, x, total]
        return outputs

    return run


@pytest.mark.gpu
@needs_sm90
def test_a_chain_of_dependent_gemvs_launched_early_gives_the_bits_of_plain_launches(monkeypatch):
    """Each kernel of the chain starts while the one before still writes its input; in a CUDA
    graph replayed on fresh inputs, and eagerly, every output equals plain launches' bit for bit.
    A kernel that read its input before the wait would see the last replay's values."""
    run = decoder_chain(num_layers=4, hidden=1536, intermediate=2048, seed=3)
    inputs = [random_x(1, 1536, seed=100 + i) for i in range(8)]
    with monkeypatch.context() as plainly:
        plainly.setattr(pdl, "uses_pdl", lambda device: False)
        plain = [[y.clone() for y in run(x)] for x in inputs]
    assert pdl.launch_prefetch(inputs[0].device, (inputs[0],), 1)["PDL"]
    for x, expected in zip(inputs, plain):
        assert all(torch.equal(y, want) for y, want in zip(run(x), expected)), "eager launches differ"
    static_x = inputs[0].clone()
    run(static_x)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_outputs = run(static_x)
    for x, expected in zip(inputs * 3, plain * 3):
        static_x.copy_(x)
        graph.replay()
        torch.cuda.synchronize()
        worst = max((y.float() - want.float()).abs().max().item() for y, want in zip(static_outputs, expected))
        assert worst == 0, f"a graph replay differs from plain launches by up to {worst}"
    compiled = [kernel for cache in gemv._awq_gemv_row_kernel.device_caches.values() for kernel in cache[0].values()]
    assert any(kernel.metadata.launch_pdl for kernel in compiled), "no GEMV was compiled for dependent launch"
