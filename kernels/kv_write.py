"""Store new K/V rows into paged caches, quantizing INT8/INT4 pages on the way, optionally
rotating q and k (RoPE) first in the same launch (`rotary_write_kv`: one launch instead of two
per layer at batch 1). Quantization follows `kv_quant.quantize_kv` step for step (IEEE division,
FP16-rounded scale and zero), so the stored bytes are identical, and rotation uses
`rotary._rotate_half`, so q, k and the pages come out as `apply_rotary` then `write_kv`.
"""

from __future__ import annotations

import torch

from lowvram.errors import KernelError
from lowvram.kernels.dispatch import HAS_TRITON, use_triton
from lowvram.kernels.kv_quant import MIN_SCALE, KVPages, store_kv

if HAS_TRITON:
    import triton
    import triton.language as tl

    from lowvram.kernels.rotary import _check_rotary_args, _rotate_half, apply_rotary_ref

FORCE_REFERENCE = False  # True runs the plain-torch references everywhere (debugging, A/B checks)


def write_kv_ref(k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor, pages: KVPages) -> None:
    is_written = slot_mapping >= 0
    store_kv(pages, slot_mapping[is_written], k[is_written], v[is_written])


def rotary_write_kv_ref(q, k, v, positions, cos, sin, slot_mapping, pages: KVPages) -> None:
    q.copy_(apply_rotary_ref(q, positions, cos, sin))
    k.copy_(apply_rotary_ref(k, positions, cos, sin))
    write_kv_ref(k, v, slot_mapping, pages)


def write_kv(
    k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor, pages: KVPages, *, use_reference: bool = False
) -> None:
    """Store k, v [T, Hkv, D] into `pages` at `slot_mapping` [T] (int32/int64, -1 = skip).

    The slot of position p is `block_table[p // B] * B + p % B`. INT8/INT4 rows are quantized
    with their own min/max; rows of pages kept in FP16 (`pages.window_row`) are also stored
    there unquantized. k and v may be strided views whose last dim is contiguous.
    """
    _check_write_args(k, v, slot_mapping, pages)
    if k.shape[0] == 0:
        return
    if not use_triton("write_kv", k.device, use_reference or FORCE_REFERENCE):
        write_kv_ref(k, v, slot_mapping, pages)
        return
    # No rotation: q, positions, cos and sin are never read, so k and the slots stand in.
    _launch(k, k, v, slot_mapping, k, k, slot_mapping, pages, rotate=False)


def rotary_write_kv(q, k, v, positions, cos, sin, slot_mapping, pages: KVPages, *, use_reference: bool = False):
    """Rotate q [T, H, D] and k [T, Hkv, D] in place by each token's position (cos, sin: float32
    [P, D/2], P > every position), then `write_kv` k and v, in one launch."""
    _check_rotary_args(q, k, positions, cos, sin, "rotary_write_kv")
    _check_write_args(k, v, slot_mapping, pages, "rotary_write_kv")
    if q.dtype != k.dtype:
        raise KernelError(f"rotary_write_kv: q is {q.dtype} and k {k.dtype}; they must match")
    if q.shape[0] == 0:
        return
    # BF16 takes the reference, as apply_rotary does.
    is_reference = use_reference or FORCE_REFERENCE or q.dtype == torch.bfloat16
    if not use_triton("rotary_write_kv", q.device, is_reference):
        rotary_write_kv_ref(q, k, v, positions, cos, sin, slot_mapping, pages)
        return
    _launch(q, k, v, positions, cos, sin, slot_mapping, pages, rotate=True)


def _launch(q, k, v, positions, cos, sin, slot_mapping, pages: KVPages, rotate: bool) -> None:
    num_tokens, num_kv_heads, head_dim = k.shape
    num_heads = q.shape[1] if rotate else 0
    half = head_dim // 2
    _write_kv_kernel[(num_tokens,)](
        q,
        k,
        v,
        positions,
        cos,
        sin,
        slot_mapping,
        pages.kernel_tensors(),
        (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0)),
        (num_heads, num_kv_heads, pages.k.shape[3], head_dim),
        ROTATE=rotate,
        HALF=half,
        BLOCK_HALF=triton.next_power_of_2(half),
        BLOCK_QH=triton.next_power_of_2(max(1, num_heads)),
        **_store_constants(pages),
        num_warps=4 if (num_heads + num_kv_heads) * head_dim >= 1024 else 1,
    )


def _store_constants(pages: KVPages) -> dict[str, int | bool]:
    """The write kernel's constexpr arguments for these pages (the fused GEMV store takes them too)."""
    return {
        "BITS": pages.bits,
        "QMAX": (1 << pages.bits) - 1 if pages.is_quantized else 0,
        "BLOCK_H": triton.next_power_of_2(pages.num_kv_heads),
        "BLOCK_C": triton.next_power_of_2(pages.k.shape[3]),
        "HAS_WINDOW": pages.has_window,
        "PAGE_SIZE": pages.block_size,
        "BLOCK_D": triton.next_power_of_2(pages.head_dim),
    }


def _check_write_args(k, v, slot_mapping: torch.Tensor, pages: KVPages, name: str = "write_kv") -> None:
    pages.validate()
    if k.dim() != 3:
        raise KernelError(f"{name}: k has shape {tuple(k.shape)}; expected [num_tokens, num_kv_heads, head_dim]")
    expected = (k.shape[0], pages.num_kv_heads, pages.head_dim)
    for arg, x in (("k", k), ("v", v)):
        if tuple(x.shape) != expected:
            raise KernelError(f"{name}: {arg} has shape {tuple(x.shape)}; expected {expected} to match the pages")
        if x.dtype not in (torch.float16, torch.float32) and not (x.dtype == torch.bfloat16 and x.device.type == "cpu"):
            raise KernelError(f"{name}: {arg} has dtype {x.dtype}; expected float16 or float32 (bfloat16 on the CPU)")
        if x.shape[0] and x.stride(2) != 1:
            raise KernelError(f"{name}: {arg} must be contiguous in its last dim (strides {x.stride()})")
        if x.device != pages.device:
            raise KernelError(f"{name}: {arg} is on {x.device} but the pages are on {pages.device}")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != k.shape[0]:
        raise KernelError(f"{name}: slot_mapping has shape {tuple(slot_mapping.shape)}; expected [{k.shape[0]}]")
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise KernelError(f"{name}: slot_mapping has dtype {slot_mapping.dtype}; expected int32 or int64")
    if slot_mapping.device != pages.device or (slot_mapping.numel() > 1 and slot_mapping.stride(0) != 1):
        raise KernelError(f"{name}: slot_mapping must be contiguous and on {pages.device}")


if HAS_TRITON:
    _MIN_SCALE = tl.constexpr(MIN_SCALE)

    @triton.jit
    def _codes(x, scale, zero, QMAX: tl.constexpr):
        # scale, zero: float32 [BLOCK_H, 1]; floor(v + 0.5), as in the reference.
        codes = tl.floor(tl.math.div_rn(x, tl.broadcast_to(scale, x.shape)) + zero + 0.5)
        return tl.minimum(tl.maximum(codes, 0.0), QMAX).to(tl.int32)

    @triton.jit
    def _row_min(x, mask):
        return tl.min(tl.where(mask, x, float("inf")), axis=1)

    @triton.jit
    def _row_max(x, mask):
        return tl.max(tl.where(mask, x, float("-inf")), axis=1)

    @triton.jit
    def _store_row(x_ptr, stride_xh, dst, slot, num_kv_heads, code_dim, BITS, QMAX, BLOCK_H, BLOCK_C):
        # One token's row of every KV head, from x_ptr [heads, D] into dst = (codes, scales,
        # zeros) at `slot` (codes alone for FP16 rows).
        cache_ptr = dst[0]
        heads = tl.arange(0, BLOCK_H)
        cols = tl.arange(0, BLOCK_C)
        # slot -1 (padding) masks the whole row; a vector compare keeps the mask a plain bool block.
        slots = tl.zeros([BLOCK_H], tl.int64) + slot
        mask_h = (heads < num_kv_heads) & (slots >= 0)
        slots = tl.maximum(slots, 0)
        mask = mask_h[:, None] & (cols < code_dim)[None, :]
        # cache row of (slot, head): [num_blocks * B * Hkv, code_dim]
        cache_offs = (slots * num_kv_heads + heads)[:, None] * code_dim + cols[None, :]
        if BITS == 16:
            x = tl.load(x_ptr + heads[:, None] * stride_xh + cols[None, :], mask=mask, other=0.0)
            tl.store(cache_ptr + cache_offs, x.to(cache_ptr.dtype.element_ty), mask=mask)
        else:
            if BITS == 8:
                x = tl.load(x_ptr + heads[:, None] * stride_xh + cols[None, :], mask=mask, other=0.0)
                x = x.to(tl.float32)
                row_min = _row_min(x, mask)
                row_max = _row_max(x, mask)
            else:
                # INT4: element 2i goes to the low nibble of byte i, 2i+1 to the high one.
                x_ptrs = x_ptr + heads[:, None] * stride_xh + 2 * cols[None, :]
                x_even = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
                x_odd = tl.load(x_ptrs + 1, mask=mask, other=0.0).to(tl.float32)
                row_min = tl.minimum(_row_min(x_even, mask), _row_min(x_odd, mask))
                row_max = tl.maximum(_row_max(x_even, mask), _row_max(x_odd, mask))
            row_min = tl.minimum(row_min, 0.0)
            row_max = tl.maximum(row_max, 0.0)
            # As kv_quant.quantize_kv: IEEE division, FP16-rounded scale and zero.
            qmax = tl.full(row_min.shape, QMAX, tl.float32)
            scale_f16 = tl.maximum(tl.math.div_rn(row_max - row_min, qmax), _MIN_SCALE).to(tl.float16)
            zero_f16 = tl.math.div_rn(-row_min, scale_f16.to(tl.float32)).to(tl.float16)
            scale = scale_f16.to(tl.float32)[:, None]
            zero = zero_f16.to(tl.float32)[:, None]
            if BITS == 8:
                codes = _codes(x, scale, zero, QMAX)
            else:
                codes = _codes(x_even, scale, zero, QMAX) | (_codes(x_odd, scale, zero, QMAX) << 4)
            tl.store(cache_ptr + cache_offs, codes.to(tl.uint8), mask=mask)
            scale_offs = slots * num_kv_heads + heads
            tl.store(dst[1] + scale_offs, scale_f16, mask=mask_h)
            tl.store(dst[2] + scale_offs, zero_f16, mask=mask_h)

    @triton.jit
    def _window_slot(window_row_ptr, slot, PAGE_SIZE: tl.constexpr):
        # The slot's row in the FP16 window arrays; negative when the slot is padding or its
        # page is not kept in FP16.
        page = tl.maximum(slot, 0) // PAGE_SIZE
        row = tl.load(window_row_ptr + page, mask=slot >= 0, other=-1).to(tl.int64)
        return row * PAGE_SIZE + tl.maximum(slot, 0) % PAGE_SIZE

    @triton.jit
    def _rotate_heads(x_ptr, stride_h, num_heads, cos, sin, HALF, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
        # One token's heads of q or k rotated in place; cos, sin: float32 [1, BLOCK_HALF].
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
    def _write_kv_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        positions_ptr,
        cos_ptr,
        sin_ptr,
        slot_ptr,
        cache,
        strides,
        sizes,
        ROTATE: tl.constexpr,
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
    ):
        # One program per token, all KV heads: with ROTATE its q and k heads rotated first, then
        # its k and v rows stored. `cache` is KVPages.kernel_tensors().
        k_cache_ptr, v_cache_ptr, k_scale_ptr, k_zero_ptr, v_scale_ptr, v_zero_ptr, window_k, window_v, window_row = (
            cache
        )
        stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cos = strides
        num_heads, num_kv_heads, code_dim, head_dim = sizes
        token = tl.program_id(0)
        k_in = k_ptr + token.to(tl.int64) * stride_kt
        v_in = v_ptr + token.to(tl.int64) * stride_vt
        if ROTATE:
            position = tl.load(positions_ptr + token).to(tl.int64)
            offs = tl.arange(0, BLOCK_HALF)
            cos = tl.load(cos_ptr + position * stride_cos + offs, mask=offs < HALF, other=0.0)[None, :]
            sin = tl.load(sin_ptr + position * stride_cos + offs, mask=offs < HALF, other=0.0)[None, :]
            q_row = q_ptr + token.to(tl.int64) * stride_qt
            _rotate_heads(q_row, stride_qh, num_heads, cos, sin, HALF, BLOCK_QH, BLOCK_HALF)
            _rotate_heads(k_in, stride_kh, num_kv_heads, cos, sin, HALF, BLOCK_H, BLOCK_HALF)
            # The store loads k in another layout, so other threads read what these wrote.
            tl.debug_barrier()
        slot = tl.load(slot_ptr + token).to(tl.int64)
        k_dst, v_dst = (k_cache_ptr, k_scale_ptr, k_zero_ptr), (v_cache_ptr, v_scale_ptr, v_zero_ptr)
        _store_row(k_in, stride_kh, k_dst, slot, num_kv_heads, code_dim, BITS, QMAX, BLOCK_H, BLOCK_C)
        _store_row(v_in, stride_vh, v_dst, slot, num_kv_heads, code_dim, BITS, QMAX, BLOCK_H, BLOCK_C)
        if HAS_WINDOW:  # pages kept in FP16 get the row unquantized too
            window_slot = _window_slot(window_row, slot, PAGE_SIZE)
            _store_row(k_in, stride_kh, (window_k,), window_slot, num_kv_heads, head_dim, 16, 0, BLOCK_H, BLOCK_D)
            _store_row(v_in, stride_vh, (window_v,), window_slot, num_kv_heads, head_dim, 16, 0, BLOCK_H, BLOCK_D)
