"""The one-row decode GEMV's K-in-thread form ("unpack": "rows") against the float32 reference.

Under the Triton interpreter on small shapes (its nibbles then come from plain Triton, the
GPU's from inline PTX); with CUDA the same tests run on the GPU, and the `gpu` tests add the
1.5B shape's projections and a check that graph replays give the same bits.
"""

import pytest
import torch
from script_modules import load_script

from lowvram.kernels import w4a16
from lowvram.kernels.w4a16 import awq_linear_ref
from tests.test_w4a16 import (
    DEVICE,
    GPU_TOLERANCE,
    SMALL_TOLERANCE,
    needs_triton,
    random_awq,
    random_lora,
    random_x,
    relative_error,
)


def rows_config(block_n, group_size, split_k, tile_rows, unroll, num_warps=4):
    return {
        "block_n": block_n,
        "block_k": group_size,
        "split_k": split_k,
        "num_warps": num_warps,
        "unpack": "rows",
        "tile_rows": tile_rows,
        "unroll": unroll,
    }


def run_rows(x, awq, group_size, config, bias=None, lora_a=None, lora_bt=None, **fused):
    qweight, qzeros, scales, _ = awq
    y = torch.full((x.shape[0], scales.shape[1]), float("nan"), dtype=x.dtype, device=x.device)
    w4a16.w4a16_gemv.launch_awq_gemv(x, qweight, qzeros, scales, group_size, bias, y, config, lora_a, lora_bt, **fused)
    return y


@needs_triton
@pytest.mark.parametrize("split_k", [1, 2, 3])
@pytest.mark.parametrize("num_outputs", [256, 200])  # 200: a partial column block, masked
@pytest.mark.parametrize("tile_rows,unroll", [(4, 2), (8, 1)])
def test_rows_form_matches_the_reference(split_k, num_outputs, tile_rows, unroll):
    awq = random_awq(192, num_outputs, 32, seed=90 + split_k)
    dtype = torch.float16 if DEVICE == "cuda" else torch.float32
    x = random_x(1, 192, seed=91, dtype=dtype)
    bias = awq[3]
    ref = awq_linear_ref(x, *awq[:3], 32, bias)
    y = run_rows(x, awq, 32, rows_config(128, 32, split_k, tile_rows, unroll), bias)
    error = relative_error(y, ref)
    print(f"rows form N={num_outputs} split_k={split_k} tile {tile_rows}x{unroll}: rel err {error:.2e}")
    assert error <= SMALL_TOLERANCE


@needs_triton
def test_every_nibble_lands_on_its_column():
    # One code per column set, the rest zero, zeros 0 and unit scales: y[n] = x . W[:, n]
    # exactly, so a nibble added to a neighbour's column or at the wrong power of 16 shows.
    num_inputs, num_outputs, group_size = 64, 64, 32
    codes = torch.arange(num_inputs * num_outputs).reshape(num_inputs, num_outputs) % 16
    from lowvram.kernels.awq_format import pack_awq

    qweight = pack_awq(codes.to(torch.int32)).to(DEVICE)
    qzeros = torch.zeros(num_inputs // group_size, num_outputs // 8, dtype=torch.int32, device=DEVICE)
    scales = torch.ones(num_inputs // group_size, num_outputs, dtype=torch.float16, device=DEVICE)
    dtype = torch.float16 if DEVICE == "cuda" else torch.float32
    x = (torch.arange(num_inputs) % 3 - 1).to(dtype).to(DEVICE)[None, :]  # -1, 0, 1: exact sums
    expected = x.double().cpu() @ codes.double()
    y = run_rows(x, (qweight, qzeros, scales, None), group_size, rows_config(64, group_size, 2, 4, 2))
    assert torch.equal(y.double().cpu(), expected)


@needs_triton
@pytest.mark.parametrize("has_residual", [False, True])
def test_rows_form_fuses_the_rms_norm(has_residual):
    from lowvram.kernels.rms_norm import rms_norm_ref
    from lowvram.kernels.w4a16 import InputNorm

    awq = random_awq(192, 128, 64, seed=93)
    dtype = torch.float16 if DEVICE == "cuda" else torch.float32
    x = random_x(1, 192, seed=94, dtype=dtype) * 4
    residual = random_x(1, 192, seed=95, dtype=dtype) if has_residual else None
    weight = (torch.rand(192, generator=torch.Generator().manual_seed(96)) + 0.5).to(dtype).to(DEVICE)
    normed, total = rms_norm_ref(x, weight, 1e-6, residual)
    ref = awq_linear_ref(normed, *awq[:3], 64, awq[3])
    unnormed = relative_error(awq_linear_ref(x, *awq[:3], 64, awq[3]), ref)
    sum_out = torch.full_like(x, float("nan")) if has_residual else None
    y = run_rows(x, awq, 64, rows_config(64, 64, 3, 8, 2), awq[3], norm=InputNorm(weight, 1e-6, residual, sum_out))
    error = relative_error(y, ref)
    assert error <= SMALL_TOLERANCE < unnormed
    if has_residual:
        assert torch.equal(sum_out, total)


@needs_triton
def test_rows_form_fuses_the_silu_gate():
    from lowvram.kernels.activation import silu_and_mul_ref

    awq = random_awq(192, 128, 64, seed=97)
    dtype = torch.float16 if DEVICE == "cuda" else torch.float32
    gate_up = random_x(1, 384, seed=98, dtype=dtype) * 3
    ref = awq_linear_ref(silu_and_mul_ref(gate_up), *awq[:3], 64, awq[3])
    y = run_rows(gate_up, awq, 64, rows_config(128, 64, 2, 4, 4), awq[3], is_gated=True)
    assert relative_error(y, ref) <= SMALL_TOLERANCE


@needs_triton
def test_rows_form_refuses_what_it_cannot_run():
    awq = random_awq(128, 64, 64, seed=99)
    dtype = torch.float16 if DEVICE == "cuda" else torch.float32
    x = random_x(1, 128, seed=100, dtype=dtype)
    with pytest.raises(ValueError, match="whole groups"):
        run_rows(x, awq, 64, {**rows_config(64, 64, 1, 4, 1), "block_k": 32})


@needs_triton
@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("rank", [16, 5])  # 5: ranks padded to 16 by masking
def test_rows_form_adds_the_compensation(split_k, rank):
    awq = random_awq(192, 200, 32, seed=103 + rank)
    dtype = torch.float16 if DEVICE == "cuda" else torch.float32
    x = random_x(1, 192, seed=104, dtype=dtype)
    lora_a, lora_bt = random_lora(rank, 192, 200, seed=105)
    ref = awq_linear_ref(x, *awq[:3], 32, awq[3], lora_a=lora_a, lora_bt=lora_bt)
    without = relative_error(awq_linear_ref(x, *awq[:3], 32, awq[3]), ref)
    y = run_rows(x, awq, 32, rows_config(128, 32, split_k, 4, 2), awq[3], lora_a=lora_a, lora_bt=lora_bt)
    error = relative_error(y, ref)
    print(f"rows form with rank {rank} split_k={split_k}: rel err {error:.2e} (without the term {without:.2e})")
    assert error <= SMALL_TOLERANCE < without


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    "num_inputs,num_outputs", [(1536, 2048), (1536, 1536), (1536, 17920), (8960, 1536), (1536, 151936)]
)
def test_rows_form_at_the_real_shapes(num_inputs, num_outputs):
    awq = random_awq(num_inputs, num_outputs, 128, seed=101)
    x = random_x(1, num_inputs, seed=102)
    config = w4a16.w4a16_gemv.choose_rows_config(num_outputs, num_inputs, 128, w4a16.num_sms(x.device))
    y = run_rows(x, awq, 128, config, awq[3])
    # the float64 reference of a vocabulary-wide head does not fit the emulated card: its first
    # and last 8,192 columns (the last block is partial) stand for it
    for cols in (slice(0, min(8192, num_outputs)), slice(max(0, num_outputs - 8192), num_outputs)):
        words = slice(cols.start // 8, cols.stop // 8)
        ref = awq_linear_ref(x, awq[0][:, words], awq[1][:, words], awq[2][:, cols], 128, awq[3][cols])
        error = relative_error(y[:, cols], ref)
        print(
            f"rows form K={num_inputs} N={num_outputs} columns {cols.start}-{cols.stop} {config}: rel err {error:.2e}"
        )
        assert error <= GPU_TOLERANCE
    # graph replays give the same bits (the split-K sum runs in split order)
    graph = torch.cuda.CUDAGraph()
    static_y = torch.empty_like(y)
    with torch.cuda.graph(graph):
        w4a16.w4a16_gemv.launch_awq_gemv(x, *awq[:3], 128, awq[3], static_y, config)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_y, y)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("num_inputs,num_outputs", [(1536, 17920), (8960, 1536)])
def test_rows_form_with_the_compensation_at_the_real_shapes(num_inputs, num_outputs):
    awq = random_awq(num_inputs, num_outputs, 128, seed=106)
    x = random_x(1, num_inputs, seed=107)
    lora_a, lora_bt = random_lora(16, num_inputs, num_outputs, seed=108, dtype=torch.float16)
    ref = awq_linear_ref(x, *awq[:3], 128, awq[3], lora_a=lora_a, lora_bt=lora_bt)
    without = relative_error(awq_linear_ref(x, *awq[:3], 128, awq[3]), ref)
    config = w4a16.w4a16_gemv.choose_rows_config(num_outputs, num_inputs, 128, w4a16.num_sms(x.device))
    y = run_rows(x, awq, 128, config, awq[3], lora_a=lora_a, lora_bt=lora_bt)
    error = relative_error(y, ref)
    print(f"rows form with rank 16 K={num_inputs} N={num_outputs}: rel err {error:.2e} (without {without:.2e})")
    assert error <= GPU_TOLERANCE < without


def test_wide_plain_layers_take_the_k_in_thread_form_and_the_rest_the_rules():
    from lowvram.kernels.w4a16_gemv import choose_gemv_config, choose_rows_config, decode_gemv_config

    # gate/up of the 1.5B shape, one row, no compensation: the K-in-thread form
    assert decode_gemv_config(1, 17920, 1536, 128, 132, False) == choose_rows_config(17920, 1536, 128, 132)
    # a narrow layer, a compensated one, several rows, a group size the form cannot step: the rules
    for args in [(1, 2048, 1536, 128), (8, 17920, 1536, 128), (17, 17920, 1536, 128)]:
        assert decode_gemv_config(*args, 132, False) == choose_gemv_config(*args, 132)
    assert decode_gemv_config(1, 17920, 1536, 128, 132, True) == choose_gemv_config(1, 17920, 1536, 128, 132)


def test_the_sweep_gives_fused_layers_the_models_compensation_rank():
    # q/k/v of the 1.5B shape: three blocks of rank 16, each on its own outputs, as
    # lowvram.models.fusion joins them; the sweep timed rank 16 on gate/up before, half the model's.
    profile_decode = load_script("profile_decode")
    lora_a, lora_bt = profile_decode.compensation_factors(1536, (1536, 256, 256), 16, device="cpu")
    assert lora_a.shape == (48, 1536) and lora_bt.shape == (48, 2048) and lora_bt.is_contiguous()
    blocks = [(slice(0, 16), slice(0, 1536)), (slice(16, 32), slice(1536, 1792)), (slice(32, 48), slice(1792, 2048))]
    mask = torch.zeros_like(lora_bt, dtype=torch.bool)
    for rows, cols in blocks:
        mask[rows, cols] = True
        assert lora_bt[rows, cols].abs().sum() > 0
    assert not lora_bt[~mask].any()
