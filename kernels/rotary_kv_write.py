"""Rotate-half RoPE on q and k and the paged KV store of k and v, in one kernel.

At batch 1 a decode step is launch-bound, and RoPE (rotary.py) followed by the KV store
(kv_write.py) is two launches per layer for a few kilobytes of work. Here one program per
token rotates the token's q and k heads in place, in float32 with the same helper as
`_rotary_kernel`, then stores k and v at the token's slot with kv_write's own store path
(`_write_token`: quantize-on-store for INT8/INT4 pages, the FP16 copy for window pages).

The store reads the rotated k back from where the rotation wrote it (after a barrier: other
threads of the program wrote it), so the rows it stores are the very FP16 values the two
kernels would store: q, k and the pages come out bit for bit as apply_rotary then write_kv.

The reference is `rotary_write_kv_ref`: apply_rotary_ref on q and k, then write_kv_ref.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lowvram.errors import KernelError
from lowvram.kernels import kv_write
from lowvram.kernels.dispatch import use_triton
from lowvram.kernels.kv_quant import KVPages
from lowvram.kernels.kv_write import _cache_pointers, _check_write_args, _store_constants, _write_token, write_kv_ref
from lowvram.kernels.pdl import await_inputs, dependent_launch
from lowvram.kernels.rotary import _check_rotary_args, _rotate_half, apply_rotary_ref


def rotary_write_kv_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slot_mapping: torch.Tensor,
    pages: KVPages,
) -> None:
    """Plain-torch `rotary_write_kv`."""
    q.copy_(apply_rotary_ref(q, positions, cos, sin))
    k.copy_(apply_rotary_ref(k, positions, cos, sin))
    write_kv_ref(k, v, slot_mapping, pages)


def rotary_write_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slot_mapping: torch.Tensor,
    pages: KVPages,
    *,
    use_reference: bool = False,
) -> None:
    """Rotate q [T, H, D] and k [T, Hkv, D] in place by each token's position, then store k
    and v [T, Hkv, D] into `pages` at `slot_mapping` [T] (-1 = skip): `apply_rotary` then
    `write_kv`, in one launch.

    positions: [T]; cos, sin: float32 [P, D/2] with P > every position. q, k and v may be
    strided views of a fused QKV output as long as their last dim is contiguous.
    """
    _check_rotary_args(q, k, positions, cos, sin, "rotary_write_kv")
    _check_write_args(k, v, slot_mapping, pages, "rotary_write_kv")
    if q.dtype != k.dtype:
        raise KernelError(f"rotary_write_kv: q is {q.dtype} and k {k.dtype}; they must match")
    if q.shape[0] == 0:
        return
    # BF16 takes the reference, as apply_rotary does.
    is_reference = use_reference or kv_write.FORCE_REFERENCE or q.dtype == torch.bfloat16
    if not use_triton("rotary_write_kv", q.device, is_reference):
        rotary_write_kv_ref(q, k, v, positions, cos, sin, slot_mapping, pages)
        return
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    half = head_dim // 2
    _rotary_write_kv_kernel[(num_tokens,)](
        q,
        k,
        v,
        positions,
        cos,
        sin,
        slot_mapping,
        *_cache_pointers(pages),
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        cos.stride(0),
        num_heads,
        num_kv_heads,
        pages.k.shape[3],
        head_dim,
        HALF=half,
        BLOCK_HALF=triton.next_power_of_2(half),
        BLOCK_QH=triton.next_power_of_2(num_heads),
        **_store_constants(pages),
        num_warps=4 if (num_heads + num_kv_heads) * head_dim >= 1024 else 1,
        **dependent_launch(q.device),
    )


@triton.jit
def _rotate_heads(
    x_ptr, stride_h, num_heads, cos, sin, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr
):
    # One token's heads of q or k, rotated in place; cos, sin: float32 [1, BLOCK_HALF].
    heads = tl.arange(0, BLOCK_H)[:, None]
    offs = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < num_heads) & (offs < HALF)
    first = x_ptr + heads * stride_h + offs  # [BLOCK_H, BLOCK_HALF]: the first half of each head
    x1 = tl.load(first, mask=mask, other=0.0)
    x2 = tl.load(first + HALF, mask=mask, other=0.0)
    out1, out2 = _rotate_half(x1, x2, cos, sin)
    tl.store(first, out1, mask=mask)
    tl.store(first + HALF, out2, mask=mask)


@triton.jit
def _rotary_write_kv_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    positions_ptr,
    cos_ptr,
    sin_ptr,
    slot_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    k_zero_ptr,
    v_scale_ptr,
    v_zero_ptr,
    window_k_ptr,
    window_v_ptr,
    window_row_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cos,
    num_heads,
    num_kv_heads,
    code_dim,
    head_dim,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_QH: tl.constexpr,
    BITS: tl.constexpr,
    QMAX: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_C: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    await_inputs(PDL)  # q, k and v come from the kernel before (kernels/pdl.py)
    # One program per token: all its q and k heads, then its k and v rows.
    token = tl.program_id(0)
    position = tl.load(positions_ptr + token).to(tl.int64)
    offs = tl.arange(0, BLOCK_HALF)
    cos = tl.load(cos_ptr + position * stride_cos + offs, mask=offs < HALF, other=0.0)[None, :]
    sin = tl.load(sin_ptr + position * stride_cos + offs, mask=offs < HALF, other=0.0)[None, :]
    _rotate_heads(q_ptr + token.to(tl.int64) * stride_qt, stride_qh, num_heads, cos, sin, HALF, BLOCK_QH, BLOCK_HALF)
    _rotate_heads(k_ptr + token.to(tl.int64) * stride_kt, stride_kh, num_kv_heads, cos, sin, HALF, BLOCK_H, BLOCK_HALF)
    # The store loads k in another layout, so other threads read what these wrote.
    tl.debug_barrier()
    _write_token(
        token,
        k_ptr,
        v_ptr,
        slot_ptr,
        k_cache_ptr,
        v_cache_ptr,
        k_scale_ptr,
        k_zero_ptr,
        v_scale_ptr,
        v_zero_ptr,
        window_k_ptr,
        window_v_ptr,
        window_row_ptr,
        stride_kt,
        stride_kh,
        stride_vt,
        stride_vh,
        num_kv_heads,
        code_dim,
        head_dim,
        BITS,
        QMAX,
        BLOCK_H,
        BLOCK_C,
        HAS_WINDOW,
        PAGE_SIZE,
        BLOCK_D,
    )
