"""Decode kernel for W4A16: y[M, N] = x[M, K] @ W[K, N] with M = 1..16 and W in AWQ GEMM form.

Decode reads every weight once per token, so the kernel is built to spread the weight bytes
over all SMs: each program owns BLOCK_N output columns and a contiguous range of K blocks
(split-K). With more than one split, each program writes its float32 partial sums to a
workspace [SPLIT_K, M, N] and counts itself in on an int32 counter of its column block; the
last to arrive adds up every split's partial in split order 0..SPLIT_K-1, adds the bias and
casts (`awq_gemv_store`). Summing in a fixed order keeps the result the same from run to run
whichever program arrives last (float atomics on the output would not), and a decode step
pays one launch per projection: a separate summing kernel added 112 launches per token to a
28-layer model, whose gaps took about a tenth of a CUDA-graph step on an H200.

Each K block lies inside one quantization group (BLOCK_K divides the group size), so one
scale and zero row serves the whole tile and the scale can be applied after the reduction:
sum_k x[k] * (q[k] - z) * s = s * sum_k x[k] * (q[k] - z). The integers (q - z) are exact in
float16, so W is never rounded: the only rounding left is the float32 accumulation.

M == 1 uses a multiply-and-sum over the tile (no padding); 2 <= M <= 16 pads M to 16 and
uses tl.dot, the smallest shape tl.dot accepts.

For M == 1 a second form of the kernel (`_awq_gemv_row_kernel`, config "unpack": "lanes")
never moves nibbles between columns: the packed tile [BLOCK_K, BLOCK_N / 8] is shifted
against the eight nibble positions into [BLOCK_K, BLOCK_N / 8, 8], and the results are
stored to the columns each nibble holds in AWQ order. "reduce" picks where the sum over K
happens: "block" reduces every K block and scales after (fewest multiplies), "end" keeps a
[BLOCK_K, BLOCK_N / 8, 8] accumulator and reduces once after the loop (no reduction across
threads inside the loop; one more multiply per weight). Which is fastest depends on the
GPU and shape; scripts/lab/profile_decode.py --sweep-gemv measures them. With 2-16 rows
the interleaving form runs.

Residual compensation (y += (x A^T) B^T, rank R) rides along in the same launch. Each split
program also accumulates t_s = x[its K range] A[:, its K range]^T in float32 while it walks K,
and adds t_s Bt[:, its columns] to its partial before `awq_gemv_store`. The sum over splits of
t_s Bt is (x A^T) B^T, so the split reduction produces the whole term without a second kernel.
Every column block recomputes its t_s: A is small (R * K * 2 bytes) and stays in L2, while a
separate x A^T kernel would cost a launch per projection, which is what the fusion removes.
Ranks are padded to BLOCK_R (a power of two, at least 16 for tl.dot) by masking. A fused
q/k/v or gate/up layer's B is block diagonal (lowvram.models.fusion) and is read whole, zeros
included: its R is the sum of its parts' ranks.
"""

import math
import os

import torch
import triton
import triton.language as tl

from lowvram.kernels import kv_write
from lowvram.kernels.activation import silu_mul
from lowvram.kernels.arrival_counters import ArrivalCounters
from lowvram.kernels.kv_write import _store_row, _window_slot
from lowvram.kernels.pdl import await_inputs, launch_prefetch, prefetch_l2
from lowvram.kernels.rms_norm import normalize_and_scale, rms_inverse
from lowvram.kernels.rotary import _rotate_half

DOT_MIN_M = 16  # tl.dot needs at least 16 rows
# Rows per launch in the batch-invariant form: bounds the float32 split-K partials
# ([SPLIT_K, rows, N]) of a long prefill chunk; rows are independent, so no row changes.
INVARIANT_MAX_ROWS = 64
MIN_SPLIT_COUNTERS = 4096  # 262,144 outputs in 64-column blocks: grown only for wider layers

# One counter per column block (and row tile); see kernels/arrival_counters.py.
SPLIT_COUNTERS = ArrivalCounters("the decode GEMV's split-K", MIN_SPLIT_COUNTERS)


@triton.jit
def awq_unpack_tile(packed, shifts):
    """[R, C/8] packed int32 -> [R, C] int32 nibbles in natural column order.

    Three interleaves repeat each packed word over its eight columns; `shifts` ([1, C] or [C])
    then picks the AWQ nibble of each column. Masking after the arithmetic shift drops the
    sign bits of negative words.
    """
    wide = tl.interleave(packed, packed)
    wide = tl.interleave(wide, wide)
    wide = tl.interleave(wide, wide)
    return (wide >> shifts) & 0xF


@triton.jit
def awq_column_shifts(offs_n):
    """Bit offset of column n inside its int32: 4 * [0, 4, 1, 5, 2, 6, 3, 7][n % 8]."""
    lane = offs_n % 8
    return ((lane % 2) * 4 + lane // 2) * 4


@triton.jit
def awq_load_block(
    qweight_ptr,
    qzeros_ptr,
    scales_ptr,
    k_start,
    pid_n,
    N,
    num_packed_cols,
    GROUP_SIZE: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    EVEN_N: tl.constexpr,
):
    """One K block (inside one group) of column block pid_n: returns (q - z) as int32
    [BLOCK_K, BLOCK_N] and the group's float32 scales [BLOCK_N].

    `num_packed_cols` (N / 8) is a kernel argument rather than N // 8 so Triton can specialise
    its divisibility and vectorise the row loads; EVEN_N drops the column masks for the same
    reason when N is a multiple of BLOCK_N.
    """
    offs_k = k_start + tl.arange(0, BLOCK_K)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_pn = pid_n * (BLOCK_N // 8) + tl.arange(0, BLOCK_N // 8)
    group = k_start // GROUP_SIZE
    qweight_ptrs = qweight_ptr + offs_k[:, None] * num_packed_cols + offs_pn[None, :]
    qzeros_ptrs = qzeros_ptr + group * num_packed_cols + offs_pn[None, :]
    scales_ptrs = scales_ptr + group * N + offs_n
    if EVEN_N:
        packed = tl.load(qweight_ptrs)
        packed_zeros = tl.load(qzeros_ptrs)
        scales = tl.load(scales_ptrs)
    else:
        mask_pn = (offs_pn < num_packed_cols)[None, :]
        packed = tl.load(qweight_ptrs, mask=mask_pn, other=0)
        packed_zeros = tl.load(qzeros_ptrs, mask=mask_pn, other=0)
        scales = tl.load(scales_ptrs, mask=offs_n < N, other=0.0)
    shifts = awq_column_shifts(offs_n)[None, :]
    centered = awq_unpack_tile(packed, shifts) - awq_unpack_tile(packed_zeros, shifts)
    return centered, scales.to(tl.float32)


@triton.jit
def awq_store_output(acc, rows, cols, mask, y_ptr, stride_ym, bias_ptr, N, HAS_BIAS: tl.constexpr):
    """y[rows, cols] = acc + bias[cols] under mask, cast to y's dtype."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    tl.store(y_ptr + rows * stride_ym + cols, acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def split_arrive(acc, rows, cols, mask, partial_ptr, counter_ptr, M, N):
    """Store this split's float32 partial sums and count in on the column block's counter:
    (whether this program came last, and then the sum of every split's partial in split
    order; zeros otherwise).

    Ordering: the CTA barrier puts every thread's partial stores before the count, whose
    release (acq_rel, GPU scope) publishes them; the acquire of the last count makes every
    split's partial visible to the last program, which reads them from L2 (".cg": L1 is not
    coherent across SMs). The caller's last program resets the counter.
    """
    # partials: [SPLIT_K, M, N] float32
    partial_ptrs = partial_ptr + rows * N + cols
    tl.store(partial_ptrs + tl.program_id(1) * M * N, acc, mask=mask)
    tl.debug_barrier()
    num_splits = tl.num_programs(1)
    is_last = tl.atomic_add(counter_ptr + tl.program_id(0), 1, sem="acq_rel") == num_splits - 1
    total = tl.zeros_like(acc)
    if is_last:
        for split in range(num_splits):  # fixed order: the sum does not depend on who came last
            total += tl.load(partial_ptrs + split * M * N, mask=mask, other=0.0, cache_modifier=".cg")
    return is_last, total


@triton.jit
def awq_gemv_store(
    acc,
    rows,
    cols,
    mask,
    y_ptr,
    stride_ym,
    bias_ptr,
    partial_ptr,
    counter_ptr,
    M,
    N,
    HAS_BIAS: tl.constexpr,
    IS_PARTIAL: tl.constexpr,
):
    """Finish a decode program: acc holds its float32 sums for output rows/cols (which
    broadcast to acc's shape), valid under mask. With one split it writes y. With several it
    writes its partial, and the last program of its column block to arrive writes y from all
    of them (split_arrive), then resets the counter for the next launch or replay.
    """
    if IS_PARTIAL:
        is_last, total = split_arrive(acc, rows, cols, mask, partial_ptr, counter_ptr, M, N)
        if is_last:
            awq_store_output(total, rows, cols, mask, y_ptr, stride_ym, bias_ptr, N, HAS_BIAS)
            tl.store(counter_ptr + tl.program_id(0), 0)
    else:
        awq_store_output(acc, rows, cols, mask, y_ptr, stride_ym, bias_ptr, N, HAS_BIAS)


@triton.jit
def await_inputs_prefetching(
    qweight_ptr,
    scales_ptr,
    qzeros_ptr,
    K,
    N,
    GROUP_SIZE: tl.constexpr,
    PDL: tl.constexpr,
    PREFETCH_0: tl.constexpr,
    PREFETCH_1: tl.constexpr,
    PREFETCH_2: tl.constexpr,
):
    """How every decode GEMV program starts: its share of the layer's packed weights, scales
    and zeros asked of L2 (pdl.prefetch_l2; PREFETCH_* lines each from pdl.launch_prefetch, 0
    for none), then pdl.await_inputs. Activations are read, and anything written, only after."""
    num_groups = K // GROUP_SIZE
    prefetch_l2(qweight_ptr, K.to(tl.int64) * (N // 2), PREFETCH_0)
    prefetch_l2(
        scales_ptr, num_groups.to(tl.int64) * N * (scales_ptr.dtype.element_ty.primitive_bitwidth // 8), PREFETCH_1
    )
    prefetch_l2(qzeros_ptr, num_groups.to(tl.int64) * (N // 2), PREFETCH_2)
    await_inputs(PDL)


@triton.jit
def lora_a_tile(lora_a_ptr, offs_k, rank, stride_ar, BLOCK_R: tl.constexpr):
    """A[:, offs_k]^T as [BLOCK_K, BLOCK_R]; ranks past `rank` read as zero."""
    offs_r = tl.arange(0, BLOCK_R)
    return tl.load(lora_a_ptr + offs_r[None, :] * stride_ar + offs_k[:, None], mask=(offs_r < rank)[None, :], other=0.0)


@triton.jit
def lora_bt_tile(lora_bt_ptr, cols, rank, N, stride_br, stride_bn, BLOCK_R: tl.constexpr):
    """Bt[:, cols] as [BLOCK_R, BLOCK_N] for columns cols [BLOCK_N]; zero past `rank` and N."""
    offs_r = tl.arange(0, BLOCK_R)
    mask = (offs_r < rank)[:, None] & (cols < N)[None, :]
    return tl.load(lora_bt_ptr + offs_r[:, None] * stride_br + cols[None, :] * stride_bn, mask=mask, other=0.0)


@triton.jit
def lora_row_down(t, x, lora_a_ptr, offs_k, rank, stride_ar, BLOCK_R: tl.constexpr):
    """One row: t [BLOCK_R] + x [BLOCK_K] (float32) @ A[:, offs_k]^T."""
    a = lora_a_tile(lora_a_ptr, offs_k, rank, stride_ar, BLOCK_R).to(tl.float32)
    return t + tl.sum(x[:, None] * a, axis=0)


@triton.jit
def lora_row_up(t, lora_bt_ptr, cols, rank, N, stride_br, stride_bn, BLOCK_R: tl.constexpr):
    """One row: t [BLOCK_R] @ Bt[:, cols] as float32 [BLOCK_N]."""
    bt = lora_bt_tile(lora_bt_ptr, cols, rank, N, stride_br, stride_bn, BLOCK_R).to(tl.float32)
    return tl.sum(t[:, None] * bt, axis=0)


@triton.jit
def lora_row_accumulate(t, t_tile, x, lora_a_ptr, offs_k, rank, stride_ar, BLOCK_R: tl.constexpr, AT_END: tl.constexpr):
    """One K block of x A^T for one row: into t [BLOCK_R] (a sum across threads per block), or
    with AT_END into t_tile [BLOCK_K, BLOCK_R] (products only; the caller sums once)."""
    if AT_END:
        t_tile += x[:, None] * lora_a_tile(lora_a_ptr, offs_k, rank, stride_ar, BLOCK_R).to(tl.float32)
    else:
        t = lora_row_down(t, x, lora_a_ptr, offs_k, rank, stride_ar, BLOCK_R)
    return t, t_tile


@triton.jit
def lora_once_term(
    flat_cols,
    t_ptr,
    ready_ptr,
    done_ptr,
    lora_bt_ptr,
    rank,
    N,
    stride_br,
    stride_bn,
    num_splits,
    num_column_blocks,
    BLOCK_R: tl.constexpr,
):
    """(x A^T) Bt[:, flat_cols] as float32 [BLOCK_N], in the last program of a column block,
    when the first column block's programs compute x A^T for everyone (LORA_ONCE).

    Program (0, s) stores its split's share t_s and counts in on ready_ptr; the last program
    of each column block waits for all num_splits shares and adds them in split order. It
    cannot wait forever: it came last in its block, so every split of that block has run,
    and (0, s) precedes (n, s) in launch order. The last of the waiting programs to count
    in on done_ptr resets both counters for the next launch or replay.
    """
    ready = tl.atomic_add(ready_ptr, 0, sem="acquire")
    while ready < num_splits:
        ready = tl.atomic_add(ready_ptr, 0, sem="acquire")
    offs_r = tl.arange(0, BLOCK_R)
    t = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for split in range(num_splits):
        t += tl.load(t_ptr + split * BLOCK_R + offs_r, cache_modifier=".cg")
    term = lora_row_up(t, lora_bt_ptr, flat_cols, rank, N, stride_br, stride_bn, BLOCK_R)
    if tl.atomic_add(done_ptr, 1, sem="acq_rel") == num_column_blocks - 1:
        tl.store(ready_ptr, 0)
        tl.store(done_ptr, 0)
    return term


@triton.jit
def lora_rows_down(t, x, lora_a_ptr, offs_k, rank, stride_ar, BLOCK_R: tl.constexpr):
    """Rows: t [BLOCK_M, BLOCK_R] + x [BLOCK_M, BLOCK_K] @ A[:, offs_k]^T on tensor cores."""
    return t + tl.dot(x, lora_a_tile(lora_a_ptr, offs_k, rank, stride_ar, BLOCK_R).to(x.dtype))


@triton.jit
def lora_rows_up(t, lora_bt_ptr, cols, rank, N, stride_br, stride_bn, BLOCK_R: tl.constexpr):
    """Rows: t [BLOCK_M, BLOCK_R] @ Bt[:, cols] as float32 [BLOCK_M, BLOCK_N]. t is rounded to
    Bt's dtype first, as the plain-torch path rounds x A^T to the activation dtype."""
    bt = lora_bt_tile(lora_bt_ptr, cols, rank, N, stride_br, stride_bn, BLOCK_R)
    return tl.dot(t.to(bt.dtype), bt)


@triton.jit
def _awq_gemv_kernel(
    x_ptr,
    qweight_ptr,
    qzeros_ptr,
    scales_ptr,
    bias_ptr,
    y_ptr,
    partial_ptr,
    counter_ptr,
    lora_a_ptr,
    lora_bt_ptr,
    lora_rank,
    stride_ar,
    stride_br,
    stride_bn,
    M,
    N,
    K,
    num_packed_cols,
    stride_xm,
    stride_xk,
    stride_ym,
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
    PDL: tl.constexpr,
    PREFETCH_0: tl.constexpr,
    PREFETCH_1: tl.constexpr,
    PREFETCH_2: tl.constexpr,
):
    await_inputs_prefetching(
        qweight_ptr, scales_ptr, qzeros_ptr, K, N, GROUP_SIZE, PDL, PREFETCH_0, PREFETCH_1, PREFETCH_2
    )
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)  # row tiles: more than one only in the batch-invariant form
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    # each row tile has its own column-block counters
    counter_ptr += pid_m * tl.num_programs(0)

    num_k_blocks = K // BLOCK_K
    kb_start = pid_k * K_BLOCKS_PER_SPLIT
    kb_end = tl.minimum(kb_start + K_BLOCKS_PER_SPLIT, num_k_blocks)

    if BLOCK_M == 1:
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        if HAS_LORA:
            t = tl.zeros((BLOCK_R,), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if HAS_LORA:
            t = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)

    for kb in range(kb_start, kb_end):
        k_start = kb * BLOCK_K
        # centered: [BLOCK_K, BLOCK_N], integers -15..15
        centered, scales = awq_load_block(
            qweight_ptr,
            qzeros_ptr,
            scales_ptr,
            k_start,
            pid_n,
            N,
            num_packed_cols,
            GROUP_SIZE,
            BLOCK_K,
            BLOCK_N,
            EVEN_N,
        )
        offs_k = k_start + tl.arange(0, BLOCK_K)
        if BLOCK_M == 1:
            x = tl.load(x_ptr + offs_k * stride_xk).to(tl.float32)
            partial = tl.sum(x[:, None] * centered.to(tl.float32), axis=0)
            acc += partial * scales
            if HAS_LORA:
                t = lora_row_down(t, x, lora_a_ptr, offs_k, lora_rank, stride_ar, BLOCK_R)
        else:
            x = tl.load(
                x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk, mask=mask_m[:, None], other=0.0
            )
            partial = tl.dot(x, centered.to(x.dtype))
            acc += partial * scales[None, :]
            if HAS_LORA:
                t = lora_rows_down(t, x, lora_a_ptr, offs_k, lora_rank, stride_ar, BLOCK_R)

    if HAS_LORA:
        if BLOCK_M == 1:
            acc += lora_row_up(t, lora_bt_ptr, offs_n, lora_rank, N, stride_br, stride_bn, BLOCK_R)
        else:
            acc += lora_rows_up(t, lora_bt_ptr, offs_n, lora_rank, N, stride_br, stride_bn, BLOCK_R)
    if BLOCK_M == 1:
        awq_gemv_store(
            acc, 0, offs_n, mask_n, y_ptr, stride_ym, bias_ptr, partial_ptr, counter_ptr, M, N, HAS_BIAS, IS_PARTIAL
        )
    else:
        awq_gemv_store(
            acc,
            offs_m[:, None],
            offs_n[None, :],
            mask_m[:, None] & mask_n[None, :],
            y_ptr,
            stride_ym,
            bias_ptr,
            partial_ptr,
            counter_ptr,
            M,
            N,
            HAS_BIAS,
            IS_PARTIAL,
        )


@triton.jit
def awq_lane_columns(pid_n, BLOCK_N: tl.constexpr):
    """Packed columns [C] of column block pid_n and the output column of each nibble [C, 8]:
    nibble j of a word holds column 8c + [0, 2, 4, 6, 1, 3, 5, 7][j]."""
    offs_c = pid_n * (BLOCK_N // 8) + tl.arange(0, BLOCK_N // 8)
    lanes = tl.arange(0, 8)
    return offs_c, offs_c[:, None] * 8 + ((lanes % 4) * 2 + lanes // 4)[None, :]


@triton.jit
def awq_unpack_lanes_int(packed, packed_zeros, scales):
    """(q - z) as int32 [K, C, 8] and float32 scales [C, 8] from awq_load_lanes_raw's tensors."""
    shifts = tl.arange(0, 8) * 4
    zeros = (packed_zeros[:, None] >> shifts[None, :]) & 0xF  # [C, 8]
    codes = (packed[:, :, None] >> shifts[None, None, :]) & 0xF  # [K, C, 8]
    return codes - zeros[None, :, :], scales.to(tl.float32)


# float32 2**23: OR-ing an integer below 2**23 into its mantissa gives 2**23 + that integer, exactly
FLOAT32_MAGIC = tl.constexpr(0x4B000000)


@triton.jit
def awq_load_lanes_raw(
    qweight_ptr,
    qzeros_ptr,
    scales_ptr,
    k_start,
    offs_c,
    cols,
    N,
    num_packed_cols,
    GROUP_SIZE: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_N: tl.constexpr,
):
    """One K block's tensors as stored: packed codes [BLOCK_K, C], packed zeros [C] and
    scales [C, 8] (see awq_load_lanes_raw)."""
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
    return packed, packed_zeros, scales


@triton.jit
def awq_unpack_lanes_f32(packed, packed_zeros, scales):
    """(q - z) as float32 [K, C, 8] and float32 scales [C, 8] from awq_load_lanes_raw's
    tensors, without an integer-to-float conversion: each nibble OR-ed into the mantissa of
    2**23 (FLOAT32_MAGIC) reads as the float 2**23 + q, and subtracting the zero's 2**23 + z
    leaves q - z exactly, in two logic ops and one add. (On an H200 this measured no faster
    than converting: the conversions were not what bounds the kernel; docs/performance.md.)
    """
    shifts = tl.arange(0, 8) * 4
    zeros = (((packed_zeros[:, None] >> shifts[None, :]) & 0xF) | FLOAT32_MAGIC).to(tl.float32, bitcast=True)
    codes = (((packed[:, :, None] >> shifts[None, None, :]) & 0xF) | FLOAT32_MAGIC).to(tl.float32, bitcast=True)
    return codes - zeros[None, :, :], scales.to(tl.float32)  # [K, C, 8], [C, 8]


# What the one-row kernel reads as x (PROLOGUE): x itself; RMSNorm of x (+ residual); or
# silu(gate) * up of a fused gate/up output [2K].
PROLOGUE_NONE, PROLOGUE_RMS_NORM, PROLOGUE_SILU_MUL = 0, 1, 2


@triton.jit
def row_inv_rms(x_ptr, residual_ptr, sum_ptr, K, eps, is_writer, HAS_RESIDUAL: tl.constexpr, ROW_BLOCK: tl.constexpr):
    """1 / rms of the whole row x (+ residual), as kernels/rms_norm.py computes it;
    the program with is_writer set also stores the sum x + residual to sum_ptr."""
    offs = tl.arange(0, ROW_BLOCK)
    mask = offs < K
    row = tl.load(x_ptr + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        row = row + tl.load(residual_ptr + offs, mask=mask, other=0.0)
        if is_writer:
            tl.store(sum_ptr + offs, row, mask=mask)
    return rms_inverse(row.to(tl.float32), K, eps)


@triton.jit
def row_input(
    x_ptr,
    offs_k,
    stride_xk,
    residual_ptr,
    norm_weight_ptr,
    inv_rms,
    K,
    PROLOGUE: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    """x[offs_k] as float32 after the prologue, through the separate kernels' own arithmetic
    (kernels/rms_norm.py, kernels/activation.py) and rounded where they store, so fusing
    changes no bits of x."""
    x = tl.load(x_ptr + offs_k * stride_xk)
    if PROLOGUE == 1:
        if HAS_RESIDUAL:
            x = x + tl.load(residual_ptr + offs_k)
        x = normalize_and_scale(x, inv_rms, tl.load(norm_weight_ptr + offs_k)).to(x.dtype)
    elif PROLOGUE == 2:
        x = silu_mul(x, tl.load(x_ptr + (K + offs_k) * stride_xk)).to(x.dtype)
    return x.to(tl.float32)


@triton.jit
def row_split(
    x_ptr,
    residual_ptr,
    sum_ptr,
    K,
    eps,
    K_BLOCKS_PER_SPLIT,
    NUM_K_BLOCKS,
    PROLOGUE: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    ROW_BLOCK: tl.constexpr,
):
    """What a one-row program needs before its K loop: its split's K blocks [start, end) and,
    with the RMSNorm prologue, 1 / rms of the whole row (every program needs it; it is K * 2
    bytes, read from L2; the first program also stores x + residual), else 1."""
    start = tl.program_id(1) * K_BLOCKS_PER_SPLIT
    end = tl.minimum(start + K_BLOCKS_PER_SPLIT, NUM_K_BLOCKS)
    inv_rms = 1.0
    if PROLOGUE == 1:
        is_writer = (tl.program_id(0) == 0) & (tl.program_id(1) == 0)
        inv_rms = row_inv_rms(x_ptr, residual_ptr, sum_ptr, K, eps, is_writer, HAS_RESIDUAL, ROW_BLOCK)
    return start, end, inv_rms


@triton.jit
def lane_halves(tile, HEAD_DIM: tl.constexpr):
    """A head's [HEAD_DIM / 8, 8] lane tile (column 8c + [0, 2, 4, 6, 1, 3, 5, 7][j] at [c, j])
    as its two halves [HEAD_DIM / 16, 8] each: element [c, j] of the second is column 64 (half
    the head) past element [c, j] of the first, the pair rotate-half RoPE mixes."""
    C: tl.constexpr = HEAD_DIM // 8
    return tl.split(tl.permute(tl.reshape(tile, (2, C // 2, 8)), (1, 2, 0)))


@triton.jit
def rope_kv_store(
    total,
    cols,
    y_ptr,
    head,
    cos_ptr,
    sin_ptr,
    stride_cos,
    positions_ptr,
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
    num_q_heads,
    num_kv_heads,
    code_dim,
    HEAD_DIM: tl.constexpr,
    BITS: tl.constexpr,
    QMAX: tl.constexpr,
    BLOCK_CODE: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
):
    """The fused q/k/v projection's output for one head (total [HEAD_DIM / 8, 8] float32, bias
    added, at columns cols) stored as rotary_write_kv would leave it: rounded to y's dtype,
    q and k heads rotated by the token's position (rotary.py's _rotate_half: the same bits),
    and k and v heads also stored into the KV pages at the token's slot (kv_write's
    _store_row, which reads the row back from y after a barrier: quantize-on-store for INT8
    and INT4 pages, the FP16 copy for window pages)."""
    C: tl.constexpr = HEAD_DIM // 8
    y = total.to(y_ptr.dtype.element_ty)
    if head < num_q_heads + num_kv_heads:
        first, second = lane_halves(y, HEAD_DIM)
        first_cols, _ = lane_halves(cols - head * HEAD_DIM, HEAD_DIM)  # 0..HEAD_DIM/2 - 1
        position = tl.load(positions_ptr).to(tl.int64)
        cos = tl.load(cos_ptr + position * stride_cos + first_cols)
        sin = tl.load(sin_ptr + position * stride_cos + first_cols)
        first, second = _rotate_half(first, second, cos, sin)
        y = tl.reshape(tl.permute(tl.join(first, second), (2, 0, 1)), (C, 8))
    tl.store(y_ptr + cols, y)
    if head >= num_q_heads:
        tl.debug_barrier()  # _store_row reads the row in its own layout: other threads stored it
        row_ptr = y_ptr + head * HEAD_DIM
        kv_head = (head - num_q_heads) % num_kv_heads
        slot = tl.load(slot_ptr).to(tl.int64)
        if head < num_q_heads + num_kv_heads:
            _store_row(
                row_ptr,
                0,
                k_cache_ptr + kv_head * code_dim,
                k_scale_ptr + kv_head,
                k_zero_ptr + kv_head,
                slot,
                num_kv_heads,
                code_dim,
                BITS,
                QMAX,
                1,
                BLOCK_CODE,
            )
            if HAS_WINDOW:
                _store_row(
                    row_ptr,
                    0,
                    window_k_ptr + kv_head * HEAD_DIM,
                    window_k_ptr,
                    window_k_ptr,
                    _window_slot(window_row_ptr, slot, PAGE_SIZE),
                    num_kv_heads,
                    HEAD_DIM,
                    16,
                    0,
                    1,
                    HEAD_DIM,
                )
        else:
            _store_row(
                row_ptr,
                0,
                v_cache_ptr + kv_head * code_dim,
                v_scale_ptr + kv_head,
                v_zero_ptr + kv_head,
                slot,
                num_kv_heads,
                code_dim,
                BITS,
                QMAX,
                1,
                BLOCK_CODE,
            )
            if HAS_WINDOW:
                _store_row(
                    row_ptr,
                    0,
                    window_v_ptr + kv_head * HEAD_DIM,
                    window_v_ptr,
                    window_v_ptr,
                    _window_slot(window_row_ptr, slot, PAGE_SIZE),
                    num_kv_heads,
                    HEAD_DIM,
                    16,
                    0,
                    1,
                    HEAD_DIM,
                )


@triton.jit
def row_finish(
    total,
    cols,
    mask,
    y_ptr,
    bias_ptr,
    N,
    cos_ptr,
    sin_ptr,
    stride_cos,
    positions_ptr,
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
    num_q_heads,
    num_kv_heads,
    code_dim,
    HAS_BIAS: tl.constexpr,
    ROPE_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BITS: tl.constexpr,
    QMAX: tl.constexpr,
    BLOCK_CODE: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
):
    """The one-row kernel's last step for its column block: y = total + bias, or with ROPE_KV
    (one head per column block) rope_kv_store's rotation and KV store as well."""
    if ROPE_KV:
        if HAS_BIAS:
            total += tl.load(bias_ptr + cols).to(tl.float32)
        rope_kv_store(
            total,
            cols,
            y_ptr,
            tl.program_id(0),
            cos_ptr,
            sin_ptr,
            stride_cos,
            positions_ptr,
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
            num_q_heads,
            num_kv_heads,
            code_dim,
            HEAD_DIM,
            BITS,
            QMAX,
            BLOCK_CODE,
            HAS_WINDOW,
            PAGE_SIZE,
        )
    else:
        awq_store_output(total, 0, cols, mask, y_ptr, 0, bias_ptr, N, HAS_BIAS)


@triton.jit
def _awq_gemv_row_kernel(
    x_ptr,
    qweight_ptr,
    qzeros_ptr,
    scales_ptr,
    bias_ptr,
    y_ptr,
    partial_ptr,
    counter_ptr,
    lora_a_ptr,
    lora_bt_ptr,
    lora_rank,
    stride_ar,
    stride_br,
    stride_bn,
    residual_ptr,
    norm_weight_ptr,
    sum_ptr,
    eps,
    lora_t_ptr,
    cos_ptr,
    sin_ptr,
    stride_cos,
    positions_ptr,
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
    num_q_heads,
    num_kv_heads,
    code_dim,
    N,
    K,
    num_packed_cols,
    stride_xk,
    K_BLOCKS_PER_SPLIT,
    NUM_K_BLOCKS,
    GROUP_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_N: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    IS_PARTIAL: tl.constexpr,
    REDUCE_AT_END: tl.constexpr,
    HAS_LORA: tl.constexpr,
    BLOCK_R: tl.constexpr,
    MAGIC_DEQUANT: tl.constexpr,
    PROLOGUE: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    ROW_BLOCK: tl.constexpr,
    LORA_ONCE: tl.constexpr,
    LORA_AT_END: tl.constexpr,
    ROPE_KV: tl.constexpr,
    BITS: tl.constexpr,
    QMAX: tl.constexpr,
    BLOCK_CODE: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    PDL: tl.constexpr,
    PREFETCH_0: tl.constexpr,
    PREFETCH_1: tl.constexpr,
    PREFETCH_2: tl.constexpr,
):
    await_inputs_prefetching(
        qweight_ptr, scales_ptr, qzeros_ptr, K, N, GROUP_SIZE, PDL, PREFETCH_0, PREFETCH_1, PREFETCH_2
    )
    BLOCK_C: tl.constexpr = BLOCK_N // 8
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_c, cols = awq_lane_columns(pid_n, BLOCK_N)  # packed columns [C], output columns [C, 8]
    mask_c = offs_c < num_packed_cols
    kb_start, kb_end, inv_rms = row_split(
        x_ptr, residual_ptr, sum_ptr, K, eps, K_BLOCKS_PER_SPLIT, NUM_K_BLOCKS, PROLOGUE, HAS_RESIDUAL, ROW_BLOCK
    )
    if REDUCE_AT_END:
        acc3 = tl.zeros((BLOCK_K, BLOCK_C, 8), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_C, 8), dtype=tl.float32)
    t = tl.zeros((BLOCK_R,), dtype=tl.float32)  # x A^T (compensation)
    # LORA_AT_END: x A^T's products summed over K once after the loop, not per K block
    if LORA_AT_END:
        t_tile = tl.zeros((BLOCK_K, BLOCK_R), dtype=tl.float32)
    else:
        t_tile = tl.zeros((1, BLOCK_R), dtype=tl.float32)  # not used
    for kb in range(kb_start, kb_end):
        k_start = kb * BLOCK_K
        packed, packed_zeros, group_scales = awq_load_lanes_raw(
            qweight_ptr, qzeros_ptr, scales_ptr, k_start, offs_c, cols, N, num_packed_cols, GROUP_SIZE, BLOCK_K, EVEN_N
        )
        if MAGIC_DEQUANT:
            centered, scales = awq_unpack_lanes_f32(packed, packed_zeros, group_scales)
        else:
            centered, scales = awq_unpack_lanes_int(packed, packed_zeros, group_scales)
            centered = centered.to(tl.float32)
        offs_k = k_start + tl.arange(0, BLOCK_K)
        x = row_input(x_ptr, offs_k, stride_xk, residual_ptr, norm_weight_ptr, inv_rms, K, PROLOGUE, HAS_RESIDUAL)
        if REDUCE_AT_END:
            acc3 += x[:, None, None] * (centered * scales[None, :, :])
        else:
            acc += tl.sum(x[:, None, None] * centered, axis=0) * scales
        if HAS_LORA:
            if LORA_ONCE:
                if pid_n == 0:
                    t, t_tile = lora_row_accumulate(
                        t, t_tile, x, lora_a_ptr, offs_k, lora_rank, stride_ar, BLOCK_R, LORA_AT_END
                    )
            else:
                t, t_tile = lora_row_accumulate(
                    t, t_tile, x, lora_a_ptr, offs_k, lora_rank, stride_ar, BLOCK_R, LORA_AT_END
                )
    if REDUCE_AT_END:
        acc = tl.sum(acc3, axis=0)
    if LORA_AT_END:
        t = tl.sum(t_tile, axis=0)
    flat_cols = tl.reshape(cols, (BLOCK_N,))  # [C, 8] row-major: reshaped back, a term lands on its column
    if LORA_ONCE:
        # only with several splits: the counters come with the split-K reduction
        num_splits = tl.num_programs(1)
        ready_ptr = counter_ptr + tl.num_programs(0)
        if pid_n == 0:
            tl.store(lora_t_ptr + pid_k * BLOCK_R + tl.arange(0, BLOCK_R), t)
            tl.debug_barrier()
            tl.atomic_add(ready_ptr, 1, sem="release")
        is_last, total = split_arrive(acc, 0, cols, mask_c[:, None], partial_ptr, counter_ptr, 1, N)
        if is_last:
            term = lora_once_term(
                flat_cols,
                lora_t_ptr,
                ready_ptr,
                ready_ptr + 1,
                lora_bt_ptr,
                lora_rank,
                N,
                stride_br,
                stride_bn,
                num_splits,
                tl.num_programs(0),
                BLOCK_R,
            )
            total += tl.reshape(term, (BLOCK_C, 8))
            row_finish(
                total,
                cols,
                mask_c[:, None],
                y_ptr,
                bias_ptr,
                N,
                cos_ptr,
                sin_ptr,
                stride_cos,
                positions_ptr,
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
                num_q_heads,
                num_kv_heads,
                code_dim,
                HAS_BIAS,
                ROPE_KV,
                BLOCK_N,
                BITS,
                QMAX,
                BLOCK_CODE,
                HAS_WINDOW,
                PAGE_SIZE,
            )
            tl.store(counter_ptr + pid_n, 0)
    else:
        if HAS_LORA:
            term = lora_row_up(t, lora_bt_ptr, flat_cols, lora_rank, N, stride_br, stride_bn, BLOCK_R)
            acc += tl.reshape(term, (BLOCK_C, 8))
        is_last = True
        if IS_PARTIAL:
            is_last, acc = split_arrive(acc, 0, cols, mask_c[:, None], partial_ptr, counter_ptr, 1, N)
        if is_last:
            row_finish(
                acc,
                cols,
                mask_c[:, None],
                y_ptr,
                bias_ptr,
                N,
                cos_ptr,
                sin_ptr,
                stride_cos,
                positions_ptr,
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
                num_q_heads,
                num_kv_heads,
                code_dim,
                HAS_BIAS,
                ROPE_KV,
                BLOCK_N,
                BITS,
                QMAX,
                BLOCK_CODE,
                HAS_WINDOW,
                PAGE_SIZE,
            )
            if IS_PARTIAL:
                tl.store(counter_ptr + pid_n, 0)


# The K-in-thread form ("unpack": "rows") turns nibbles into floats through inline PTX on
# the GPU (one lop3 each); the interpreter, which runs no PTX, computes the same bits in Triton.
_PTX_NIBBLES = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") != "1")


@triton.jit
def nibble_times_power(packed, J: tl.constexpr):
    """Float32 q_j * 16**p of every AWQ word in `packed` (any shape) for nibble J, in one logic
    op and one add (two more for J >= 5, shared by the three nibbles that shift): nibble J,
    masked in place (J < 5, p = J) or after a 20-bit shift (J >= 5, p = J - 5), is below 2**23,
    so OR-ed into the mantissa of 2**23 (FLOAT32_MAGIC) it reads as 2**23 + q * 16**p."""
    if J >= 5:
        packed = packed >> 20
    MASK: tl.constexpr = 0xF << (4 * (J % 5))
    if _PTX_NIBBLES:
        magic = tl.full(packed.shape, FLOAT32_MAGIC, tl.int32)
        # (a & MASK) | magic: the mask stays an immediate, the magic one register for all nibbles
        bits = tl.inline_asm_elementwise(
            f"lop3.b32 $0, $1, {MASK}, $2, 0xea;", "=r,r,r", [packed, magic], dtype=tl.int32, is_pure=True, pack=1
        )
    else:
        bits = (packed & MASK) | FLOAT32_MAGIC
    return bits.to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def nibble_sums(TILE_ROWS: tl.constexpr, BLOCK_C: tl.constexpr):
    """Eight float32 zero sums [TILE_ROWS, BLOCK_C], one per nibble position of the words."""
    zero = tl.zeros((TILE_ROWS, BLOCK_C), tl.float32)
    return zero, zero, zero, zero, zero, zero, zero, zero


@triton.jit
def rows_group_term(acc, partial, x_sum, zeros_word, scales_ptr, mask, J: tl.constexpr, COLUMN: tl.constexpr):
    """acc + s * (partial - x_sum * z) for nibble J of a group: partial [R, C] are the row
    slots' sums of x * q * 16**p, x_sum [R, 1] the slots' sums of x, zeros_word [1, C] the
    group's packed zeros and scales_ptr [1, C] its scales of column 8c (COLUMN: the nibble's
    column in the word; mask [1, C]: the columns inside N). The factor 16**p is taken out at
    the end."""
    scale = tl.load(scales_ptr + COLUMN, mask=mask, other=0.0).to(tl.float32)
    return acc + scale * (partial - x_sum * nibble_times_power(zeros_word, J))


@triton.jit
def join8(v0, v1, v2, v3, v4, v5, v6, v7):
    """Eight [C] tensors as one [C, 8] (in the order the joins give; build the matching
    column indices with the same call)."""
    low = tl.join(tl.join(v0, v1), tl.join(v2, v3))
    high = tl.join(tl.join(v4, v5), tl.join(v6, v7))
    return tl.reshape(tl.join(low, high), (v0.shape[0], 8))


@triton.jit
def _awq_gemv_rows_kernel(
    x_ptr,
    qweight_ptr,
    qzeros_ptr,
    scales_ptr,
    bias_ptr,
    y_ptr,
    partial_ptr,
    counter_ptr,
    lora_a_ptr,
    lora_bt_ptr,
    lora_rank,
    stride_ar,
    stride_br,
    stride_bn,
    residual_ptr,
    norm_weight_ptr,
    sum_ptr,
    eps,
    N,
    K,
    num_packed_cols,
    stride_xk,
    K_BLOCKS_PER_SPLIT,
    NUM_K_BLOCKS,
    GROUP_SIZE: tl.constexpr,
    BLOCK_C: tl.constexpr,
    TILE_ROWS: tl.constexpr,
    UNROLL: tl.constexpr,
    EVEN_N: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    IS_PARTIAL: tl.constexpr,
    HAS_LORA: tl.constexpr,
    BLOCK_R: tl.constexpr,
    PROLOGUE: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    ROW_BLOCK: tl.constexpr,
    PDL: tl.constexpr,
    PREFETCH_0: tl.constexpr,
    PREFETCH_1: tl.constexpr,
    PREFETCH_2: tl.constexpr,
):
    await_inputs_prefetching(
        qweight_ptr, scales_ptr, qzeros_ptr, K, N, GROUP_SIZE, PDL, PREFETCH_0, PREFETCH_1, PREFETCH_2
    )
    # One row, K summed inside each thread ("unpack": "rows"). A program owns BLOCK_C packed
    # columns (8 * BLOCK_C outputs) and whole groups of K. Each step loads UNROLL tiles of
    # TILE_ROWS rows x BLOCK_C words (each thread a few whole words of one row, 16-byte loads)
    # and adds x * q_j * 16**p into eight per-nibble sums per row slot: no sum across threads
    # until the program's last group. Per group, each slot's sums take the group's scale and
    # zero: s * (sum x q - z sum x). The threads' slots are added once at the end. The
    # compensation's x A^T over the program's K range is summed the same way (products per
    # row slot, one sum at the end), and its term t Bt for the program's columns joins the
    # partial: the split-K sum makes the whole (x A^T) Bt, as in the lane kernel.
    pid_n = tl.program_id(0)
    offs_c = pid_n * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_c = offs_c < num_packed_cols
    offs_r = tl.arange(0, TILE_ROWS)
    g_start, g_end, inv_rms = row_split(
        x_ptr, residual_ptr, sum_ptr, K, eps, K_BLOCKS_PER_SPLIT, NUM_K_BLOCKS, PROLOGUE, HAS_RESIDUAL, ROW_BLOCK
    )
    a0, a1, a2, a3, a4, a5, a6, a7 = nibble_sums(TILE_ROWS, BLOCK_C)  # the program's, per nibble
    t_tile = tl.zeros((TILE_ROWS, BLOCK_R), tl.float32)  # x A^T's products (compensation)
    for g in range(g_start, g_end):
        p0, p1, p2, p3, p4, p5, p6, p7 = nibble_sums(TILE_ROWS, BLOCK_C)  # the group's
        x_sum = tl.zeros((TILE_ROWS, 1), tl.float32)
        for step in range(0, GROUP_SIZE, TILE_ROWS * UNROLL):
            for u in tl.static_range(UNROLL):
                offs_k = g * GROUP_SIZE + step + u * TILE_ROWS + offs_r
                weight_ptrs = qweight_ptr + offs_k[:, None] * num_packed_cols + offs_c[None, :]
                if EVEN_N:
                    packed = tl.load(weight_ptrs)
                else:
                    packed = tl.load(weight_ptrs, mask=mask_c[None, :], other=0)
                x = row_input(
                    x_ptr, offs_k, stride_xk, residual_ptr, norm_weight_ptr, inv_rms, K, PROLOGUE, HAS_RESIDUAL
                )[:, None]
                x_sum += x
                if HAS_LORA:
                    t_tile += x * lora_a_tile(lora_a_ptr, offs_k, lora_rank, stride_ar, BLOCK_R).to(tl.float32)
                p0 += x * nibble_times_power(packed, 0)
                p1 += x * nibble_times_power(packed, 1)
                p2 += x * nibble_times_power(packed, 2)
                p3 += x * nibble_times_power(packed, 3)
                p4 += x * nibble_times_power(packed, 4)
                p5 += x * nibble_times_power(packed, 5)
                p6 += x * nibble_times_power(packed, 6)
                p7 += x * nibble_times_power(packed, 7)
        zeros_word = tl.load(qzeros_ptr + g * num_packed_cols + offs_c, mask=mask_c, other=0)[None, :]
        group_scales = scales_ptr + g * N + offs_c[None, :] * 8
        # nibble j holds column 8c + [0, 2, 4, 6, 1, 3, 5, 7][j] (awq_lane_columns)
        a0 = rows_group_term(a0, p0, x_sum, zeros_word, group_scales, mask_c[None, :], 0, 0)
        a1 = rows_group_term(a1, p1, x_sum, zeros_word, group_scales, mask_c[None, :], 1, 2)
        a2 = rows_group_term(a2, p2, x_sum, zeros_word, group_scales, mask_c[None, :], 2, 4)
        a3 = rows_group_term(a3, p3, x_sum, zeros_word, group_scales, mask_c[None, :], 3, 6)
        a4 = rows_group_term(a4, p4, x_sum, zeros_word, group_scales, mask_c[None, :], 4, 1)
        a5 = rows_group_term(a5, p5, x_sum, zeros_word, group_scales, mask_c[None, :], 5, 3)
        a6 = rows_group_term(a6, p6, x_sum, zeros_word, group_scales, mask_c[None, :], 6, 5)
        a7 = rows_group_term(a7, p7, x_sum, zeros_word, group_scales, mask_c[None, :], 7, 7)
    # 16**-p is exact: the sums' only rounding is float32's, as in the other forms
    y0, y1, y2, y3 = tl.sum(a0, 0), tl.sum(a1, 0) * (1 / 16), tl.sum(a2, 0) * (1 / 256), tl.sum(a3, 0) * (1 / 4096)
    y4, y5, y6, y7 = tl.sum(a4, 0) * (1 / 65536), tl.sum(a5, 0), tl.sum(a6, 0) * (1 / 16), tl.sum(a7, 0) * (1 / 256)
    base = offs_c * 8
    if HAS_LORA:
        t = tl.sum(t_tile, 0)
        y0 += lora_row_up(t, lora_bt_ptr, base, lora_rank, N, stride_br, stride_bn, BLOCK_R)
        y1 += lora_row_up(t, lora_bt_ptr, base + 2, lora_rank, N, stride_br, stride_bn, BLOCK_R)
        y2 += lora_row_up(t, lora_bt_ptr, base + 4, lora_rank, N, stride_br, stride_bn, BLOCK_R)
        y3 += lora_row_up(t, lora_bt_ptr, base + 6, lora_rank, N, stride_br, stride_bn, BLOCK_R)
        y4 += lora_row_up(t, lora_bt_ptr, base + 1, lora_rank, N, stride_br, stride_bn, BLOCK_R)
        y5 += lora_row_up(t, lora_bt_ptr, base + 3, lora_rank, N, stride_br, stride_bn, BLOCK_R)
        y6 += lora_row_up(t, lora_bt_ptr, base + 5, lora_rank, N, stride_br, stride_bn, BLOCK_R)
        y7 += lora_row_up(t, lora_bt_ptr, base + 7, lora_rank, N, stride_br, stride_bn, BLOCK_R)
    acc = join8(y0, y1, y2, y3, y4, y5, y6, y7)
    cols = join8(base, base + 2, base + 4, base + 6, base + 1, base + 3, base + 5, base + 7)
    awq_gemv_store(acc, 0, cols, cols < N, y_ptr, 0, bias_ptr, partial_ptr, counter_ptr, 1, N, HAS_BIAS, IS_PARTIAL)


def choose_gemv_config(
    num_rows: int, num_outputs: int, num_inputs: int, group_size: int, num_sms: int, block_n: int = 64
) -> dict:
    """Block sizes and split-K for the decode kernel.

    Aims for about two programs per SM: the small projections (N = 256 or 1536) have too few
    column blocks to fill a large GPU on their own. One row uses the lane form with 64-column
    blocks and at least four K splits; long inputs (32 K blocks or more) aim for four programs
    per SM and reduce every K block, as wide outputs do; the others reduce at the end. The
    compensation's x A^T is computed once per launch for those two: for the short, narrow
    projections (q/k/v, o) waiting for the shares costs more than recomputing them, and they
    sum its products once after the K loop ("lora_reduce": "end", 0.5 us less each). All of
    this is the best of a sweep on an H200 with the weights read from memory, for every
    projection of the 1.5B shape (profile_decode.py --sweep-gemv-only; docs/performance.md).
    `block_n` changes one row's column blocks (RoPE and the KV store take one head per block).
    """
    block_k = min(group_size, 128)
    num_k_blocks = num_inputs // block_k
    if num_rows == 1:
        num_n_blocks = triton.cdiv(num_outputs, block_n)
        is_long = num_k_blocks >= 32
        programs_per_sm = 4 if is_long else 2
        split_k = max(1, min(num_k_blocks, max(4, triton.cdiv(programs_per_sm * num_sms, num_n_blocks))))
        is_wide = num_outputs > 4096
        return {
            "block_n": block_n,
            "block_k": block_k,
            "split_k": split_k,
            "num_warps": 4,
            "unpack": "lanes",
            "reduce": "block" if is_wide or is_long else "end",
            **({"lora": "once"} if is_wide or is_long else {"lora": "per_block", "lora_reduce": "end"}),
        }
    block_n = 64 if num_outputs <= 2048 else 128
    num_n_blocks = triton.cdiv(num_outputs, block_n)
    split_k = max(1, min(num_k_blocks, triton.cdiv(2 * num_sms, num_n_blocks)))
    return {"block_n": block_n, "block_k": block_k, "split_k": split_k, "num_warps": 4}


def choose_rows_config(
    num_outputs: int, num_inputs: int, group_size: int, num_sms: int, programs_per_sm: int = 8
) -> dict:
    """The K-in-thread form's configuration for one row: 128-column blocks of 16-row tiles
    loaded two at a time over two warps (each thread four words of a row per load), K split
    into whole groups for about `programs_per_sm` programs per SM. The best of the sweep on
    an H200 for gate/up (profile_decode.py --sweep-gemv-only --sweep-forms rows;
    docs/performance.md)."""
    num_groups = num_inputs // group_size
    num_n_blocks = triton.cdiv(num_outputs, 128)
    split_k = max(1, min(num_groups, triton.cdiv(programs_per_sm * num_sms, num_n_blocks)))
    tile_rows, unroll = (16, 2) if group_size % 32 == 0 else (16, 1)
    return {
        "block_n": 128,
        "block_k": group_size,
        "split_k": split_k,
        "num_warps": 2,
        "unpack": "rows",
        "tile_rows": tile_rows,
        "unroll": unroll,
    }


# Outputs above which one row without compensation takes the K-in-thread form: on an H200 it
# beat the lane kernel on gate/up (N = 17,920) and lost on q/k/v, o and down (N <= 2,048).
ROWS_FORM_MIN_OUTPUTS = 4096


def decode_gemv_config(
    num_rows: int, num_outputs: int, num_inputs: int, group_size: int, num_sms: int, has_lora: bool
) -> dict:
    """The decode kernel's configuration for a layer: for one row, the K-in-thread form for a
    wide layer without compensation where its whole-group steps fit the group size; else
    choose_gemv_config."""
    if num_rows == 1 and not has_lora and num_outputs > ROWS_FORM_MIN_OUTPUTS and group_size % 16 == 0:
        return choose_rows_config(num_outputs, num_inputs, group_size, num_sms)
    return choose_gemv_config(num_rows, num_outputs, num_inputs, group_size, num_sms)


def invariant_gemv_config(num_outputs: int, num_inputs: int, group_size: int, num_sms: int) -> dict:
    """One configuration for every row count: the batch-invariant form.

    Each output row's sum then runs in the same order however many rows come with it: the
    same K blocks, split the same way, summed in split order, through tl.dot on 16-row tiles
    (a row's products do not depend on the other rows of its tile). Decode steps of one
    request or of eight, and prefill chunks of any length, give a row the same bits. The
    tiling is the multi-row decode one, sized from N and K only.
    """
    config = choose_gemv_config(DOT_MIN_M, num_outputs, num_inputs, group_size, num_sms)
    return {**config, "block_m": DOT_MIN_M}


def lora_block_r(rank: int) -> int:
    """The padded rank the kernels work in: a power of two, at least tl.dot's 16."""
    return max(DOT_MIN_M, triton.next_power_of_2(rank))


def launch_awq_gemv(
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
    is_gated: bool = False,
    rope_kv=None,
):
    """Run the decode kernel into y [M, N]; inputs already checked by the caller.

    x: [M, K] (M <= 16, or any M with invariant_gemv_config; any strides); qweight/qzeros/scales
    contiguous; y: [M, N] with unit column stride. `config` comes from choose_gemv_config,
    invariant_gemv_config or a benchmark sweep (which may add "num_stages"). lora_a [R, K]
    (unit stride along K) and lora_bt [R, N] (any strides; contiguous reads fastest), both or
    neither, add (x A^T) Bt in the same launch. With one row and the lane form, `norm` fuses an
    RMSNorm before the matmul (w4a16.InputNorm), and `is_gated` reads x as a fused gate/up output
    [1, 2K] and multiplies W by silu(gate) * up: one launch instead of two, whose gap inside a
    CUDA graph costs more than the norm or activation itself. `rope_kv` (w4a16.RopeKVWrite), for
    a fused q/k/v projection of one token in the lane form, finishes each head as
    rotary_write_kv would: q and k rotated in y, k and v stored into the KV pages (one column
    block per head, so block_n becomes the head size).
    """
    num_rows = x.shape[0]
    num_inputs = qweight.shape[0]
    num_outputs = y.shape[1]
    if rope_kv is not None:
        if config.get("unpack") != "lanes" or num_rows != 1:
            raise ValueError("RoPE and the KV store run in the one-row lane kernel only")
        config = {**config, "block_n": rope_kv.pages.head_dim}
    block_n, block_k = config["block_n"], config["block_k"]
    if group_size % block_k != 0 or block_n % 8 != 0:
        raise ValueError(
            f"block_k {block_k} must divide group size {group_size} and block_n {block_n} must be a multiple of 8"
        )
    is_row_tiled = config.get("block_m") == DOT_MIN_M  # invariant_gemv_config: any number of rows
    if num_rows > DOT_MIN_M and not is_row_tiled:
        raise ValueError(f"the decode kernel takes at most {DOT_MIN_M} rows, got {num_rows}")
    num_k_blocks = num_inputs // block_k
    k_blocks_per_split = triton.cdiv(num_k_blocks, max(1, min(config["split_k"], num_k_blocks)))
    split_k = triton.cdiv(num_k_blocks, k_blocks_per_split)
    block_m = 1 if num_rows == 1 and not is_row_tiled else DOT_MIN_M
    num_row_tiles = triton.cdiv(num_rows, DOT_MIN_M)
    is_partial = split_k > 1
    has_bias = bias is not None
    num_column_blocks = triton.cdiv(num_outputs, block_n)
    has_lora = lora_a is not None
    # x A^T once per launch rather than once per column block (see lora_once_term)
    is_lora_once = has_lora and is_partial and config.get("lora", "once") == "once"
    if is_partial:
        # partials: [SPLIT_K, M, N] float32, from the graph pool under capture
        partials = x.new_empty((split_k, num_rows, num_outputs), dtype=torch.float32)
        # with is_lora_once, two more past the column blocks' counters: shares ready, blocks done
        counters = SPLIT_COUNTERS.get(y.device, num_column_blocks * num_row_tiles + 2)
    else:
        partials = counters = y  # not read
    outputs = (bias if has_bias else scales, y, partials, counters)
    if has_lora:
        rank = lora_a.shape[0]
        lora = (lora_a, lora_bt, rank, lora_a.stride(0), lora_bt.stride(0), lora_bt.stride(1))
    else:
        rank = 0
        lora = (scales, scales, 0, 0, 0, 0)  # not read
    lora_flags = {"HAS_LORA": has_lora, "BLOCK_R": lora_block_r(rank)}
    grid = (num_column_blocks, split_k, num_row_tiles)
    launch_options = {"num_warps": config["num_warps"]}
    if "num_stages" in config:
        launch_options["num_stages"] = config["num_stages"]
    # on sm_90+: start while the kernel before runs, the weights on their way into L2 (kernels/pdl.py)
    launch_options.update(launch_prefetch(x.device, (qweight, scales, qzeros), math.prod(grid)))
    is_lanes = config.get("unpack") == "lanes" and not is_row_tiled
    if is_lanes and num_rows > 1:
        raise ValueError('the lane form ("unpack": "lanes") runs one row; several take the interleaving kernel')
    is_rows = config.get("unpack") == "rows" and num_rows == 1 and not is_row_tiled
    if is_rows and block_k != group_size:
        raise ValueError('the K-in-thread form ("unpack": "rows") takes whole groups (block_k = group size)')
    has_prologue = norm is not None or is_gated
    if has_prologue and not (is_lanes or is_rows):  # both run one row only (checked above)
        raise ValueError("the norm and gate prologues run in the one-row kernels only")
    if norm is not None:
        prologue, has_residual = PROLOGUE_RMS_NORM, norm.residual is not None
        residual = norm.residual if has_residual else x
        fused = (residual, norm.weight, norm.sum_out if has_residual else x, norm.eps)
    else:
        prologue, has_residual = PROLOGUE_SILU_MUL if is_gated else PROLOGUE_NONE, False
        fused = (x, x, x, 0.0)  # not read
    row_block = triton.next_power_of_2(num_inputs) if norm is not None else 16
    if is_rows:
        _awq_gemv_rows_kernel[grid](
            x,
            qweight,
            qzeros,
            scales,
            *outputs,
            *lora,
            *fused,
            num_outputs,
            num_inputs,
            num_outputs // 8,
            x.stride(1),
            k_blocks_per_split,
            num_k_blocks,
            GROUP_SIZE=group_size,
            BLOCK_C=block_n // 8,
            TILE_ROWS=config["tile_rows"],
            UNROLL=config["unroll"],
            EVEN_N=num_outputs % block_n == 0,
            HAS_BIAS=has_bias,
            IS_PARTIAL=is_partial,
            PROLOGUE=prologue,
            HAS_RESIDUAL=has_residual,
            ROW_BLOCK=row_block,
            **lora_flags,
            **launch_options,
        )
    elif is_lanes:
        # x A^T shares: [SPLIT_K, BLOCK_R] float32
        lora_t = x.new_empty((split_k, lora_flags["BLOCK_R"]), dtype=torch.float32) if is_lora_once else partials
        if rope_kv is not None:
            pages = rope_kv.pages
            rope = (
                rope_kv.cos,
                rope_kv.sin,
                rope_kv.cos.stride(0),
                rope_kv.positions,
                rope_kv.slot_mapping,
                *kv_write._cache_pointers(pages),
                rope_kv.num_heads,
                pages.num_kv_heads,
                pages.k.shape[3],
            )
            stores = kv_write._store_constants(pages)
            store_flags = {
                "BITS": stores["BITS"],
                "QMAX": stores["QMAX"],
                "BLOCK_CODE": stores["BLOCK_C"],
                "HAS_WINDOW": stores["HAS_WINDOW"],
                "PAGE_SIZE": stores["PAGE_SIZE"],
            }
        else:
            rope = (scales, scales, 0, scales, scales, *(scales,) * 9, 0, 0, 0)  # not read
            store_flags = {"BITS": 16, "QMAX": 0, "BLOCK_CODE": 16, "HAS_WINDOW": False, "PAGE_SIZE": 16}
        _awq_gemv_row_kernel[grid](
            x,
            qweight,
            qzeros,
            scales,
            *outputs,
            *lora,
            *fused,
            lora_t,
            *rope,
            num_outputs,
            num_inputs,
            num_outputs // 8,
            x.stride(1),
            k_blocks_per_split,
            num_k_blocks,
            GROUP_SIZE=group_size,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
            EVEN_N=num_outputs % block_n == 0,
            HAS_BIAS=has_bias,
            IS_PARTIAL=is_partial,
            REDUCE_AT_END=config.get("reduce") == "end",
            MAGIC_DEQUANT=config.get("dequant", "magic") == "magic",
            PROLOGUE=prologue,
            HAS_RESIDUAL=has_residual,
            ROW_BLOCK=row_block,
            LORA_ONCE=is_lora_once,
            LORA_AT_END=has_lora and config.get("lora_reduce", "block") == "end",
            ROPE_KV=rope_kv is not None,
            **store_flags,
            **lora_flags,
            **launch_options,
        )
    else:
        _awq_gemv_kernel[grid](
            x,
            qweight,
            qzeros,
            scales,
            *outputs,
            *lora,
            num_rows,
            num_outputs,
            num_inputs,
            num_outputs // 8,
            x.stride(0),
            x.stride(1),
            y.stride(0),
            k_blocks_per_split,
            GROUP_SIZE=group_size,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
            EVEN_N=num_outputs % block_n == 0,
            HAS_BIAS=has_bias,
            IS_PARTIAL=is_partial,
            **lora_flags,
            **launch_options,
        )
    return y
