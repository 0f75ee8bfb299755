"""Rotate-half RoPE in place on q and k (strided views of a fused QKV output allowed), one program
per (token, head), in float32 rounded once, as the reference `apply_rotary_ref`. The dense models
rotate inside the KV store instead (kv_write.rotary_write_kv), with the same `_rotate_half`.
"""

import torch
import triton
import triton.language as tl

from lowvram.errors import KernelError
from lowvram.kernels.dispatch import use_triton


@triton.jit
def _rotate_half(x1, x2, cos, sin):
    x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
    return (x1f * cos - x2f * sin).to(x1.dtype), (x2f * cos + x1f * sin).to(x1.dtype)


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, positions_ptr, cos_ptr, sin_ptr, num_q_heads, strides, HALF: tl.constexpr, BLOCK: tl.constexpr
):
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cos = strides
    token = tl.program_id(0)
    head = tl.program_id(1)
    if head < num_q_heads:
        base = q_ptr + token * stride_qt + head * stride_qh
    else:
        base = k_ptr + token * stride_kt + (head - num_q_heads) * stride_kh
    offs = tl.arange(0, BLOCK)
    mask = offs < HALF
    position = tl.load(positions_ptr + token)
    cos = tl.load(cos_ptr + position * stride_cos + offs, mask=mask, other=0.0)
    sin = tl.load(sin_ptr + position * stride_cos + offs, mask=mask, other=0.0)
    x1 = tl.load(base + offs, mask=mask, other=0.0)
    x2 = tl.load(base + HALF + offs, mask=mask, other=0.0)
    out1, out2 = _rotate_half(x1, x2, cos, sin)
    tl.store(base + offs, out1, mask=mask)
    tl.store(base + HALF + offs, out2, mask=mask)


def apply_rotary_ref(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] rotated by position: returns a new tensor in x's dtype."""
    c = cos[positions][:, None, :]  # [T, 1, D/2]
    s = sin[positions][:, None, :]
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


def apply_rotary(q, k, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, use_reference=False) -> None:
    """Rotate q [T, H, D] and k [T, Hkv, D] in place; cos, sin: float32 [P, D/2] with P > every position."""
    _check_rotary_args(q, k, positions, cos, sin, "apply_rotary")
    head_dim = q.shape[2]
    if q.dtype == torch.bfloat16 or not use_triton("apply_rotary", q.device, use_reference):
        q.copy_(apply_rotary_ref(q, positions, cos, sin))
        k.copy_(apply_rotary_ref(k, positions, cos, sin))
        return
    if q.shape[0] == 0:
        return
    half = head_dim // 2
    strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0))
    grid = (q.shape[0], q.shape[1] + k.shape[1])
    _rotary_kernel[grid](
        q, k, positions, cos, sin, q.shape[1], strides, half, BLOCK=triton.next_power_of_2(half), num_warps=1
    )


def _check_rotary_args(q, k, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, name: str) -> None:
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise KernelError(f"{name}: q {tuple(q.shape)} and k {tuple(k.shape)} must be [T, heads, D] with one T and D")
    head_dim = q.shape[2]
    if head_dim % 2 or cos.shape != sin.shape or cos.dim() != 2 or cos.shape[1] != head_dim // 2:
        raise KernelError(f"{name}: cos/sin are {tuple(cos.shape)}; expected [positions, {head_dim // 2}]")
    if cos.dtype != torch.float32 or sin.dtype != torch.float32:
        raise KernelError(
            f"{name}: cos/sin are {cos.dtype}/{sin.dtype}; expected float32 (the rotation is done in float32)"
        )
    if q.stride(2) != 1 or k.stride(2) != 1 or not cos.is_contiguous() or not sin.is_contiguous():
        raise KernelError(f"{name}: q and k must be contiguous in their last dim, cos and sin contiguous")
    if any(t.device != q.device for t in (k, positions, cos, sin)):
        raise KernelError(f"{name}: q, k, positions, cos and sin must be on one device")
    if positions.shape != (q.shape[0],):
        raise KernelError(f"{name}: positions is {tuple(positions.shape)}; expected [{q.shape[0]}]")
