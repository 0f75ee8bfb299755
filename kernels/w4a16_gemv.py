"""Triton kernels for W4A16: y[M, N] = x[M, K] @ W[K, N] (+ bias + (x A^T) Bt), W in AWQ GEMM form.

`_row_kernel` runs one row (batch-1 decode), with the norm or SiLU-gate prologue and the RoPE +
KV store epilogue of the fused decoder layer. `_tiled_kernel` runs tl.dot tiles of 16 rows or
more: decode of 2-16 rows, the prefill GEMM, the batch-invariant form and, over dense weights,
`linear_invariant`. `_dequant_kernel` writes W in float16 for the dequantize-then-cuBLAS path.

Decode reads every weight once per token, so the work is spread over all SMs: each program owns
a column block and a contiguous range of K blocks (split-K). With several splits each program
writes its float32 partials to a workspace [SPLIT_K, M, N] and counts in on its column block's
counter; the last to arrive adds the partials in split order, adds the bias and casts
(`split_arrive`). The fixed order keeps results the same from run to run (float atomics would
not), and no second launch per projection is needed.

Each K block lies inside one quantization group, so one scale and zero row serves the tile and
the scale is applied after the reduction: sum_k x (q - z) s = s sum_k x (q - z). The integers
q - z are exact in float16 and float32, so W is never rounded; only the float32 sums round.
Residual compensation (rank R padded to BLOCK_R) rides along: each split also accumulates
t_s = x A[:, its K range]^T and adds t_s Bt, and the split sum makes the whole (x A^T) Bt.
"""

import torch
import triton
import triton.language as tl

from lowvram.kernels import kv_write
from lowvram.kernels.activation import silu_mul
from lowvram.kernels.arrival_counters import ArrivalCounters
from lowvram.kernels.kv_write import _store_row, _window_slot
from lowvram.kernels.rms_norm import normalize_and_scale, rms_inverse
from lowvram.kernels.rotary import _rotate_half

DOT_MIN_M = 16  # tl.dot needs at least 16 rows
MAX_DECODE_M = 16
# Rows per launch in the batch-invariant form: bounds the float32 split-K partials
# ([SPLIT_K, rows, N]) of a long prefill chunk; rows are independent, so no row changes.
INVARIANT_MAX_ROWS = 64
# One counter per column block (and row tile), 262,144 outputs in 64-column blocks at first
SPLIT_COUNTERS = ArrivalCounters("the decode GEMV's split-K", 4096)
# What the one-row kernel reads as x: x itself; RMSNorm of x (+ residual); or silu(gate) * up
# of a fused gate/up output [2K].
PROLOGUE_NONE, PROLOGUE_RMS_NORM, PROLOGUE_SILU_MUL = 0, 1, 2
# float32 2**23: OR-ing an integer below 2**23 into its mantissa gives 2**23 + that integer, exactly
FLOAT32_MAGIC = tl.constexpr(0x4B000000)


@triton.jit
def awq_unpack(packed, shifts):
    """[R, C/8] packed int32 -> [R, C] nibbles in natural column order: three interleaves repeat
    each word over its eight columns, `shifts` [1, C] picks each column's AWQ nibble; masking
    after the arithmetic shift drops the sign bits of negative words."""
    wide = tl.interleave(packed, packed)
    wide = tl.interleave(wide, wide)
    wide = tl.interleave(wide, wide)
    return (wide >> shifts) & 0xF


@triton.jit
def awq_load_block(awq, k_start, pid_n, N, num_packed_cols, GROUP_SIZE, BLOCK_K, BLOCK_N, EVEN_N: tl.constexpr):
    """One K block (inside one group) of column block pid_n: (q - z) as int32 [BLOCK_K, BLOCK_N]
    and the group's float32 scales [BLOCK_N]. `num_packed_cols` (N / 8) is an argument so Triton
    can specialise its divisibility and vectorise the loads; EVEN_N drops the column masks."""
    qweight_ptr, qzeros_ptr, scales_ptr = awq
    offs_k = k_start + tl.arange(0, BLOCK_K)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_pn = pid_n * (BLOCK_N // 8) + tl.arange(0, BLOCK_N // 8)
    group = k_start // GROUP_SIZE
    weight_ptrs = qweight_ptr + offs_k[:, None] * num_packed_cols + offs_pn[None, :]
    zeros_ptrs = qzeros_ptr + group * num_packed_cols + offs_pn[None, :]
    if EVEN_N:
        packed, packed_zeros = tl.load(weight_ptrs), tl.load(zeros_ptrs)
        scales = tl.load(scales_ptr + group * N + offs_n)
    else:
        mask_pn = (offs_pn < num_packed_cols)[None, :]
        packed = tl.load(weight_ptrs, mask=mask_pn, other=0)
        packed_zeros = tl.load(zeros_ptrs, mask=mask_pn, other=0)
        scales = tl.load(scales_ptr + group * N + offs_n, mask=offs_n < N, other=0.0)
    lane = offs_n % 8
    shifts = (((lane % 2) * 4 + lane // 2) * 4)[None, :]  # 4 * [0, 4, 1, 5, 2, 6, 3, 7][n % 8]
    return awq_unpack(packed, shifts) - awq_unpack(packed_zeros, shifts), scales.to(tl.float32)


@triton.jit
def split_arrive(acc, offsets, mask, partial_ptr, counter_ptr, split, num_splits, slice_size):
    """Store this split's float32 partial sums (at `offsets` of a [M, N] slice) and count in on
    the column block's counter: (whether this program came last, and then the sum of every
    split's partial in split order; zeros otherwise).

    The CTA barrier puts every thread's partial stores before the count, whose release (acq_rel,
    GPU scope) publishes them; the acquire of the last count makes every split's partial visible
    to the last program, which reads them from L2 (".cg": L1 is not coherent across SMs). The
    caller's last program resets the counter for the next launch or graph replay.
    """
    # partials: [SPLIT_K, M, N] float32
    tl.store(partial_ptr + split * slice_size + offsets, acc, mask=mask)
    tl.debug_barrier()
    is_last = tl.atomic_add(counter_ptr, 1, sem="acq_rel") == num_splits - 1
    total = tl.zeros_like(acc)
    if is_last:
        for s in range(num_splits):  # fixed order: the sum does not depend on who came last
            total += tl.load(partial_ptr + s * slice_size + offsets, mask=mask, other=0.0, cache_modifier=".cg")
    return is_last, total


@triton.jit
def store_output(acc, offsets, cols, mask, y_ptr, bias_ptr, N, HAS_BIAS: tl.constexpr):
    """y[offsets] = acc + bias[cols] under mask, cast to y's dtype."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    tl.store(y_ptr + offsets, acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def lora_a_tile(lora, offs_k, BLOCK_R: tl.constexpr):
    """A[:, offs_k]^T as [BLOCK_K, BLOCK_R]; ranks past the rank read as zero."""
    lora_a_ptr, _, _, rank, stride_ar, _, _ = lora
    offs_r = tl.arange(0, BLOCK_R)
    return tl.load(lora_a_ptr + offs_r[None, :] * stride_ar + offs_k[:, None], mask=(offs_r < rank)[None, :], other=0.0)


@triton.jit
def lora_bt_tile(lora, cols, N, BLOCK_R: tl.constexpr):
    """Bt[:, cols] as [BLOCK_R, BLOCK_N]; zero past the rank and N."""
    _, lora_bt_ptr, _, rank, _, stride_br, stride_bn = lora
    offs_r = tl.arange(0, BLOCK_R)
    mask = (offs_r < rank)[:, None] & (cols < N)[None, :]
    return tl.load(lora_bt_ptr + offs_r[:, None] * stride_br + cols[None, :] * stride_bn, mask=mask, other=0.0)


@triton.jit
def _tiled_kernel(
    x_ptr,
    weight,
    bias_ptr,
    y_ptr,
    split,
    lora,
    M,
    N,
    K,
    num_packed_cols,
    strides,
    K_BLOCKS_PER_SPLIT,
    GROUP_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_N: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    IS_PARTIAL: tl.constexpr,
    HAS_LORA: tl.constexpr,
    BLOCK_R: tl.constexpr,
    IS_DENSE: tl.constexpr,
):
    # Grid: (row tiles, column blocks, K splits). Row tiles go fastest, so the programs that
    # share a weight tile run side by side and read it from DRAM once. `weight` is the AWQ
    # (qweight, qzeros, scales), or with IS_DENSE a float W [N, K] as (w, stride_wn, stride_wk).
    stride_xm, stride_xk, stride_ym = strides
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m, mask_n = offs_m < M, offs_n < N
    kb_start = pid_k * K_BLOCKS_PER_SPLIT
    kb_end = tl.minimum(kb_start + K_BLOCKS_PER_SPLIT, tl.cdiv(K, BLOCK_K))
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    t = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)  # x A^T (compensation)
    for kb in range(kb_start, kb_end):
        offs_k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk
        if IS_DENSE:
            w_ptr, stride_wn, stride_wk = weight
            mask_k = offs_k < K
            x = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            # w^T: [BLOCK_K, BLOCK_N]
            w_ptrs = w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk
            acc += tl.dot(x, tl.load(w_ptrs, mask=mask_n[None, :] & mask_k[:, None], other=0.0))
        else:
            x = tl.load(x_ptrs, mask=mask_m[:, None], other=0.0)
            # centered: [BLOCK_K, BLOCK_N], integers -15..15
            centered, scales = awq_load_block(
                weight, kb * BLOCK_K, pid_n, N, num_packed_cols, GROUP_SIZE, BLOCK_K, BLOCK_N, EVEN_N
            )
            acc += tl.dot(x, centered.to(x.dtype)) * scales[None, :]
        if HAS_LORA:
            t += tl.dot(x, lora_a_tile(lora, offs_k, BLOCK_R).to(x.dtype))
    if HAS_LORA:
        # t rounded to Bt's dtype first, as the plain-torch path rounds x A^T to the activation dtype
        bt = lora_bt_tile(lora, offs_n, N, BLOCK_R)
        acc += tl.dot(t.to(bt.dtype), bt)
    rows, cols = offs_m[:, None], offs_n[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    partial_ptr, counter_ptr = split
    counter_ptr += pid_n * tl.num_programs(0) + pid_m  # each row tile has its own column-block counters
    is_last = True
    if IS_PARTIAL:
        is_last, acc = split_arrive(
            acc, rows * N + cols, mask, partial_ptr, counter_ptr, pid_k, tl.num_programs(2), M * N
        )
    if is_last:
        store_output(acc, rows * stride_ym + cols, cols, mask, y_ptr, bias_ptr, N, HAS_BIAS)
        if IS_PARTIAL:
            tl.store(counter_ptr, 0)


@triton.jit
def _dequant_kernel(awq, w_ptr, N, num_packed_cols, GROUP_SIZE, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_N):
    pid_k, pid_n = tl.program_id(0), tl.program_id(1)
    centered, scales = awq_load_block(
        awq, pid_k * BLOCK_K, pid_n, N, num_packed_cols, GROUP_SIZE, BLOCK_K, BLOCK_N, EVEN_N
    )
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    w = centered.to(tl.float32) * scales[None, :]
    tl.store(w_ptr + offs_k[:, None] * N + offs_n[None, :], w.to(w_ptr.dtype.element_ty), mask=(offs_n < N)[None, :])


@triton.jit
def awq_load_lanes(awq, k_start, offs_c, cols, N, num_packed_cols, GROUP_SIZE, BLOCK_K, EVEN_N: tl.constexpr):
    """One K block in the one-row kernel's lane layout: (q - z) as float32 [BLOCK_K, C, 8] and the
    scales [C, 8], nibble j of packed column c being output column cols[c, j].

    No nibble moves between columns and no integer is converted: each nibble OR-ed into the
    mantissa of 2**23 (FLOAT32_MAGIC) reads as the float 2**23 + q, and subtracting the zero's
    2**23 + z leaves q - z exactly, in two logic ops and one add.
    """
    qweight_ptr, qzeros_ptr, scales_ptr = awq
    offs_k = k_start + tl.arange(0, BLOCK_K)
    group = k_start // GROUP_SIZE
    weight_ptrs = qweight_ptr + offs_k[:, None] * num_packed_cols + offs_c[None, :]
    if EVEN_N:
        packed = tl.load(weight_ptrs)
        packed_zeros = tl.load(qzeros_ptr + group * num_packed_cols + offs_c)
        scales = tl.load(scales_ptr + group * N + cols)
    else:
        mask_c = offs_c < num_packed_cols
        packed = tl.load(weight_ptrs, mask=mask_c[None, :], other=0)
        packed_zeros = tl.load(qzeros_ptr + group * num_packed_cols + offs_c, mask=mask_c, other=0)
        scales = tl.load(scales_ptr + group * N + cols, mask=mask_c[:, None], other=0.0)
    shifts = tl.arange(0, 8) * 4
    zeros = (((packed_zeros[:, None] >> shifts[None, :]) & 0xF) | FLOAT32_MAGIC).to(tl.float32, bitcast=True)
    codes = (((packed[:, :, None] >> shifts[None, None, :]) & 0xF) | FLOAT32_MAGIC).to(tl.float32, bitcast=True)
    return codes - zeros[None, :, :], scales.to(tl.float32)


@triton.jit
def row_input(x_ptr, offs_k, norm, inv_rms, K, PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """x[offs_k] as float32 after the prologue, through the separate kernels' own arithmetic
    (kernels/rms_norm.py, kernels/activation.py) and rounded where they store, so fusing
    changes no bits of x."""
    x = tl.load(x_ptr + offs_k)
    if PROLOGUE == 1:
        residual_ptr, norm_weight_ptr, _, _ = norm
        if HAS_RESIDUAL:
            x = x + tl.load(residual_ptr + offs_k)
        x = normalize_and_scale(x, inv_rms, tl.load(norm_weight_ptr + offs_k)).to(x.dtype)
    elif PROLOGUE == 2:
        x = silu_mul(x, tl.load(x_ptr + K + offs_k)).to(x.dtype)
    return x.to(tl.float32)


@triton.jit
def row_inv_rms(x_ptr, norm, K, PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, ROW_BLOCK: tl.constexpr):
    """With the RMSNorm prologue, 1 / rms of the whole row (K * 2 bytes, read from L2 by every
    program; the first also stores x + residual); else 1."""
    inv_rms = 1.0
    if PROLOGUE == 1:
        residual_ptr, _, sum_ptr, eps = norm
        offs = tl.arange(0, ROW_BLOCK)
        row = tl.load(x_ptr + offs, mask=offs < K, other=0.0)
        if HAS_RESIDUAL:
            row = row + tl.load(residual_ptr + offs, mask=offs < K, other=0.0)
            if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
                tl.store(sum_ptr + offs, row, mask=offs < K)
        inv_rms = rms_inverse(row.to(tl.float32), K, eps)
    return inv_rms


@triton.jit
def lane_halves(tile, HEAD_DIM: tl.constexpr):
    """A head's [HEAD_DIM / 8, 8] lane tile as its two halves [HEAD_DIM / 16, 8] each: element
    [c, j] of the second is half a head past element [c, j] of the first, the pair rotate-half
    RoPE mixes."""
    return tl.split(tl.permute(tl.reshape(tile, (2, HEAD_DIM // 16, 8)), (1, 2, 0)))


@triton.jit
def rope_kv_store(total, cols, y_ptr, head, rope, HEAD_DIM: tl.constexpr, STORE: tl.constexpr):
    """The fused q/k/v projection's output for one head (total [HEAD_DIM / 8, 8] float32, bias
    added, at columns cols) stored as rotary_write_kv would leave it: rounded to y's dtype, q and
    k heads rotated by the token's position (rotary.py's _rotate_half: the same bits), and k and
    v heads also stored into the KV pages at the token's slot (kv_write's _store_row, which reads
    the row back from y after a barrier: quantize-on-store for INT8 and INT4 pages, the FP16 copy
    for window pages)."""
    cos_ptr, sin_ptr, stride_cos, positions_ptr, slot_ptr, num_q_heads, num_kv_heads, code_dim, k_pages, v_pages = rope
    BITS: tl.constexpr = STORE[0]  # the pages' constants, as kv_write._store_constants gives them
    QMAX: tl.constexpr = STORE[1]
    BLOCK_CODE: tl.constexpr = STORE[2]
    HAS_WINDOW: tl.constexpr = STORE[3]
    PAGE_SIZE: tl.constexpr = STORE[4]
    y = total.to(y_ptr.dtype.element_ty)
    is_k = head < num_q_heads + num_kv_heads
    if is_k:
        first, second = lane_halves(y, HEAD_DIM)
        first_cols, _ = lane_halves(cols - head * HEAD_DIM, HEAD_DIM)  # 0..HEAD_DIM/2 - 1
        position = tl.load(positions_ptr).to(tl.int64)
        cos = tl.load(cos_ptr + position * stride_cos + first_cols)
        sin = tl.load(sin_ptr + position * stride_cos + first_cols)
        first, second = _rotate_half(first, second, cos, sin)
        y = tl.reshape(tl.permute(tl.join(first, second), (2, 0, 1)), (HEAD_DIM // 8, 8))
    tl.store(y_ptr + cols, y)
    if head >= num_q_heads:
        tl.debug_barrier()  # _store_row reads the row in its own layout: other threads stored it
        row_ptr = y_ptr + head * HEAD_DIM
        kv_head = (head - num_q_heads) % num_kv_heads
        slot = tl.load(slot_ptr).to(tl.int64)
        # (codes, scales, zeros, FP16 window) of k or v, and the window's page rows
        if is_k:
            cache_ptr, scale_ptr, zero_ptr, window_ptr, window_row_ptr = k_pages
        else:
            cache_ptr, scale_ptr, zero_ptr, window_ptr, window_row_ptr = v_pages
        _store_row(
            row_ptr,
            0,
            cache_ptr + kv_head * code_dim,
            scale_ptr + kv_head,
            zero_ptr + kv_head,
            slot,
            num_kv_heads,
            code_dim,
            BITS,
            QMAX,
            1,
            BLOCK_CODE,
        )
        if HAS_WINDOW:
            window_slot = _window_slot(window_row_ptr, slot, PAGE_SIZE)
            _store_row(
                row_ptr,
                0,
                window_ptr + kv_head * HEAD_DIM,
                window_ptr,
                window_ptr,
                window_slot,
                num_kv_heads,
                HEAD_DIM,
                16,
                0,
                1,
                HEAD_DIM,
            )


@triton.jit
def lora_once_term(lora, cols, ready_ptr, N, num_splits, num_column_blocks, BLOCK_R: tl.constexpr):
    """(x A^T) Bt[:, cols] as float32 [BLOCK_N], in the last program of a column block, when the
    first column block's programs compute x A^T for everyone (LORA_ONCE).

    Program (0, s) stores its split's share t_s and counts in on ready_ptr; the last program of
    each column block waits for all num_splits shares and adds them in split order. It cannot
    wait forever: it came last in its block, so every split of that block has run, and (0, s)
    precedes (n, s) in launch order. The last of the waiting programs to count in on the next
    counter resets both for the next launch or replay.
    """
    _, _, shares_ptr, _, _, _, _ = lora
    ready = tl.atomic_add(ready_ptr, 0, sem="acquire")
    while ready < num_splits:
        ready = tl.atomic_add(ready_ptr, 0, sem="acquire")
    offs_r = tl.arange(0, BLOCK_R)
    t = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for s in range(num_splits):
        t += tl.load(shares_ptr + s * BLOCK_R + offs_r, cache_modifier=".cg")
    term = tl.sum(t[:, None] * lora_bt_tile(lora, cols, N, BLOCK_R).to(tl.float32), axis=0)
    if tl.atomic_add(ready_ptr + 1, 1, sem="acq_rel") == num_column_blocks - 1:
        tl.store(ready_ptr, 0)
        tl.store(ready_ptr + 1, 0)
    return term


@triton.jit
def _row_kernel(
    x_ptr,
    awq,
    bias_ptr,
    y_ptr,
    split,
    lora,
    norm,
    rope,
    N,
    K,
    num_packed_cols,
    K_BLOCKS_PER_SPLIT,
    GROUP_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_N: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    IS_PARTIAL: tl.constexpr,
    REDUCE_AT_END: tl.constexpr,
    HAS_LORA: tl.constexpr,
    LORA_ONCE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    PROLOGUE: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    ROW_BLOCK: tl.constexpr,
    ROPE_KV: tl.constexpr,
    STORE: tl.constexpr,
):
    # One row. A program owns BLOCK_N columns as [C, 8] lanes (awq_load_lanes) and a range of K
    # blocks. REDUCE_AT_END keeps [BLOCK_K, C, 8] products and sums over K once after the loop
    # (no reduction across threads inside it: faster for short K); else each K block is summed
    # and scaled. With LORA_ONCE (several splits) only the first column block computes x A^T,
    # and every block's last program adds its shares (lora_once_term); else each program adds
    # its own t_s Bt to its partial.
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    offs_c = pid_n * (BLOCK_N // 8) + tl.arange(0, BLOCK_N // 8)  # packed columns [C]
    lanes = tl.arange(0, 8)
    cols = offs_c[:, None] * 8 + ((lanes % 4) * 2 + lanes // 4)[None, :]  # nibble j: column 8c + [0,2,4,6,1,3,5,7][j]
    mask = (offs_c < num_packed_cols)[:, None]
    kb_start = pid_k * K_BLOCKS_PER_SPLIT
    kb_end = tl.minimum(kb_start + K_BLOCKS_PER_SPLIT, K // BLOCK_K)
    inv_rms = row_inv_rms(x_ptr, norm, K, PROLOGUE, HAS_RESIDUAL, ROW_BLOCK)
    if REDUCE_AT_END:
        acc3 = tl.zeros((BLOCK_K, BLOCK_N // 8, 8), dtype=tl.float32)
        t_tile = tl.zeros((BLOCK_K, BLOCK_R), dtype=tl.float32)  # x A^T's products (compensation)
    else:
        acc = tl.zeros((BLOCK_N // 8, 8), dtype=tl.float32)
        t = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for kb in range(kb_start, kb_end):
        centered, scales = awq_load_lanes(
            awq, kb * BLOCK_K, offs_c, cols, N, num_packed_cols, GROUP_SIZE, BLOCK_K, EVEN_N
        )
        offs_k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        x = row_input(x_ptr, offs_k, norm, inv_rms, K, PROLOGUE, HAS_RESIDUAL)
        if REDUCE_AT_END:
            acc3 += x[:, None, None] * (centered * scales[None, :, :])
        else:
            acc += tl.sum(x[:, None, None] * centered, axis=0) * scales
        if HAS_LORA:
            if (pid_n == 0) | (not LORA_ONCE):
                if REDUCE_AT_END:
                    t_tile += x[:, None] * lora_a_tile(lora, offs_k, BLOCK_R).to(tl.float32)
                else:
                    t += tl.sum(x[:, None] * lora_a_tile(lora, offs_k, BLOCK_R).to(tl.float32), axis=0)
    if REDUCE_AT_END:
        acc = tl.sum(acc3, axis=0)
        t = tl.sum(t_tile, axis=0)
    flat_cols = tl.reshape(cols, (BLOCK_N,))  # [C, 8] row-major: reshaped back, a term lands on its column
    partial_ptr, counter_ptr = split
    if HAS_LORA:
        if LORA_ONCE:
            if pid_n == 0:
                tl.store(lora[2] + pid_k * BLOCK_R + tl.arange(0, BLOCK_R), t)  # x A^T shares [SPLIT_K, BLOCK_R]
                tl.debug_barrier()
                tl.atomic_add(counter_ptr + tl.num_programs(0), 1, sem="release")
        else:
            term = tl.sum(t[:, None] * lora_bt_tile(lora, flat_cols, N, BLOCK_R).to(tl.float32), axis=0)
            acc += tl.reshape(term, (BLOCK_N // 8, 8))
    is_last = True
    if IS_PARTIAL:
        is_last, acc = split_arrive(acc, cols, mask, partial_ptr, counter_ptr + pid_n, pid_k, tl.num_programs(1), N)
    if is_last:
        if LORA_ONCE:
            ready_ptr = counter_ptr + tl.num_programs(0)  # two counters past the column blocks'
            term = lora_once_term(lora, flat_cols, ready_ptr, N, tl.num_programs(1), tl.num_programs(0), BLOCK_R)
            acc += tl.reshape(term, (BLOCK_N // 8, 8))
        if ROPE_KV:  # one head per column block
            if HAS_BIAS:
                acc += tl.load(bias_ptr + cols).to(tl.float32)
            rope_kv_store(acc, cols, y_ptr, pid_n, rope, BLOCK_N, STORE)
        else:
            store_output(acc, cols, cols, mask, y_ptr, bias_ptr, N, HAS_BIAS)
        if IS_PARTIAL:
            tl.store(counter_ptr + pid_n, 0)


@triton.jit
def nibble_times_power(packed, J: tl.constexpr):
    """Float32 q * 16**p of nibble J of every AWQ word in `packed`, in one logic op and one add
    (and a shift shared by J >= 5): masked in place (J < 5, p = J) or after a 20-bit shift
    (J >= 5, p = J - 5), the nibble stays below 2**23, so OR-ed into the mantissa of 2**23
    (FLOAT32_MAGIC) it reads as 2**23 + q * 16**p."""
    if J >= 5:
        packed = packed >> 20
    MASK: tl.constexpr = 0xF << (4 * (J % 5))
    return ((packed & MASK) | FLOAT32_MAGIC).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def group_term(acc, sums, x_sum, zeros_word, scales_ptr, mask, J: tl.constexpr, COLUMN: tl.constexpr):
    """acc + s * (sums - x_sum * z) for nibble J of a group: `sums` [R, C] are the row slots'
    sums of x * q * 16**p, x_sum [R, 1] their sums of x, zeros_word [1, C] the group's packed
    zeros, scales_ptr [1, C] its scales of column 8c, COLUMN the nibble's column in the word."""
    scale = tl.load(scales_ptr + COLUMN, mask=mask, other=0.0).to(tl.float32)
    return acc + scale * (sums - x_sum * nibble_times_power(zeros_word, J))


@triton.jit
def join8(v0, v1, v2, v3, v4, v5, v6, v7):
    """Eight [C] tensors as one [C, 8]; the same call on their columns gives the matching columns."""
    low = tl.join(tl.join(v0, v1), tl.join(v2, v3))
    high = tl.join(tl.join(v4, v5), tl.join(v6, v7))
    return tl.reshape(tl.join(low, high), (v0.shape[0], 8))


@triton.jit
def _wide_row_kernel(
    x_ptr,
    awq,
    bias_ptr,
    y_ptr,
    split,
    norm,
    N,
    K,
    num_packed_cols,
    GROUPS_PER_SPLIT,
    GROUP_SIZE: tl.constexpr,
    BLOCK_C: tl.constexpr,
    TILE_ROWS: tl.constexpr,
    UNROLL: tl.constexpr,
    EVEN_N: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    IS_PARTIAL: tl.constexpr,
    PROLOGUE: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    ROW_BLOCK: tl.constexpr,
):
    # One row of a wide layer without compensation (gate/up), K summed inside each thread. A
    # program owns BLOCK_C packed columns and whole groups of K. Each step loads UNROLL tiles
    # of TILE_ROWS rows x BLOCK_C words (a thread holds whole words of one row) and adds
    # x * q * 16**p into eight per-nibble sums per row slot: nothing is summed across threads
    # until the end, and no nibble is shifted into place (16**-p is taken out at the end,
    # exactly). Per group each slot's sums take the group's scale and zero:
    # s * (sum x q - z sum x).
    qweight_ptr, qzeros_ptr, scales_ptr = awq
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    offs_c = pid_n * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_c = offs_c < num_packed_cols
    offs_r = tl.arange(0, TILE_ROWS)
    g_start = pid_k * GROUPS_PER_SPLIT
    g_end = tl.minimum(g_start + GROUPS_PER_SPLIT, K // GROUP_SIZE)
    inv_rms = row_inv_rms(x_ptr, norm, K, PROLOGUE, HAS_RESIDUAL, ROW_BLOCK)
    zero = tl.zeros((TILE_ROWS, BLOCK_C), tl.float32)
    a0, a1, a2, a3, a4, a5, a6, a7 = zero, zero, zero, zero, zero, zero, zero, zero  # the program's
    for g in range(g_start, g_end):
        p0, p1, p2, p3, p4, p5, p6, p7 = zero, zero, zero, zero, zero, zero, zero, zero  # the group's
        x_sum = tl.zeros((TILE_ROWS, 1), tl.float32)
        for step in range(0, GROUP_SIZE, TILE_ROWS * UNROLL):
            for u in tl.static_range(UNROLL):
                offs_k = g * GROUP_SIZE + step + u * TILE_ROWS + offs_r
                weight_ptrs = qweight_ptr + offs_k[:, None] * num_packed_cols + offs_c[None, :]
                if EVEN_N:
                    packed = tl.load(weight_ptrs)
                else:
                    packed = tl.load(weight_ptrs, mask=mask_c[None, :], other=0)
                x = row_input(x_ptr, offs_k, norm, inv_rms, K, PROLOGUE, HAS_RESIDUAL)[:, None]
                x_sum += x
                p0 += x * nibble_times_power(packed, 0)
                p1 += x * nibble_times_power(packed, 1)
                p2 += x * nibble_times_power(packed, 2)
                p3 += x * nibble_times_power(packed, 3)
                p4 += x * nibble_times_power(packed, 4)
                p5 += x * nibble_times_power(packed, 5)
                p6 += x * nibble_times_power(packed, 6)
                p7 += x * nibble_times_power(packed, 7)
        zeros_word = tl.load(qzeros_ptr + g * num_packed_cols + offs_c, mask=mask_c, other=0)[None, :]
        scales = scales_ptr + g * N + offs_c[None, :] * 8
        mask = mask_c[None, :]
        # nibble j holds column 8c + [0, 2, 4, 6, 1, 3, 5, 7][j]
        a0 = group_term(a0, p0, x_sum, zeros_word, scales, mask, 0, 0)
        a1 = group_term(a1, p1, x_sum, zeros_word, scales, mask, 1, 2)
        a2 = group_term(a2, p2, x_sum, zeros_word, scales, mask, 2, 4)
        a3 = group_term(a3, p3, x_sum, zeros_word, scales, mask, 3, 6)
        a4 = group_term(a4, p4, x_sum, zeros_word, scales, mask, 4, 1)
        a5 = group_term(a5, p5, x_sum, zeros_word, scales, mask, 5, 3)
        a6 = group_term(a6, p6, x_sum, zeros_word, scales, mask, 6, 5)
        a7 = group_term(a7, p7, x_sum, zeros_word, scales, mask, 7, 7)
    y0, y1, y2, y3 = tl.sum(a0, 0), tl.sum(a1, 0) / 16, tl.sum(a2, 0) / 256, tl.sum(a3, 0) / 4096
    y4, y5, y6, y7 = tl.sum(a4, 0) / 65536, tl.sum(a5, 0), tl.sum(a6, 0) / 16, tl.sum(a7, 0) / 256
    acc = join8(y0, y1, y2, y3, y4, y5, y6, y7)  # [C, 8]
    base = offs_c * 8
    cols = join8(base, base + 2, base + 4, base + 6, base + 1, base + 3, base + 5, base + 7)
    mask = cols < N
    partial_ptr, counter_ptr = split
    is_last = True
    if IS_PARTIAL:
        is_last, acc = split_arrive(acc, cols, mask, partial_ptr, counter_ptr + pid_n, pid_k, tl.num_programs(1), N)
    if is_last:
        store_output(acc, cols, cols, mask, y_ptr, bias_ptr, N, HAS_BIAS)
        if IS_PARTIAL:
            tl.store(counter_ptr + pid_n, 0)


def lora_block_r(rank: int) -> int:
    """The padded rank the kernels work in: a power of two, at least tl.dot's 16."""
    return max(DOT_MIN_M, triton.next_power_of_2(rank))


# Outputs above which one row without compensation takes the K-in-thread kernel: it beats the
# lane kernel on gate/up (N = 17,920 at the 1.5B shape) and loses on q/k/v, o and down.
WIDE_ROW_MIN_OUTPUTS = 4096


def row_config(
    num_outputs: int, num_inputs: int, group_size: int, num_sms: int, has_lora: bool, block_n: int = 64
) -> dict:
    """The one-row tiling. A wide layer without compensation runs _wide_row_kernel: 128-column blocks, two warps, K split into whole groups for
    about eight programs per SM. Else the lane kernel: 64-column blocks (RoPE and the KV store
    take one head per block instead) and at least four K splits, for about two programs per
    SM (the small projections, N = 256 or 1536, have too few column blocks to fill a GPU on
    their own), four for long inputs (32 K blocks or more). Long inputs and wide outputs reduce
    every K block and compute the compensation's x A^T once per launch; the short, narrow
    projections (q/k/v, o) sum over K once after the loop, where waiting for shared x A^T costs
    more than recomputing it.
    """
    if not has_lora and num_outputs > WIDE_ROW_MIN_OUTPUTS and block_n == 64:
        num_groups = num_inputs // group_size
        split_k = max(1, min(num_groups, triton.cdiv(8 * num_sms, triton.cdiv(num_outputs, 128))))
        return {"block_n": 128, "block_k": group_size, "split_k": split_k, "num_warps": 2, "k_in_thread": True}
    block_k = min(group_size, 128)
    num_k_blocks = num_inputs // block_k
    is_long = num_k_blocks >= 32
    num_programs = (4 if is_long else 2) * num_sms
    split_k = max(1, min(num_k_blocks, max(4, triton.cdiv(num_programs, triton.cdiv(num_outputs, block_n)))))
    is_short = not is_long and num_outputs <= 4096
    return {"block_n": block_n, "block_k": block_k, "split_k": split_k, "num_warps": 4, "reduce_at_end": is_short}


def tiled_config(num_rows: int, num_outputs: int, num_inputs: int, group_size: int, num_sms: int) -> dict:
    """The tiled kernel's tiling: up to MAX_DECODE_M rows, one 16-row tile split over K for about
    two programs per SM (the batch-invariant form uses this for every row count); more rows,
    the prefill GEMM's 32- or 64-row tiles without a split."""
    if num_rows > MAX_DECODE_M:
        block_m = 32 if num_rows <= 32 else 64
        return {"block_m": block_m, "block_n": 128, "block_k": min(group_size, 64), "split_k": 1, "num_warps": 4}
    block_n, block_k = (64 if num_outputs <= 2048 else 128), min(group_size, 128)
    num_k_blocks = num_inputs // block_k
    split_k = max(1, min(num_k_blocks, triton.cdiv(2 * num_sms, triton.cdiv(num_outputs, block_n))))
    return {"block_m": DOT_MIN_M, "block_n": block_n, "block_k": block_k, "split_k": split_k, "num_warps": 4}


def _splits(x, y, num_k_blocks: int, config: dict, num_counters: int):
    """(split_k, K blocks per split, (partials, counters)) of a launch; no empty split."""
    per_split = triton.cdiv(num_k_blocks, max(1, min(config["split_k"], num_k_blocks)))
    split_k = triton.cdiv(num_k_blocks, per_split)
    if split_k == 1:
        return 1, per_split, (y, y)  # not read
    # partials: [SPLIT_K, M, N] float32, from the graph pool under capture
    partials = x.new_empty((split_k, *y.shape), dtype=torch.float32)
    return split_k, per_split, (partials, SPLIT_COUNTERS.get(y.device, num_counters))


def launch_tiled(x, weight, bias, y, config, lora_a=None, lora_bt=None):
    """Run the tiled kernel into y [M, N]; inputs already checked by the caller.

    x: [M, K] (any strides); y: [M, N] with unit column stride; `weight` is the AWQ layer as
    (qweight, qzeros, scales, group_size), all contiguous, or a float W [N, K] (any strides).
    `config` from tiled_config. lora_a [R, K] (unit stride along K) and lora_bt [R, N], both
    or neither, add (x A^T) Bt in the same launch (AWQ only).
    """
    num_rows, num_inputs = x.shape
    num_outputs = y.shape[1]
    block_m, block_n, block_k = config["block_m"], config["block_n"], config["block_k"]
    is_dense = isinstance(weight, torch.Tensor)
    if is_dense:
        group_size, args = block_k, (weight, weight.stride(0), weight.stride(1))
    else:
        *args, group_size = weight
        if group_size % block_k or block_n % 8 or num_inputs % block_k:
            raise ValueError(f"tiles {config} do not fit group size {group_size}")
    num_column_blocks, num_row_tiles = triton.cdiv(num_outputs, block_n), triton.cdiv(num_rows, block_m)
    split_k, per_split, split = _splits(
        x, y, triton.cdiv(num_inputs, block_k), config, num_column_blocks * num_row_tiles
    )
    has_lora = lora_a is not None
    lora = (lora_a, lora_bt, lora_a, lora_a.shape[0], lora_a.stride(0), *lora_bt.stride()) if has_lora else ()
    _tiled_kernel[(num_row_tiles, num_column_blocks, split_k)](
        x,
        tuple(args),
        bias if bias is not None else y,
        y,
        split,
        lora,
        num_rows,
        num_outputs,
        num_inputs,
        num_outputs // 8,
        (x.stride(0), x.stride(1), y.stride(0)),
        per_split,
        GROUP_SIZE=group_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        EVEN_N=num_outputs % block_n == 0,
        HAS_BIAS=bias is not None,
        IS_PARTIAL=split_k > 1,
        HAS_LORA=has_lora,
        BLOCK_R=lora_block_r(lora_a.shape[0] if has_lora else 0),
        IS_DENSE=is_dense,
        num_warps=config["num_warps"],
    )
    return y


def launch_row(
    x,
    qweight,
    qzeros,
    scales,
    group_size,
    bias,
    y,
    config,
    lora_a=None,
    lora_bt=None,
    norm=None,
    is_gated=False,
    rope_kv=None,
):
    """Run the one-row kernel into y [1, N]; inputs already checked by the caller.

    x: [1, K] contiguous; `config` from row_config. lora_a [R, K] and lora_bt [R, N]
    as for launch_tiled. `norm` (w4a16.InputNorm) fuses an RMSNorm before the matmul, and
    `is_gated` reads x as a fused gate/up output [1, 2K] and multiplies W by silu(gate) * up: one
    launch instead of two, whose gap inside a CUDA graph costs more than the norm or activation
    itself. `rope_kv` (w4a16.RopeKVWrite), for a fused q/k/v projection, finishes each head as
    rotary_write_kv would: q and k rotated in y, k and v stored into the KV pages (one column
    block per head).
    """
    num_inputs, num_outputs = qweight.shape[0], y.shape[1]
    block_n = config["block_n"] if rope_kv is None else rope_kv.pages.head_dim
    block_k = config["block_k"]
    if group_size % block_k or block_n % 8:
        raise ValueError(
            f"block_k {block_k} must divide group size {group_size} and block_n {block_n} be a multiple of 8"
        )
    if x.shape[0] != 1 or not x.is_contiguous():
        raise ValueError(f"the one-row kernel takes one row, contiguous; got {list(x.shape)} strides {x.stride()}")
    num_k_blocks = num_inputs // block_k
    num_column_blocks = triton.cdiv(num_outputs, block_n)
    has_residual = norm is not None and norm.residual is not None
    norm_args = ()
    if norm is not None:
        norm_args = (
            (norm.residual, norm.weight, norm.sum_out, norm.eps) if has_residual else (x, norm.weight, x, norm.eps)
        )
    prologue = PROLOGUE_RMS_NORM if norm is not None else PROLOGUE_SILU_MUL if is_gated else PROLOGUE_NONE
    row_block = triton.next_power_of_2(num_inputs) if norm is not None else 16
    if config.get("k_in_thread"):
        if lora_a is not None or rope_kv is not None or block_k != group_size:
            raise ValueError("the K-in-thread kernel takes whole groups, without compensation or RoPE")
        split_k, per_split, split = _splits(x, y, num_k_blocks, config, num_column_blocks)
        _wide_row_kernel[(num_column_blocks, split_k)](
            x,
            (qweight, qzeros, scales),
            bias if bias is not None else y,
            y,
            split,
            norm_args,
            num_outputs,
            num_inputs,
            num_outputs // 8,
            per_split,
            GROUP_SIZE=group_size,
            BLOCK_C=block_n // 8,
            TILE_ROWS=16,
            UNROLL=2,  # groups are multiples of 32 rows
            EVEN_N=num_outputs % block_n == 0,
            HAS_BIAS=bias is not None,
            IS_PARTIAL=split_k > 1,
            PROLOGUE=prologue,
            HAS_RESIDUAL=has_residual,
            ROW_BLOCK=row_block,
            num_warps=config["num_warps"],
        )
        return y
    # with LORA_ONCE, two counters past the column blocks': shares ready, blocks done
    split_k, per_split, split = _splits(x, y, num_k_blocks, config, num_column_blocks + 2)
    has_lora = lora_a is not None
    is_lora_once = has_lora and split_k > 1 and not config["reduce_at_end"]
    block_r = lora_block_r(lora_a.shape[0] if has_lora else 0)
    lora = ()
    if has_lora:
        # x A^T shares: [SPLIT_K, BLOCK_R] float32
        shares = x.new_empty((split_k, block_r), dtype=torch.float32) if is_lora_once else lora_a
        lora = (lora_a, lora_bt, shares, lora_a.shape[0], lora_a.stride(0), *lora_bt.stride())
    rope, store = (), ()
    if rope_kv is not None:
        pages = rope_kv.pages
        k, v, k_scale, k_zero, v_scale, v_zero, window_k, window_v, window_row = kv_write._cache_pointers(pages)
        constants = kv_write._store_constants(pages)
        cos = rope_kv.cos
        rope = (
            cos,
            rope_kv.sin,
            cos.stride(0),
            rope_kv.positions,
            rope_kv.slot_mapping,
            rope_kv.num_heads,
            pages.num_kv_heads,
            k.shape[3],
            (k, k_scale, k_zero, window_k, window_row),
            (v, v_scale, v_zero, window_v, window_row),
        )
        store = tuple(constants[name] for name in ("BITS", "QMAX", "BLOCK_C", "HAS_WINDOW", "PAGE_SIZE"))
    _row_kernel[(num_column_blocks, split_k)](
        x,
        (qweight, qzeros, scales),
        bias if bias is not None else y,
        y,
        split,
        lora,
        norm_args,
        rope,
        num_outputs,
        num_inputs,
        num_outputs // 8,
        per_split,
        GROUP_SIZE=group_size,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        EVEN_N=num_outputs % block_n == 0,
        HAS_BIAS=bias is not None,
        IS_PARTIAL=split_k > 1,
        REDUCE_AT_END=config["reduce_at_end"],
        HAS_LORA=has_lora,
        LORA_ONCE=is_lora_once,
        BLOCK_R=block_r,
        PROLOGUE=prologue,
        HAS_RESIDUAL=has_residual,
        ROW_BLOCK=row_block,
        ROPE_KV=rope_kv is not None,
        STORE=store,
        num_warps=config["num_warps"],
    )
    return y


def launch_dequant(qweight, qzeros, scales, group_size, dtype=torch.float16):
    """Dequantize a checked AWQ layer into a new contiguous W [K, N] of `dtype`."""
    num_inputs, num_outputs = qweight.shape[0], scales.shape[1]
    weight = torch.empty((num_inputs, num_outputs), dtype=dtype, device=qweight.device)
    block_k, block_n = min(group_size, 32), 128
    grid = (num_inputs // block_k, triton.cdiv(num_outputs, block_n))
    even_n = num_outputs % block_n == 0
    _dequant_kernel[grid](
        (qweight, qzeros, scales), weight, num_outputs, num_outputs // 8, group_size, block_n, block_k, even_n
    )
    return weight
