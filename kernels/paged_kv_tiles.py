"""Triton helpers that read paged K/V tiles as the attention kernels' dot operands.

A head is read in planes (`paged_attention.plane_layout`): one for FP16, INT8's low and high bytes
(elements 2i, 2i + 1), INT4's four nibbles (4i to 4i + 3), so quantized heads move as 16-bit words
and no code moves between columns. Query rows, K/V tiles and accumulators are 4-tuples of planes;
planes past NUM_PLANES = 16 // BITS repeat the first and are not used. A tile's tokens are
(rows, window_page, window_rows, mask_n): rows = slot * num_kv_heads + kv_head in the page arrays,
window_page the page's row in the FP16 window (-1: not kept), window_rows the token's row there.
`cache` is KVPages.kernel_tensors(). Codes become float16 without int-to-float instructions: a
code's bits are the subnormal code * 2**-24 (CODE_UNIT), and the token's scale carries 2**24 back.
"""

import os

import triton
import triton.language as tl

# Inline PTX turns codes into float16 on the GPU; the interpreter takes _code_values (same values).
_PTX_CODES = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") != "1")
CODE_UNIT = tl.constexpr(2.0**-24)
# Which tokens a tile of pages with an FP16 window reads: each from its codes or its window row
# (prefill), only those from codes (decode's main loop), or only the window's (decode's last pass).
_MIXED = tl.constexpr(0)
_CODES_ONLY = tl.constexpr(1)
_KEPT_ONLY = tl.constexpr(2)


@triton.jit
def _table_blocks(table_row, positions, end, PAGE_SIZE: tl.constexpr):
    return tl.load(table_row + positions // PAGE_SIZE, mask=positions < end, other=0)


@triton.jit
def _block_tokens(blocks, positions, end, head, PAGE_SIZE: tl.constexpr, HAS_WINDOW: tl.constexpr, WIDE_OFFSETS):
    # The tokens at `positions` (below `end`) in pages `blocks`; head = (kv_head, num_kv_heads,
    # window_row_ptr). Offsets are int64 only where a page array needs them: 64-bit address
    # arithmetic is costly in the quantized loops.
    kv_head, num_kv_heads, window_row_ptr = head
    mask_n = positions < end
    block = blocks
    if WIDE_OFFSETS:
        block = block.to(tl.int64)
    rows = (block * PAGE_SIZE + positions % PAGE_SIZE) * num_kv_heads + kv_head
    if HAS_WINDOW:
        window_page = tl.load(window_row_ptr + block, mask=mask_n, other=-1).to(block.dtype)
    else:
        window_page = tl.zeros_like(block) - 1
    window_rows = (tl.maximum(window_page, 0) * PAGE_SIZE + positions % PAGE_SIZE) * num_kv_heads + kv_head
    return rows, window_page, window_rows, mask_n


@triton.jit
def _tokens(table_row, positions, end, head, PAGE_SIZE, HAS_WINDOW, WIDE_OFFSETS):
    blocks = _table_blocks(table_row, positions, end, PAGE_SIZE)
    return _block_tokens(blocks, positions, end, head, PAGE_SIZE, HAS_WINDOW, WIDE_OFFSETS)


@triton.jit
def _load_rows(ptr, rows, mask_rows, cols, ROW_LEN, NUM_COLS: tl.constexpr, BLOCK_C, TRANSPOSED: tl.constexpr = False):
    # Elements `cols` of `rows` as [len(rows), BLOCK_C] (transposed with TRANSPOSED). Masked rows
    # read nothing (unwritten slots may hold NaN) and, like columns past NUM_COLS, come back 0.
    if TRANSPOSED:
        if BLOCK_C == NUM_COLS:
            mask = mask_rows[None, :]
        else:
            mask = mask_rows[None, :] & (tl.arange(0, BLOCK_C) < NUM_COLS)[:, None]
        ptrs = ptr + rows[None, :] * ROW_LEN + cols[:, None]
    else:
        if BLOCK_C == NUM_COLS:
            mask = mask_rows[:, None]
        else:
            mask = mask_rows[:, None] & (tl.arange(0, BLOCK_C) < NUM_COLS)[None, :]
        ptrs = ptr + rows[:, None] * ROW_LEN + cols[None, :]
    return tl.load(ptrs, mask=mask, other=0)


@triton.jit
def _code_values(codes, DOT_DTYPE: tl.constexpr, SUBNORMAL: tl.constexpr):
    # Codes 0..255 as exact DOT_DTYPE values: with SUBNORMAL (float16) the bits alone, code *
    # CODE_UNIT; else OR-ed into the mantissa of 1024 (float16) or 2**23 (float32), less that.
    if SUBNORMAL:
        return codes.to(tl.int16).to(tl.float16, bitcast=True)
    elif DOT_DTYPE == tl.float16:
        return (codes.to(tl.int16) | 0x6400).to(tl.float16, bitcast=True) - 1024.0
    else:
        return (codes.to(tl.int32) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


# The conversions' PTX, two 16-bit words a register: codes as float16 subnormals, or as
# 1024 + code (under 0x64, the high byte of 1024.0) less 1024.
_PAIRS_SUBNORMAL = tl.constexpr("""{
    .reg .b32 z;
    mov.b32 z, 0;
    prmt.b32 $0, $2, z, 0x4240;
    prmt.b32 $1, $2, z, 0x4341;
    }""")
_PAIRS_OFFSET = tl.constexpr("""{
    .reg .b32 lo, hi, k;
    mov.b32 k, 0x64006400;
    prmt.b32 lo, $2, k, 0x7250;
    prmt.b32 hi, $2, k, 0x7351;
    sub.f16x2 $0, lo, k;
    sub.f16x2 $1, hi, k;
    }""")
_NIBBLES_SUBNORMAL = tl.constexpr("""{
    .reg .b32 t;
    and.b32 $0, $4, 0x000F000F;
    shr.b32 t, $4, 4;
    and.b32 $1, t, 0x000F000F;
    shr.b32 t, $4, 8;
    and.b32 $2, t, 0x000F000F;
    shr.b32 t, $4, 12;
    and.b32 $3, t, 0x000F000F;
    }""")
# Nibbles 1 and 3 left in place: subnormals of 16 * code, a shift and two masks per pair.
_NIBBLES_SUBNORMAL_ODD_X16 = tl.constexpr("""{
    .reg .b32 t;
    and.b32 $0, $4, 0x000F000F;
    and.b32 $1, $4, 0x00F000F0;
    shr.b32 t, $4, 8;
    and.b32 $2, t, 0x000F000F;
    and.b32 $3, t, 0x00F000F0;
    }""")
_NIBBLES_OFFSET = tl.constexpr("""{
    .reg .b32 a, b, k;
    mov.b32 k, 0x64006400;
    prmt.b32 a, $4, k, 0x7250;
    prmt.b32 b, $4, k, 0x7351;
    and.b32 $0, a, 0xFF0FFF0F;
    and.b32 $2, b, 0xFF0FFF0F;
    shr.b32 a, a, 4;
    shr.b32 b, b, 4;
    lop3.b32 $1, a, 0x000F000F, k, 0xEA;
    lop3.b32 $3, b, 0x000F000F, k, 0xEA;
    sub.f16x2 $0, $0, k;
    sub.f16x2 $1, $1, k;
    sub.f16x2 $2, $2, k;
    sub.f16x2 $3, $3, k;
    }""")


@triton.jit
def _pair_halves(pairs, SUBNORMAL: tl.constexpr):
    return tl.inline_asm_elementwise(
        asm=_PAIRS_SUBNORMAL if SUBNORMAL else _PAIRS_OFFSET,
        constraints="=r,=r,r",
        args=[pairs],
        dtype=(tl.float16, tl.float16),
        is_pure=True,
        pack=2,
    )


@triton.jit
def _nibble_halves(words, SUBNORMAL: tl.constexpr, ODD_X16: tl.constexpr = False):
    # Nibble p of each word in plane p; with ODD_X16 nibbles 1 and 3 stay in place (16 * code).
    return tl.inline_asm_elementwise(
        asm=(_NIBBLES_SUBNORMAL_ODD_X16 if ODD_X16 else _NIBBLES_SUBNORMAL) if SUBNORMAL else _NIBBLES_OFFSET,
        constraints="=r,=r,=r,=r,r",
        args=[words],
        dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
        is_pure=True,
        pack=2,
    )


@triton.jit
def _code_mask(mask_n, window_page, HAS_WINDOW: tl.constexpr):
    if HAS_WINDOW:
        return mask_n & (window_page < 0)
    return mask_n


@triton.jit
def _kept_mask(mask_n, window_page, HAS_WINDOW: tl.constexpr):
    if HAS_WINDOW:
        return mask_n & (window_page >= 0)
    return mask_n & False


@triton.jit
def _tile_scales(cache, rows, mask_n, BITS: tl.constexpr):
    # (k_scale, k_zero, v_scale, v_zero) of a tile's tokens as stored (0 when masked, float32 0
    # for FP16 pages), loaded a tile ahead of their use, where they are taken to float32.
    if BITS == 16:
        k_scale = tl.zeros(mask_n.shape, tl.float32)
        k_zero, v_scale, v_zero = k_scale, k_scale, k_scale
    else:
        k_scale = tl.load(cache[2] + rows, mask=mask_n, other=0.0)
        k_zero = tl.load(cache[3] + rows, mask=mask_n, other=0.0)
        v_scale = tl.load(cache[4] + rows, mask=mask_n, other=0.0)
        v_zero = tl.load(cache[5] + rows, mask=mask_n, other=0.0)
    return k_scale, k_zero, v_scale, v_zero


@triton.jit
def _window_plane(plane, window_ptr, window_rows, is_window, PLANE: tl.constexpr, HEAD_DIM, BITS, BLOCK_C):
    NUM_PLANES: tl.constexpr = 16 // BITS
    cols = tl.arange(0, BLOCK_C) * NUM_PLANES + PLANE
    kept = _load_rows(window_ptr, window_rows, is_window, cols, HEAD_DIM, HEAD_DIM // NUM_PLANES, BLOCK_C)
    return tl.where(is_window[:, None], kept.to(plane.dtype), plane)


@triton.jit
def _load_operands(
    cache,
    scales,
    IS_V: tl.constexpr,
    tokens,
    HEAD_DIM: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BITS: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    WINDOW: tl.constexpr,
    TRANSPOSED: tl.constexpr = False,
    ODD_X16: tl.constexpr = False,
):
    # The K (or with IS_V the V) tile as the dots take it: (planes, scale, zero), planes [BLOCK_N,
    # BLOCK_C] in DOT_DTYPE ([BLOCK_C, BLOCK_N] with TRANSPOSED, not _MIXED), float32 scale and
    # zero [BLOCK_N] with value = (plane - zero) * scale. Window tokens get scale 1 and zero 0;
    # tokens not read (WINDOW) or masked come back 0. With ODD_X16 (INT4 subnormal codes only)
    # planes 1 and 3 hold 16 * code * CODE_UNIT.
    tl.static_assert(not TRANSPOSED or WINDOW != _MIXED)
    cache_ptr, window_ptr = cache[IS_V], cache[6 + IS_V]
    scale, zero = scales[2 * IS_V], scales[2 * IS_V + 1]
    NUM_PLANES: tl.constexpr = 16 // BITS
    PLANE_DIM: tl.constexpr = HEAD_DIM // NUM_PLANES
    rows, window_page, window_rows, mask_n = tokens
    offs_c = tl.arange(0, BLOCK_C)
    mask_codes = _code_mask(mask_n, window_page, HAS_WINDOW)
    if BITS == 16:
        plane0 = _load_rows(cache_ptr, rows, mask_codes, offs_c, HEAD_DIM, PLANE_DIM, BLOCK_C, TRANSPOSED)
        plane0 = plane0.to(DOT_DTYPE)
        plane1, plane2, plane3 = plane0, plane0, plane0
    elif HAS_WINDOW and WINDOW == _KEPT_ONLY:
        # Whole FP16 rows in one load, split into planes in registers (element c * NUM_PLANES + p
        # is plane p's column c; elements past HEAD_DIM are the padded columns).
        is_window = _kept_mask(mask_n, window_page, HAS_WINDOW)
        cols = tl.arange(0, NUM_PLANES * BLOCK_C)
        row = _load_rows(window_ptr, window_rows, is_window, cols, HEAD_DIM, HEAD_DIM, NUM_PLANES * BLOCK_C)
        row = row.to(DOT_DTYPE)
        if NUM_PLANES == 2:
            plane0, plane1 = tl.split(tl.reshape(row, [mask_n.shape[0], BLOCK_C, 2]))
            plane2, plane3 = plane0, plane1
        else:
            even, odd = tl.split(tl.reshape(row, [mask_n.shape[0], BLOCK_C, 2, 2]))
            plane0, plane2 = tl.split(even)
            plane1, plane3 = tl.split(odd)
        if TRANSPOSED:
            plane0, plane1, plane2, plane3 = tl.trans(plane0), tl.trans(plane1), tl.trans(plane2), tl.trans(plane3)
        scale = tl.full(mask_n.shape, 1.0, tl.float32)
        zero = tl.zeros(mask_n.shape, tl.float32)
    else:
        # Subnormal codes unless window tokens share the dots (_MIXED): their scale 1 beside the
        # codes' 2**24 would leave the window's weights below float16's range.
        SUBNORMAL: tl.constexpr = DOT_DTYPE == tl.float16 and (not HAS_WINDOW or WINDOW != _MIXED)
        words_ptr = cache_ptr.to(tl.pointer_type(tl.uint16))
        words = _load_rows(words_ptr, rows, mask_codes, offs_c, PLANE_DIM, PLANE_DIM, BLOCK_C, TRANSPOSED)
        if BITS == 8:
            if _PTX_CODES and DOT_DTYPE == tl.float16:
                plane0, plane1 = _pair_halves(words, SUBNORMAL)
            else:
                plane0 = _code_values(words & 255, DOT_DTYPE, SUBNORMAL)
                plane1 = _code_values(words >> 8, DOT_DTYPE, SUBNORMAL)
        else:
            if _PTX_CODES and DOT_DTYPE == tl.float16:
                plane0, plane1, plane2, plane3 = _nibble_halves(words, SUBNORMAL, ODD_X16)
            elif ODD_X16:
                tl.static_assert(SUBNORMAL)
                plane0 = _code_values(words & 15, DOT_DTYPE, SUBNORMAL)
                plane1 = _code_values(words & 0xF0, DOT_DTYPE, SUBNORMAL)
                plane2 = _code_values((words >> 8) & 15, DOT_DTYPE, SUBNORMAL)
                plane3 = _code_values((words >> 8) & 0xF0, DOT_DTYPE, SUBNORMAL)
            else:
                plane0 = _code_values(words & 15, DOT_DTYPE, SUBNORMAL)
                plane1 = _code_values((words >> 4) & 15, DOT_DTYPE, SUBNORMAL)
                plane2 = _code_values((words >> 8) & 15, DOT_DTYPE, SUBNORMAL)
                plane3 = _code_values(words >> 12, DOT_DTYPE, SUBNORMAL)
        if SUBNORMAL:
            # The planes hold code * CODE_UNIT: (plane - zero * CODE_UNIT) * scale / CODE_UNIT.
            scale = scale * (1.0 / CODE_UNIT)
            zero = zero * CODE_UNIT
        # Only tiles holding window tokens (as a rule a sequence's last) read the window.
        is_window = _kept_mask(mask_n, window_page, HAS_WINDOW)
        if HAS_WINDOW and WINDOW == _MIXED and tl.max(is_window.to(tl.int32), axis=0) > 0:
            plane0 = _window_plane(plane0, window_ptr, window_rows, is_window, 0, HEAD_DIM, BITS, BLOCK_C)
            plane1 = _window_plane(plane1, window_ptr, window_rows, is_window, 1, HEAD_DIM, BITS, BLOCK_C)
            if NUM_PLANES == 4:
                plane2 = _window_plane(plane2, window_ptr, window_rows, is_window, 2, HEAD_DIM, BITS, BLOCK_C)
                plane3 = _window_plane(plane3, window_ptr, window_rows, is_window, 3, HEAD_DIM, BITS, BLOCK_C)
            scale = tl.where(is_window, 1.0, scale)
            zero = tl.where(is_window, 0.0, zero)
        if BITS == 8:
            plane2, plane3 = plane0, plane1
    return (plane0, plane1, plane2, plane3), scale, zero


@triton.jit
def _load_query_planes(row_ptrs, mask_rows, HEAD_DIM: tl.constexpr, BITS: tl.constexpr, BLOCK_C: tl.constexpr):
    # Query rows (row_ptrs [R, 1]) split like the K planes, and their float32 sums [R].
    NUM_PLANES: tl.constexpr = 16 // BITS
    offs_c = tl.arange(0, BLOCK_C)
    mask = mask_rows[:, None] & (offs_c < HEAD_DIM // NUM_PLANES)[None, :]
    q0 = tl.load(row_ptrs + (offs_c * NUM_PLANES)[None, :], mask=mask, other=0.0)
    q_sum = tl.sum(q0.to(tl.float32), axis=1)
    q1, q2, q3 = q0, q0, q0
    if NUM_PLANES >= 2:
        q1 = tl.load(row_ptrs + (offs_c * NUM_PLANES + 1)[None, :], mask=mask, other=0.0)
        q_sum += tl.sum(q1.to(tl.float32), axis=1)
    if NUM_PLANES == 4:
        q2 = tl.load(row_ptrs + (offs_c * NUM_PLANES + 2)[None, :], mask=mask, other=0.0)
        q3 = tl.load(row_ptrs + (offs_c * NUM_PLANES + 3)[None, :], mask=mask, other=0.0)
        q_sum += tl.sum(q2.to(tl.float32), axis=1) + tl.sum(q3.to(tl.float32), axis=1)
    return (q0, q1, q2, q3), q_sum


@triton.jit
def _store_planes(row_ptrs, results, mask_rows, HEAD_DIM: tl.constexpr, BITS: tl.constexpr, BLOCK_C: tl.constexpr):
    NUM_PLANES: tl.constexpr = 16 // BITS
    offs_c = tl.arange(0, BLOCK_C)
    mask = mask_rows[:, None] & (offs_c < HEAD_DIM // NUM_PLANES)[None, :]
    dtype = row_ptrs.dtype.element_ty
    tl.store(row_ptrs + (offs_c * NUM_PLANES)[None, :], results[0].to(dtype), mask=mask)
    if NUM_PLANES >= 2:
        tl.store(row_ptrs + (offs_c * NUM_PLANES + 1)[None, :], results[1].to(dtype), mask=mask)
    if NUM_PLANES == 4:
        tl.store(row_ptrs + (offs_c * NUM_PLANES + 2)[None, :], results[2].to(dtype), mask=mask)
        tl.store(row_ptrs + (offs_c * NUM_PLANES + 3)[None, :], results[3].to(dtype), mask=mask)


@triton.jit
def _load_kv(cache, scales, tokens, HEAD_DIM, BLOCK_C, BITS, HAS_WINDOW, DOT_DTYPE, WINDOW, BY_TOKEN, ODD_X16):
    # A tile's K and V operands, V's loads issued before any dot so that both are in flight
    # together; by token, V's planes come turned over, [BLOCK_C, BLOCK_N].
    k_scale, k_zero = scales[0].to(tl.float32), scales[1].to(tl.float32)
    v_scale, v_zero = scales[2].to(tl.float32), scales[3].to(tl.float32)
    scales = (k_scale, k_zero, v_scale, v_zero)
    k = _load_operands(cache, scales, 0, tokens, HEAD_DIM, BLOCK_C, BITS, HAS_WINDOW, DOT_DTYPE, WINDOW, False, ODD_X16)
    v = _load_operands(
        cache, scales, 1, tokens, HEAD_DIM, BLOCK_C, BITS, HAS_WINDOW, DOT_DTYPE, WINDOW, BY_TOKEN, ODD_X16
    )
    return k, v
