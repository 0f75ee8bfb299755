"""W4A16 launchers and the tiled kernels: y[M, N] = x[M, K] @ W[K, N] (+ bias + (x A^T) Bt), W in AWQ GEMM form.

`_tiled_kernel` runs tl.dot tiles of 16 rows or more: decode of 2-16 rows, the prefill GEMM, the
batch-invariant form and, over dense weights, `linear_invariant`; the one-row kernels are in
w4a16_row; `_dequant_kernel` writes W in float16 for dequantize-then-cuBLAS. Each K block lies
in one quantization group, so the scale is applied after the reduction: s sum_k x (q - z). The
integers q - z are exact, so W is never rounded; only the float32 sums round. Compensation
(rank R padded to BLOCK_R) rides along: each split adds t_s Bt, t_s = x A[:, its K range]^T.
"""

import torch
import triton
import triton.language as tl

from lowvram.kernels import kv_write
from lowvram.kernels.arrival_counters import ArrivalCounters
from lowvram.kernels.w4a16_row import (
    _row_kernel,
    _wide_row_kernel,
    lora_a_tile,
    lora_bt_tile,
    split_arrive,
    store_output,
)

DOT_MIN_M = 16  # tl.dot needs at least 16 rows
MAX_DECODE_M = 16
# Rows per batch-invariant launch: bounds the split-K partials [SPLIT_K, rows, N] of long chunks.
INVARIANT_MAX_ROWS = 64
# One counter per column block and row tile
SPLIT_COUNTERS = ArrivalCounters("the decode GEMV's split-K", 4096)
# What the one-row kernel reads as x: x, RMSNorm of x (+ residual), or silu(gate) * up of x [2K].
PROLOGUE_NONE, PROLOGUE_RMS_NORM, PROLOGUE_SILU_MUL = 0, 1, 2


@triton.jit
def awq_unpack(packed, shifts):
    """[R, C/8] packed int32 -> [R, C] nibbles in column order (`shifts` [1, C] picks each column's)."""
    wide = tl.interleave(packed, packed)
    wide = tl.interleave(wide, wide)
    wide = tl.interleave(wide, wide)
    return (wide >> shifts) & 0xF


@triton.jit
def awq_load_block(awq, k_start, pid_n, N, num_packed_cols, GROUP_SIZE, BLOCK_K, BLOCK_N, EVEN_N: tl.constexpr):
    """One K block (in one group) of column block pid_n: (q - z) int32 [BLOCK_K, BLOCK_N] and float32
    scales [BLOCK_N]. num_packed_cols (N / 8) is an argument so Triton specialises its divisibility."""
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
    # Grid (row tiles, column blocks, K splits): row tiles go fastest, so programs sharing a weight
    # tile read it from DRAM once. `weight`: AWQ (qweight, qzeros, scales), or IS_DENSE (w [N, K],
    # stride_wn, stride_wk).
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


def lora_block_r(rank: int) -> int:
    return max(DOT_MIN_M, triton.next_power_of_2(rank))


# Outputs above which a row without compensation takes the K-in-thread kernel (faster on gate/up only).
WIDE_ROW_MIN_OUTPUTS = 4096


def row_config(
    num_outputs: int, num_inputs: int, group_size: int, num_sms: int, has_lora: bool, block_n: int = 64
) -> dict:
    """The one-row tiling. Wide layers without compensation: _wide_row_kernel, 128-column blocks,
    2 warps, whole groups split for ~8 programs per SM. Else the lane kernel: 64-column blocks (or
    one head with RoPE), at least 4 K splits for ~2 programs per SM (4 for 32+ K blocks). Short,
    narrow projections sum over K after the loop (REDUCE_AT_END) and recompute x A^T per program.
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
    """The tiled kernel's tiling: up to MAX_DECODE_M rows (and batch-invariant), a 16-row tile split
    over K for ~2 programs per SM; more rows, 32- or 64-row tiles without a split."""
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
    partials = x.new_empty((split_k, *y.shape), dtype=torch.float32)
    return split_k, per_split, (partials, SPLIT_COUNTERS.get(y.device, num_counters))


def launch_tiled(x, weight, bias, y, config, lora_a=None, lora_bt=None):
    """Run the tiled kernel into y [M, N] (unit column stride); inputs checked by the caller.
    x [M, K], any strides; `weight` (qweight, qzeros, scales, group_size) or a float W [N, K];
    `config` from tiled_config; lora_a [R, K] and lora_bt [R, N] add (x A^T) Bt (AWQ only)."""
    num_rows, num_inputs = x.shape
    num_outputs = y.shape[1]
    block_m, block_n, block_k = config["block_m"], config["block_n"], config["block_k"]
    is_dense = isinstance(weight, torch.Tensor)
    if is_dense:
        group_size, weight_args = block_k, (weight, weight.stride(0), weight.stride(1))
    else:
        *weight_args, group_size = weight
        if group_size % block_k or block_n % 8 or num_inputs % block_k:
            raise ValueError(f"tiles {config} do not fit group size {group_size}")
    num_column_blocks, num_row_tiles = triton.cdiv(num_outputs, block_n), triton.cdiv(num_rows, block_m)
    split_k, per_split, split = _splits(
        x, y, triton.cdiv(num_inputs, block_k), config, num_column_blocks * num_row_tiles
    )
    has_lora = lora_a is not None
    lora = (lora_a, lora_bt, lora_a, lora_a.shape[0], lora_a.stride(0), *lora_bt.stride()) if has_lora else ()
    args = (x, tuple(weight_args), bias if bias is not None else y, y, split, lora)
    sizes = (num_rows, num_outputs, num_inputs, num_outputs // 8, (x.stride(0), x.stride(1), y.stride(0)), per_split)
    _tiled_kernel[(num_row_tiles, num_column_blocks, split_k)](
        *args,
        *sizes,
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
    """Run the one-row kernel into y [1, N]; inputs checked by the caller. x [1, K] contiguous,
    `config` from row_config, lora_a and lora_bt as for launch_tiled. `norm` (w4a16.InputNorm)
    fuses an RMSNorm before the matmul and `is_gated` silu(gate) * up of x [1, 2K]; `rope_kv`
    (w4a16.RopeKVWrite) finishes a fused q/k/v projection as rotary_write_kv would, a head per
    column block.
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
    is_k_in_thread = config.get("k_in_thread")
    if is_k_in_thread and (lora_a is not None or rope_kv is not None or block_k != group_size):
        raise ValueError("the K-in-thread kernel takes whole groups, without compensation or RoPE")
    num_column_blocks = triton.cdiv(num_outputs, block_n)
    # with LORA_ONCE, two counters past the column blocks': shares ready, blocks done
    num_counters = num_column_blocks + (0 if is_k_in_thread else 2)
    split_k, per_split, split = _splits(x, y, num_inputs // block_k, config, num_counters)
    has_residual = norm is not None and norm.residual is not None
    norm_args = ()
    if norm is not None:
        norm_args = (
            (norm.residual, norm.weight, norm.sum_out, norm.eps) if has_residual else (x, norm.weight, x, norm.eps)
        )
    args = (x, (qweight, qzeros, scales), bias if bias is not None else y, y, split)
    sizes = (num_outputs, num_inputs, num_outputs // 8, per_split)
    options = {
        "GROUP_SIZE": group_size,
        "EVEN_N": num_outputs % block_n == 0,
        "HAS_BIAS": bias is not None,
        "IS_PARTIAL": split_k > 1,
        "PROLOGUE": PROLOGUE_RMS_NORM if norm is not None else PROLOGUE_SILU_MUL if is_gated else PROLOGUE_NONE,
        "HAS_RESIDUAL": has_residual,
        "ROW_BLOCK": triton.next_power_of_2(num_inputs) if norm is not None else 16,
        "num_warps": config["num_warps"],
    }
    if is_k_in_thread:
        # UNROLL: groups are multiples of 32 rows
        _wide_row_kernel[(num_column_blocks, split_k)](
            *args, norm_args, *sizes, BLOCK_C=block_n // 8, TILE_ROWS=16, UNROLL=2, **options
        )
        return y
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
        k, v, k_scale, k_zero, v_scale, v_zero, window_k, window_v, window_row = pages.kernel_tensors()
        positions = (rope_kv.positions, rope_kv.slot_mapping, rope_kv.num_heads, pages.num_kv_heads, k.shape[3])
        k_pages, v_pages = (k, k_scale, k_zero, window_k, window_row), (v, v_scale, v_zero, window_v, window_row)
        rope = (rope_kv.cos, rope_kv.sin, rope_kv.cos.stride(0), *positions, k_pages, v_pages)
        constants = kv_write._store_constants(pages)
        store = tuple(constants[name] for name in ("BITS", "QMAX", "BLOCK_C", "HAS_WINDOW", "PAGE_SIZE"))
    _row_kernel[(num_column_blocks, split_k)](
        *args,
        lora,
        norm_args,
        rope,
        *sizes,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        REDUCE_AT_END=config["reduce_at_end"],
        HAS_LORA=has_lora,
        LORA_ONCE=is_lora_once,
        BLOCK_R=block_r,
        ROPE_KV=rope_kv is not None,
        STORE=store,
        **options,
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
