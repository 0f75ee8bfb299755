"""Attention over paged KV: the metadata the runner builds and plain-torch paths.

Pages of one layer: `k_cache`, `v_cache`: [num_blocks, block_size, num_kv_heads, head_dim].
The slot of the token at position p of a sequence is
`block_table[p // block_size] * block_size + p % block_size`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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


def write_kv_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store k, v [T, Hkv, D] at their slots; slots < 0 are skipped."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    # flat caches: [num_blocks * block_size, Hkv, D]
    k_cache.view(-1, num_kv_heads, head_dim)[slots] = k[keep].to(k_cache.dtype)
    v_cache.view(-1, num_kv_heads, head_dim)[slots] = v[keep].to(v_cache.dtype)


def _gather_context(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    block_size = cache.shape[1]
    pos = torch.arange(length, device=cache.device)
    slots = block_table[pos // block_size].long() * block_size + pos % block_size
    return cache.view(-1, cache.shape[2], cache.shape[3])[slots]  # [L, Hkv, D]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """q [Q, H, D], k/v [L, Hkv, D], mask [Q, L] (True = visible) -> [Q, H, D] in FP32."""
    num_q, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    qf = q.float().view(num_q, num_kv_heads, group, head_dim)  # [Q, Hkv, G, D]
    scores = torch.einsum("qhgd,lhd->hgql", qf, k.float()) * scale  # [Hkv, G, Q, L]
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("hgql,lhd->qhgd", probs, v.float())  # [Q, Hkv, G, D]
    return out.reshape(num_q, num_heads, head_dim)


def paged_prefill_attention_ref(q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its whole context."""
    out = torch.empty_like(q)
    for s, (q_len, ctx_len) in enumerate(zip(meta.query_lens_cpu, meta.context_lens_cpu)):
        start = int(meta.cu_seqlens_q[s])
        k = _gather_context(k_cache, meta.block_tables[s], ctx_len)
        v = _gather_context(v_cache, meta.block_tables[s], ctx_len)
        q_pos = torch.arange(ctx_len - q_len, ctx_len, device=q.device)
        mask = q_pos[:, None] >= torch.arange(ctx_len, device=q.device)[None, :]  # [Q, L]
        out[start : start + q_len] = _attend(q[start : start + q_len], k, v, mask, scale).to(q.dtype)
    return out


def paged_decode_attention_ref(q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """One query per sequence over its context; sequences batched with padding."""
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    max_len = meta.max_context_len
    pos = torch.arange(max_len, device=q.device)
    blocks = meta.block_tables[:, pos // block_size].long()  # [S, L]
    slots = blocks * block_size + pos % block_size
    k = k_cache.view(-1, num_kv_heads, head_dim)[slots].float()  # [S, L, Hkv, D]
    v = v_cache.view(-1, num_kv_heads, head_dim)[slots].float()
    group = num_heads // num_kv_heads
    qf = q.float().view(num_seqs, num_kv_heads, group, head_dim)
    scores = torch.einsum("shgd,slhd->shgl", qf, k) * scale  # [S, Hkv, G, L]
    visible = pos[None, :] < meta.context_lens[:, None].long()  # [S, L]
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("shgl,slhd->shgd", probs, v)
    return out.reshape(num_seqs, num_heads, head_dim).to(q.dtype)


def paged_attention(q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Store this step's k, v then attend: q [T, H, D], k/v [T, Hkv, D] -> [T, H, D]."""
    write_kv_ref(k, v, k_cache, v_cache, meta.slot_mapping)
    if meta.is_prefill:
        return paged_prefill_attention_ref(q, k_cache, v_cache, meta, scale)
    return paged_decode_attention_ref(q, k_cache, v_cache, meta, scale)
