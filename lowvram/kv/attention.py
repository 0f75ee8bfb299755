"""Attention over paged KV: the step metadata the runner builds, and the dispatch to the
kernels. The token at position p of a sequence lives in slot
`block_table[p // block_size] * block_size + p % block_size` of a layer's `KVPages`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lowvram.kernels.kv_quant import KVPages
from lowvram.kernels.kv_write import rotary_write_kv, write_kv
from lowvram.kernels.paged_attention import paged_decode_attention, paged_prefill_attention


@dataclass
class AttentionMetadata:
    """What one step needs to read and write the paged KV cache. Tokens of all sequences are
    flattened into T rows: in a prefill sequence s owns rows cu_seqlens_q[s]:cu_seqlens_q[s+1]
    (the last tokens of its context); in a decode step each sequence has one row."""

    is_prefill: bool
    slot_mapping: torch.Tensor  # [T] int64, -1 = do not store
    block_tables: torch.Tensor  # [S, max_blocks] int32
    context_lens: torch.Tensor  # [S] int32, tokens in the cache after this step
    cu_seqlens_q: torch.Tensor  # [S+1] int32
    max_context_len: int
    context_lens_cpu: list[int]
    query_lens_cpu: list[int]


@dataclass
class Rope:
    """Rotate-half RoPE for this step: each token's position [T] and the float32 cos and sin
    tables [P, D/2], P above every position (`lowvram.models.dense.Rotary`)."""

    positions: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor


def _is_kernel_path(q: torch.Tensor, head_dim: int) -> bool:
    # Triton runs on CUDA for head sizes from 16 (MLA's 576 is padded inside the kernels);
    # the CPU and tiny heads use the plain-torch references.
    return q.is_cuda and head_dim >= 16


def paged_attention(
    q, k, v, pages: KVPages, meta: AttentionMetadata, scale, rope=None, *, batch_invariant=False, is_stored=False
) -> torch.Tensor:
    """Store this step's k, v (quantized for INT8/INT4 pages; first rotating q and k in place with
    a `Rope`), then attend with softmax `scale`: q [T, H, D], k/v [T, Hkv, D] -> [T, H, D].
    `batch_invariant`: a row's bits do not depend on the rest of the step nor its kind.
    `is_stored`: already rotated and stored."""
    use_reference = not _is_kernel_path(q, q.shape[-1])
    if not is_stored and rope is None:
        write_kv(k, v, meta.slot_mapping, pages, use_reference=use_reference)
    elif not is_stored:
        rotary_write_kv(
            q, k, v, rope.positions, rope.cos, rope.sin, meta.slot_mapping, pages, use_reference=use_reference
        )
    if batch_invariant and use_reference:
        return _rows_ref(q, pages, meta, scale)
    if meta.is_prefill or batch_invariant:
        # Batch-invariant decode rows take the prefill kernel too, whose tiles sit at absolute
        # positions: a token gets the same bits from its decode step and from a recompute.
        max_q_len = max(meta.query_lens_cpu)
        tables, cu_seqlens, lens = meta.block_tables, meta.cu_seqlens_q, meta.context_lens
        return paged_prefill_attention(
            q, pages, tables, cu_seqlens, lens, scale, max_q_len=max_q_len, use_reference=use_reference
        )
    tables, lens, max_len = meta.block_tables, meta.context_lens, meta.max_context_len
    return paged_decode_attention(q, pages, tables, lens, scale, max_context_len=max_len, use_reference=use_reference)


def _rows_ref(q: torch.Tensor, pages: KVPages, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Plain-torch attention one row at a time over exactly its prefix: the whole-chunk reference's
    shapes, so a token's bits, would depend on where the prompt was cut and on the kind of step."""
    out = torch.empty_like(q)
    one_row = torch.tensor([0, 1], dtype=torch.int32, device=q.device)  # cu_seqlens_q of a one-row step
    row = 0
    for seq, (context_len, query_len) in enumerate(zip(meta.context_lens_cpu, meta.query_lens_cpu)):
        for position in range(context_len - query_len, context_len):
            length = torch.tensor([position + 1], dtype=torch.int32, device=q.device)
            tables = meta.block_tables[seq : seq + 1]
            out[row : row + 1] = paged_prefill_attention(
                q[row : row + 1], pages, tables, one_row, length, scale, max_q_len=1, use_reference=True
            )
            row += 1
    return out
