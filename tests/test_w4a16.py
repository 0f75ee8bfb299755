"""W4A16 kernels against the float32 reference.

Without CUDA the kernels run under the Triton interpreter on small shapes; with CUDA the same
tests run on the GPU, and the `gpu` tests add the real layer shapes of the target models.
Error is reported as max|y - ref| / max|ref|: float16 output rounding alone is up to 2^-11.
"""

import logging

import pytest
import torch

from lowvram.awq_format import dequantize_awq
from lowvram.errors import KernelError
from lowvram.kernels import w4a16
from lowvram.kernels.w4a16 import awq_linear, awq_linear_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SMALL_TOLERANCE = 1e-3
GPU_TOLERANCE = 2e-3
# (K, N) of the R1-Distill-Qwen-1.5B projections and of deepseek-coder-1.3b's MLP
GPU_SHAPES = [(1536, 1536), (1536, 8960), (8960, 1536), (1536, 256), (2048, 5504)]

needs_triton = pytest.mark.skipif(
    w4a16.w4a16_gemv is None or not w4a16._backend_for(torch.device(DEVICE).type,
                                                          torch.device(DEVICE).index)[0],
    reason="Triton kernels unavailable here (no CUDA and TRITON_INTERPRET unset)",
)


def random_awq(num_inputs, num_outputs, group_size, seed, device=DEVICE):
    gen = torch.Generator().manual_seed(seed)
    qweight = torch.randint(-(2**31), 2**31 - 1, (num_inputs, num_outputs // 8),
                            dtype=torch.int32, generator=gen)
    qzeros = torch.randint(-(2**31), 2**31 - 1, (num_inputs // group_size, num_outputs // 8),
                           dtype=torch.int32, generator=gen)
    scales = torch.rand(num_inputs // group_size, num_outputs, generator=gen) * 0.02 + 1e-3
    bias = torch.randn(num_outputs, generator=gen)
    return (qweight.to(device), qzeros.to(device), scales.half().to(device),
            bias.half().to(device))


def random_x(num_rows, num_inputs, seed, dtype=torch.float16, device=DEVICE):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(num_rows, num_inputs, generator=gen).to(dtype).to(device)


def relative_error(y, ref):
    assert torch.isfinite(y).all(), "output has NaN/inf (an element was not written)"
    return ((y.float() - ref).abs().max() / ref.abs().max()).item()


@needs_triton
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("num_rows", [1, 3, 16, 33])
def test_awq_linear_matches_reference(num_rows, group_size):
    qweight, qzeros, scales, bias = random_awq(256, 128, group_size, seed=num_rows + group_size)
    x = random_x(num_rows, 256, seed=num_rows)
    for layer_bias in (None, bias):
        y = awq_linear(x, qweight, qzeros, scales, group_size, layer_bias)
        ref = awq_linear_ref(x, qweight, qzeros, scales, group_size, layer_bias)
        assert y.shape == (num_rows, 128) and y.dtype == torch.float16
        error = relative_error(y, ref)
        print(f"M={num_rows} G={group_size} bias={layer_bias is not None}: rel err {error:.2e}")
        assert error <= SMALL_TOLERANCE


ROW_FORMS = [{}, {"unpack": "lanes", "reduce": "block"}, {"unpack": "lanes", "reduce": "end"}]


@needs_triton
@pytest.mark.parametrize("num_rows", [1, 5])
@pytest.mark.parametrize("split_k", [1, 2, 4])
@pytest.mark.parametrize("form", ROW_FORMS, ids=["interleave", "lanes-block", "lanes-end"])
def test_decode_kernel_splits_and_column_tails(num_rows, split_k, form):
    # N = 200 leaves a partial column block; every output starts as NaN so a skipped store shows
    qweight, qzeros, scales, bias = random_awq(256, 200, 64, seed=split_k)
    x = random_x(num_rows, 256, seed=7)
    for layer_bias in (None, bias):
        y = torch.full((num_rows, 200), float("nan"), dtype=torch.float16, device=DEVICE)
        config = {"block_n": 64, "block_k": 32, "split_k": split_k, "num_warps": 4, **form}
        w4a16.w4a16_gemv.launch_awq_gemv(x, qweight, qzeros, scales, 64, layer_bias, y, config)
        error = relative_error(y, awq_linear_ref(x, qweight, qzeros, scales, 64, layer_bias))
        print(f"decode M={num_rows} split_k={split_k} {form} bias={layer_bias is not None}: rel err {error:.2e}")
        assert error <= SMALL_TOLERANCE


@needs_triton
def test_prefill_kernel_row_and_column_tails():
    qweight, qzeros, scales, bias = random_awq(128, 200, 32, seed=3)
    x = random_x(40, 128, seed=4)
    y = torch.full((40, 200), float("nan"), dtype=torch.float16, device=DEVICE)
    config = {"block_m": 32, "block_n": 64, "block_k": 32, "num_warps": 4, "num_stages": 2}
    w4a16.w4a16_gemm.launch_awq_gemm(x, qweight, qzeros, scales, 32, bias, y, config)
    error = relative_error(y, awq_linear_ref(x, qweight, qzeros, scales, 32, bias))
    print(f"prefill M=40 N=200: rel err {error:.2e}")
    assert error <= SMALL_TOLERANCE


@needs_triton
@pytest.mark.parametrize("num_outputs", [72, 256])
def test_dequant_kernel_is_bit_exact(num_outputs):
    qweight, qzeros, scales, _ = random_awq(128, num_outputs, 64, seed=5)
    weight = w4a16.w4a16_gemm.launch_awq_dequant(qweight, qzeros, scales, 64)
    assert torch.equal(weight, dequantize_awq(qweight, qzeros, scales, 64))


@needs_triton
def test_large_batches_dequantize_then_matmul(monkeypatch):
    monkeypatch.setattr(w4a16, "DEQUANT_MATMUL_MIN_M", 32)
    qweight, qzeros, scales, bias = random_awq(256, 64, 128, seed=6)
    x = random_x(48, 256, seed=8)
    y = awq_linear(x, qweight, qzeros, scales, 128, bias)
    error = relative_error(y, awq_linear_ref(x, qweight, qzeros, scales, 128, bias))
    print(f"dequant+matmul M=48: rel err {error:.2e}")
    assert error <= SMALL_TOLERANCE


@needs_triton
@pytest.mark.parametrize("num_rows", [1, 4])
def test_batched_and_strided_activations(num_rows):
    qweight, qzeros, scales, _ = random_awq(256, 64, 128, seed=9)
    x = random_x(256, 2 * num_rows, seed=10).t()[::2]  # [M, K] with strides (2, 2M)
    y = awq_linear(x, qweight, qzeros, scales, 128)
    assert relative_error(y, awq_linear_ref(x, qweight, qzeros, scales, 128)) <= SMALL_TOLERANCE
    x3d = random_x(2 * 3, 256, seed=11).reshape(2, 3, 256)
    y3d = awq_linear(x3d, qweight, qzeros, scales, 128)
    assert y3d.shape == (2, 3, 64)
    assert relative_error(y3d, awq_linear_ref(x3d, qweight, qzeros, scales, 128)) <= SMALL_TOLERANCE


@needs_triton
def test_empty_batch_gives_empty_output():
    qweight, qzeros, scales, _ = random_awq(128, 16, 128, seed=12)
    y = awq_linear(torch.empty(0, 128, dtype=torch.float16, device=DEVICE), qweight, qzeros, scales, 128)
    assert y.shape == (0, 16)


def test_torch_path_without_triton(monkeypatch):
    monkeypatch.setattr(w4a16, "IS_INTERPRETER", False)
    w4a16._backend_for.cache_clear()
    try:
        qweight, qzeros, scales, bias = random_awq(128, 32, 64, seed=13, device="cpu")
        for dtype in (torch.float32, torch.bfloat16):
            x = random_x(5, 128, seed=14, dtype=dtype, device="cpu")
            y = awq_linear(x, qweight, qzeros, scales, 64, bias)
            assert y.dtype == dtype
            ref = awq_linear_ref(x, qweight, qzeros, scales, 64, bias)
            assert relative_error(y, ref) <= (1e-5 if dtype == torch.float32 else 1e-2)
    finally:
        w4a16._backend_for.cache_clear()


def test_path_choice_is_logged_once(caplog):
    w4a16._logged_choices.clear()
    qweight, qzeros, scales, _ = random_awq(128, 16, 128, seed=15)
    x = random_x(1, 128, seed=16)
    with caplog.at_level(logging.INFO, logger="lowvram.kernels"):
        awq_linear(x, qweight, qzeros, scales, 128)
        awq_linear(x, qweight, qzeros, scales, 128)
    records = [r for r in caplog.records if r.name == "lowvram.kernels"]
    assert len(records) == 1
    assert "AWQ linear on" in records[0].getMessage()


@pytest.mark.parametrize(
    "case, pattern",
    [
        ("wrong_k", r"x has 100 features .* expects K = 128"),
        ("qweight_dtype", r"qweight must be a 2-D int32 .*int64"),
        ("qweight_strides", r"qweight \[128, 4\] must be contiguous"),
        ("group_size", r"group_size 96 is not supported"),
        ("group_divides_k", r"group_size 128 does not divide the layer's 64 inputs"),
        ("scales_shape", r"scales must be float16 \[K/G, N\] = \[2, 32\]"),
        ("bias_shape", r"bias must be a float tensor \[N\] = \[32\]"),
        ("x_int", r"x must be a floating-point tensor"),
    ],
)
def test_bad_inputs_raise_kernel_error(case, pattern):
    qweight, qzeros, scales, bias = random_awq(128, 32, 64, seed=17)
    x = random_x(2, 128, seed=18)
    group_size = 64
    if case == "wrong_k":
        x = random_x(2, 100, seed=18)
    elif case == "qweight_dtype":
        qweight = qweight.long()
    elif case == "qweight_strides":
        qweight = qweight.t().contiguous().t()
    elif case == "group_size":
        group_size = 96
    elif case == "group_divides_k":
        qweight, qzeros, scales = qweight[:64], qzeros[:1], scales[:1]
        x, group_size = x[:, :64], 128
    elif case == "scales_shape":
        scales = scales[:, :16]
    elif case == "bias_shape":
        bias = bias[:8]
    elif case == "x_int":
        x = x.to(torch.int32)
    with pytest.raises(KernelError, match=pattern):
        awq_linear(x, qweight, qzeros, scales, group_size, bias)


@needs_triton
def test_bfloat16_activations_are_refused_by_the_kernels():
    qweight, qzeros, scales, _ = random_awq(128, 16, 128, seed=19)
    x = random_x(1, 128, seed=20, dtype=torch.bfloat16)
    with pytest.raises(KernelError, match="bfloat16.*float16"):
        awq_linear(x, qweight, qzeros, scales, 128)


@pytest.mark.gpu
@pytest.mark.parametrize("num_rows", [1, 4, 16, 512])
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_real_shapes_on_gpu(shape, num_rows):
    num_inputs, num_outputs = shape
    qweight, qzeros, scales, bias = random_awq(num_inputs, num_outputs, 128,
                                               seed=num_inputs + num_outputs)
    x = random_x(num_rows, num_inputs, seed=num_rows)
    ref = awq_linear_ref(x, qweight, qzeros, scales, 128, bias)
    y = torch.full((num_rows, num_outputs), float("nan"), dtype=torch.float16, device="cuda")
    if num_rows <= w4a16.MAX_DECODE_M:
        config = w4a16.w4a16_gemv.choose_gemv_config(num_rows, num_outputs, num_inputs, 128,
                                                     w4a16._num_sms(x.device))
        w4a16.w4a16_gemv.launch_awq_gemv(x, qweight, qzeros, scales, 128, bias, y, config)
    else:
        config = w4a16.w4a16_gemm.choose_gemm_config(num_rows, 128)
        w4a16.w4a16_gemm.launch_awq_gemm(x, qweight, qzeros, scales, 128, bias, y, config)
    kernel_error = relative_error(y, ref)
    wrapper_error = relative_error(awq_linear(x, qweight, qzeros, scales, 128, bias), ref)
    print(f"K={num_inputs} N={num_outputs} M={num_rows} {config}: rel err kernel "
          f"{kernel_error:.2e} wrapper {wrapper_error:.2e}")
    assert kernel_error <= GPU_TOLERANCE
    assert wrapper_error <= GPU_TOLERANCE


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1536, 8960), (8960, 1536)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_dequant_matmul_path_on_gpu(shape):
    num_inputs, num_outputs = shape
    qweight, qzeros, scales, bias = random_awq(num_inputs, num_outputs, 128, seed=21)
    weight = w4a16.w4a16_gemm.launch_awq_dequant(qweight, qzeros, scales, 128)
    assert torch.equal(weight, dequantize_awq(qweight, qzeros, scales, 128))
    x = random_x(w4a16.DEQUANT_MATMUL_MIN_M, num_inputs, seed=22)
    error = relative_error(awq_linear(x, qweight, qzeros, scales, 128, bias),
                           awq_linear_ref(x, qweight, qzeros, scales, 128, bias))
    print(f"dequant+matmul K={num_inputs} N={num_outputs}: rel err {error:.2e}")
    assert error <= GPU_TOLERANCE


@pytest.mark.gpu
def test_float32_activations_are_refused_on_gpu():
    qweight, qzeros, scales, _ = random_awq(128, 16, 128, seed=23)
    with pytest.raises(KernelError, match="float32.*float16"):
        awq_linear(random_x(1, 128, seed=24, dtype=torch.float32), qweight, qzeros, scales, 128)


@pytest.mark.gpu
@pytest.mark.parametrize("num_rows", [1, 8])
@pytest.mark.parametrize("form", ROW_FORMS[1:], ids=["lanes-block", "lanes-end"])
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_lane_kernel_at_real_shapes_on_gpu(shape, form, num_rows):
    num_inputs, num_outputs = shape
    qweight, qzeros, scales, bias = random_awq(num_inputs, num_outputs, 128, seed=num_inputs + 3)
    x = random_x(num_rows, num_inputs, seed=11)
    ref = awq_linear_ref(x, qweight, qzeros, scales, 128, bias)
    blocks = ((128, 64, 1), (256, 128, 6), (64, 32, 16)) if num_rows == 1 else ((128, 64, 1), (64, 128, 6), (64, 32, 16))
    for block_n, block_k, split_k in blocks:
        y = torch.full((num_rows, num_outputs), float("nan"), dtype=torch.float16, device="cuda")
        config = {"block_n": block_n, "block_k": block_k, "split_k": split_k, "num_warps": 4, **form}
        w4a16.w4a16_gemv.launch_awq_gemv(x, qweight, qzeros, scales, 128, bias, y, config)
        error = relative_error(y, ref)
        print(f"K={num_inputs} N={num_outputs} {config}: rel err {error:.2e}")
        assert error <= GPU_TOLERANCE
