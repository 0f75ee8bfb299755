"""RMSNorm in one kernel (one program per row, float32), optionally fused with the residual add
before it and writing both results over their inputs, as vLLM's fused_add_rms_norm. The reference
`rms_norm_ref` normalises in float32, rounds to x's dtype, then multiplies by the weight.
"""

import torch
import triton
import triton.language as tl

from lowvram.errors import KernelError
from lowvram.kernels.dispatch import use_triton


@triton.jit
def rms_inverse(xf, num_cols, eps):
    return 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / num_cols + eps)


@triton.jit
def normalize_and_scale(x, inv_rms, weight):
    """weight * x / rms in float32, x / rms rounded to x's dtype first (also the GEMV's prologue)."""
    normed = (x.to(tl.float32) * inv_rms).to(x.dtype)
    return normed.to(tl.float32) * weight.to(tl.float32)


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    sum_ptr,
    num_cols,
    strides,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    stride_x, stride_r, stride_o, stride_s = strides
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < num_cols
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x = x + tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0)
    inv_rms = rms_inverse(x.to(tl.float32), num_cols, eps)
    # out and sum may be x and residual: no thread stores before every thread has loaded.
    tl.debug_barrier()
    if HAS_RESIDUAL:
        tl.store(sum_ptr + row * stride_s + offs, x, mask=mask)
    out = normalize_and_scale(x, inv_rms, tl.load(weight_ptr + offs, mask=mask, other=0.0))
    tl.store(out_ptr + row * stride_o + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """(weight * normalise(x + residual), x + residual or None)."""
    total = x if residual is None else x + residual
    xf = total.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return weight * normed, None if residual is None else total


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual=None, *, out=None, sum_out=None, use_reference=False
):
    """(weight * normalise(x + residual) [T, C] in x's dtype promoted with weight's, x + residual or
    None), written into `out` and `sum_out` when given, which may be x and residual themselves.
    Rows may be strided; the last dim must be contiguous."""
    if x.dim() != 2 or weight.shape != (x.shape[1],):
        raise KernelError(f"rms_norm: x is {tuple(x.shape)} and weight {tuple(weight.shape)}; expected [T, C] and [C]")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        got = f"{tuple(residual.shape)} {residual.dtype}, x {tuple(x.shape)} {x.dtype}"
        raise KernelError(f"rms_norm: residual is {got}; they must match")
    out_dtype = torch.promote_types(x.dtype, weight.dtype)
    if out is not None and (out.shape != x.shape or out.dtype != out_dtype):
        raise KernelError(f"rms_norm: out is {tuple(out.shape)} {out.dtype}; expected {tuple(x.shape)} {out_dtype}")
    if sum_out is not None and (residual is None or sum_out.shape != x.shape or sum_out.dtype != x.dtype):
        got = f"{tuple(sum_out.shape)} {sum_out.dtype}"
        raise KernelError(f"rms_norm: sum_out is {got}; expected {tuple(x.shape)} {x.dtype}, and a residual to add")
    tensors = [t for t in (x, weight, residual, out, sum_out) if t is not None]
    if any(t.stride(-1) != 1 for t in tensors):
        raise KernelError("rms_norm: x, weight, residual and the outputs must be contiguous in their last dim")
    if any(t.device != x.device for t in tensors):
        raise KernelError("rms_norm: x, weight, residual and the outputs must be on one device")
    if x.dtype == torch.bfloat16 or not use_triton("rms_norm", x.device, use_reference) or x.shape[0] == 0:
        normed, total = rms_norm_ref(x, weight, eps, residual)
        if sum_out is not None:
            total = sum_out.copy_(total)
        return (normed if out is None else out.copy_(normed)), total
    num_rows, num_cols = x.shape
    if out is None:
        out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    total = None if residual is None else sum_out if sum_out is not None else torch.empty_like(x)
    block = triton.next_power_of_2(num_cols)
    has_residual = residual is not None
    residual_arg, total_arg = (residual, total) if has_residual else (x, out)  # not read without a residual
    strides = (x.stride(0), residual_arg.stride(0), out.stride(0), total_arg.stride(0))
    args = (x, residual_arg, weight, out, total_arg, num_cols, strides, eps)
    _rms_norm_kernel[(num_rows,)](*args, HAS_RESIDUAL=has_residual, BLOCK=block, num_warps=4 if block <= 2048 else 8)
    return out, total
