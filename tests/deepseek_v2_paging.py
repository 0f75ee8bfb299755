"""Running a DeepseekV2ForCausalLM by hand over paged KV, as the tests compare it with transformers."""

import torch

from lowvram.kernels.kv_quant import allocate_pages
from lowvram.kv.attention import AttentionMetadata

BLOCK_SIZE = 4
NUM_DECODE_STEPS = 16
MAX_REL_DIFF = 1e-4


def transformers_reference(checkpoint):
    """transformers' own DeepseekV2ForCausalLM on `checkpoint`, in float32: what the tests compare against."""
    from transformers import DeepseekV2ForCausalLM

    return DeepseekV2ForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()


def _metadata(
    block_table: list[int], num_cached: int, num_new: int, device: torch.device | str = "cpu"
) -> tuple[AttentionMetadata, torch.Tensor]:
    positions = torch.arange(num_cached, num_cached + num_new)
    blocks = torch.tensor(block_table)
    slots = blocks[positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
    context_len = num_cached + num_new
    meta = AttentionMetadata(
        is_prefill=num_cached == 0,
        slot_mapping=slots.long().to(device),
        block_tables=blocks[None].int().to(device),
        context_lens=torch.tensor([context_len], dtype=torch.int32, device=device),
        cu_seqlens_q=torch.tensor([0, num_new], dtype=torch.int32, device=device),
        max_context_len=context_len,
        context_lens_cpu=[context_len],
        query_lens_cpu=[num_new],
    )
    return meta, positions.to(device)


def greedy_through_pages(
    model, prompt: list[int], num_steps: int, forced: list[int] | None = None
) -> tuple[list[int], torch.Tensor]:
    """Prefill then greedy decode through paged KV on the model's device; returns (new tokens,
    logits of every step [1 + steps, V]). `forced` feeds these tokens instead of the argmax
    (to compare two models step by step where rounding could flip a near tie)."""
    device = model.lm_head.weight.device
    num_tokens = len(prompt) + num_steps
    num_blocks = -(-num_tokens // BLOCK_SIZE) + 1
    # the pool layout (deepseek_v2.layer_kv_pages): num_kv_layers layers of one kv_head_dim head
    c = model.config
    pages = [
        allocate_pages(num_blocks, BLOCK_SIZE, 1, c.kv_head_dim, "fp16", model.dtype, device)
        for _ in range(c.num_kv_layers)
    ]
    # Scattered, descending block ids: a model that ignores the block table reads the wrong rows.
    block_table = list(range(num_blocks - 1, 0, -1))
    meta, positions = _metadata(block_table, 0, len(prompt), device)
    with torch.no_grad():
        hidden = model(torch.tensor(prompt, device=device), positions, meta, pages)
        step_logits = [model.compute_logits(hidden[-1:])]
        tokens = []
        for step in range(num_steps):
            tokens.append(forced[step] if forced is not None else int(step_logits[-1].argmax()))
            meta, positions = _metadata(block_table, len(prompt) + len(tokens) - 1, 1, device)
            hidden = model(torch.tensor(tokens[-1:], device=device), positions, meta, pages)
            step_logits.append(model.compute_logits(hidden))
    return tokens, torch.cat(step_logits).cpu()


def rel_diff(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return float((ours - theirs).abs().max() / theirs.abs().max())
