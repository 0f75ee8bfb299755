"""DeepSeek-V2 through the engine (LLM.generate), and the memory plan's V2 formulas.

The KV pool must hold one latent row per token and layer (kv_lora_rank + qk_rope_head_dim
values, K and V the same storage), and the plan must count those bytes and only the
routed experts the device caches.
"""

import copy

import pytest
import torch
from deepseek_v2_paging import transformers_reference
from script_modules import load_script

from lowvram import LLM, SamplingParams
from lowvram.config import load_profile
from lowvram.errors import OutOfMemoryError
from lowvram.memory import plan as mp
from lowvram.models.deepseek_v2 import DeepseekV2Config, layer_kv_pages

NUM_TOKENS = 12
PROMPTS = ["The scheduler reads the next token", "def add(a, b):"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from tiny_models import make_tiny_deepseek_v2

    return make_tiny_deepseek_v2(tmp_path_factory.mktemp("dsv2-engine"), seed=3)


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(str(checkpoint), "cpu", max_model_len=128)


def _greedy(llm) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    return [out.outputs[0].token_ids for out in llm.generate(PROMPTS, params)]


def _transformers_greedy(checkpoint, prompt_ids: list[int]) -> list[int]:
    model = transformers_reference(checkpoint)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=NUM_TOKENS,
            min_new_tokens=NUM_TOKENS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=1,
        )
    return out[0, len(prompt_ids) :].tolist()


def test_llm_generates_the_greedy_tokens_of_transformers(checkpoint, llm):
    tokens = _greedy(llm)
    for prompt, ours in zip(PROMPTS, tokens):
        assert ours == _transformers_greedy(checkpoint, llm.engine.tokenizer.encode(prompt))


def test_offloaded_experts_generate_the_same_tokens(llm):
    before = _greedy(llm)
    llm.engine.model.offload_experts(2)
    stats = llm.engine.model.expert_stats.copy()
    assert _greedy(llm) == before
    moved = llm.engine.model.expert_stats.since(stats)
    assert moved.num_fetches > 0 and moved.bytes_per_token > 0 and 0 < moved.hit_rate < 1


def test_kv_pool_holds_one_latent_row_per_token_and_layer(llm):
    engine = llm.engine
    config = engine.config
    assert isinstance(config, DeepseekV2Config)
    shape = engine.kv_pool.shape
    # 3 layers: two share pool layer 0 (its K and V), the third has pool layer 1's K.
    assert (shape.num_layers, shape.num_kv_heads, shape.head_dim) == (2, 1, 32 + 8)
    assert engine.kv_plan.bytes_per_token == shape.block_bytes("fp16") // shape.block_size == 2 * 2 * 40 * 4
    pages = engine.kv_pool.pages
    view = layer_kv_pages(pages, 1)
    assert view.k is pages[0].v and view.v is pages[0].v, "a layer's K and V must be the same storage"
    assert layer_kv_pages(pages, 2).k is pages[1].k


# ---------------------------------------------------------------- the memory plan at the real shape


def _v2_lite_awq() -> tuple[DeepseekV2Config, dict]:
    raw = copy.deepcopy(load_script("bench_deepseek_v2").DEEPSEEK_V2_LITE_CONFIG)
    raw["quantization_config"] = {
        "quant_method": "awq",
        "bits": 4,
        "group_size": 128,
        "zero_point": True,
        "version": "gemm",
        "modules_to_not_convert": ["model.layers.0.mlp.down_proj"],
    }
    return DeepseekV2Config.from_dict(raw), raw


def test_kv_bytes_per_token_count_one_576_value_row_per_layer():
    config, _ = _v2_lite_awq()
    assert config.kv_head_dim == 576 and config.num_kv_layers == 14
    # 27 layers in 14 pool layers: the 28th row is the unused half of the last one.
    assert mp.kv_bytes_per_token(config, "fp16", 2) == 28 * 576 * 2 == 32_256
    assert mp.kv_bytes_per_token(config, "int8", 2) == 28 * (576 + 4)
    assert mp.kv_bytes_per_token(config, "int4", 2) == 28 * (288 + 4)


def test_weight_bytes_count_only_the_cached_experts_on_the_device():
    config, raw = _v2_lite_awq()
    # One expert in AWQ g128: gate and up [2048 -> 1408], down [1408 -> 2048].
    expert = 2 * (2048 * 176 * 4 + 16 * 176 * 4 + 16 * 1408 * 2) + (1408 * 256 * 4 + 11 * 256 * 4 + 11 * 2048 * 2)
    assert mp.routed_expert_bytes(config, 2) == expert
    everything = mp.weight_bytes_by_kind(config, 2)
    cached = mp.weight_bytes_by_kind(config, 2, max_cached_experts=8)
    assert cached.host_expert_bytes == 26 * (64 - 8) * expert
    assert everything.total_bytes - cached.total_bytes == cached.host_expert_bytes
    assert 8.0 < everything.total_bytes / 2**30 < 8.6  # 15.7B parameters, nearly all INT4


def test_loaded_weight_bytes_equal_the_plan(checkpoint):
    from lowvram.models.loader import load_deepseek_v2

    for max_cached_experts in (None, 2):
        model, _ = load_deepseek_v2(checkpoint, "cpu", torch.float32, max_cached_experts=max_cached_experts)
        planned = mp.weight_bytes_by_kind(model.config, 4, max_cached_experts=max_cached_experts)
        assert model.weight_bytes == planned.total_bytes


def test_expert_cache_takes_what_the_4gb_card_has_left():
    config, raw = _v2_lite_awq()
    profile = load_profile("4gb").replace(emulate_vram_gib=4.0)
    max_len = min(profile.max_model_len, config.max_position_embeddings)

    def plan(num_cached: int) -> mp.KVPlan:
        weights = mp.weight_bytes_by_kind(config, 2, max_cached_experts=num_cached)
        return mp.plan_kv(config, profile, weights.total_bytes, 2, max_len, device_type="cuda")

    num_cached = mp.plan_expert_cache(config, profile, 2, max_len, device_type="cuda")
    assert mp.MIN_CACHED_EXPERTS <= num_cached < config.num_routed_experts
    assert plan(num_cached).max_tokens >= max_len  # one full-length sequence still fits
    with pytest.raises(OutOfMemoryError):
        plan(num_cached + 1)  # one more expert per layer would not leave it room
