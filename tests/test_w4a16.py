"""W4A16 kernels against the float32 reference.

Without CUDA the kernels run under the Triton interpreter on small shapes; with CUDA the same
tests run on the GPU, and the `gpu` tests add the real layer shapes of the target models.
Error is reported as max|y - ref| / max|ref|: float16 output rounding alone is up to 2^-11.
"""

import logging

import pytest
import torch

from lowvram.errors import KernelError
from lowvram.kernels import dispatch, w4a16
from lowvram.kernels.awq_format import dequantize_awq
from lowvram.kernels.w4a16 import awq_linear, awq_linear_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SMALL_TOLERANCE = 1e-3
GPU_TOLERANCE = 2e-3
# (K, N) of the R1-Distill-Qwen-1.5B projections and of deepseek-coder-1.3b's MLP
GPU_SHAPES = [(1536, 1536), (1536, 8960), (8960, 1536), (1536, 256), (2048, 5504)]

needs_triton = pytest.mark.skipif(
    not dispatch.triton_path(torch.device(DEVICE).type, None)[0],
    reason="Triton kernels unavailable here (no CUDA and TRITON_INTERPRET unset)",
)


def random_awq(num_inputs, num_outputs, group_size, seed, device=DEVICE):
    gen = torch.Generator().manual_seed(seed)
    qweight = torch.randint(-(2**31), 2**31 - 1, (num_inputs, num_outputs // 8), dtype=torch.int32, generator=gen)
    qzeros = torch.randint(
        -(2**31), 2**31 - 1, (num_inputs // group_size, num_outputs // 8), dtype=torch.int32, generator=gen
    )
    scales = torch.rand(num_inputs // group_size, num_outputs, generator=gen) * 0.02 + 1e-3
    bias = torch.randn(num_outputs, generator=gen)
    return (qweight.to(device), qzeros.to(device), scales.half().to(device), bias.half().to(device))


def random_x(num_rows, num_inputs, seed, dtype=torch.float16, device=DEVICE):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(num_rows, num_inputs, generator=gen).to(dtype).to(device)


def random_lora(rank, num_inputs, num_outputs, seed, dtype=torch.float32, device=DEVICE):
    """Compensation factors A [R, K] and Bt [R, N] whose term is about a tenth of y, as a
    fitted correction is: large enough that leaving it out fails every tolerance."""
    gen = torch.Generator().manual_seed(seed)
    lora_a = torch.randn(rank, num_inputs, generator=gen) * 0.05
    lora_bt = torch.randn(rank, num_outputs, generator=gen) * 0.05
    return lora_a.to(dtype).to(device), lora_bt.to(dtype).to(device)


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


# Configurations of the two kernels: the one-row kernel reducing every K block (and, with
# several splits, computing the compensation's x A^T once) or once after the loop; the tiled
# kernel's 16-row tile for several rows.
ROW_FORMS = [{"reduce_at_end": False}, {"reduce_at_end": True}]
ROW_FORM_IDS = ["block", "end"]


def rows_and_forms(several):
    """(num_rows, config) pairs: one row in each one-row form, `several` rows in the tiled kernel."""
    return [pytest.param(1, form, id=f"1-{name}") for form, name in zip(ROW_FORMS, ROW_FORM_IDS)] + [
        pytest.param(several, {"block_m": 16}, id=f"{several}-tiled")
    ]


def launch(x, qweight, qzeros, scales, group_size, bias, y, config, lora_a=None, lora_bt=None, **fused):
    """The kernel a config names: the tiled one when it has block_m, else the one-row kernel."""
    gemv = w4a16.w4a16_gemv
    if "block_m" in config:
        return gemv.launch_tiled(x, (qweight, qzeros, scales, group_size), bias, y, config, lora_a, lora_bt)
    return gemv.launch_row(x, qweight, qzeros, scales, group_size, bias, y, config, lora_a, lora_bt, **fused)


@needs_triton
@pytest.mark.parametrize("split_k", [1, 2, 4])
@pytest.mark.parametrize("num_rows,form", rows_and_forms(5))
def test_decode_kernel_splits_and_column_tails(num_rows, split_k, form):
    # N = 200 leaves a partial column block; every output starts as NaN so a skipped store shows
    qweight, qzeros, scales, bias = random_awq(256, 200, 64, seed=split_k)
    x = random_x(num_rows, 256, seed=7)
    for layer_bias in (None, bias):
        y = torch.full((num_rows, 200), float("nan"), dtype=torch.float16, device=DEVICE)
        config = {"block_n": 64, "block_k": 32, "split_k": split_k, "num_warps": 4, **form}
        launch(x, qweight, qzeros, scales, 64, layer_bias, y, config)
        error = relative_error(y, awq_linear_ref(x, qweight, qzeros, scales, 64, layer_bias))
        print(f"decode M={num_rows} split_k={split_k} {form} bias={layer_bias is not None}: rel err {error:.2e}")
        assert error <= SMALL_TOLERANCE


@needs_triton
def test_the_row_kernel_refuses_several_rows():
    qweight, qzeros, scales, _ = random_awq(256, 64, 64, seed=3)
    x = random_x(2, 256, seed=4)
    y = torch.empty((2, 64), dtype=x.dtype, device=DEVICE)
    config = {"block_n": 64, "block_k": 32, "split_k": 1, "num_warps": 4, **ROW_FORMS[1]}
    with pytest.raises(ValueError, match="one row"):
        launch(x, qweight, qzeros, scales, 64, None, y, config)


@needs_triton
@pytest.mark.parametrize("rank", [16, 12])
@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("num_rows,form", rows_and_forms(5))
def test_decode_kernel_adds_compensation(rank, num_rows, split_k, form):
    # Each split adds its share t_s Bt of the rank-R term; the split reduction must give the
    # whole (x A^T) Bt. R = 12 is padded to 16 by masks; N = 200 leaves a partial column block.
    qweight, qzeros, scales, bias = random_awq(256, 200, 64, seed=50 + split_k)
    x = random_x(num_rows, 256, seed=51, dtype=torch.float32)
    lora_a, lora_bt = random_lora(rank, 256, 200, seed=rank)
    config = {"block_n": 64, "block_k": 32, "split_k": split_k, "num_warps": 4, **form}
    for layer_bias in (None, bias):
        ref = awq_linear_ref(x, qweight, qzeros, scales, 64, layer_bias, lora_a=lora_a, lora_bt=lora_bt)
        without = relative_error(awq_linear_ref(x, qweight, qzeros, scales, 64, layer_bias), ref)
        y = torch.full((num_rows, 200), float("nan"), dtype=torch.float32, device=DEVICE)
        launch(x, qweight, qzeros, scales, 64, layer_bias, y, config, lora_a, lora_bt)
        if split_k > 1:  # every arrival counter, the compensation's included, is back to zero
            assert not w4a16.w4a16_gemv.SPLIT_COUNTERS.by_device[y.device].any()
        error = relative_error(y, ref)
        print(
            f"decode + lora R={rank} M={num_rows} split_k={split_k} {form} bias={layer_bias is not None}: "
            f"rel err {error:.2e} (leaving the term out: {without:.2e})"
        )
        assert error <= SMALL_TOLERANCE < without


@needs_triton
@pytest.mark.parametrize("has_residual", [False, True])
@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("reduce", ["block", "end"])
def test_one_row_kernel_fuses_the_rms_norm(has_residual, split_k, reduce):
    # K = 192 is not a power of two (the row's norm reads a masked block); N = 200 leaves a
    # partial column block. The result must be the norm kernel's output through the matmul.
    from lowvram.kernels.rms_norm import rms_norm_ref
    from lowvram.kernels.w4a16 import InputNorm

    qweight, qzeros, scales, bias = random_awq(192, 200, 64, seed=60 + split_k)
    dtype = torch.float16 if DEVICE == "cuda" else torch.float32
    x = random_x(1, 192, seed=61, dtype=dtype) * 4
    residual = random_x(1, 192, seed=62, dtype=dtype) if has_residual else None
    weight = (torch.rand(192, generator=torch.Generator().manual_seed(63)) + 0.5).to(dtype).to(DEVICE)
    lora_a, lora_bt = random_lora(16, 192, 200, seed=64)
    normed, total = rms_norm_ref(x, weight, 1e-6, residual)
    ref = awq_linear_ref(normed, qweight, qzeros, scales, 64, bias, lora_a=lora_a, lora_bt=lora_bt)
    unnormed = relative_error(awq_linear_ref(x, qweight, qzeros, scales, 64, bias, lora_a=lora_a, lora_bt=lora_bt), ref)
    sum_out = torch.full_like(x, float("nan")) if has_residual else None
    y = torch.full((1, 200), float("nan"), dtype=dtype, device=DEVICE)
    config = {"block_n": 64, "block_k": 32, "split_k": split_k, "num_warps": 4, "reduce_at_end": reduce == "end"}
    launch(
        x,
        qweight,
        qzeros,
        scales,
        64,
        bias,
        y,
        config,
        lora_a,
        lora_bt,
        norm=InputNorm(weight, 1e-6, residual, sum_out),
    )
    error = relative_error(y, ref)
    print(
        f"norm prologue residual={has_residual} split_k={split_k} {reduce}: rel err {error:.2e} "
        f"(without the norm: {unnormed:.2e})"
    )
    assert error <= SMALL_TOLERANCE < unnormed
    if has_residual:
        assert torch.equal(sum_out, total)


@needs_triton
@pytest.mark.parametrize("split_k", [1, 3])
def test_one_row_kernel_fuses_the_silu_gate(split_k):
    from lowvram.kernels.activation import silu_and_mul_ref

    qweight, qzeros, scales, bias = random_awq(192, 200, 64, seed=70 + split_k)
    dtype = torch.float16 if DEVICE == "cuda" else torch.float32
    gate_up = random_x(1, 384, seed=71, dtype=dtype) * 3  # [1, 2K]: gate, then up
    ref = awq_linear_ref(silu_and_mul_ref(gate_up), qweight, qzeros, scales, 64, bias)
    y = torch.full((1, 200), float("nan"), dtype=dtype, device=DEVICE)
    config = {"block_n": 64, "block_k": 32, "split_k": split_k, "num_warps": 4, "reduce_at_end": True}
    launch(gate_up, qweight, qzeros, scales, 64, bias, y, config, is_gated=True)
    error = relative_error(y, ref)
    print(f"silu-gate prologue split_k={split_k}: rel err {error:.2e}")
    assert error <= SMALL_TOLERANCE


@needs_triton
@pytest.mark.parametrize("prologue", ["none", "norm", "norm+residual", "gate"])
@pytest.mark.parametrize("group_size,split_k", [(32, 1), (32, 3), (64, 2), (64, 5)])
def test_wide_row_kernel(prologue, group_size, split_k):
    # The K-in-thread kernel (wide layers without compensation) against the reference through
    # each prologue; N = 200 leaves a partial column block, NaN outputs show a skipped store.
    from lowvram.kernels.activation import silu_and_mul_ref
    from lowvram.kernels.rms_norm import rms_norm_ref
    from lowvram.kernels.w4a16 import InputNorm

    qweight, qzeros, scales, bias = random_awq(192, 200, group_size, seed=80 + split_k)
    dtype = torch.float16 if DEVICE == "cuda" else torch.float32
    x = random_x(1, 384 if prologue == "gate" else 192, seed=81, dtype=dtype) * 3
    fused, reference_x = {}, x
    if prologue == "gate":
        fused["is_gated"], reference_x = True, silu_and_mul_ref(x)
    elif prologue != "none":
        residual = random_x(1, 192, seed=82, dtype=dtype) if prologue == "norm+residual" else None
        weight = (torch.rand(192, generator=torch.Generator().manual_seed(83)) + 0.5).to(dtype).to(DEVICE)
        sum_out = torch.full_like(x, float("nan")) if residual is not None else None
        fused["norm"] = InputNorm(weight, 1e-6, residual, sum_out)
        reference_x, total = rms_norm_ref(x, weight, 1e-6, residual)
    ref = awq_linear_ref(reference_x, qweight, qzeros, scales, group_size, bias)
    y = torch.full((1, 200), float("nan"), dtype=dtype, device=DEVICE)
    config = {"block_n": 64, "block_k": group_size, "split_k": split_k, "num_warps": 2, "k_in_thread": True}
    launch(x, qweight, qzeros, scales, group_size, bias, y, config, **fused)
    error = relative_error(y, ref)
    print(f"K-in-thread {prologue} group {group_size} split_k={split_k}: rel err {error:.2e}")
    assert error <= SMALL_TOLERANCE
    if prologue == "norm+residual":
        assert torch.equal(fused["norm"].sum_out, total)


def test_row_config_takes_the_k_in_thread_kernel_for_wide_plain_layers():
    row_config = w4a16.w4a16_gemv.row_config
    assert row_config(17920, 1536, 128, 132, False).get("k_in_thread")  # gate/up, plain
    assert not row_config(17920, 1536, 128, 132, True).get("k_in_thread")  # compensated
    assert not row_config(1536, 8960, 128, 132, False).get("k_in_thread")  # down: narrow
    assert not row_config(17920, 1536, 128, 132, False, block_n=128).get("k_in_thread")  # one head per block


@needs_triton
def test_one_row_fusion_checks_its_inputs():
    from lowvram.kernels.w4a16 import InputNorm

    qweight, qzeros, scales, _ = random_awq(128, 64, 64, seed=80)
    dtype = torch.float16 if DEVICE == "cuda" else torch.float32
    x = random_x(1, 128, seed=81, dtype=dtype)
    weight = torch.ones(128, dtype=dtype, device=DEVICE)
    with pytest.raises(KernelError, match="norm or is_gated"):
        w4a16.awq_linear_one_row(x, qweight, qzeros, scales, 64)
    with pytest.raises(KernelError, match="one contiguous row of 256"):
        w4a16.awq_linear_one_row(x, qweight, qzeros, scales, 64, is_gated=True)
    with pytest.raises(KernelError, match="must be a new tensor"):
        residual = torch.zeros_like(x)
        w4a16.awq_linear_one_row(x, qweight, qzeros, scales, 64, norm=InputNorm(weight, 1e-6, residual, residual))
    with pytest.raises(KernelError, match="norm weight"):
        w4a16.awq_linear_one_row(x, qweight, qzeros, scales, 64, norm=InputNorm(weight[:64], 1e-6))


@needs_triton
@pytest.mark.parametrize("form", ROW_FORMS, ids=ROW_FORM_IDS)
def test_decode_kernel_reads_transposed_lora_bt(form):
    # Bt given as B.t() of a contiguous B [N, R]: strided reads, same result
    qweight, qzeros, scales, bias = random_awq(128, 64, 32, seed=52)
    x = random_x(1, 128, seed=53, dtype=torch.float32)
    lora_a, lora_bt = random_lora(8, 128, 64, seed=54)
    strided = lora_bt.t().contiguous().t()
    assert not strided.is_contiguous()
    y = torch.empty((1, 64), dtype=torch.float32, device=DEVICE)
    config = {"block_n": 64, "block_k": 32, "split_k": 2, "num_warps": 4, **form}
    launch(x, qweight, qzeros, scales, 32, bias, y, config, lora_a, strided)
    error = relative_error(y, awq_linear_ref(x, qweight, qzeros, scales, 32, bias, lora_a=lora_a, lora_bt=lora_bt))
    print(f"strided lora_bt {form}: rel err {error:.2e}")
    assert error <= SMALL_TOLERANCE


@needs_triton
@pytest.mark.parametrize("num_rows", [1, 5, 33, 48])
def test_awq_linear_adds_compensation_on_every_path(num_rows, monkeypatch):
    # 1 and 5 rows: the decode kernel; 33: the tl.dot GEMM then one addmm; 48 (with the
    # threshold lowered): the lora term folded into the dequantized W before cuBLAS
    monkeypatch.setattr(w4a16, "DEQUANT_MATMUL_MIN_M", 40)
    qweight, qzeros, scales, bias = random_awq(256, 128, 64, seed=55)
    x = random_x(num_rows, 256, seed=56)
    lora_a, lora_bt = random_lora(8, 256, 128, seed=57, dtype=torch.float16)
    ref = awq_linear_ref(x, qweight, qzeros, scales, 64, bias, lora_a=lora_a, lora_bt=lora_bt)
    y = awq_linear(x, qweight, qzeros, scales, 64, bias, lora_a=lora_a, lora_bt=lora_bt)
    torch_y = awq_linear(x, qweight, qzeros, scales, 64, bias, lora_a=lora_a, lora_bt=lora_bt, use_reference=True)
    error, torch_error = relative_error(y, ref), relative_error(torch_y, ref)
    print(f"awq_linear + lora M={num_rows}: rel err kernels {error:.2e}, plain torch {torch_error:.2e}")
    assert error <= SMALL_TOLERANCE and torch_error <= SMALL_TOLERANCE


def split_partials(x, qweight, qzeros, scales, group_size, config):
    """The float32 partial sum of each K split of `config`, one split-free launch per K range."""
    num_inputs = x.shape[1]
    num_k_blocks = num_inputs // config["block_k"]
    split_inputs = -(-num_k_blocks // config["split_k"]) * config["block_k"]
    assert split_inputs % group_size == 0, "each split must start on a group"
    partials = []
    for start in range(0, num_inputs, split_inputs):
        end = min(start + split_inputs, num_inputs)
        groups = slice(start // group_size, end // group_size)
        partial = torch.empty((x.shape[0], qweight.shape[1] * 8), dtype=torch.float32, device=x.device)
        launch(
            x[:, start:end],
            qweight[start:end],
            qzeros[groups],
            scales[groups],
            group_size,
            None,
            partial,
            config | {"split_k": 1},
        )
        partials.append(partial)
    return partials


@needs_triton
@pytest.mark.parametrize("split_k", [1, 3, 8])
@pytest.mark.parametrize("num_rows,form", rows_and_forms(5))
def test_split_k_sums_in_split_order_then_adds_bias(num_rows, split_k, form):
    # The split programs reduce themselves: whichever arrives last, y must be exactly
    # (((0 + p_0) + p_1) + ... + p_{S-1}) + bias in float32, as the separate summing kernel
    # computed it. A float32 y keeps every bit of that sum (float16 would round most changes of
    # order away). 8 K blocks in 3 splits leaves a short last split; N = 200 a partial column block.
    group_size = 32
    qweight, qzeros, scales, bias = random_awq(256, 200, group_size, seed=30 + split_k)
    x = random_x(num_rows, 256, seed=31)
    config = {"block_n": 64, "block_k": 32, "split_k": split_k, "num_warps": 4, **form}
    partials = split_partials(x, qweight, qzeros, scales, group_size, config)
    assert len(partials) == split_k
    for layer_bias in (None, bias):
        expected = torch.zeros_like(partials[0])
        for partial in partials:
            expected += partial
        if layer_bias is not None:
            expected += layer_bias.float()
        outputs = []
        for _ in range(3):  # the counters must be back at zero for every launch
            y = torch.full((num_rows, 200), float("nan"), dtype=torch.float32, device=DEVICE)
            launch(x, qweight, qzeros, scales, group_size, layer_bias, y, config)
            outputs.append(y)
        error = relative_error(outputs[0], awq_linear_ref(x, qweight, qzeros, scales, group_size, layer_bias))
        largest = (outputs[0] - expected).abs().max().item()
        print(
            f"split_k={split_k} M={num_rows} {form} bias={layer_bias is not None}: rel err {error:.2e}, "
            f"largest difference from the ordered split sum {largest:.2e}"
        )
        assert error <= SMALL_TOLERANCE
        assert torch.equal(outputs[0], expected)
        assert all(torch.equal(y, outputs[0]) for y in outputs[1:])
    if split_k > 1:
        assert not w4a16.w4a16_gemv.SPLIT_COUNTERS.by_device[y.device].any()


@needs_triton
def test_split_counters_grow_for_wider_layers(monkeypatch):
    from lowvram.kernels.arrival_counters import ArrivalCounters

    gemv = w4a16.w4a16_gemv
    monkeypatch.setattr(gemv, "SPLIT_COUNTERS", ArrivalCounters("the decode GEMV's split-K", 2))
    config = {"block_n": 64, "block_k": 32, "split_k": 4, "num_warps": 4, "reduce_at_end": False}
    for num_outputs in (128, 512):  # 2 column blocks, then 8
        qweight, qzeros, scales, bias = random_awq(128, num_outputs, 32, seed=num_outputs)
        x = random_x(1, 128, seed=33)
        y = torch.full((1, num_outputs), float("nan"), dtype=torch.float16, device=DEVICE)
        gemv.launch_row(x, qweight, qzeros, scales, 32, bias, y, config)
        assert relative_error(y, awq_linear_ref(x, qweight, qzeros, scales, 32, bias)) <= SMALL_TOLERANCE
    counters = gemv.SPLIT_COUNTERS.by_device[y.device]
    # one counter per column block and two for the compensation's shares, rounded up to a power of two
    assert counters.numel() == 16 and not counters.any()
    # graphs captured with the smaller buffer still point at it
    assert [c.numel() for c in gemv.SPLIT_COUNTERS.replaced] == [4]


def test_arrival_counters_are_not_made_during_graph_capture(monkeypatch):
    from lowvram.kernels.arrival_counters import ArrivalCounters

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(KernelError, match="cannot be made during CUDA-graph capture"):
        ArrivalCounters("the decode GEMV's split-K", 16).get(torch.device("cuda", 0), 24)


@needs_triton
def test_prefill_kernel_row_and_column_tails():
    qweight, qzeros, scales, bias = random_awq(128, 200, 32, seed=3)
    x = random_x(40, 128, seed=4)
    y = torch.full((40, 200), float("nan"), dtype=torch.float16, device=DEVICE)
    config = {"block_m": 32, "block_n": 64, "block_k": 32, "split_k": 1, "num_warps": 4}
    launch(x, qweight, qzeros, scales, 32, bias, y, config)
    error = relative_error(y, awq_linear_ref(x, qweight, qzeros, scales, 32, bias))
    print(f"prefill M=40 N=200: rel err {error:.2e}")
    assert error <= SMALL_TOLERANCE


@needs_triton
@pytest.mark.parametrize("num_outputs", [72, 256])
def test_dequant_kernel_is_bit_exact(num_outputs):
    qweight, qzeros, scales, _ = random_awq(128, num_outputs, 64, seed=5)
    weight = w4a16.w4a16_gemv.launch_dequant(qweight, qzeros, scales, 64)
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
    monkeypatch.setattr(dispatch, "IS_INTERPRETER", False)
    dispatch.triton_path.cache_clear()
    try:
        qweight, qzeros, scales, bias = random_awq(128, 32, 64, seed=13, device="cpu")
        for dtype in (torch.float32, torch.bfloat16):
            x = random_x(5, 128, seed=14, dtype=dtype, device="cpu")
            y = awq_linear(x, qweight, qzeros, scales, 64, bias)
            assert y.dtype == dtype
            ref = awq_linear_ref(x, qweight, qzeros, scales, 64, bias)
            assert relative_error(y, ref) <= (1e-5 if dtype == torch.float32 else 1e-2)
    finally:
        dispatch.triton_path.cache_clear()


def test_path_choice_is_logged_once(caplog):
    dispatch._logged_paths.clear()
    qweight, qzeros, scales, _ = random_awq(128, 16, 128, seed=15)
    x = random_x(1, 128, seed=16)
    with caplog.at_level(logging.INFO, logger="lowvram.kernels"):
        awq_linear(x, qweight, qzeros, scales, 128)
        awq_linear(x, qweight, qzeros, scales, 128)
    records = [r for r in caplog.records if r.name == "lowvram.kernels"]
    assert len(records) == 1
    assert records[0].getMessage().startswith("awq_linear on")


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
        ("lora_alone", r"lora_a and lora_bt come together"),
        ("lora_a_shape", r"lora_a must be a float tensor \[R, K\] = \[R, 128\]"),
        ("lora_ranks", r"lora_a has rank 4 but lora_bt has rank 8"),
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
    lora_a, lora_bt = random_lora(8, 128, 32, seed=18)
    lora = {"lora_a": lora_a, "lora_bt": lora_bt} if case.startswith("lora") else {}
    if case == "lora_alone":
        lora = {"lora_a": lora_a}
    elif case == "lora_a_shape":
        lora["lora_a"] = lora_a[:, :64]
    elif case == "lora_ranks":
        lora["lora_a"] = lora_a[:4]
    with pytest.raises(KernelError, match=pattern):
        awq_linear(x, qweight, qzeros, scales, group_size, bias, **lora)


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
    qweight, qzeros, scales, bias = random_awq(num_inputs, num_outputs, 128, seed=num_inputs + num_outputs)
    x = random_x(num_rows, num_inputs, seed=num_rows)
    ref = awq_linear_ref(x, qweight, qzeros, scales, 128, bias)
    y = torch.full((num_rows, num_outputs), float("nan"), dtype=torch.float16, device="cuda")
    sms = w4a16.num_sms(x.device)
    if num_rows == 1:
        config = w4a16.w4a16_gemv.row_config(num_outputs, num_inputs, 128, sms, False)
    else:
        config = w4a16.w4a16_gemv.tiled_config(num_rows, num_outputs, num_inputs, 128, sms)
    launch(x, qweight, qzeros, scales, 128, bias, y, config)
    kernel_error = relative_error(y, ref)
    wrapper_error = relative_error(awq_linear(x, qweight, qzeros, scales, 128, bias), ref)
    print(
        f"K={num_inputs} N={num_outputs} M={num_rows} {config}: rel err kernel "
        f"{kernel_error:.2e} wrapper {wrapper_error:.2e}"
    )
    assert kernel_error <= GPU_TOLERANCE
    assert wrapper_error <= GPU_TOLERANCE


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1536, 8960), (8960, 1536)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_dequant_matmul_path_on_gpu(shape):
    num_inputs, num_outputs = shape
    qweight, qzeros, scales, bias = random_awq(num_inputs, num_outputs, 128, seed=21)
    weight = w4a16.w4a16_gemv.launch_dequant(qweight, qzeros, scales, 128)
    assert torch.equal(weight, dequantize_awq(qweight, qzeros, scales, 128))
    x = random_x(w4a16.DEQUANT_MATMUL_MIN_M, num_inputs, seed=22)
    error = relative_error(
        awq_linear(x, qweight, qzeros, scales, 128, bias), awq_linear_ref(x, qweight, qzeros, scales, 128, bias)
    )
    print(f"dequant+matmul K={num_inputs} N={num_outputs}: rel err {error:.2e}")
    assert error <= GPU_TOLERANCE


@pytest.mark.gpu
def test_float32_activations_are_refused_on_gpu():
    qweight, qzeros, scales, _ = random_awq(128, 16, 128, seed=23)
    with pytest.raises(KernelError, match="float32.*float16"):
        awq_linear(random_x(1, 128, seed=24, dtype=torch.float32), qweight, qzeros, scales, 128)


@pytest.mark.gpu
@pytest.mark.parametrize("form", ROW_FORMS, ids=ROW_FORM_IDS)
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_lane_kernel_at_real_shapes_on_gpu(shape, form):
    num_inputs, num_outputs, num_rows = *shape, 1
    qweight, qzeros, scales, bias = random_awq(num_inputs, num_outputs, 128, seed=num_inputs + 3)
    x = random_x(num_rows, num_inputs, seed=11)
    ref = awq_linear_ref(x, qweight, qzeros, scales, 128, bias)
    blocks = ((128, 64, 1), (256, 128, 6), (64, 32, 16))
    for block_n, block_k, split_k in blocks:
        y = torch.full((num_rows, num_outputs), float("nan"), dtype=torch.float16, device="cuda")
        config = {"block_n": block_n, "block_k": block_k, "split_k": split_k, "num_warps": 4, **form}
        launch(x, qweight, qzeros, scales, 128, bias, y, config)
        error = relative_error(y, ref)
        print(f"K={num_inputs} N={num_outputs} {config}: rel err {error:.2e}")
        assert error <= GPU_TOLERANCE


@pytest.mark.gpu
@pytest.mark.parametrize("num_rows,form", rows_and_forms(8))
@pytest.mark.parametrize("shape", [(8960, 1536), (1536, 8960)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_split_k_reduction_in_cuda_graph_replays(shape, form, num_rows):
    # Inside a decode graph the last-arriving program sums the splits; many waves of programs
    # make the arrival order vary between replays. A partial read before it was visible (a
    # memory-ordering fault) or a counter not reset would show as a replay that differs from
    # the eager result of the same input; float32 outputs keep even a change of summing order.
    num_inputs, num_outputs = shape
    qweight, qzeros, scales, bias = random_awq(num_inputs, num_outputs, 128, seed=num_inputs + 5)
    xs = [random_x(num_rows, num_inputs, seed=40 + i) for i in range(3)]
    config = {"block_n": 64, "block_k": 128, "split_k": 12, "num_warps": 4, **form}
    eager = []
    for x in xs:
        y = torch.empty((num_rows, num_outputs), dtype=torch.float32, device="cuda")
        launch(x, qweight, qzeros, scales, 128, bias, y, config)
        eager.append(y)
    static_x = xs[0].clone()
    static_y = torch.empty((num_rows, num_outputs), dtype=torch.float32, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up off the default stream, as the engine does
        launch(static_x, qweight, qzeros, scales, 128, bias, static_y, config)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch(static_x, qweight, qzeros, scales, 128, bias, static_y, config)
    num_mismatches = 0
    for replay in range(30):
        which = replay % len(xs)
        static_x.copy_(xs[which])
        static_y.fill_(float("nan"))
        graph.replay()
        if not torch.equal(static_y, eager[which]):
            num_mismatches += 1
            print(f"replay {replay}: largest difference from eager {(static_y - eager[which]).abs().max().item():.2e}")
    torch.cuda.synchronize()
    error = relative_error(eager[0], awq_linear_ref(xs[0], qweight, qzeros, scales, 128, bias))
    print(
        f"K={num_inputs} N={num_outputs} M={num_rows} {config}: rel err {error:.2e}, "
        f"{num_mismatches} of 30 replays differ from eager"
    )
    assert error <= GPU_TOLERANCE
    assert num_mismatches == 0
    assert not w4a16.w4a16_gemv.SPLIT_COUNTERS.by_device[static_y.device].any()


@pytest.mark.gpu
@pytest.mark.parametrize("num_rows", [1, 8])
@pytest.mark.parametrize("shape", [(1536, 17920), (8960, 1536)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_compensation_in_the_decode_kernel_on_gpu(shape, num_rows):
    # The fused gate/up and down projections of the 1.5B model with rank-16 compensation:
    # every decode form against the float64 reference, then the default form replayed in a
    # CUDA graph, where the lora term must not need a launch of its own.
    num_inputs, num_outputs = shape
    qweight, qzeros, scales, bias = random_awq(num_inputs, num_outputs, 128, seed=num_inputs + 7)
    lora_a, lora_bt = random_lora(16, num_inputs, num_outputs, seed=60, dtype=torch.float16)
    x = random_x(num_rows, num_inputs, seed=61)
    ref = awq_linear_ref(x, qweight, qzeros, scales, 128, bias, lora_a=lora_a, lora_bt=lora_bt)
    sms = w4a16.num_sms(x.device)
    if num_rows == 1:
        default, forms = w4a16.w4a16_gemv.row_config(num_outputs, num_inputs, 128, sms, True), ROW_FORMS
    else:
        default, forms = w4a16.w4a16_gemv.tiled_config(num_rows, num_outputs, num_inputs, 128, sms), [{"block_m": 16}]
    for config in (default, *({"block_n": 64, "block_k": 128, "split_k": 8, "num_warps": 4, **form} for form in forms)):
        y = torch.full((num_rows, num_outputs), float("nan"), dtype=torch.float16, device="cuda")
        launch(x, qweight, qzeros, scales, 128, bias, y, config, lora_a, lora_bt)
        error = relative_error(y, ref)
        print(f"K={num_inputs} N={num_outputs} M={num_rows} R=16 {config}: rel err {error:.2e}")
        assert error <= GPU_TOLERANCE
    static_x, static_y = x.clone(), torch.empty((num_rows, num_outputs), dtype=torch.float16, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up off the default stream makes the split counters
        static_y.copy_(awq_linear(static_x, qweight, qzeros, scales, 128, bias, lora_a=lora_a, lora_bt=lora_bt))
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y.copy_(awq_linear(static_x, qweight, qzeros, scales, 128, bias, lora_a=lora_a, lora_bt=lora_bt))
    x2 = random_x(num_rows, num_inputs, seed=62)
    static_x.copy_(x2)
    static_y.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    error = relative_error(
        static_y, awq_linear_ref(x2, qweight, qzeros, scales, 128, bias, lora_a=lora_a, lora_bt=lora_bt)
    )
    print(f"K={num_inputs} N={num_outputs} M={num_rows} R=16 graph replay: rel err {error:.2e}")
    assert error <= GPU_TOLERANCE
