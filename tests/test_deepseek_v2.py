"""DeepseekV2ForCausalLM against transformers' implementation on a tiny random checkpoint (FP32, CPU).

Prefill and decode go through paged KV with a block size smaller than the prompt,
so page boundaries, the latent cache layout and absorbed up-projections are all
exercised; logits must match transformers within 1e-4 relative.
"""

import pytest
import torch

from lowvram.attention import AttentionMetadata
from lowvram.model_deepseek_v2 import DeepseekV2Config, allocate_latent_pages, load_deepseek_v2, softmax_scale

BLOCK_SIZE = 4
NUM_DECODE_STEPS = 16
MAX_REL_DIFF = 1e-4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from lowvram.testing import make_tiny_deepseek_v2

    return make_tiny_deepseek_v2(tmp_path_factory.mktemp("dsv2"), seed=0)


@pytest.fixture(scope="module")
def reference(checkpoint):
    from transformers import DeepseekV2ForCausalLM

    return DeepseekV2ForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()


def _metadata(block_table: list[int], num_cached: int, num_new: int) -> tuple[AttentionMetadata, torch.Tensor]:
    positions = torch.arange(num_cached, num_cached + num_new)
    blocks = torch.tensor(block_table)
    slots = blocks[positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
    context_len = num_cached + num_new
    meta = AttentionMetadata(
        is_prefill=num_cached == 0,
        slot_mapping=slots.long(),
        block_tables=blocks[None].int(),
        context_lens=torch.tensor([context_len], dtype=torch.int32),
        cu_seqlens_q=torch.tensor([0, num_new], dtype=torch.int32),
        max_context_len=context_len,
        context_lens_cpu=[context_len],
        query_lens_cpu=[num_new],
    )
    return meta, positions


def _greedy_through_pages(model, prompt: list[int], num_steps: int) -> tuple[list[int], torch.Tensor]:
    """Prefill then greedy decode through paged KV; returns (new tokens, logits of every step [1 + steps, V])."""
    num_tokens = len(prompt) + num_steps
    num_blocks = -(-num_tokens // BLOCK_SIZE) + 1
    pages = [allocate_latent_pages(model.config, num_blocks, BLOCK_SIZE, "fp16", dtype=torch.float32)
             for _ in model.model.layers]
    # Scattered, descending block ids: a model that ignores the block table reads the wrong rows.
    block_table = list(range(num_blocks - 1, 0, -1))
    meta, positions = _metadata(block_table, 0, len(prompt))
    with torch.no_grad():
        hidden = model(torch.tensor(prompt), positions, meta, pages)
        step_logits = [model.compute_logits(hidden[-1:])]
        tokens = []
        for _ in range(num_steps):
            tokens.append(int(step_logits[-1].argmax()))
            meta, positions = _metadata(block_table, len(prompt) + len(tokens) - 1, 1)
            hidden = model(torch.tensor(tokens[-1:]), positions, meta, pages)
            step_logits.append(model.compute_logits(hidden))
    return tokens, torch.cat(step_logits)


def _rel_diff(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return float((ours - theirs).abs().max() / theirs.abs().max())


def test_config_reads_mla_moe_and_yarn_fields(checkpoint):
    import json

    config = DeepseekV2Config.from_dict(json.loads((checkpoint / "config.json").read_text()))
    assert config.kv_head_dim == 32 + 8
    assert (config.num_routed_experts, config.num_experts_per_tok, config.first_k_dense_replace) == (8, 2, 1)
    assert config.rope["rope_type"] == "yarn" and config.rope["factor"] == 4.0
    # mscale_all_dim=0.707 at factor 4 raises the softmax scale above 1/sqrt(24).
    assert softmax_scale(config) == pytest.approx(24**-0.5 * (0.1 * 0.707 * torch.log(torch.tensor(4.0)).item() + 1) ** 2)


def test_prefill_and_paged_decode_logits_match_transformers(checkpoint, reference):
    model, _ = load_deepseek_v2(checkpoint, "cpu", torch.float32)
    prompt = [0, 17, 230, 5, 99, 402, 64, 12, 300, 7, 41]
    tokens, logits = _greedy_through_pages(model, prompt, NUM_DECODE_STEPS)
    with torch.no_grad():
        expected = reference(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 :].float()
    diff = _rel_diff(logits, expected)
    print(f"largest relative logit difference over prefill + {NUM_DECODE_STEPS} decode steps: {diff:.2e}")
    assert diff <= MAX_REL_DIFF


def test_greedy_continuation_equals_transformers_generate(checkpoint, reference):
    model, _ = load_deepseek_v2(checkpoint, "cpu", torch.float32)
    prompt = [0, 3, 250, 48, 111, 9]
    tokens, _ = _greedy_through_pages(model, prompt, NUM_DECODE_STEPS)
    with torch.no_grad():
        # The explicit mask keeps generate from taking the BOS (id 0) for padding.
        generated = reference.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                       max_new_tokens=NUM_DECODE_STEPS, min_new_tokens=NUM_DECODE_STEPS,
                                       do_sample=False, eos_token_id=None, pad_token_id=1)
    assert tokens == generated[0, len(prompt):].tolist()
    assert len(set(tokens)) > 1, "a constant continuation would not tell a right model from a wrong one"


def test_router_weights_stay_float32_in_a_float16_model(checkpoint):
    model, _ = load_deepseek_v2(checkpoint, "cpu", torch.float16)
    assert model.model.layers[1].mlp.gate.weight.dtype == torch.float32
    assert model.model.layers[1].mlp.experts[0].up_proj.weight.dtype == torch.float16
    assert not hasattr(model.model.layers[0].mlp, "gate"), "the first layer is dense (first_k_dense_replace=1)"
