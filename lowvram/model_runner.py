"""Turns a ScheduledBatch into tensors, runs the model, returns last-token logits."""

from __future__ import annotations

import torch

from lowvram.attention import AttentionMetadata
from lowvram.block_manager import BlockManager
from lowvram.kv_quant import allocate_pages
from lowvram.model import CausalLM
from lowvram.scheduler import ScheduledBatch


class ModelRunner:
    def __init__(self, model: CausalLM, block_manager: BlockManager, num_blocks: int, device: torch.device,
                 dtype: torch.dtype, kv_precision: str = "fp16"):
        config = model.config
        self.model = model
        self.block_manager = block_manager
        self.device = device
        self.block_size = block_manager.block_size
        # one KVPages per layer: k/v [num_blocks, block_size, Hkv, D] (INT4: D/2 bytes)
        self.kv_pages = [
            allocate_pages(num_blocks, self.block_size, config.num_kv_heads, config.head_dim, kv_precision, dtype, device)
            for _ in range(config.num_layers)
        ]

    def prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        cu_seqlens = [0]
        context_lens: list[int] = []
        tables: list[list[int]] = []
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + num_new
            table = self.block_manager.block_table(seq.seq_id)
            input_ids.extend(seq.all_token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(table[p // self.block_size] * self.block_size + p % self.block_size for p in range(start, end))
            cu_seqlens.append(cu_seqlens[-1] + num_new)
            context_lens.append(end)
            tables.append(table)
        max_blocks = max(len(t) for t in tables)
        padded = [t + [0] * (max_blocks - len(t)) for t in tables]
        dev = self.device
        meta = AttentionMetadata(
            is_prefill=batch.is_prefill,
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=dev),
            context_lens=torch.tensor(context_lens, dtype=torch.int32, device=dev),
            cu_seqlens_q=torch.tensor(cu_seqlens, dtype=torch.int32, device=dev),
            max_context_len=max(context_lens),
            context_lens_cpu=context_lens,
            query_lens_cpu=list(batch.num_new_tokens),
        )
        ids = torch.tensor(input_ids, dtype=torch.long, device=dev)
        pos = torch.tensor(positions, dtype=torch.long, device=dev)
        last_rows = [end - 1 for end in cu_seqlens[1:]]
        return ids, pos, meta, last_rows

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch, *, is_all_rows: bool = False) -> torch.Tensor:
        """FP32 logits [S, vocab] at the last new token of each scheduled sequence
        (or [T, vocab] at every new token with is_all_rows, for scoring text)."""
        ids, pos, meta, last_rows = self.prepare(batch)
        hidden = self.model(ids, pos, meta, self.kv_pages)
        return self.model.compute_logits(hidden if is_all_rows else hidden[last_rows])
