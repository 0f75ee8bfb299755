"""Attention over paged KV: the metadata the runner builds, and the dispatch to the
kernels (`lowvram.kernels.paged_attention`, `lowvram.kernels.kv_write`).

Pages of one layer are a `KVPages` (FP16, INT8 or INT4); the slot of the token at
position p of a sequence is `block_table[p // block_size] * block_size + p % block_size`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lowvram.kernels.kv_quant import KVPages
from lowvram.kernels.kv_write import rotary_write_kv, write_kv
from lowvram.kernels.paged_attention import paged_decode_attention, paged_prefill_attention


@dataclass
class AttentionMetadata:
    """What one forward step needs to read and write the paged KV cache.

    Tokens of all sequences are flattened into one dimension T. In a prefill step
    sequence s owns rows cu_seqlens_q[s]:cu_seqlens_q[s+1] (its new tokens, which
    are the last ones of its context); in a decode step each sequence has one row.
    """

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
    """Rotate-half RoPE for this step's q and k: each token's position [T] and the float32
    cos and sin tables [P, D/2], P above every position (`lowvram.models.dense.Rotary`)."""

    positions: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor


def _is_kernel_path(q: torch.Tensor, head_dim: int) -> bool:
    # Triton kernels run on CUDA for head sizes of 16 and up (a size that is not a power
    # of two, like MLA's 576, is padded inside the kernels); the CPU (and tiny head
    # sizes) use the plain-torch references beside the kernels.
    return q.is_cuda and head_dim >= 16


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pages: KVPages,
    meta: AttentionMetadata,
    scale: float,
    rope: Rope | None = None,
    *,
    batch_invariant: bool = False,
    is_stored: bool = False,
) -> torch.Tensor:
    """Store this step's k, v (quantizing for INT8/INT4 pages) then attend.

    q [T, H, D], k/v [T, Hkv, D] -> [T, H, D]. With `rope`, q and k are first rotated in
    place, in the kernel that stores k and v (one launch, not two). `batch_invariant` gives
    each row the same bits whatever else the step holds and whichever kind of step computes
    it (lowvram.models.batch_invariance). `is_stored`: q and k are rotated and k, v stored already (the
    fused q/k/v projection's kernel did it; model.Attention.fused_rope_kv).
    """
    use_reference = not _is_kernel_path(q, q.shape[-1])
    if not is_stored:
        if rope is None:
            write_kv(k, v, meta.slot_mapping, pages, use_reference=use_reference)
        else:
            rotary_write_kv(
                q, k, v, rope.positions, rope.cos, rope.sin, meta.slot_mapping, pages, use_reference=use_reference
            )
    if batch_invariant and use_reference:
        return _rows_ref(q, pages, meta, scale)
    if meta.is_prefill or batch_invariant:
        # Batch-invariant decode rows go through the prefill kernel too, whose tiles sit at
        # absolute positions: a generated token then gets the same bits from its decode step
        # and from the prefill that recomputes it after a preemption.
        return paged_prefill_attention(
            q,
            pages,
            meta.block_tables,
            meta.cu_seqlens_q,
            meta.context_lens,
            scale,
            max_q_len=max(meta.query_lens_cpu),
            use_reference=use_reference,
        )
    return paged_decode_attention(
        q,
        pages,
        meta.block_tables,
        meta.context_lens,
        scale,
        max_context_len=meta.max_context_len,
        use_reference=use_reference,
    )


def _rows_ref(q: torch.Tensor, pages: KVPages, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Plain-torch attention one query row at a time, each over exactly its causal prefix, for
    prefill and decode rows alike: the whole-chunk reference's matmul and softmax shapes
    follow the chunk, so a token's bits would depend on where the scheduler cut its prompt,
    and on whether a decode step or a recompute computed it."""
    out = torch.empty_like(q)
    one_row = torch.tensor([0, 1], dtype=torch.int32, device=q.device)  # cu_seqlens_q of a one-row step
    row = 0
    for seq, (context_len, query_len) in enumerate(zip(meta.context_lens_cpu, meta.query_lens_cpu)):
        for position in range(context_len - query_len, context_len):
            out[row : row + 1] = paged_prefill_attention(
                q[row : row + 1],
                pages,
                meta.block_tables[seq : seq + 1],
                one_row,
                torch.tensor([position + 1], dtype=torch.int32, device=q.device),
                scale,
                max_q_len=1,
                use_reference=True,
            )
            row += 1
    return out
