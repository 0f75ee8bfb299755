"""Running a dense CausalLM by hand over paged KV: a prefill, then one decode step per token."""

import torch

from lowvram.kernels.kv_quant import allocate_pages
from lowvram.kv.attention import AttentionMetadata

BLOCK_SIZE = 4


def _step(model, token_ids: list[int], num_cached: int, pages) -> torch.Tensor:
    """One forward over `token_ids` after `num_cached` cached tokens (block table 0, 1, ...)."""
    device = model.lm_head.weight.device
    num_new = len(token_ids)
    positions = torch.arange(num_cached, num_cached + num_new, device=device)
    context_len = num_cached + num_new
    meta = AttentionMetadata(
        is_prefill=num_cached == 0,
        slot_mapping=positions.clone(),
        block_tables=torch.arange(context_len // BLOCK_SIZE + 1, dtype=torch.int32, device=device)[None],
        context_lens=torch.tensor([context_len], dtype=torch.int32, device=device),
        cu_seqlens_q=torch.tensor([0, num_new], dtype=torch.int32, device=device),
        max_context_len=context_len,
        context_lens_cpu=[context_len],
        query_lens_cpu=[num_new],
    )
    with torch.no_grad():
        return model(torch.tensor(token_ids, device=device), positions, meta, pages)


def hidden_states_through_pages(
    model, prompt: list[int], decoded: list[int], precision: str = "fp16"
) -> list[torch.Tensor]:
    """Final hidden states of the prefill of `prompt` [len(prompt), hidden], then of one decode
    step per token of `decoded` [1, hidden], over fresh `precision` pages."""
    config = model.config
    device = model.lm_head.weight.device
    num_blocks = (len(prompt) + len(decoded)) // BLOCK_SIZE + 2
    pages = [
        allocate_pages(
            num_blocks,
            BLOCK_SIZE,
            config.num_kv_heads,
            config.head_dim,
            precision,
            dtype=model.lm_head.weight.dtype,
            device=device,
        )
        for _ in range(config.num_layers)
    ]
    hidden = [_step(model, prompt, 0, pages)]
    for i, token in enumerate(decoded):
        hidden.append(_step(model, [token], len(prompt) + i, pages))
    return hidden
