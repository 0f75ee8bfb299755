"""Attention over paged K/V caches (FP16, INT8 and INT4 pages): decode and prefill.

Decode (one new token per sequence) is memory bound: each program owns one sequence, one KV
head and one partition of the context, and processes all the query heads of that KV head's
group together (GQA), so every K/V byte is read once. The token tile is the dots' first
operand (scores as K q^T, [tokens, group]), so a group of up to 8 heads is one 8-wide
tensor-core tile rather than rows padded to 16. Long contexts are split into partitions that
run in parallel (flash-decoding), enough to fill the GPU, and a merge kernel adds the partial
results through their log-sum-exps.

Prefill (a batch of new tokens, possibly after a cached prefix) is compute bound and follows
flash-attention 2: one program per (query tile, sequence, query head), online softmax over K/V
tiles up to the causal limit. Query and K/V tiles sit at absolute positions, so a prompt token
meets the same tiles, bit for bit, whatever chunk of the prompt and whatever batch it comes in
(the batch-invariant mode sends its decode rows here too).

Both kernels gather K/V through the block table one token row at a time
(`block_table[seq, p // B] * B + p % B`) and accumulate in float32; scores use exp2 with the
softmax scale folded into log2(e). INT8/INT4 codes go into the dots as they are and each
token's scale and zero are applied to the dots' results: `q . k_j = s_j (q . c_j) - s_j z_j
sum(q)` for K and `sum_j p_j v_j = sum_j (p_j s_j) c_j - sum_j p_j s_j z_j` for V, which is
faster than dequantizing every element. A code becomes a float16 without an int-to-float
instruction (a quarter of the float rate): its bits alone are the subnormal code * 2**-24,
exact, and the token's scale carries the 2**24 back. Quantized heads are read as 16-bit words
split into planes so that no code moves between columns: INT8's low and high bytes (elements
2i and 2i + 1) and INT4's four nibbles (elements 4i to 4i + 3). Tokens of pages kept in FP16
beside the codes (`KVPages.window_row`, see `lowvram.kernels.kv_quant`) are read from the FP16
copy with scale 1 and zero 0; the decode kernel reads them in a pass of its own after its
main loop, so that the main loop keeps the registers of pages without a window.

The public wrappers check shapes, dtypes and strides, then run the Triton kernel on CUDA
tensors (or on CPU tensors when TRITON_INTERPRET=1) and the float32 plain-torch reference
(`*_ref`) otherwise.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass, replace

import torch

from lowvram.errors import KernelError
from lowvram.kernels.dispatch import num_sms, use_triton
from lowvram.kernels.kv_quant import KVPages, gather_kv

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # Windows and macOS wheels of torch ship without Triton
    HAS_TRITON = False


# Set to True to run the plain-torch references everywhere (debugging, A/B checks).
FORCE_REFERENCE = False

# Decode partitions shorter than this cost more in the merge than they win in parallelism.
MIN_PARTITION_TOKENS = 128
TARGET_WAVES = 4
# The decode kernel's query rows per program at the least: one 8-wide tensor-core tile.
DECODE_MIN_GROUP = 8
# Tokens per decode tile by page bits, heads up to 128 wide, on GPUs with cp.async.
ASYNC_DECODE_TILE_TOKENS = {16: 32, 8: 64, 4: 128}
# The merge kernel adds partials in lanes (one load brings a partial for each lane): a program
# per MERGE_SLICE_D columns with MERGE_KERNEL_LANES lanes, or up to WHOLE_HEAD_MERGE_SPLITS
# partitions a whole head per program (a quarter of the programs, a shorter tree of lanes).
MERGE_SLICE_D = 32
MERGE_KERNEL_LANES = 128
WHOLE_HEAD_MERGE_SPLITS = 64
_LOG2_E = 1.4426950408889634


@dataclass(frozen=True)
class DecodeConfig:
    """Tuning of the decode kernel; benchmarks sweep it through `paged_decode_attention(_config=)`.

    block_n: tokens per K/V tile, a power of two >= 16 (partitions are whole tiles).
    num_warps, num_stages: Triton's launch options (stages of the tile loads' pipeline).
    """

    block_n: int
    num_warps: int
    num_stages: int


# decode_config's choice for grids of no more programs than SMs: 128-token tiles over 4 warps
# issue a partition's loads at once.
LATENCY_DECODE_CONFIG = DecodeConfig(block_n=128, num_warps=4, num_stages=2)
MIN_TILES_PER_PARTITION = 2
MIN_FITTED_TILE_TOKENS = 64


@functools.cache
def default_decode_config(device: torch.device, head_dim: int, bits: int = 16) -> DecodeConfig:
    """The decode kernel's configuration for pages of `bits` (16, 8 or 4) on `device`."""
    block_d = _block_d(head_dim)
    block_n, num_warps, num_stages = _decode_block_n(device), 8 if block_d >= 512 else 4, 3
    if _has_async_copies(device):
        if block_d <= 128:
            # Measured (scripts/bench_paged_attention.py --sweep): FP16 pages in 32-token tiles
            # over one warp (no barrier for the reductions over a tile's tokens), INT8 codes in
            # 64-token tiles and INT4 in 128-token ones over two warps, three pipeline stages.
            block_n = ASYNC_DECODE_TILE_TOKENS[bits]
            num_warps = 1 if bits == 16 else 2
        elif bits == 16:
            num_stages = 2  # wider heads' FP16 pages (MLA's 576: 16-row tiles over 8 warps)
    return DecodeConfig(block_n=_tile_rows(block_d, block_n), num_warps=num_warps, num_stages=num_stages)


def decode_config(
    device: torch.device,
    head_dim: int,
    bits: int,
    num_seqs: int,
    num_kv_heads: int,
    max_context_len: int,
    *,
    is_partitioning_fixed: bool = False,
) -> DecodeConfig:
    """The configuration `paged_decode_attention` takes for a call: `default_decode_config`'s,
    fitted to the call's grid (`fit_decode_config`) on GPUs with cp.async for heads up to 128,
    unless the caller forced the partition count (`is_partitioning_fixed`)."""
    config = default_decode_config(device, head_dim, bits)
    if is_partitioning_fixed or not _has_async_copies(device) or _block_d(head_dim) > 128:
        return config
    return fit_decode_config(config, num_seqs, num_kv_heads, max_context_len, num_sms(device))


def fit_decode_config(
    config: DecodeConfig, num_seqs: int, num_kv_heads: int, max_context_len: int, sm_count: int
) -> DecodeConfig:
    """`config` fitted to the default partitioning's grid on a GPU of `sm_count` SMs.

    A grid of no more programs than SMs is a matter of latency: LATENCY_DECODE_CONFIG.
    Otherwise a partition shorter than MIN_TILES_PER_PARTITION tiles takes tiles half as long,
    down to MIN_FITTED_TILE_TOKENS (INT4's 128-token tiles become 64 under 256 tokens).
    """
    num_splits = choose_num_splits(num_seqs, num_kv_heads, max_context_len, sm_count)
    if num_seqs * num_kv_heads * num_splits <= sm_count:
        return LATENCY_DECODE_CONFIG
    partition_tokens = math.ceil(max(1, max_context_len) / num_splits)
    block_n = config.block_n
    while block_n > MIN_FITTED_TILE_TOKENS and partition_tokens < MIN_TILES_PER_PARTITION * block_n:
        block_n //= 2
    return replace(config, block_n=block_n)


def _has_async_copies(device: torch.device) -> bool:
    # Ampere and later pipeline tile loads through shared memory (cp.async) and have the
    # shared memory for two stages of 128-token INT8 tiles; Turing keeps the first tiles.
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 8


def _use_triton(kernel_name: str, device: torch.device, use_reference: bool) -> bool:
    return use_triton(kernel_name, device, use_reference or FORCE_REFERENCE)


def _decode_block_n(device: torch.device) -> int:
    # Small tiles in the interpreter so tiny tests still cross tile and partition edges.
    return 16 if device.type == "cpu" else 64


# ---------------------------------------------------------------- references


def _sequence_kv(pages: KVPages, block_table: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Dequantized K, V of the first `num_tokens` positions: float32 [num_tokens, Hkv, D]."""
    positions = torch.arange(num_tokens, device=block_table.device)
    block_size = pages.block_size
    slots = block_table[positions // block_size].long() * block_size + positions % block_size
    return gather_kv(pages, slots)


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, q_positions: torch.Tensor | None
) -> torch.Tensor:
    """q [M, H, D] float32 over k, v [L, Hkv, D]; causal when `q_positions [M]` is given."""
    group_size = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group_size, dim=1)  # [L, Hkv, D] -> [L, H, D]
    v = v.repeat_interleave(group_size, dim=1)
    scores = torch.einsum("mhd,lhd->hml", q, k) * scale  # [H, M, L]
    if q_positions is not None:
        k_positions = torch.arange(k.shape[0], device=k.device)
        is_future = k_positions[None, :] > q_positions[:, None]  # [M, L]
        scores = scores.masked_fill(is_future[None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hml,lhd->mhd", probs, v)  # [M, H, D]


def paged_decode_attention_ref(
    q: torch.Tensor,
    pages: KVPages,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Plain-torch decode attention in float32; returns q's dtype. Sequences of length 0 give zeros."""
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for seq, context_len in enumerate(context_lens.tolist()):
        if context_len == 0:
            continue
        k, v = _sequence_kv(pages, block_tables[seq], context_len)
        out[seq] = _attend(q[seq : seq + 1].float(), k, v, scale, None)[0]
    return out.to(q.dtype)


def paged_prefill_attention_ref(
    q: torch.Tensor,
    pages: KVPages,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Plain-torch causal prefill attention in float32; returns q's dtype."""
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    starts = cu_seqlens_q.tolist()
    for seq, context_len in enumerate(context_lens.tolist()):
        q_start, q_end = starts[seq], starts[seq + 1]
        num_new = q_end - q_start
        if num_new == 0:
            continue
        if num_new > context_len:
            raise KernelError(
                f"paged_prefill_attention: sequence {seq} has {num_new} new tokens but context_lens is "
                f"{context_len}; context_lens must count the new tokens too"
            )
        k, v = _sequence_kv(pages, block_tables[seq], context_len)
        q_positions = torch.arange(context_len - num_new, context_len, device=q.device)
        out[q_start:q_end] = _attend(q[q_start:q_end].float(), k, v, scale, q_positions)
    return out.to(q.dtype)


# ---------------------------------------------------------------- wrappers


def _check_common(name: str, q: torch.Tensor, pages: KVPages, block_tables: torch.Tensor, context_lens: torch.Tensor):
    pages.validate()
    if q.dim() != 3:
        raise KernelError(f"{name}: q has shape {tuple(q.shape)}; expected 3 dims [tokens, num_heads, head_dim]")
    num_heads, head_dim = q.shape[1], q.shape[2]
    if head_dim != pages.head_dim:
        raise KernelError(f"{name}: q has head_dim {head_dim} but the pages hold head_dim {pages.head_dim}")
    if num_heads % pages.num_kv_heads:
        raise KernelError(
            f"{name}: q has {num_heads} heads, not a multiple of the pages' {pages.num_kv_heads} KV heads"
        )
    if q.dtype not in (torch.float16, torch.float32) and not (q.dtype == torch.bfloat16 and q.device.type == "cpu"):
        raise KernelError(f"{name}: q has dtype {q.dtype}; expected float16 or float32 (bfloat16 on the CPU)")
    if not pages.is_quantized and q.dtype != pages.k.dtype:
        raise KernelError(f"{name}: q is {q.dtype} but the fp16 pages are {pages.k.dtype}; they must match")
    if q.shape[0] and q.stride(2) != 1:
        raise KernelError(f"{name}: q must be contiguous in its last dim (strides {q.stride()})")
    num_seqs = context_lens.shape[0] if context_lens.dim() == 1 else -1
    if context_lens.dim() != 1 or context_lens.dtype != torch.int32 or not context_lens.is_contiguous():
        raise KernelError(
            f"{name}: context_lens is {tuple(context_lens.shape)} {context_lens.dtype}; expected contiguous int32 [num_seqs]"
        )
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs or block_tables.dtype != torch.int32:
        raise KernelError(
            f"{name}: block_tables is {tuple(block_tables.shape)} {block_tables.dtype}; "
            f"expected int32 [{num_seqs}, max_blocks]"
        )
    if block_tables.shape[1] and block_tables.stride(1) != 1:
        raise KernelError(f"{name}: block_tables must be contiguous in its last dim (strides {block_tables.stride()})")
    for tensor_name, tensor in (("q", q), ("block_tables", block_tables), ("context_lens", context_lens)):
        if tensor.device != pages.device:
            raise KernelError(f"{name}: {tensor_name} is on {tensor.device} but the pages are on {pages.device}")


def _check_kernel_head_dim(name: str, head_dim: int, bits: int) -> None:
    if head_dim < 16:
        raise KernelError(
            f"{name}: the Triton kernel needs head_dim >= 16, got {head_dim}; "
            "pass use_reference=True to use the plain-torch path"
        )
    num_planes = 16 // bits
    if head_dim % num_planes:
        raise KernelError(
            f"{name}: the Triton kernel reads INT{bits} heads in {num_planes} planes, so head_dim must be a "
            f"multiple of {num_planes}, got {head_dim}; pass use_reference=True to use the plain-torch path"
        )


def _block_d(head_dim: int) -> int:
    # Tiles span a power of two along the head dim; columns past head_dim are masked
    # (MLA's 576 = 512 latent + 64 RoPE runs in 1024-wide tiles). Plain Python: the
    # reference path needs it too, where Triton may be missing.
    return 1 << max(0, head_dim - 1).bit_length()


def plane_layout(bits: int, head_dim: int) -> dict:
    """The kernels' plane width: quantized heads are read as 16-bit words, INT8's split into two
    planes (their low and high bytes: elements 2i and 2i + 1) and INT4's into four (their
    nibbles: elements 4i to 4i + 3); FP16 heads are one plane. tl.dot needs at least 16
    columns, so small heads pad their planes."""
    return {"BLOCK_C": max(16, _block_d(head_dim // (16 // bits)))}


def _tile_rows(block_d: int, rows: int) -> int:
    # Wide rows shrink the tiles so q, K and V tiles fit shared memory and the
    # float32 accumulator fits registers.
    if block_d > 512:
        return min(rows, 16)
    return min(rows, 32) if block_d > 256 else rows


def _scale_pointers(pages: KVPages) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    # FP16 pages have no scales; the kernel never reads these slots then.
    if pages.is_quantized:
        return pages.k_scale, pages.k_zero, pages.v_scale, pages.v_zero
    return pages.k, pages.k, pages.v, pages.v


def _needs_wide_offsets(pages: KVPages) -> bool:
    """Whether some element of a page array (codes, scales, the FP16 window) lies 2**31 or
    more elements past its first: the kernels then compute page offsets in int64."""
    arrays = [pages.k, pages.v]
    if pages.is_quantized:
        arrays += [pages.k_scale, pages.k_zero, pages.v_scale, pages.v_zero]
    if pages.has_window:
        arrays += [pages.window_k, pages.window_v]
    return any(a.numel() and a.shape[0] * a.stride(0) >= 2**31 for a in arrays)


def _window_pointers(pages: KVPages) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # Without a window the kernel never reads these slots.
    if pages.has_window:
        return pages.window_k, pages.window_v, pages.window_row
    return pages.k, pages.v, pages.k


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_context_len: int, sm_count: int) -> int:
    """Partitions per sequence: about TARGET_WAVES programs per SM, none shorter than MIN_PARTITION_TOKENS.

    Several resident programs per SM keep enough loads in flight to saturate
    memory bandwidth; batch 1 with 2 KV heads has only 2 programs without splitting.
    """
    max_useful = max(1, math.ceil(max_context_len / MIN_PARTITION_TOKENS))
    wanted = math.ceil(TARGET_WAVES * sm_count / max(1, num_seqs * num_kv_heads))
    return max(1, min(wanted, max_useful))


def plan_decode_partitions(
    num_seqs: int,
    num_kv_heads: int,
    max_context_len: int,
    device: torch.device,
    num_splits: int | None = None,
    *,
    block_n: int | None = None,
) -> tuple[int, int]:
    """(num_splits, partition_tokens) that `paged_decode_attention` uses; partitions are whole
    tiles of `block_n` tokens (by default 64, 16 in the interpreter)."""
    if block_n is None:
        block_n = _decode_block_n(device)
    max_context_len = max(1, max_context_len)
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, num_kv_heads, max_context_len, num_sms(device))
    partition_tokens = math.ceil(math.ceil(max_context_len / max(1, num_splits)) / block_n) * block_n
    return math.ceil(max_context_len / partition_tokens), partition_tokens


def _check_config(name: str, config: DecodeConfig) -> None:
    if config.block_n < 16 or config.block_n & (config.block_n - 1):
        raise KernelError(f"{name}: DecodeConfig.block_n is {config.block_n}; expected a power of two >= 16")
    if config.num_warps not in (1, 2, 4, 8, 16) or config.num_stages < 1:
        raise KernelError(
            f"{name}: DecodeConfig num_warps={config.num_warps}, num_stages={config.num_stages}; "
            "expected num_warps a power of two up to 16 and num_stages >= 1"
        )


def paged_decode_attention(
    q: torch.Tensor,
    pages: KVPages,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    num_splits: int | None = None,
    max_context_len: int | None = None,
    use_reference: bool = False,
    _config: DecodeConfig | None = None,
) -> torch.Tensor:
    """Attention of one new token per sequence over its cached context.

    q: `[num_seqs, num_heads, head_dim]` (float16, or float32 with float32/quantized pages);
    block_tables: int32 `[num_seqs, max_blocks]`; context_lens: int32 `[num_seqs]`,
    the number of cached tokens to attend to (including the new token's own K/V).
    Returns `[num_seqs, num_heads, head_dim]` in q's dtype.

    `num_splits` forces the number of context partitions (1 = no split);
    by default it is chosen from `max_context_len`, which defaults to the
    block table's capacity (`max_blocks * block_size`) so no device sync is
    needed. Pass the true maximum when the table is padded far beyond it; it
    must not be below any `context_lens` entry (tokens past it are not read).
    `_config` overrides the kernel's tuning (`DecodeConfig`), for benchmarks.
    """
    name = "paged_decode_attention"
    _check_common(name, q, pages, block_tables, context_lens)
    if q.shape[0] != context_lens.shape[0]:
        raise KernelError(f"{name}: q has {q.shape[0]} rows but context_lens has {context_lens.shape[0]} sequences")
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = pages.num_kv_heads
    if max_context_len is None:
        max_context_len = block_tables.shape[1] * pages.block_size
    config = _config or decode_config(
        q.device,
        head_dim,
        pages.bits,
        num_seqs,
        num_kv_heads,
        max_context_len,
        is_partitioning_fixed=num_splits is not None,
    )
    _check_config(name, config)
    num_splits, partition_tokens = plan_decode_partitions(
        num_seqs, num_kv_heads, max_context_len, q.device, num_splits, block_n=config.block_n
    )
    if num_seqs == 0:
        return torch.empty_like(q)
    if not _use_triton(name, q.device, use_reference):
        return paged_decode_attention_ref(q, pages, block_tables, context_lens, scale)
    _check_kernel_head_dim(name, head_dim, pages.bits)
    group_size = num_heads // num_kv_heads
    is_split = num_splits > 1
    out = torch.empty((num_seqs, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if is_split:
        # From the graph's pool under CUDA-graph capture, like every per-step buffer.
        partial_out = torch.empty((num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
        partial_lse = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32, device=q.device)
    else:
        partial_out, partial_lse = out, out  # unused without splitting
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        q,
        pages.k,
        pages.v,
        *_scale_pointers(pages),
        *_window_pointers(pages),
        block_tables,
        context_lens,
        out,
        partial_out,
        partial_lse,
        scale * _LOG2_E,
        q.stride(0),
        q.stride(1),
        block_tables.stride(0),
        num_kv_heads,
        group_size,
        partition_tokens,
        num_splits,
        PAGE_SIZE=pages.block_size,
        HEAD_DIM=head_dim,
        **plane_layout(pages.bits, head_dim),
        BITS=pages.bits,
        BLOCK_G=max(DECODE_MIN_GROUP, triton.next_power_of_2(group_size)),
        BLOCK_N=config.block_n,
        IS_SPLIT=is_split,
        HAS_WINDOW=pages.has_window,
        WIDE_OFFSETS=_needs_wide_offsets(pages),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if is_split:
        # Up to WHOLE_HEAD_MERGE_SPLITS partitions of heads up to 128 wide: a whole head per
        # program in one chunk of lanes; otherwise MERGE_SLICE_D columns in MERGE_KERNEL_LANES.
        block_d = _block_d(head_dim)
        slice_d, lanes = MERGE_SLICE_D, MERGE_KERNEL_LANES
        if num_splits <= WHOLE_HEAD_MERGE_SPLITS and block_d <= 128:
            slice_d, lanes = block_d, max(2, triton.next_power_of_2(num_splits))
        _merge_partitions_kernel[(num_seqs, num_heads, triton.cdiv(head_dim, slice_d))](
            partial_out,
            partial_lse,
            out,
            context_lens,
            partition_tokens,
            num_splits,
            HEAD_DIM=head_dim,
            SLICE_D=slice_d,
            LANES=lanes,
            num_warps=4,
        )
    return out


def paged_prefill_attention(
    q: torch.Tensor,
    pages: KVPages,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    max_q_len: int | None = None,
    use_reference: bool = False,
) -> torch.Tensor:
    """Causal attention of a variable-length batch of new tokens over paged K/V.

    q: `[total_new_tokens, num_heads, head_dim]`; sequence s owns rows
    `cu_seqlens_q[s]:cu_seqlens_q[s + 1]` (int32 `[num_seqs + 1]`). Its new tokens
    are the last `q_len` of its `context_lens[s]` tokens and must already be in
    the pages (`write_kv`); earlier tokens are a cached prefix. New token i sits
    at position `context_lens[s] - q_len + i` and attends to positions <= its own.
    `max_q_len` (the longest q_len) sizes the grid; computed (one device sync) when omitted.
    """
    name = "paged_prefill_attention"
    _check_common(name, q, pages, block_tables, context_lens)
    num_seqs = context_lens.shape[0]
    if cu_seqlens_q.shape != (num_seqs + 1,) or cu_seqlens_q.dtype != torch.int32 or not cu_seqlens_q.is_contiguous():
        raise KernelError(
            f"{name}: cu_seqlens_q is {tuple(cu_seqlens_q.shape)} {cu_seqlens_q.dtype}; "
            f"expected contiguous int32 [{num_seqs + 1}]"
        )
    if cu_seqlens_q.device != pages.device:
        raise KernelError(f"{name}: cu_seqlens_q is on {cu_seqlens_q.device} but the pages are on {pages.device}")
    if q.shape[0] == 0 or num_seqs == 0:
        return torch.zeros_like(q)
    if not _use_triton(name, q.device, use_reference):
        return paged_prefill_attention_ref(q, pages, block_tables, cu_seqlens_q, context_lens, scale)
    _check_kernel_head_dim(name, q.shape[2], pages.bits)

    num_tokens, num_heads, head_dim = q.shape
    if max_q_len is None:
        max_q_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    is_interpreted = q.device.type == "cpu"
    block_m = 16 if is_interpreted else _tile_rows(_block_d(head_dim), 64)
    block_n = 16 if is_interpreted else _tile_rows(_block_d(head_dim), 64)
    out = torch.zeros_like(q, memory_format=torch.contiguous_format)
    # One more query tile than the longest chunk needs: a chunk after a cached prefix may start
    # inside a tile.
    grid = (triton.cdiv(max(1, max_q_len), block_m) + 1, num_seqs, num_heads)
    _prefill_kernel[grid](
        q,
        pages.k,
        pages.v,
        *_scale_pointers(pages),
        *_window_pointers(pages),
        block_tables,
        cu_seqlens_q,
        context_lens,
        out,
        scale * _LOG2_E,
        q.stride(0),
        q.stride(1),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        pages.num_kv_heads,
        num_heads // pages.num_kv_heads,
        PAGE_SIZE=pages.block_size,
        HEAD_DIM=head_dim,
        **plane_layout(pages.bits, head_dim),
        BITS=pages.bits,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        HAS_WINDOW=pages.has_window,
        WIDE_OFFSETS=_needs_wide_offsets(pages),
        num_warps=8 if _block_d(head_dim) >= 512 else 4,
    )
    return out


# ---------------------------------------------------------------- Triton kernels
#
# A head is read in planes (plane_layout): one for FP16, INT8's low and high bytes, INT4's four
# nibbles. Query rows, K/V tiles and accumulators travel as 4-tuples of planes; planes past
# NUM_PLANES = 16 // BITS repeat the first ones and are never used. A tile's tokens travel as
# (rows, window_page, window_rows, mask_n): rows = slot * num_kv_heads + kv_head in the page
# arrays, window_page the page's row in the FP16 window arrays (-1: not kept there),
# window_rows the token's row in them, mask_n the tokens that exist.

if HAS_TRITON:
    # Codes become float16 through inline PTX (_pair_halves, _nibble_halves) on the GPU; the
    # interpreter, which runs no PTX, takes _code_values, the same values one code at a time.
    _PTX_CODES = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") != "1")
    # What a code's float16 plane element is worth: its bits as a subnormal (_code_values).
    CODE_UNIT = tl.constexpr(2.0**-24)
    # The most tokens a tile of the decode kernel's pass over the FP16 window holds.
    WINDOW_TILE_TOKENS = tl.constexpr(64)
    # Which tokens a tile of pages with an FP16 window reads (_load_operands' WINDOW): each from
    # its codes or its window row (prefill), only those from codes (the decode kernel's main
    # loop), or only those from the window (its pass over the window's tiles).
    _MIXED = tl.constexpr(0)
    _CODES_ONLY = tl.constexpr(1)
    _KEPT_ONLY = tl.constexpr(2)

    @triton.jit
    def _table_blocks(table_row, positions, end, PAGE_SIZE: tl.constexpr):
        # The pages of the tokens at `positions` (0 past `end`), as the block table holds them.
        return tl.load(table_row + positions // PAGE_SIZE, mask=positions < end, other=0)

    @triton.jit
    def _block_tokens(
        blocks,
        positions,
        end,
        kv_head,
        num_kv_heads,
        window_row_ptr,
        PAGE_SIZE: tl.constexpr,
        HAS_WINDOW: tl.constexpr,
        WIDE_OFFSETS: tl.constexpr,
    ):
        # The tokens at `positions` (those below `end`) in pages `blocks` (_table_blocks). Offsets
        # are int64 only where a page array needs them (_needs_wide_offsets): 64-bit address
        # arithmetic is a large share of the quantized pages' instructions.
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
    def _tokens(table_row, positions, end, kv_head, num_kv_heads, window_row_ptr, PAGE_SIZE, HAS_WINDOW, WIDE_OFFSETS):
        # _block_tokens, their pages read from the table now.
        blocks = _table_blocks(table_row, positions, end, PAGE_SIZE)
        return _block_tokens(
            blocks, positions, end, kv_head, num_kv_heads, window_row_ptr, PAGE_SIZE, HAS_WINDOW, WIDE_OFFSETS
        )

    @triton.jit
    def _load_rows(
        ptr,
        rows,
        mask_rows,
        cols,
        ROW_LEN: tl.constexpr,
        NUM_COLS: tl.constexpr,
        BLOCK_C: tl.constexpr,
        TRANSPOSED: tl.constexpr = False,
    ):
        # [len(rows), BLOCK_C]: elements `cols` of rows `rows` ([BLOCK_C, len(rows)] with
        # TRANSPOSED). Masked rows read nothing (unwritten slots may hold NaN) and, like columns
        # past NUM_COLS, come back as 0.
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
        # Codes 0..255 as exact DOT_DTYPE values without int-to-float instructions. With
        # SUBNORMAL (float16 only) a code's bits alone are the subnormal code * CODE_UNIT, with
        # no instruction at all; otherwise a code OR-ed into the low mantissa bits of 1024
        # (float16) or of 2**23 (float32) makes that power of two plus the code, exactly, and a
        # subtraction removes the power of two.
        if SUBNORMAL:
            return codes.to(tl.int16).to(tl.float16, bitcast=True)
        elif DOT_DTYPE == tl.float16:
            return (codes.to(tl.int16) | 0x6400).to(tl.float16, bitcast=True) - 1024.0
        else:
            return (codes.to(tl.int32) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0

    # The conversions' PTX, two 16-bit words a register: INT8 pairs and INT4 nibbles as float16
    # subnormals (over zero bytes; a shift and a mask per nibble) or as 1024 + code (under 0x64,
    # the high byte of 1024.0, less 1024 in float16 pairs).
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
        # uint16 pairs of uint8 codes as two float16 planes, the low bytes and the high ones.
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
        # uint16 words of four INT4 codes as four float16 planes, nibble p of each word in
        # plane p; with ODD_X16 nibbles 1 and 3 stay in place (16 * code), one shift for two planes.
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
        # The tokens read from their codes: unmasked ones outside the pages kept in FP16.
        if HAS_WINDOW:
            return mask_n & (window_page < 0)
        return mask_n

    @triton.jit
    def _kept_mask(mask_n, window_page, HAS_WINDOW: tl.constexpr):
        # The tokens read from the window: unmasked ones of pages kept in FP16 (none without one).
        if HAS_WINDOW:
            return mask_n & (window_page >= 0)
        return mask_n & False

    @triton.jit
    def _tile_scales(scale_ptrs, rows, mask_n, BITS: tl.constexpr):
        # (k_scale, k_zero, v_scale, v_zero) of a tile's tokens [BLOCK_N] as stored, 0 for masked
        # tokens; float32 zeros for FP16 pages. _attend_tile takes them to float32 so that the
        # loads have a tile's time to arrive.
        if BITS == 16:
            k_scale = tl.zeros(mask_n.shape, tl.float32)
            k_zero, v_scale, v_zero = k_scale, k_scale, k_scale
        else:
            k_scale = tl.load(scale_ptrs[0] + rows, mask=mask_n, other=0.0)
            k_zero = tl.load(scale_ptrs[1] + rows, mask=mask_n, other=0.0)
            v_scale = tl.load(scale_ptrs[2] + rows, mask=mask_n, other=0.0)
            v_zero = tl.load(scale_ptrs[3] + rows, mask=mask_n, other=0.0)
        return k_scale, k_zero, v_scale, v_zero

    @triton.jit
    def _window_plane(plane, window_ptr, window_rows, is_window, PLANE: tl.constexpr, HEAD_DIM, BITS, BLOCK_C):
        # `plane` with the rows of tokens in pages kept in FP16 taken from the window.
        NUM_PLANES: tl.constexpr = 16 // BITS
        cols = tl.arange(0, BLOCK_C) * NUM_PLANES + PLANE
        kept = _load_rows(window_ptr, window_rows, is_window, cols, HEAD_DIM, HEAD_DIM // NUM_PLANES, BLOCK_C)
        return tl.where(is_window[:, None], kept.to(plane.dtype), plane)

    @triton.jit
    def _load_operands(
        cache_ptr,
        window_ptr,
        scale,
        zero,
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
        # One K or V tile as the dots take it: (planes, scale, zero), planes [BLOCK_N, BLOCK_C] in
        # DOT_DTYPE ([BLOCK_C, BLOCK_N] with TRANSPOSED, not _MIXED) and the float32 scale and
        # zero [BLOCK_N] such that a value is (plane - zero) * scale. Codes are read as 16-bit
        # words, a plane per byte or nibble, so that no code moves between columns and the tiles
        # move through shared memory into the dots' layouts a word at a time. Tokens of pages
        # kept in FP16 come from the window with scale 1 and zero 0 (WINDOW _MIXED), or only the
        # others from their codes (_CODES_ONLY), or only the window's (_KEPT_ONLY); the tokens
        # not read, like masked ones, come back as 0. With ODD_X16 (INT4 codes as subnormals
        # only) planes 1 and 3 hold 16 * code * CODE_UNIT.
        tl.static_assert(not TRANSPOSED or WINDOW != _MIXED)
        NUM_PLANES: tl.constexpr = 16 // BITS
        PLANE_DIM: tl.constexpr = HEAD_DIM // NUM_PLANES
        rows, window_page, window_rows, mask_n = tokens
        offs_c = tl.arange(0, BLOCK_C)
        mask_codes = _code_mask(mask_n, window_page, HAS_WINDOW)
        if BITS == 16:
            plane0 = _load_rows(cache_ptr, rows, mask_codes, offs_c, HEAD_DIM, PLANE_DIM, BLOCK_C, TRANSPOSED)
            plane0 = plane0.to(DOT_DTYPE)
            plane1 = plane0
            plane2 = plane0
            plane3 = plane0
        elif HAS_WINDOW and WINDOW == _KEPT_ONLY:
            # Whole FP16 rows in one load, split into the planes in registers: element
            # c * NUM_PLANES + p is plane p's column c, and the row's elements past HEAD_DIM
            # (padded planes) are exactly those columns past PLANE_DIM.
            is_window = _kept_mask(mask_n, window_page, HAS_WINDOW)
            cols = tl.arange(0, NUM_PLANES * BLOCK_C)
            row = _load_rows(window_ptr, window_rows, is_window, cols, HEAD_DIM, HEAD_DIM, NUM_PLANES * BLOCK_C)
            row = row.to(DOT_DTYPE)
            if NUM_PLANES == 2:
                plane0, plane1 = tl.split(tl.reshape(row, [mask_n.shape[0], BLOCK_C, 2]))
                plane2 = plane0
                plane3 = plane1
            else:
                even, odd = tl.split(tl.reshape(row, [mask_n.shape[0], BLOCK_C, 2, 2]))
                plane0, plane2 = tl.split(even)
                plane1, plane3 = tl.split(odd)
            if TRANSPOSED:
                plane0, plane1, plane2, plane3 = tl.trans(plane0), tl.trans(plane1), tl.trans(plane2), tl.trans(plane3)
            scale = tl.full(mask_n.shape, 1.0, tl.float32)
            zero = tl.zeros(mask_n.shape, tl.float32)
        else:
            # Float16 codes as subnormals unless window tokens share the tile's dots (_MIXED):
            # their scale 1 beside the codes' 2**24 would leave the window's weights below
            # float16's range.
            SUBNORMAL: tl.constexpr = DOT_DTYPE == tl.float16 and (not HAS_WINDOW or WINDOW != _MIXED)
            words = _load_rows(
                cache_ptr.to(tl.pointer_type(tl.uint16)),
                rows,
                mask_codes,
                offs_c,
                PLANE_DIM,
                PLANE_DIM,
                BLOCK_C,
                TRANSPOSED,
            )
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
            # Only tiles holding tokens of pages kept in FP16 (as a rule a sequence's last pages)
            # read the window; the others skip its loads.
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
                plane2 = plane0
                plane3 = plane1
        return (plane0, plane1, plane2, plane3), scale, zero

    @triton.jit
    def _load_query_planes(row_ptrs, mask_rows, HEAD_DIM: tl.constexpr, BITS: tl.constexpr, BLOCK_C: tl.constexpr):
        # Query rows (row_ptrs [R, 1] to their first element) split like the K planes, and their
        # float32 sums over all columns [R].
        NUM_PLANES: tl.constexpr = 16 // BITS
        offs_c = tl.arange(0, BLOCK_C)
        mask = mask_rows[:, None] & (offs_c < HEAD_DIM // NUM_PLANES)[None, :]
        q0 = tl.load(row_ptrs + (offs_c * NUM_PLANES)[None, :], mask=mask, other=0.0)
        q_sum = tl.sum(q0.to(tl.float32), axis=1)
        q1 = q0
        q2 = q0
        q3 = q0
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
        # The inverse of _load_query_planes: planes [R, BLOCK_C] back to element order.
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
    def _softmax_step(scores, m_i, l_i, TOKEN_AXIS: tl.constexpr):
        # The online softmax over one tile of base-2 `scores`, tokens along TOKEN_AXIS: the rows'
        # new maxima, the factor that rescales what they summed before, the tile's weights p and
        # the new sums. A row that has seen no token yet (a tile of only window tokens in the
        # codes' pass, or the reverse) keeps m = -inf and adds zeros, rather than exp2(-inf + inf).
        m_new = tl.maximum(m_i, tl.max(scores, axis=TOKEN_AXIS))
        m_seen = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_seen)
        p = tl.exp2(scores - tl.expand_dims(m_seen, TOKEN_AXIS))
        return m_new, alpha, p, l_i * alpha + tl.sum(p, axis=TOKEN_AXIS)

    @triton.jit
    def _load_kv(kv_ptrs, scales, tokens, HEAD_DIM, BLOCK_C, BITS, HAS_WINDOW, DOT_DTYPE, WINDOW, BY_TOKEN, ODD_X16):
        # A tile's K and V operands (_load_operands), V's loads issued before any dot so that both
        # tiles are in flight together; by token, V's planes come turned over, [BLOCK_C, BLOCK_N].
        k_ptr, window_k_ptr, v_ptr, window_v_ptr = kv_ptrs
        k_scale, k_zero = scales[0].to(tl.float32), scales[1].to(tl.float32)
        v_scale, v_zero = scales[2].to(tl.float32), scales[3].to(tl.float32)
        k = _load_operands(
            k_ptr,
            window_k_ptr,
            k_scale,
            k_zero,
            tokens,
            HEAD_DIM,
            BLOCK_C,
            BITS,
            HAS_WINDOW,
            DOT_DTYPE,
            WINDOW,
            False,
            ODD_X16,
        )
        v = _load_operands(
            v_ptr,
            window_v_ptr,
            v_scale,
            v_zero,
            tokens,
            HEAD_DIM,
            BLOCK_C,
            BITS,
            HAS_WINDOW,
            DOT_DTYPE,
            WINDOW,
            BY_TOKEN,
            ODD_X16,
        )
        return k, v

    @triton.jit
    def _attend_tile(
        q, q_sum, state, is_visible, scale_log2, kv_ptrs, scales, tokens, HEAD_DIM, BLOCK_C, BITS, HAS_WINDOW
    ):
        # The prefill kernel's tile: query rows q (planes [R, BLOCK_C], q_sum [R] their float32
        # sums) over one K/V tile where is_visible [R, BLOCK_N]: the new state (m_i, l_i, acc).
        NUM_PLANES: tl.constexpr = 16 // BITS
        m_i, l_i, acc = state
        k_tile, v_tile = _load_kv(
            kv_ptrs, scales, tokens, HEAD_DIM, BLOCK_C, BITS, HAS_WINDOW, q[0].dtype, _MIXED, False, False
        )
        k, k_scale, k_zero = k_tile
        v, v_scale, v_zero = v_tile
        qk = tl.dot(q[0], tl.trans(k[0]), input_precision="ieee")  # [R, BLOCK_N]
        if NUM_PLANES >= 2:
            qk = tl.dot(q[1], tl.trans(k[1]), qk, input_precision="ieee")
        if NUM_PLANES == 4:
            qk = tl.dot(q[2], tl.trans(k[2]), qk, input_precision="ieee")
            qk = tl.dot(q[3], tl.trans(k[3]), qk, input_precision="ieee")
        if BITS == 16:
            scores = qk * scale_log2
        else:
            # q . (codes - zero) * scale = (q . codes - zero * sum(q)) * scale
            scores = (qk - q_sum[:, None] * k_zero[None, :]) * (k_scale * scale_log2)[None, :]
        scores = tl.where(is_visible, scores, float("-inf"))
        m_new, alpha, p, l_i = _softmax_step(scores, m_i, l_i, 1)
        acc0, acc1, acc2, acc3 = acc
        if BITS == 16:
            acc0 = acc0 * alpha[:, None] + tl.dot(p.to(q[0].dtype), v[0], input_precision="ieee")
        else:
            # p . (codes - zero) * scale = v_max * (w . codes - w . zero) with w = p * scale / v_max,
            # v_max a row's largest scale among the tokens it sees (not the tile's: which other
            # tokens a tile holds depends on the chunk). It keeps w in [0, 1] and out of float16's
            # subnormals. The zero term uses w as rounded for the dot, so the two terms cancel in
            # float32 and w's rounding weighs on (codes - zero), as p's did on the values.
            v_max = tl.max(tl.where(is_visible, v_scale[None, :], 0.0), axis=1)
            v_max = tl.where(v_max > 0.0, v_max, 1.0)[:, None]  # [R, 1]
            w = (p * v_scale[None, :] / v_max).to(q[0].dtype)
            zero_term = tl.sum(w.to(tl.float32) * v_zero[None, :], axis=1)[:, None]
            acc0 = acc0 * alpha[:, None] + (tl.dot(w, v[0], input_precision="ieee") - zero_term) * v_max
            acc1 = acc1 * alpha[:, None] + (tl.dot(w, v[1], input_precision="ieee") - zero_term) * v_max
            if NUM_PLANES == 4:
                acc2 = acc2 * alpha[:, None] + (tl.dot(w, v[2], input_precision="ieee") - zero_term) * v_max
                acc3 = acc3 * alpha[:, None] + (tl.dot(w, v[3], input_precision="ieee") - zero_term) * v_max
        return m_new, l_i, (acc0, acc1, acc2, acc3)

    @triton.jit
    def _attend_tile_by_token(
        q,
        q_sum,
        state,
        is_visible,
        scale_log2,
        kv_ptrs,
        scales,
        tokens,
        HEAD_DIM,
        BLOCK_C,
        BITS,
        HAS_WINDOW,
        WINDOW,
        ODD_X16,
    ):
        # _attend_tile for the decode kernel, whose query rows all see the same tokens
        # (is_visible [BLOCK_N]), turned over: q and acc are planes [BLOCK_C, R], the scores
        # [BLOCK_N, R]. A token tile is the dots' first operand, so a group of up to 8 query rows
        # is one 8-wide tensor-core tile rather than rows of 16, and the softmax's per-score
        # arithmetic covers half the elements. With ODD_X16 the INT4 planes 1 and 3 hold
        # 16 * code (_nibble_halves): q's planes 1 and 3 come divided by 16, and V's planes 1
        # and 3 take the 16 back in their zero term and v_max.
        NUM_PLANES: tl.constexpr = 16 // BITS
        m_i, l_i, acc = state
        k_tile, v_tile = _load_kv(
            kv_ptrs, scales, tokens, HEAD_DIM, BLOCK_C, BITS, HAS_WINDOW, q[0].dtype, WINDOW, True, ODD_X16
        )
        k, k_scale, k_zero = k_tile
        v, v_scale, v_zero = v_tile
        qk = tl.dot(k[0], q[0], input_precision="ieee")  # [BLOCK_N, R]
        if NUM_PLANES >= 2:
            qk = tl.dot(k[1], q[1], qk, input_precision="ieee")
        if NUM_PLANES == 4:
            qk = tl.dot(k[2], q[2], qk, input_precision="ieee")
            qk = tl.dot(k[3], q[3], qk, input_precision="ieee")
        if BITS == 16:
            scores = qk * scale_log2
        else:
            scores = (qk - k_zero[:, None] * q_sum[None, :]) * (k_scale * scale_log2)[:, None]
        scores = tl.where(is_visible[:, None], scores, float("-inf"))
        m_new, alpha, p, l_i = _softmax_step(scores, m_i, l_i, 0)
        acc0, acc1, acc2, acc3 = acc
        if BITS == 16:
            acc0 = acc0 * alpha[None, :] + tl.dot(v[0], p.to(q[0].dtype), input_precision="ieee")
        else:
            # As in _attend_tile, with v_max the largest scale among the tile's visible tokens
            # (every row sees the same ones).
            v_max = tl.max(tl.where(is_visible, v_scale, 0.0), axis=0)
            v_max = tl.where(v_max > 0.0, v_max, 1.0)
            w = (p * (v_scale * (1.0 / v_max))[:, None]).to(q[0].dtype)
            zero_term = tl.sum(w.to(tl.float32) * v_zero[:, None], axis=0)[None, :]
            if ODD_X16:
                odd_zero_term, odd_v_max = zero_term * 16.0, v_max * (1.0 / 16.0)
            else:
                odd_zero_term, odd_v_max = zero_term, v_max
            acc0 = acc0 * alpha[None, :] + (tl.dot(v[0], w, input_precision="ieee") - zero_term) * v_max
            acc1 = acc1 * alpha[None, :] + (tl.dot(v[1], w, input_precision="ieee") - odd_zero_term) * odd_v_max
            if NUM_PLANES == 4:
                acc2 = acc2 * alpha[None, :] + (tl.dot(v[2], w, input_precision="ieee") - zero_term) * v_max
                acc3 = acc3 * alpha[None, :] + (tl.dot(v[3], w, input_precision="ieee") - odd_zero_term) * odd_v_max
        return m_new, l_i, (acc0, acc1, acc2, acc3)

    # Neither the table's width nor the batch's partition count picks a compiled variant.
    @triton.jit(do_not_specialize=["stride_bt", "num_splits"])
    def _decode_kernel(
        q_ptr,
        k_cache_ptr,
        v_cache_ptr,
        k_scale_ptr,
        k_zero_ptr,
        v_scale_ptr,
        v_zero_ptr,
        window_k_ptr,
        window_v_ptr,
        window_row_ptr,
        block_tables_ptr,
        context_lens_ptr,
        out_ptr,
        partial_out_ptr,
        partial_lse_ptr,
        scale_log2,
        stride_qs,
        stride_qh,
        stride_bt,
        num_kv_heads,
        group_size,
        partition_tokens,
        num_splits,
        PAGE_SIZE: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_C: tl.constexpr,
        BITS: tl.constexpr,
        BLOCK_G: tl.constexpr,
        BLOCK_N: tl.constexpr,
        IS_SPLIT: tl.constexpr,
        HAS_WINDOW: tl.constexpr,
        WIDE_OFFSETS: tl.constexpr,
    ):
        # One program per (sequence, KV head, partition): the group's query heads over the
        # partition's tokens.
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        context_len = tl.load(context_lens_ptr + seq)
        # Partitions past this sequence's context (the batch's longest sets num_splits) do
        # nothing: the merge reads only the sequence's own. An empty context still has one.
        num_parts = _num_partitions(context_len, partition_tokens, num_splits)
        if split >= num_parts:
            return
        start = split * partition_tokens
        end = tl.minimum(start + partition_tokens, context_len)
        offs_n = tl.arange(0, BLOCK_N)
        table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
        kv_ptrs = (k_cache_ptr, window_k_ptr, v_cache_ptr, window_v_ptr)
        scale_ptrs = (k_scale_ptr, k_zero_ptr, v_scale_ptr, v_zero_ptr)
        rows, window_page, _, mask_n = _tokens(
            table_row, start + offs_n, end, kv_head, num_kv_heads, window_row_ptr, PAGE_SIZE, HAS_WINDOW, WIDE_OFFSETS
        )

        offs_g = tl.arange(0, BLOCK_G)
        mask_g = offs_g < group_size
        heads = kv_head * group_size + offs_g
        # q rows of this KV head's group, padded to BLOCK_G (8 or more): [BLOCK_G, BLOCK_C] per plane
        q_rows = q_ptr + seq.to(tl.int64) * stride_qs + heads[:, None] * stride_qh
        q, q_sum = _load_query_planes(q_rows, mask_g, HEAD_DIM, BITS, BLOCK_C)
        # INT4 codes as float16 subnormals with nibbles 1 and 3 in place (_nibble_halves): q's
        # planes 1 and 3 divided by 16 for them, exactly or (below 2**-10) to a subnormal's
        # 2**-25, a quarter of float16's rounding of q at 2**-10. The window's pass reads FP16
        # values and q as it is.
        ODD_X16: tl.constexpr = BITS == 4 and q_ptr.dtype.element_ty == tl.float16
        q0, q1, q2, q3 = q
        if ODD_X16:
            q1, q3 = q1 * (1.0 / 16.0), q3 * (1.0 / 16.0)
        # Token by token (_attend_tile_by_token): q and the accumulators turned over, [BLOCK_C, BLOCK_G].
        q = (tl.trans(q0), tl.trans(q1), tl.trans(q2), tl.trans(q3))
        acc0 = tl.zeros([BLOCK_C, BLOCK_G], tl.float32)
        state = (
            tl.full([BLOCK_G], float("-inf"), tl.float32),
            tl.zeros([BLOCK_G], tl.float32),
            (acc0, acc0, acc0, acc0),
        )
        # The loads that address a tile run ahead of it, each a tile before the loads that need
        # it: its page numbers two tiles ahead, its scales and the window's tags one tile ahead
        # (at two bytes per token the scales are too narrow for the compiler to pipeline).
        # With an FP16 window, this loop reads every token's codes but the window's, and notes
        # the first and last tile holding window tokens (per lane, reduced once after it); a
        # second pass reads the window's tokens of those tiles (as a rule a sequence's last one
        # or two), which keeps the main loop's registers those of pages without a window.
        scales = _tile_scales(scale_ptrs, rows, mask_n, BITS)
        next_blocks = _table_blocks(table_row, start + BLOCK_N + offs_n, end, PAGE_SIZE)
        # Bounds that leave the window's pass empty and cannot overflow in the compiler's
        # pipelined loop (it steps past them): `end` and the tile before `start`.
        first_kept = tl.zeros([BLOCK_N], tl.int32) + end
        last_kept = tl.zeros([BLOCK_N], tl.int32) + (start - BLOCK_N)
        for tile_start in range(start, end, BLOCK_N):
            next_rows, next_window_page, _, next_mask = _block_tokens(
                next_blocks,
                tile_start + BLOCK_N + offs_n,
                end,
                kv_head,
                num_kv_heads,
                window_row_ptr,
                PAGE_SIZE,
                HAS_WINDOW,
                WIDE_OFFSETS,
            )
            next_scales = _tile_scales(scale_ptrs, next_rows, next_mask, BITS)
            next_blocks = _table_blocks(table_row, tile_start + 2 * BLOCK_N + offs_n, end, PAGE_SIZE)
            is_visible = _code_mask(mask_n, window_page, HAS_WINDOW)
            if HAS_WINDOW:
                is_kept = _kept_mask(mask_n, window_page, HAS_WINDOW)
                first_kept = tl.minimum(first_kept, tl.where(is_kept, tile_start, end))
                last_kept = tl.maximum(last_kept, tl.where(is_kept, tile_start, start - BLOCK_N))
            tokens = (rows, window_page, rows, mask_n)
            state = _attend_tile_by_token(
                q,
                q_sum,
                state,
                is_visible,
                scale_log2,
                kv_ptrs,
                scales,
                tokens,
                HEAD_DIM,
                BLOCK_C,
                BITS,
                HAS_WINDOW,
                _CODES_ONLY,
                ODD_X16,
            )
            mask_n, rows, window_page, scales = next_mask, next_rows, next_window_page, next_scales
        if HAS_WINDOW:
            if ODD_X16:
                q = (q[0], q[1] * 16.0, q[2], q[3] * 16.0)
            # Not pipelined: one or two tiles, whose loads the compiler would otherwise issue
            # ahead for tiles past the last. Its tiles hold at most WINDOW_N tokens: whole FP16
            # rows of the main loop's 128-token INT4 tiles would take every register.
            WINDOW_N: tl.constexpr = min(BLOCK_N, WINDOW_TILE_TOKENS)
            offs_w = tl.arange(0, WINDOW_N)
            unused_scale = tl.zeros([WINDOW_N], tl.float32)  # the pass's tokens have scale 1, zero 0
            unused_scales = (unused_scale, unused_scale, unused_scale, unused_scale)
            for tile_start in tl.range(
                tl.min(first_kept, axis=0), tl.max(last_kept, axis=0) + BLOCK_N, WINDOW_N, num_stages=1
            ):
                tokens_w = _tokens(
                    table_row,
                    tile_start + offs_w,
                    end,
                    kv_head,
                    num_kv_heads,
                    window_row_ptr,
                    PAGE_SIZE,
                    HAS_WINDOW,
                    WIDE_OFFSETS,
                )
                is_kept = _kept_mask(tokens_w[3], tokens_w[1], HAS_WINDOW)
                state = _attend_tile_by_token(
                    q,
                    q_sum,
                    state,
                    is_kept,
                    scale_log2,
                    kv_ptrs,
                    unused_scales,
                    tokens_w,
                    HEAD_DIM,
                    BLOCK_C,
                    BITS,
                    HAS_WINDOW,
                    _KEPT_ONLY,
                    False,
                )

        m_i, l_i, acc = state
        has_tokens = l_i > 0.0
        denominator = tl.where(has_tokens, l_i, 1.0)[:, None]
        result = (
            tl.trans(acc[0]) / denominator,
            tl.trans(acc[1]) / denominator,
            tl.trans(acc[2]) / denominator,
            tl.trans(acc[3]) / denominator,
        )
        head_rows = seq.to(tl.int64) * num_kv_heads * group_size + heads  # [BLOCK_G]
        if IS_SPLIT:
            # partial_out: [num_seqs, num_heads, num_splits, HEAD_DIM]; partial_lse: [num_seqs, num_heads, num_splits]
            lse_offs = head_rows * num_splits + split
            lse = tl.where(has_tokens, m_i + tl.log2(tl.where(has_tokens, l_i, 1.0)), float("-inf"))
            tl.store(partial_lse_ptr + lse_offs, lse, mask=mask_g)
            _store_planes(partial_out_ptr + lse_offs[:, None] * HEAD_DIM, result, mask_g, HEAD_DIM, BITS, BLOCK_C)
        else:
            _store_planes(out_ptr + head_rows[:, None] * HEAD_DIM, result, mask_g, HEAD_DIM, BITS, BLOCK_C)

    @triton.jit
    def _num_partitions(context_len, partition_tokens, num_splits):
        # Partitions holding this sequence's tokens: at least one (an empty context gives
        # zeros through it), at most num_splits (max_context_len may stop short of context_len).
        return tl.minimum(tl.maximum(tl.cdiv(context_len, partition_tokens), 1), num_splits)

    @triton.jit
    def _sum_lanes(x, ROWS: tl.constexpr, LANES: tl.constexpr):
        # [ROWS, LANES] -> [ROWS]: lanes 2i and 2i + 1 added, and again, LANES a power of two.
        # Moving values between threads, never adding them in the layout's order, so the sum
        # is the same for any layout.
        for level in tl.static_range(1, LANES.bit_length()):
            x = tl.reshape(x, [ROWS, LANES >> level, 2])
            even, odd = tl.split(x)
            x = even + odd
        return tl.reshape(x, [ROWS])

    @triton.jit(do_not_specialize=["num_splits"])
    def _merge_partitions_kernel(
        partial_out_ptr,
        partial_lse_ptr,
        out_ptr,
        context_lens_ptr,
        partition_tokens,
        num_splits,
        HEAD_DIM: tl.constexpr,
        SLICE_D: tl.constexpr,
        LANES: tl.constexpr,
    ):
        # One program per (sequence, head, SLICE_D columns): the row's first num_parts partials,
        # each weighted by exp2(lse - max lse), in one pass: a chunk of LANES partitions at a
        # time (their loads in flight together), the sums so far rescaled when a chunk raises
        # the maximum. Partition s goes into lane s % LANES, then the lanes are added pairwise
        # (_sum_lanes); splits past num_parts are never read.
        seq = tl.program_id(0)
        row = seq.to(tl.int64) * tl.num_programs(1) + tl.program_id(1)
        num_parts = _num_partitions(tl.load(context_lens_ptr + seq), partition_tokens, num_splits)
        offs_d = tl.program_id(2) * SLICE_D + tl.arange(0, SLICE_D)
        offs_l = tl.arange(0, LANES)
        mask_d = offs_d < HEAD_DIM
        lse_row = partial_lse_ptr + row * num_splits
        part_row = partial_out_ptr + row * num_splits * HEAD_DIM
        max_lse = float("-inf")
        total = tl.zeros([1, LANES], tl.float32)
        acc = tl.zeros([SLICE_D, LANES], tl.float32)
        for chunk_start in range(0, num_parts, LANES):
            splits = chunk_start + offs_l
            is_part = splits < num_parts
            lse = tl.load(lse_row + splits, mask=is_part, other=float("-inf"), cache_modifier=".cg")
            part = tl.load(
                part_row + offs_d[:, None] + splits[None, :] * HEAD_DIM,
                mask=mask_d[:, None] & is_part[None, :],
                other=0.0,
                cache_modifier=".cg",
            )
            new_max = tl.maximum(max_lse, tl.max(lse, axis=0))
            # -inf until a partition has tokens (an empty context has none): weights 0 then.
            reference = tl.where(new_max == float("-inf"), 0.0, new_max)
            rescale = tl.exp2(max_lse - reference)  # 0 on the first chunk, 1 while the max holds
            weight = tl.exp2(lse - reference)[None, :]  # 0 past num_parts: adds exact zeros
            total = total * rescale + weight
            acc = acc * rescale + part * weight
            max_lse = new_max
        total = _sum_lanes(total, 1, LANES)
        result = _sum_lanes(acc, SLICE_D, LANES) / tl.where(total > 0.0, total, 1.0)
        tl.store(out_ptr + row * HEAD_DIM + offs_d, result.to(out_ptr.dtype.element_ty), mask=mask_d)

    @triton.jit
    def _prefill_kernel(
        q_ptr,
        k_cache_ptr,
        v_cache_ptr,
        k_scale_ptr,
        k_zero_ptr,
        v_scale_ptr,
        v_zero_ptr,
        window_k_ptr,
        window_v_ptr,
        window_row_ptr,
        block_tables_ptr,
        cu_seqlens_q_ptr,
        context_lens_ptr,
        out_ptr,
        scale_log2,
        stride_qt,
        stride_qh,
        stride_bt,
        stride_ot,
        stride_oh,
        num_kv_heads,
        group_size,
        PAGE_SIZE: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_C: tl.constexpr,
        BITS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        HAS_WINDOW: tl.constexpr,
        WIDE_OFFSETS: tl.constexpr,
    ):
        seq = tl.program_id(1)
        head = tl.program_id(2)
        kv_head = head // group_size
        q_start = tl.load(cu_seqlens_q_ptr + seq)
        q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
        context_len = tl.load(context_lens_ptr + seq)
        num_cached = context_len - q_len
        # Query tiles, like K/V tiles, sit at absolute positions (tile t holds positions
        # t * BLOCK_M ...), the chunk's new tokens masked in: a token meets the same tiles,
        # in the same row, whatever chunk of the prompt it comes in.
        q_tile = num_cached // BLOCK_M + tl.program_id(0)

        q_positions = q_tile * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        mask_m = (q_positions >= num_cached) & (q_positions < context_len)
        token_rows = (q_start + q_positions - num_cached).to(tl.int64)
        q, q_sum = _load_query_planes(
            q_ptr + token_rows[:, None] * stride_qt + head * stride_qh, mask_m, HEAD_DIM, BITS, BLOCK_C
        )

        # K/V up to the last query of this tile (causal); none when the tile has no new token.
        end = tl.minimum(context_len, (q_tile + 1) * BLOCK_M)
        end = tl.where((q_tile * BLOCK_M < context_len) & (q_len > 0), end, 0)

        acc0 = tl.zeros([BLOCK_M, BLOCK_C], tl.float32)
        state = (
            tl.full([BLOCK_M], float("-inf"), tl.float32),
            tl.zeros([BLOCK_M], tl.float32),
            (acc0, acc0, acc0, acc0),
        )
        kv_ptrs = (k_cache_ptr, window_k_ptr, v_cache_ptr, window_v_ptr)
        scale_ptrs = (k_scale_ptr, k_zero_ptr, v_scale_ptr, v_zero_ptr)
        table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
        # Position 0 is in the first tile and visible to every query, so m_i is finite after it.
        for tile_start in range(0, end, BLOCK_N):
            positions = tile_start + offs_n
            tokens = _tokens(
                table_row, positions, end, kv_head, num_kv_heads, window_row_ptr, PAGE_SIZE, HAS_WINDOW, WIDE_OFFSETS
            )
            scales = _tile_scales(scale_ptrs, tokens[0], tokens[3], BITS)
            is_visible = tokens[3][None, :] & (positions[None, :] <= q_positions[:, None])  # [BLOCK_M, BLOCK_N]
            state = _attend_tile(
                q, q_sum, state, is_visible, scale_log2, kv_ptrs, scales, tokens, HEAD_DIM, BLOCK_C, BITS, HAS_WINDOW
            )

        _, l_i, acc = state
        denominator = tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        result = (acc[0] / denominator, acc[1] / denominator, acc[2] / denominator, acc[3] / denominator)
        _store_planes(
            out_ptr + token_rows[:, None] * stride_ot + head * stride_oh, result, mask_m, HEAD_DIM, BITS, BLOCK_C
        )
