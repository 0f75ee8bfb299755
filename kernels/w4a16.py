"""W4A16 linear layer over AutoAWQ GEMM tensors: y = x @ W + bias (+ (x A^T) Bt), W stored as INT4.

`awq_linear` runs one row through the split-K one-row kernel, 2..MAX_DECODE_M rows through the
tiled kernel's 16-row tile split over K, up to DEQUANT_MATMUL_MIN_M rows through the tiled GEMM,
and more by dequantizing W once for cuBLAS. Without Triton (and for the engine on the CPU) it
dequantizes and multiplies in torch. `awq_linear_ref` is the float64 reference.
"""

from dataclasses import dataclass

import torch

from lowvram.errors import ConfigError, KernelError
from lowvram.kernels.awq_format import check_awq_shapes, dequantize_awq
from lowvram.kernels.dispatch import HAS_TRITON, num_sms, use_triton
from lowvram.kernels.kv_quant import KVPages

if HAS_TRITON:
    from lowvram.kernels import w4a16_gemv

MAX_DECODE_M = 16
# At 512 rows dequantize-then-cuBLAS beat the tl.dot GEMM on 4 of 5 real shapes (H200, docs/performance.md).
DEQUANT_MATMUL_MIN_M = 512


def awq_linear_ref(x, qweight, qzeros, scales, group_size, bias=None, *, lora_a=None, lora_bt=None):
    """x [..., K] @ W [K, N] (+ bias) (+ (x A^T) Bt) in float64 (immune to TF32), as float32."""
    check_awq_shapes(qweight, qzeros, scales, group_size)
    weight = dequantize_awq(qweight, qzeros, scales, group_size, dtype=torch.float64)
    x64 = x.to(torch.float64)
    y = x64 @ weight.to(x.device)
    if bias is not None:
        y = y + bias.to(torch.float64)
    if lora_a is not None:
        y = y + (x64 @ lora_a.to(torch.float64).t()) @ lora_bt.to(torch.float64)
    return y.to(torch.float32)


def awq_linear(
    x,
    qweight,
    qzeros,
    scales,
    group_size,
    bias=None,
    *,
    lora_a=None,
    lora_bt=None,
    use_reference: bool = False,
    batch_invariant: bool = False,
):
    """y [..., N] = x [..., K] @ W [K, N] + bias + (x A^T) Bt, W given as AutoAWQ GEMM tensors.

    x: float16 [..., K], any strides (float32 and bfloat16 on the torch path, float32 under the
    interpreter); qweight, qzeros, scales as in awq_format and bias [N], contiguous, on x's device;
    group_size 32/64/128 dividing K. lora_a [R, K] (contiguous) and lora_bt [R, N], both or
    neither: the residual compensation. Returns y in x's dtype; KernelError names a bad tensor.
    use_reference forces the torch path; batch_invariant gives each row the same bits however
    many rows x has (one tiling for every M, or one row at a time in torch).
    """
    num_inputs, num_outputs = _check_inputs(x, qweight, qzeros, scales, group_size, bias, lora_a, lora_bt)
    is_triton = use_triton("awq_linear", x.device, use_reference)
    if is_triton:
        _check_kernel_dtype(x)
    x2d = x.reshape(-1, num_inputs)  # [M, K]
    num_rows = x2d.shape[0]
    out_shape = (*x.shape[:-1], num_outputs)
    if num_rows == 0:
        return x.new_empty(out_shape)
    if not is_triton:
        return _awq_linear_torch(
            x2d, qweight, qzeros, scales, group_size, bias, lora_a, lora_bt, batch_invariant
        ).reshape(out_shape)
    has_lora = lora_a is not None
    if num_rows >= DEQUANT_MATMUL_MIN_M and not batch_invariant:
        weight = w4a16_gemv.launch_dequant(qweight, qzeros, scales, group_size, x.dtype)  # [K, N], ours
        if has_lora:
            # W += A^T Bt: one op however many rows
            weight.addmm_(lora_a.t().to(x.dtype), lora_bt.to(x.dtype))
        y = x2d @ weight if bias is None else torch.addmm(bias.to(x.dtype), x2d, weight)
        return y.reshape(out_shape)
    y = torch.empty((num_rows, num_outputs), dtype=x.dtype, device=x.device)
    sms = num_sms(x.device)
    if num_rows == 1 and not batch_invariant:
        config = w4a16_gemv.row_config(num_outputs, num_inputs, group_size, sms, has_lora)
        x2d = x2d.contiguous()  # K * 2 bytes, copied only when strided
        w4a16_gemv.launch_row(x2d, qweight, qzeros, scales, group_size, bias, y, config, lora_a, lora_bt)
    elif num_rows <= MAX_DECODE_M or batch_invariant:
        config = w4a16_gemv.tiled_config(MAX_DECODE_M, num_outputs, num_inputs, group_size, sms)
        for start in range(0, num_rows, w4a16_gemv.INVARIANT_MAX_ROWS):
            stop = start + w4a16_gemv.INVARIANT_MAX_ROWS
            weight = (qweight, qzeros, scales, group_size)
            w4a16_gemv.launch_tiled(x2d[start:stop], weight, bias, y[start:stop], config, lora_a, lora_bt)
    else:
        config = w4a16_gemv.tiled_config(num_rows, num_outputs, num_inputs, group_size, sms)
        w4a16_gemv.launch_tiled(x2d, (qweight, qzeros, scales, group_size), bias, y, config)
        if has_lora:
            y.addmm_(x2d @ lora_a.t().to(x.dtype), lora_bt.to(x.dtype))
    return y.reshape(out_shape)


@dataclass
class InputNorm:
    """The one-row kernel's RMSNorm prologue: W times weight * normalise(x + residual), the sum
    stored to sum_out. weight [K] in x's dtype; residual and sum_out [1, K] contiguous, both or
    neither; sum_out must be a new tensor, as other programs still read x and residual."""

    weight: torch.Tensor
    eps: float
    residual: torch.Tensor | None = None
    sum_out: torch.Tensor | None = None


@dataclass
class RopeKVWrite:
    """What the fused one-row q/k/v projection needs to finish as rotary_write_kv does: the token's
    position [1], float32 cos/sin [P, D/2], slot [1] and the layer's pages."""

    num_heads: int
    positions: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    slot_mapping: torch.Tensor
    pages: KVPages


def can_fuse_one_row(x: torch.Tensor) -> bool:
    """Whether awq_linear_one_row serves x: one contiguous float16 row on a device with Triton."""
    is_row = x.dim() == 2 and x.shape[0] == 1 and x.dtype == torch.float16 and x.is_contiguous()
    return is_row and use_triton("awq_linear", x.device, False)


def awq_linear_one_row(
    x,
    qweight,
    qzeros,
    scales,
    group_size,
    bias=None,
    *,
    lora_a=None,
    lora_bt=None,
    norm: InputNorm | None = None,
    is_gated: bool = False,
    rope_kv: RopeKVWrite | None = None,
):
    """awq_linear of one contiguous row x [1, K] with its input's last step fused: `norm` (an
    RMSNorm) or `is_gated` (x [1, 2K], gate then up: silu(gate) * up). `rope_kv` (with the norm,
    on a fused q/k/v layer) also rotates q and k in y and stores k and v in its pages."""
    if (norm is None) == (not is_gated):
        raise KernelError("awq_linear_one_row fuses one prologue: give norm or is_gated, not both or neither")
    num_inputs = qweight.shape[0]
    width = num_inputs * (2 if is_gated else 1)
    if x.dim() != 2 or x.shape[0] != 1 or x.shape[1] != width or not x.is_contiguous():
        raise KernelError(
            f"awq_linear_one_row: x is {list(x.shape)} with strides {x.stride()}; expected one "
            f"contiguous row of {width} ({'gate then up, ' if is_gated else ''}K = {num_inputs})"
        )
    _, num_outputs = _check_inputs(x[:, :num_inputs], qweight, qzeros, scales, group_size, bias, lora_a, lora_bt)
    if not use_triton("awq_linear", x.device, False):
        raise KernelError(f"awq_linear_one_row needs the Triton kernels, which {x.device} does not have")
    _check_kernel_dtype(x)
    if norm is not None:
        _check_norm(x, norm)
    block_n = 64
    if rope_kv is not None:
        pages = rope_kv.pages
        expected = (rope_kv.num_heads + 2 * pages.num_kv_heads) * pages.head_dim
        if norm is None or num_outputs != expected or pages.head_dim % 16:
            raise KernelError(
                f"awq_linear_one_row: RoPE and the KV store need the norm prologue and a fused q/k/v "
                f"layer of {rope_kv.num_heads} + 2 x {pages.num_kv_heads} heads of {pages.head_dim} "
                f"({expected} outputs); got {num_outputs} outputs"
            )
        block_n = pages.head_dim  # one column block per head
    config = w4a16_gemv.row_config(num_outputs, num_inputs, group_size, num_sms(x.device), lora_a is not None, block_n)
    y = torch.empty((1, num_outputs), dtype=x.dtype, device=x.device)
    return w4a16_gemv.launch_row(
        x, qweight, qzeros, scales, group_size, bias, y, config, lora_a, lora_bt, norm, is_gated, rope_kv
    )


def _awq_linear_torch(x2d, qweight, qzeros, scales, group_size, bias, lora_a, lora_bt, batch_invariant):
    # float32 on the CPU (fastest and most accurate there)
    compute_dtype = x2d.dtype if x2d.is_cuda else torch.float32
    weight = dequantize_awq(qweight, qzeros, scales, group_size, dtype=compute_dtype)
    x = x2d.to(compute_dtype)

    def rows_times_weight(rows: torch.Tensor) -> torch.Tensor:
        y = rows @ weight
        if bias is not None:
            y = y + bias.to(compute_dtype)
        if lora_a is not None:
            y = torch.addmm(y, rows @ lora_a.t().to(compute_dtype), lora_bt.to(compute_dtype))
        return y

    if batch_invariant:
        # BLAS picks its blocking (and so a row's summation order) from the row count
        return torch.cat([rows_times_weight(x[i : i + 1]) for i in range(x.shape[0])]).to(x2d.dtype)
    return rows_times_weight(x).to(x2d.dtype)


def _check_kernel_dtype(x):
    allowed = (torch.float16, torch.float32) if x.device.type == "cpu" else (torch.float16,)
    if x.dtype not in allowed:
        names = [str(d) for d in allowed]
        raise KernelError(f"x is {x.dtype}; the Triton AWQ kernels take {names} (convert activations to float16)")


def _check_inputs(x, qweight, qzeros, scales, group_size, bias, lora_a, lora_bt):
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() < 1:
        got = f"{getattr(x, 'dtype', type(x).__name__)} {list(getattr(x, 'shape', []))}"
        raise KernelError(f"x must be a floating-point tensor [..., K], got {got}")
    try:
        num_inputs, num_outputs = check_awq_shapes(qweight, qzeros, scales, group_size)
    except ConfigError as exc:
        raise KernelError(str(exc)) from exc
    if x.shape[-1] != num_inputs:
        raise KernelError(f"x has {x.shape[-1]} features ({list(x.shape)}) but qweight expects K = {num_inputs}")
    for name, tensor in (("qweight", qweight), ("qzeros", qzeros), ("scales", scales), ("bias", bias)):
        if tensor is not None and not tensor.is_contiguous():
            raise KernelError(
                f"{name} {list(tensor.shape)} must be contiguous (strides {tensor.stride()}): call .contiguous()"
            )
    if bias is not None and (not bias.is_floating_point() or list(bias.shape) != [num_outputs]):
        raise KernelError(f"bias must be a float tensor [N] = [{num_outputs}], got {bias.dtype} {list(bias.shape)}")
    if (lora_a is None) != (lora_bt is None):
        raise KernelError("lora_a and lora_bt come together: pass both or neither")
    if lora_a is not None:
        for name, tensor, dim, width in (("lora_a", lora_a, "K", num_inputs), ("lora_bt", lora_bt, "N", num_outputs)):
            if not tensor.is_floating_point() or tensor.dim() != 2 or tensor.shape[1] != width:
                got = f"{tensor.dtype} {list(tensor.shape)}"
                raise KernelError(f"{name} must be a float tensor [R, {dim}] = [R, {width}], got {got}")
        if lora_a.shape[0] != lora_bt.shape[0]:
            raise KernelError(f"lora_a has rank {lora_a.shape[0]} but lora_bt has rank {lora_bt.shape[0]}")
        if lora_a.stride(1) != 1:
            raise KernelError(f"lora_a must have unit stride along K, got {lora_a.stride()}: call .contiguous()")
    named = {"qweight": qweight, "qzeros": qzeros, "scales": scales, "bias": bias, "lora_a": lora_a, "lora_bt": lora_bt}
    for name, tensor in named.items():
        if tensor is not None and tensor.device != x.device:
            raise KernelError(f"{name} is on {tensor.device} but x on {x.device}; move the layer and x to one device")
    return num_inputs, num_outputs


def _check_norm(x, norm: InputNorm):
    weight, num_inputs = norm.weight, x.shape[1]
    if weight.shape != (num_inputs,) or weight.dtype != x.dtype or not weight.is_contiguous():
        got = f"{weight.dtype} {list(weight.shape)}"
        raise KernelError(f"the norm weight is {got}; expected a contiguous {x.dtype} [{num_inputs}]")
    if (norm.residual is None) != (norm.sum_out is None):
        raise KernelError("the norm's residual and sum_out come together: pass both or neither")
    for name, t in (("residual", norm.residual), ("sum_out", norm.sum_out)):
        if t is not None and (
            t.shape != x.shape or t.dtype != x.dtype or not t.is_contiguous() or t.device != x.device
        ):
            got, expected = f"{t.dtype} {list(t.shape)} on {t.device}", f"{x.dtype} {list(x.shape)} on {x.device}"
            raise KernelError(f"the norm's {name} is {got}; expected a contiguous {expected}")
    if norm.sum_out is not None and norm.sum_out.data_ptr() in (x.data_ptr(), norm.residual.data_ptr()):
        raise KernelError("the norm's sum_out must be a new tensor: other programs still read x and residual")
