"""Saving a conversation's KV to disk and restoring it in another engine."""

import pytest

from lowvram import LLM, SamplingParams
from lowvram.config import load_profile

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
HISTORY = [
    {"role": "user", "content": "remember the number forty two and the colour blue"},
    {"role": "assistant", "content": "noted: forty two, blue"},
]
NEXT = HISTORY + [{"role": "user", "content": "what did I ask you to remember?"}]


def _llm(model_dir, **changes):
    return LLM(str(model_dir), load_profile("cpu").replace(kv_block_size=8, **changes))


def test_restored_conversation_continues_without_recompute_and_same_text(tiny_qwen2_dir, tmp_path):
    path = _llm(tiny_qwen2_dir).save_conversation(HISTORY, tmp_path / "conv.kv")
    fresh = _llm(tiny_qwen2_dir)
    result = fresh.restore_conversation(path)
    assert result.is_restored and result.num_tokens > 16, result.message
    before = fresh.engine.stats.num_prefill_tokens
    restored_reply = fresh.chat(NEXT, GREEDY)[0].outputs[0].token_ids
    computed = fresh.engine.stats.num_prefill_tokens - before
    full_prompt = len(fresh.engine.tokenizer.apply_chat_template(NEXT))
    assert computed <= full_prompt - result.num_tokens + 1
    assert (
        restored_reply == _llm(tiny_qwen2_dir, enable_prefix_caching=False).chat(NEXT, GREEDY)[0].outputs[0].token_ids
    )


def test_default_location_is_the_user_data_dir(tiny_qwen2_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    path = _llm(tiny_qwen2_dir).save_conversation(HISTORY)
    assert path.parent == tmp_path / "lowvram" / "conversations" and path.is_file()
    assert not list(path.parent.glob("*.partial"))


@pytest.mark.parametrize("case", ["other-model", "other-kv-precision", "corrupt", "missing"])
def test_a_mismatch_falls_back_to_recompute_with_a_message(case, tiny_qwen2_dir, tiny_llama_dir, tmp_path):
    path = _llm(tiny_qwen2_dir).save_conversation(HISTORY, tmp_path / "conv.kv")
    target = {
        "other-model": lambda: _llm(tiny_llama_dir),
        "other-kv-precision": lambda: _llm(tiny_qwen2_dir, kv_precision="int8"),
    }
    llm = target.get(case, lambda: _llm(tiny_qwen2_dir))()
    if case == "corrupt":
        data = bytearray(path.read_bytes())
        data[20:60] = b"x" * 40
        path.write_bytes(bytes(data))
    if case == "missing":
        path.unlink()
    result = llm.restore_conversation(path)
    assert not result.is_restored and "recomputed" in result.message
    expected = {
        "other-model": "model",
        "other-kv-precision": "kv_precision",
        "corrupt": "damaged",
        "missing": "does not exist",
    }[case]
    assert expected in result.message
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
    assert len(llm.chat(NEXT, GREEDY)[0].outputs[0].token_ids) == 10


def test_int8_pages_round_trip(tiny_llama_dir, tmp_path):
    path = _llm(tiny_llama_dir, kv_precision="int8").save_conversation(HISTORY, tmp_path / "c.kv")
    fresh = _llm(tiny_llama_dir, kv_precision="int8")
    assert fresh.restore_conversation(path).is_restored
    recomputed = _llm(tiny_llama_dir, kv_precision="int8").chat(NEXT, GREEDY)[0].outputs[0].token_ids
    assert fresh.chat(NEXT, GREEDY)[0].outputs[0].token_ids == recomputed
