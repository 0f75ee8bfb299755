"""Routed experts offloaded to host memory with a small device cache (lowvram.models.expert_offload).

On the CPU "offloaded" means the cache holds fewer experts than the layer has, so
every fetch, eviction and wave of the cache really runs; the model must still give
transformers' logits and greedy tokens.
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
from torch import nn

from lowvram.errors import ConfigError
from lowvram.models.expert_offload import ExpertCache, ExpertCacheStats
from lowvram.models.loader import load_deepseek_v2


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from tiny_models import make_tiny_deepseek_v2

    return make_tiny_deepseek_v2(tmp_path_factory.mktemp("dsv2-offload"), seed=1)


@pytest.fixture(scope="module")
def reference(checkpoint):
    return transformers_reference(checkpoint)


@pytest.mark.parametrize("max_cached_experts", [1, 3])
def test_offloaded_experts_give_transformers_logits(checkpoint, reference, max_cached_experts):
    # 8 experts, top-2: the 11-token prefill needs more experts per layer than the cache
    # holds, so they run in waves; decode steps miss, evict and prefetch.
    model, _ = load_deepseek_v2(checkpoint, "cpu", torch.float32, max_cached_experts=max_cached_experts)
    assert model.num_cached_experts == max_cached_experts
    prompt = [0, 17, 230, 5, 99, 402, 64, 12, 300, 7, 41]
    tokens, logits = greedy_through_pages(model, prompt, NUM_DECODE_STEPS)
    with torch.no_grad():
        expected = reference(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 :].float()
    diff = rel_diff(logits, expected)
    stats = model.expert_stats
    print(
        f"{max_cached_experts} cached experts: largest relative logit difference {diff:.2e}; "
        f"hit rate {stats.hit_rate:.2f}, {stats.num_fetches} fetches"
    )
    assert diff <= MAX_REL_DIFF
    assert stats.num_fetches > 0 and stats.hit_rate < 1.0, "the cache never missed: nothing was offloaded"
    assert stats.fetched_bytes == stats.num_fetches * model.moe_layers[0].cache.expert_bytes


def test_offloaded_greedy_continuation_equals_transformers_generate(checkpoint, reference):
    model, _ = load_deepseek_v2(checkpoint, "cpu", torch.float32, max_cached_experts=2)
    prompt = [0, 3, 250, 48, 111, 9]
    tokens, _ = greedy_through_pages(model, prompt, NUM_DECODE_STEPS)
    with torch.no_grad():
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


def test_offloaded_experts_leave_the_model_and_its_device_bytes(checkpoint):
    resident, _ = load_deepseek_v2(checkpoint, "cpu", torch.float32)
    offloaded, _ = load_deepseek_v2(checkpoint, "cpu", torch.float32, max_cached_experts=2)
    config = resident.config
    expert_bytes = 3 * config.hidden_size * config.moe_intermediate_size * 4
    num_moe = config.num_moe_layers
    # 8 experts per layer resident, 2 per layer cached: 6 experts per MoE layer fewer.
    assert resident.weight_bytes - offloaded.weight_bytes == pytest.approx(6 * num_moe * expert_bytes, rel=0.01)
    assert not any(".experts." in name for name, _ in offloaded.named_parameters())


# ---------------------------------------------------------------- the cache itself


def _experts(num_experts: int) -> list[nn.Module]:
    """Experts that are told apart by their output: expert e maps x to (e + 1) * x."""
    experts = []
    for e in range(num_experts):
        expert = nn.Linear(2, 2, bias=False)
        expert.weight = nn.Parameter(torch.eye(2) * (e + 1), requires_grad=False)
        experts.append(expert)
    return experts


def _route(cache: ExpertCache, expert_ids: list[int]) -> torch.Tensor:
    """One token per expert id, routed to that expert alone with weight 1."""
    x = torch.ones(len(expert_ids), 2)
    ids = torch.tensor(expert_ids)[:, None]
    counts = [expert_ids.count(e) for e in range(cache.num_experts)]
    return cache.run(x, torch.ones(len(expert_ids), 1), ids, counts)


def _resident(cache: ExpertCache) -> list[int]:
    return sorted(e for e in cache.expert_in_slot if e >= 0)


def test_cache_evicts_the_least_routed_expert_first():
    stats = ExpertCacheStats()
    cache = ExpertCache(_experts(4), num_slots=2, device="cpu", stats=stats)
    assert _resident(cache) == [0, 1]  # filled with the lowest ids at start
    for _ in range(3):
        _route(cache, [1])  # expert 1 is routed often, expert 0 never
    out = _route(cache, [3])
    assert out[0].tolist() == [4.0, 4.0]
    assert _resident(cache) == [1, 3], "expert 0 (never routed) should have been evicted, not expert 1"
    _route(cache, [2])
    assert _resident(cache) == [1, 2], "expert 3 (routed once) goes before expert 1 (three times)"
    assert (stats.num_lookups, stats.num_hits, stats.num_fetches) == (5, 3, 2)
    assert stats.fetched_bytes == 2 * cache.expert_bytes


def test_more_experts_than_slots_run_in_waves():
    stats = ExpertCacheStats()
    cache = ExpertCache(_experts(6), num_slots=2, device="cpu", stats=stats)
    out = _route(cache, [5, 0, 3, 1, 4, 2])
    assert out[:, 0].tolist() == [6.0, 1.0, 4.0, 2.0, 5.0, 3.0]
    assert stats.num_fetches == 4 and stats.num_hits == 2


def test_prefetched_experts_are_hits():
    stats = ExpertCacheStats()
    cache = ExpertCache(_experts(4), num_slots=2, device="cpu", stats=stats)
    cache.prefetch([0, 0, 0, 2])  # a guess: two tokens will pick expert 3
    assert 3 in cache.slot_of and stats.num_prefetches == 1
    _route(cache, [3])
    assert (stats.num_hits, stats.num_prefetch_hits, stats.prefetch_accuracy) == (1, 1, 1.0)


def test_resize_keeps_results_and_rejects_a_cache_without_slots():
    cache = ExpertCache(_experts(4), num_slots=1, device="cpu", stats=ExpertCacheStats())
    cache.resize(4)
    assert _route(cache, [0, 1, 2, 3])[:, 0].tolist() == [1.0, 2.0, 3.0, 4.0]
    assert cache.stats.num_fetches == 0
    with pytest.raises(ConfigError, match="1..4 slots"):
        cache.resize(0)
