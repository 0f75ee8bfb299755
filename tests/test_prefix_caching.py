"""Prefix caching end to end: same greedy text, less prefill."""

import pytest

from lowvram import LLM, SamplingParams
from lowvram.config import load_profile

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(params=[True, False], ids=["cache", "no-cache"])
def llm(request, tiny_model_dir):
    profile = load_profile("cpu").replace(enable_prefix_caching=request.param, kv_block_size=8)
    return LLM(str(tiny_model_dir), profile)


def _chat(llm, turns):
    """A multi-turn chat: each turn resends the whole conversation."""
    messages, replies = [], []
    for user in turns:
        messages.append({"role": "user", "content": user})
        out = llm.chat(messages, GREEDY)[0]
        replies.append(out.outputs[0].token_ids)
        messages.append({"role": "assistant", "content": out.outputs[0].text})
    return replies


TURNS = ["hello there, how are you today?", "tell me about the weather", "and tomorrow?", "thanks, bye"]


def test_multi_turn_outputs_do_not_depend_on_the_cache(tiny_model_dir):
    cached = LLM(str(tiny_model_dir), load_profile("cpu").replace(kv_block_size=8))
    plain = LLM(str(tiny_model_dir), load_profile("cpu").replace(kv_block_size=8, enable_prefix_caching=False))
    assert _chat(cached, TURNS) == _chat(plain, TURNS)
    assert cached.engine.stats.num_prefill_tokens < plain.engine.stats.num_prefill_tokens


def test_later_turns_reuse_earlier_pages(llm):
    _chat(llm, TURNS[:2])
    before = llm.engine.stats.num_prefill_tokens
    _chat_prompt_tokens = len(llm.engine.tokenizer.apply_chat_template([{"role": "user", "content": TURNS[0]}]))
    llm.chat([{"role": "user", "content": TURNS[0]}], GREEDY)
    computed = llm.engine.stats.num_prefill_tokens - before
    if llm.engine.profile.enable_prefix_caching:
        assert computed < _chat_prompt_tokens  # only the tail past the cached full pages
    else:
        assert computed == _chat_prompt_tokens


def test_cached_pages_count_as_free_and_are_evicted_when_needed(tiny_qwen2_dir):
    profile = load_profile("cpu").replace(kv_block_size=8, max_model_len=256, max_num_seqs=1)
    llm = LLM(str(tiny_qwen2_dir), profile)
    bm = llm.engine.block_manager
    llm.generate(["a fairly long prompt " * 8], GREEDY)
    assert bm.num_cached_blocks > 0 and bm.num_free_blocks == bm.num_blocks
    # fill the pool with other prompts: cached pages are evicted, nothing fails
    for i in range(bm.num_blocks // 4 + 2):
        llm.generate([f"different text number {i} " * 6], GREEDY)
    assert bm.num_free_blocks == bm.num_blocks


def test_concurrent_requests_sharing_a_system_prompt_match_separate_runs(tiny_llama_dir):
    system = "You are a helpful assistant that answers briefly and precisely. " * 2
    convs = [[{"role": "system", "content": system}, {"role": "user", "content": q}] for q in ("hi", "2+2?", "name?")]
    cached = LLM(str(tiny_llama_dir), load_profile("cpu").replace(kv_block_size=8))
    cached.chat(convs[0], GREEDY)  # warm the cache with the shared system prompt
    together = [o.outputs[0].token_ids for o in cached.chat(convs, GREEDY)]
    plain = LLM(str(tiny_llama_dir), load_profile("cpu").replace(kv_block_size=8, enable_prefix_caching=False))
    alone = [plain.chat(c, GREEDY)[0].outputs[0].token_ids for c in convs]
    assert together == alone


def test_bundled_model_chat_is_identical_with_and_without_reuse():
    turns = [
        "What is 17 + 25?",
        "What is 120 - 45?",
        "Sort these words alphabetically: pear, apple, kiwi",
        "How many letters a are in banana?",
    ]
    cached = LLM(None, load_profile("cpu"))
    plain = LLM(None, load_profile("cpu").replace(enable_prefix_caching=False))
    with_reuse = _chat(cached, turns)
    assert with_reuse == _chat(plain, turns)
    assert cached.engine.stats.num_prefill_tokens < plain.engine.stats.num_prefill_tokens
    assert cached.engine.tokenizer.decode(with_reuse[0]).startswith("42")  # ignore_eos: it runs on after the answer
