"""DeepseekV2ForCausalLM against transformers' implementation on a tiny random checkpoint (FP32, CPU).

Prefill and decode go through paged KV with a block size smaller than the prompt,
so page boundaries, the latent cache layout and absorbed up-projections are all
exercised; logits must match transformers within 1e-4 relative.
"""

import pytest
import torch
from deepseek_v2_paging import (
    MAX_REL_DIFF,
    NUM_DECODE_STEPS,
    greedy_through_pages,
    rel_diff,
    transformers_reference,
)

from lowvram.models.deepseek_v2 import DeepseekV2Config, softmax_scale
from lowvram.models.loader import load_deepseek_v2


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from tiny_models import make_tiny_deepseek_v2

    return make_tiny_deepseek_v2(tmp_path_factory.mktemp("dsv2"), seed=0)


@pytest.fixture(scope="module")
def reference(checkpoint):
    return transformers_reference(checkpoint)


def test_config_reads_mla_moe_and_yarn_fields(checkpoint):
    import json

    config = DeepseekV2Config.from_dict(json.loads((checkpoint / "config.json").read_text()))
    assert config.kv_head_dim == 32 + 8
    assert (config.num_routed_experts, config.num_experts_per_tok, config.first_k_dense_replace) == (8, 2, 1)
    assert config.rope["rope_type"] == "yarn" and config.rope["factor"] == 4.0
    # mscale_all_dim=0.707 at factor 4 raises the softmax scale above 1/sqrt(24).
    assert softmax_scale(config) == pytest.approx(
        24**-0.5 * (0.1 * 0.707 * torch.log(torch.tensor(4.0)).item() + 1) ** 2
    )


def test_prefill_and_paged_decode_logits_match_transformers(checkpoint, reference):
    model, _ = load_deepseek_v2(checkpoint, "cpu", torch.float32)
    prompt = [0, 17, 230, 5, 99, 402, 64, 12, 300, 7, 41]
    tokens, logits = greedy_through_pages(model, prompt, NUM_DECODE_STEPS)
    with torch.no_grad():
        expected = reference(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 :].float()
    diff = rel_diff(logits, expected)
    print(f"largest relative logit difference over prefill + {NUM_DECODE_STEPS} decode steps: {diff:.2e}")
    assert diff <= MAX_REL_DIFF


def test_greedy_continuation_equals_transformers_generate(checkpoint, reference):
    model, _ = load_deepseek_v2(checkpoint, "cpu", torch.float32)
    prompt = [0, 3, 250, 48, 111, 9]
    tokens, _ = greedy_through_pages(model, prompt, NUM_DECODE_STEPS)
    with torch.no_grad():
        # The explicit mask keeps generate from taking the BOS (id 0) for padding.
        generated = reference.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=NUM_DECODE_STEPS,
            min_new_tokens=NUM_DECODE_STEPS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=1,
        )
    assert tokens == generated[0, len(prompt) :].tolist()
    assert len(set(tokens)) > 1, "a constant continuation would not tell a right model from a wrong one"


def test_router_weights_stay_float32_in_a_float16_model(checkpoint):
    model, _ = load_deepseek_v2(checkpoint, "cpu", torch.float16)
    assert model.model.layers[1].mlp.gate.weight.dtype == torch.float32
    assert model.model.layers[1].mlp.experts[0].up_proj.weight.dtype == torch.float16
    assert not hasattr(model.model.layers[0].mlp, "gate"), "the first layer is dense (first_k_dense_replace=1)"
