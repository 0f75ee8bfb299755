"""W4A16 Triton kernels for one row (batch-1 decode), and the split-K helpers shared with the tiled kernel.

A program owns a column block and a range of K blocks; with several splits each writes float32
partials [SPLIT_K, M, N] and the last to count in adds them in split order (run-to-run identical),
adds the bias and casts, with no second launch.
"""

import triton
import triton.language as tl

from lowvram.kernels.activation import silu_mul
from lowvram.kernels.kv_write import _store_row, _window_slot
from lowvram.kernels.rms_norm import normalize_and_scale, rms_inverse
from lowvram.kernels.rotary import _rotate_half

# float32 2**23: OR-ing an integer below 2**23 into its mantissa gives 2**23 + that integer, exactly
FLOAT32_MAGIC = tl.constexpr(0x4B000000)


@triton.jit
def split_arrive(acc, offsets, mask, partial_ptr, counter_ptr, split, num_splits, slice_size):
    """Store this split's partial (at `offsets` of a [M, N] slice of partials [SPLIT_K, M, N]),
    count in: (whether this program came last, the sum of all partials in split order, else 0).

    The barrier puts every thread's stores before the acq_rel count, which publishes them; the last
    program reads them from L2 (".cg": L1 is not coherent across SMs). Its caller resets the counter.
    """
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
def awq_load_lanes(awq, k_start, offs_c, cols, N, num_packed_cols, GROUP_SIZE, BLOCK_K, EVEN_N: tl.constexpr):
    """One K block as (q - z) float32 [BLOCK_K, C, 8] and scales [C, 8]; nibble j of packed column
    c is output column cols[c, j]. Each nibble OR-ed into FLOAT32_MAGIC reads as 2**23 + q, so one
    subtraction of the zero's 2**23 + z leaves q - z exactly, with no int-to-float conversion."""
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
    """x[offs_k] in float32 after the prologue (1: RMSNorm, 2: silu(gate) * up), computed and
    rounded as rms_norm.py and activation.py do, so fusing changes no bits."""
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
    """With the RMSNorm prologue, 1 / rms of the whole row (every program reads it from L2; the
    first also stores x + residual); else 1."""
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
    """A head's lane tile [HEAD_DIM / 8, 8] as its two halves [HEAD_DIM / 16, 8]: the pairs
    rotate-half RoPE mixes."""
    return tl.split(tl.permute(tl.reshape(tile, (2, HEAD_DIM // 16, 8)), (1, 2, 0)))


@triton.jit
def rope_kv_store(total, cols, y_ptr, head, rope, HEAD_DIM: tl.constexpr, STORE: tl.constexpr):
    """One head of a fused q/k/v output (total [HEAD_DIM / 8, 8] float32, bias added) left as
    rotary_write_kv leaves it, with the same helpers: rounded to y's dtype, q and k rotated,
    k and v also stored into the KV pages (and the FP16 window) at the token's slot."""
    cos_ptr, sin_ptr, stride_cos, positions_ptr, slot_ptr, num_q_heads, num_kv_heads, code_dim, k_pages, v_pages = rope
    BITS: tl.constexpr = STORE[0]  # kv_write._store_constants of the pages
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
        if is_k:  # (codes, scales, zeros, FP16 window, window rows)
            cache_ptr, scale_ptr, zero_ptr, window_ptr, window_row_ptr = k_pages
        else:
            cache_ptr, scale_ptr, zero_ptr, window_ptr, window_row_ptr = v_pages
        dst = (cache_ptr + kv_head * code_dim, scale_ptr + kv_head, zero_ptr + kv_head)
        _store_row(row_ptr, 0, dst, slot, num_kv_heads, code_dim, BITS, QMAX, 1, BLOCK_CODE)
        if HAS_WINDOW:
            window_slot = _window_slot(window_row_ptr, slot, PAGE_SIZE)
            _store_row(
                row_ptr, 0, (window_ptr + kv_head * HEAD_DIM,), window_slot, num_kv_heads, HEAD_DIM, 16, 0, 1, HEAD_DIM
            )


@triton.jit
def lora_once_term(lora, cols, ready_ptr, N, num_splits, num_column_blocks, BLOCK_R: tl.constexpr):
    """(x A^T) Bt[:, cols] float32 [BLOCK_N] in a column block's last program (LORA_ONCE), from the
    shares t_s that programs (0, s) stored before counting in on ready_ptr, added in split order.
    The wait ends: (0, s) precedes (n, s) in launch order and this program came last in its block.
    The last waiter to count in on ready_ptr + 1 resets both counters."""
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
    # A program owns BLOCK_N columns as [C, 8] lanes and a range of K blocks. REDUCE_AT_END keeps
    # [BLOCK_K, C, 8] products and sums over K once after the loop (faster for short K); else each
    # K block is summed and scaled. With LORA_ONCE only column block 0 computes x A^T (its shares
    # added by lora_once_term); else each program adds its own t_s Bt to its partial.
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
    """Float32 q * 16**p of nibble J of each word: masked in place (J < 5, p = J) or after a 20-bit
    shift (J >= 5, p = J - 5) it stays below 2**23, so OR-ed into FLOAT32_MAGIC it reads as
    2**23 + q * 16**p."""
    if J >= 5:
        packed = packed >> 20
    MASK: tl.constexpr = 0xF << (4 * (J % 5))
    return ((packed & MASK) | FLOAT32_MAGIC).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def group_term(acc, sums, x_sum, zeros_word, scales_ptr, mask, J: tl.constexpr, COLUMN: tl.constexpr):
    """acc + s * (sums - x_sum * z) for nibble J (column COLUMN of the word) of a group: sums [R, C]
    of x * q * 16**p, x_sum [R, 1], zeros_word [1, C] the packed zeros, scales_ptr [1, C] column 8c's."""
    scale = tl.load(scales_ptr + COLUMN, mask=mask, other=0.0).to(tl.float32)
    return acc + scale * (sums - x_sum * nibble_times_power(zeros_word, J))


@triton.jit
def join8(v0, v1, v2, v3, v4, v5, v6, v7):
    """Eight [C] tensors as one [C, 8]."""
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
    # One row of a wide layer without compensation, K summed inside each thread: a program owns
    # BLOCK_C packed columns and whole groups; each step adds x * q * 16**p of UNROLL tiles of
    # TILE_ROWS x BLOCK_C words into eight per-nibble sums per row slot (16**-p taken out at the
    # end, exactly), and each group's sums take its scale and zero: s * (sum x q - z sum x).
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
