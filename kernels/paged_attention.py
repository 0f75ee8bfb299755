"""Attention over paged K/V caches (FP16, INT8 and INT4 pages): decode and prefill.

Decode is memory bound: a program owns one sequence, KV head and context partition and all the
query heads of that group (GQA), so each K/V byte is read once; long contexts are split into
partitions (flash-decoding) whose results a merge kernel adds through their log-sum-exps.
Prefill follows flash-attention 2, one program per (query tile, sequence, query head); tiles sit
at absolute positions, so a token meets the same tiles, bit for bit, whatever chunk or batch it
comes in (batch-invariant decode runs here too). Both gather K/V through the block table, use
exp2 with the scale folded into log2(e), accumulate in float32 and apply INT8/INT4 scales and
zeros to the dots' results: q . k_j = s_j (q . c_j) - s_j z_j sum(q), and for V
sum_j p_j v_j = sum_j (p_j s_j) c_j - sum_j p_j s_j z_j. Pages kept in FP16 are read from that copy.
The wrappers check their inputs and run the kernels where dispatch allows, else the `*_ref`s.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

import torch

from lowvram.errors import KernelError
from lowvram.kernels.dispatch import HAS_TRITON, num_sms, use_triton
from lowvram.kernels.kv_quant import KVPages, gather_kv

if HAS_TRITON:
    import triton

    from lowvram.kernels.paged_attention_kernels import _decode_kernel, _merge_partitions_kernel, _prefill_kernel

FORCE_REFERENCE = False  # True runs the plain-torch references everywhere (debugging, A/B checks)

# Decode partitions shorter than this cost more in the merge than they win in parallelism.
MIN_PARTITION_TOKENS = 128
TARGET_WAVES = 4
# The decode kernel's query rows per program at the least: one 8-wide tensor-core tile.
DECODE_MIN_GROUP = 8
# Tokens per decode tile by page bits, heads up to 128 wide, on GPUs with cp.async.
ASYNC_DECODE_TILE_TOKENS = {16: 32, 8: 64, 4: 128}
# The merge: a program per MERGE_SLICE_D columns over MERGE_KERNEL_LANES lanes, or a whole head
# per program for up to WHOLE_HEAD_MERGE_SPLITS partitions.
MERGE_SLICE_D = 32
MERGE_KERNEL_LANES = 128
WHOLE_HEAD_MERGE_SPLITS = 64
_LOG2_E = 1.4426950408889634


@dataclass(frozen=True)
class DecodeConfig:
    """The decode kernel's tuning (benchmarks pass it as `_config`): block_n tokens per tile, a
    power of two >= 16; Triton's num_warps and num_stages."""

    block_n: int
    num_warps: int
    num_stages: int


# For grids of no more programs than SMs: a partition's loads issued at once.
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
            # Measured (scripts/bench_paged_attention.py --sweep); one warp needs no barrier.
            block_n = ASYNC_DECODE_TILE_TOKENS[bits]
            num_warps = 1 if bits == 16 else 2
        elif bits == 16:
            num_stages = 2  # wider heads' FP16 pages (MLA's 576: 16-row tiles over 8 warps)
    return DecodeConfig(block_n=_tile_rows(block_d, block_n), num_warps=num_warps, num_stages=num_stages)


def decode_config(device, head_dim, bits, num_seqs, num_kv_heads, max_context_len, *, is_partitioning_fixed=False):
    """`default_decode_config`, fitted to the call's grid on GPUs with cp.async for heads up to 128
    unless the caller fixed the partition count."""
    config = default_decode_config(device, head_dim, bits)
    if is_partitioning_fixed or not _has_async_copies(device) or _block_d(head_dim) > 128:
        return config
    return fit_decode_config(config, num_seqs, num_kv_heads, max_context_len, num_sms(device))


def fit_decode_config(config: DecodeConfig, num_seqs, num_kv_heads, max_context_len, sm_count) -> DecodeConfig:
    """`config` for the default partitioning on `sm_count` SMs: LATENCY_DECODE_CONFIG when there
    are no more programs than SMs; else tiles halved, down to MIN_FITTED_TILE_TOKENS, while a
    partition is shorter than MIN_TILES_PER_PARTITION tiles."""
    num_splits = choose_num_splits(num_seqs, num_kv_heads, max_context_len, sm_count)
    if num_seqs * num_kv_heads * num_splits <= sm_count:
        return LATENCY_DECODE_CONFIG
    partition_tokens = math.ceil(max(1, max_context_len) / num_splits)
    block_n = config.block_n
    while block_n > MIN_FITTED_TILE_TOKENS and partition_tokens < MIN_TILES_PER_PARTITION * block_n:
        block_n //= 2
    return replace(config, block_n=block_n)


def _has_async_copies(device: torch.device) -> bool:
    # Ampere and later pipeline tile loads through shared memory (cp.async); Turing does not.
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 8


def _use_triton(kernel_name: str, device: torch.device, use_reference: bool, head_dim: int = 128) -> bool:
    # MLA's 576-wide heads need 128 KiB of shared memory; Turing has 64 KiB: the torch path.
    is_too_wide = head_dim > 256 and device.type == "cuda" and not _has_async_copies(device)
    return use_triton(kernel_name, device, use_reference or FORCE_REFERENCE or is_too_wide)


def _decode_block_n(device: torch.device) -> int:
    # Small tiles in the interpreter, so tiny tests cross tile and partition edges.
    return 16 if device.type == "cpu" else 64


def _sequence_kv(pages: KVPages, block_table: torch.Tensor, num_tokens: int):
    positions = torch.arange(num_tokens, device=block_table.device)
    block_size = pages.block_size
    slots = block_table[positions // block_size].long() * block_size + positions % block_size
    return gather_kv(pages, slots)


def _attend(q: torch.Tensor, k, v, scale: float, q_positions: torch.Tensor | None) -> torch.Tensor:
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


def paged_decode_attention_ref(q: torch.Tensor, pages: KVPages, block_tables, context_lens, scale: float):
    """Decode attention in float32, returned in q's dtype; empty sequences give zeros."""
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for seq, context_len in enumerate(context_lens.tolist()):
        if context_len == 0:
            continue
        k, v = _sequence_kv(pages, block_tables[seq], context_len)
        out[seq] = _attend(q[seq : seq + 1].float(), k, v, scale, None)[0]
    return out.to(q.dtype)


def paged_prefill_attention_ref(q: torch.Tensor, pages: KVPages, block_tables, cu_seqlens_q, context_lens, scale):
    """Causal prefill attention in float32, returned in q's dtype."""
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


def _check_common(name: str, q: torch.Tensor, pages: KVPages, block_tables, context_lens):
    pages.validate()
    if q.dim() != 3:
        raise KernelError(f"{name}: q has shape {tuple(q.shape)}; expected 3 dims [tokens, num_heads, head_dim]")
    num_heads, head_dim = q.shape[1], q.shape[2]
    if head_dim != pages.head_dim:
        raise KernelError(f"{name}: q has head_dim {head_dim} but the pages hold head_dim {pages.head_dim}")
    if num_heads % pages.num_kv_heads:
        raise KernelError(f"{name}: q has {num_heads} heads, not a multiple of the {pages.num_kv_heads} KV heads")
    if q.dtype not in (torch.float16, torch.float32) and not (q.dtype == torch.bfloat16 and q.device.type == "cpu"):
        raise KernelError(f"{name}: q has dtype {q.dtype}; expected float16 or float32 (bfloat16 on the CPU)")
    if not pages.is_quantized and q.dtype != pages.k.dtype:
        raise KernelError(f"{name}: q is {q.dtype} but the fp16 pages are {pages.k.dtype}; they must match")
    if q.shape[0] and q.stride(2) != 1:
        raise KernelError(f"{name}: q must be contiguous in its last dim (strides {q.stride()})")
    num_seqs = context_lens.shape[0] if context_lens.dim() == 1 else -1
    if context_lens.dim() != 1 or context_lens.dtype != torch.int32 or not context_lens.is_contiguous():
        got = f"{tuple(context_lens.shape)} {context_lens.dtype}"
        raise KernelError(f"{name}: context_lens is {got}; expected contiguous int32 [num_seqs]")
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs or block_tables.dtype != torch.int32:
        got = f"{tuple(block_tables.shape)} {block_tables.dtype}"
        raise KernelError(f"{name}: block_tables is {got}; expected int32 [{num_seqs}, max_blocks]")
    if block_tables.shape[1] and block_tables.stride(1) != 1:
        raise KernelError(f"{name}: block_tables must be contiguous in its last dim (strides {block_tables.stride()})")
    for tensor_name, tensor in (("q", q), ("block_tables", block_tables), ("context_lens", context_lens)):
        if tensor.device != pages.device:
            raise KernelError(f"{name}: {tensor_name} is on {tensor.device} but the pages are on {pages.device}")


def _check_kernel_head_dim(name: str, head_dim: int, bits: int) -> None:
    num_planes = 16 // bits
    if head_dim < 16 or head_dim % num_planes:
        raise KernelError(
            f"{name}: the Triton kernel needs head_dim >= 16 and, for {bits}-bit pages, a multiple of "
            f"{num_planes}; got {head_dim}; pass use_reference=True to use the plain-torch path"
        )


def _block_d(head_dim: int) -> int:
    # Tiles span a power of two of the head (MLA's 576 in 1024), the rest masked; no Triton here.
    return 1 << max(0, head_dim - 1).bit_length()


def plane_layout(bits: int, head_dim: int) -> dict:
    """The kernels' plane width (paged_kv_tiles): 1, 2 or 4 planes for 16, 8 or 4 bits, at least
    tl.dot's 16 columns."""
    return {"BLOCK_C": max(16, _block_d(head_dim // (16 // bits)))}


def _tile_rows(block_d: int, rows: int) -> int:
    # Wide rows shrink the tiles to fit shared memory and the accumulator registers.
    if block_d > 512:
        return min(rows, 16)
    return min(rows, 32) if block_d > 256 else rows


def _needs_wide_offsets(pages: KVPages) -> bool:
    """Whether a page array has 2**31 elements or more: the kernels then use int64 offsets."""
    return any(a.numel() and a.shape[0] * a.stride(0) >= 2**31 for a in pages.kernel_tensors())


def _page_constants(pages: KVPages, head_dim: int) -> dict:
    constants = {
        "PAGE_SIZE": pages.block_size,
        "HEAD_DIM": head_dim,
        "BITS": pages.bits,
        "HAS_WINDOW": pages.has_window,
    }
    return {**constants, **plane_layout(pages.bits, head_dim), "WIDE_OFFSETS": _needs_wide_offsets(pages)}


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_context_len: int, sm_count: int) -> int:
    """Partitions per sequence: about TARGET_WAVES programs per SM (enough loads in flight to
    saturate bandwidth), none shorter than MIN_PARTITION_TOKENS."""
    max_useful = max(1, math.ceil(max_context_len / MIN_PARTITION_TOKENS))
    wanted = math.ceil(TARGET_WAVES * sm_count / max(1, num_seqs * num_kv_heads))
    return max(1, min(wanted, max_useful))


def plan_decode_partitions(num_seqs, num_kv_heads, max_context_len, device, num_splits=None, *, block_n=None):
    """(num_splits, partition_tokens) of `paged_decode_attention`: whole tiles of `block_n` tokens."""
    if block_n is None:
        block_n = _decode_block_n(device)
    max_context_len = max(1, max_context_len)
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, num_kv_heads, max_context_len, num_sms(device))
    partition_tokens = math.ceil(math.ceil(max_context_len / max(1, num_splits)) / block_n) * block_n
    return math.ceil(max_context_len / partition_tokens), partition_tokens


def _check_config(name: str, config: DecodeConfig) -> None:
    block_n, num_warps = config.block_n, config.num_warps
    if block_n < 16 or block_n & (block_n - 1) or num_warps not in (1, 2, 4, 8, 16) or config.num_stages < 1:
        raise KernelError(f"{name}: {config}; expected block_n a power of two >= 16, num_warps <= 16, num_stages >= 1")


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
    """Attention of one new token per sequence over its cached context (its own K/V included).

    q [num_seqs, num_heads, head_dim] (float16, or float32 with float32/quantized pages);
    block_tables int32 [num_seqs, max_blocks]; context_lens int32 [num_seqs]. Returns q's shape
    and dtype. `num_splits` forces the partition count (1 = none), else it follows
    `max_context_len` (default: the table's capacity, no device sync; never below a context_len).
    `_config` overrides the kernel's tuning, for benchmarks.
    """
    name = "paged_decode_attention"
    _check_common(name, q, pages, block_tables, context_lens)
    if q.shape[0] != context_lens.shape[0]:
        raise KernelError(f"{name}: q has {q.shape[0]} rows but context_lens has {context_lens.shape[0]} sequences")
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = pages.num_kv_heads
    if max_context_len is None:
        max_context_len = block_tables.shape[1] * pages.block_size
    is_fixed = num_splits is not None
    config = _config or decode_config(
        q.device, head_dim, pages.bits, num_seqs, num_kv_heads, max_context_len, is_partitioning_fixed=is_fixed
    )
    _check_config(name, config)
    num_splits, partition_tokens = plan_decode_partitions(
        num_seqs, num_kv_heads, max_context_len, q.device, num_splits, block_n=config.block_n
    )
    if num_seqs == 0:
        return torch.empty_like(q)
    if not _use_triton(name, q.device, use_reference, head_dim):
        return paged_decode_attention_ref(q, pages, block_tables, context_lens, scale)
    _check_kernel_head_dim(name, head_dim, pages.bits)
    group_size = num_heads // num_kv_heads
    is_split = num_splits > 1
    out = torch.empty((num_seqs, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if is_split:
        partial_out = torch.empty((num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
        partial_lse = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32, device=q.device)
    else:
        partial_out, partial_lse = out, out  # unused without splitting
    args = (q, pages.kernel_tensors(), block_tables, context_lens, out, partial_out, partial_lse, scale * _LOG2_E)
    sizes = (q.stride(0), q.stride(1), block_tables.stride(0), num_kv_heads, group_size, partition_tokens, num_splits)
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        *args,
        *sizes,
        **_page_constants(pages, head_dim),
        BLOCK_G=max(DECODE_MIN_GROUP, triton.next_power_of_2(group_size)),
        BLOCK_N=config.block_n,
        IS_SPLIT=is_split,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if is_split:
        block_d = _block_d(head_dim)
        slice_d, lanes = MERGE_SLICE_D, MERGE_KERNEL_LANES
        if num_splits <= WHOLE_HEAD_MERGE_SPLITS and block_d <= 128:
            slice_d, lanes = block_d, max(2, triton.next_power_of_2(num_splits))
        grid = (num_seqs, num_heads, triton.cdiv(head_dim, slice_d))
        args = (partial_out, partial_lse, out, context_lens, partition_tokens, num_splits)
        _merge_partitions_kernel[grid](*args, HEAD_DIM=head_dim, SLICE_D=slice_d, LANES=lanes, num_warps=4)
    return out


def paged_prefill_attention(
    q, pages: KVPages, block_tables, cu_seqlens_q, context_lens, scale, *, max_q_len=None, use_reference=False
):
    """Causal attention of a variable-length batch of new tokens over paged K/V.

    q [total_new_tokens, num_heads, head_dim]; sequence s owns rows cu_seqlens_q[s]:cu_seqlens_q[s + 1]
    (int32 [num_seqs + 1]), the last q_len of its context_lens[s] tokens, already in the pages;
    new token i sits at position context_lens[s] - q_len + i. `max_q_len` (the longest q_len)
    sizes the grid; computed with a device sync when omitted.
    """
    name = "paged_prefill_attention"
    _check_common(name, q, pages, block_tables, context_lens)
    num_seqs = context_lens.shape[0]
    if cu_seqlens_q.shape != (num_seqs + 1,) or cu_seqlens_q.dtype != torch.int32 or not cu_seqlens_q.is_contiguous():
        got = f"{tuple(cu_seqlens_q.shape)} {cu_seqlens_q.dtype}"
        raise KernelError(f"{name}: cu_seqlens_q is {got}; expected contiguous int32 [{num_seqs + 1}]")
    if cu_seqlens_q.device != pages.device:
        raise KernelError(f"{name}: cu_seqlens_q is on {cu_seqlens_q.device} but the pages are on {pages.device}")
    if q.shape[0] == 0 or num_seqs == 0:
        return torch.zeros_like(q)
    if not _use_triton(name, q.device, use_reference, q.shape[2]):
        return paged_prefill_attention_ref(q, pages, block_tables, cu_seqlens_q, context_lens, scale)
    _check_kernel_head_dim(name, q.shape[2], pages.bits)

    num_heads, head_dim = q.shape[1:]
    if max_q_len is None:
        max_q_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    block_m = block_n = 16 if q.device.type == "cpu" else _tile_rows(_block_d(head_dim), 64)
    out = torch.zeros_like(q, memory_format=torch.contiguous_format)
    # One more query tile: a chunk after a cached prefix may start inside a tile.
    grid = (triton.cdiv(max(1, max_q_len), block_m) + 1, num_seqs, num_heads)
    args = (q, pages.kernel_tensors(), block_tables, cu_seqlens_q, context_lens, out, scale * _LOG2_E)
    strides = (q.stride(0), q.stride(1), block_tables.stride(0), out.stride(0), out.stride(1))
    _prefill_kernel[grid](
        *args,
        strides,
        pages.num_kv_heads,
        num_heads // pages.num_kv_heads,
        **_page_constants(pages, head_dim),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        num_warps=8 if _block_d(head_dim) >= 512 else 4,
    )
    return out
