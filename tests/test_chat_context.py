"""A chat longer than the model's context runs on: old turns are dropped as lowvram.core.context says, the kept
head comes from the prefix cache, and the user is told."""

import io

import pytest

pytest.importorskip("textual")

from lowvram.core.context import ContextLengthError  # noqa: E402
from lowvram.tui.backend import EngineSpec, fit_to_context, message_token_counts, prompt_token_ids  # noqa: E402
from lowvram.tui.conversation import ChatSettings  # noqa: E402
from lowvram.tui.plain import PlainChat  # noqa: E402

MAX_MODEL_LEN = 512
MAX_TOKENS = 48
SYSTEM = "You are a terse assistant for a small GPU."
WORDS = "cache page token block prefix sequence layer kernel batch memory".split()


def message(i: int) -> str:
    return f"question {i}: " + " ".join(WORDS[(i + j) % len(WORDS)] for j in range(30 + i % 7))


def expected_kept(engine, messages: list[dict]) -> list[dict]:
    """The oracle: the system prompt, the first turn, and the longest run of the newest turns that fits."""
    head, middle, new = messages[:3], messages[3:-1], messages[-1:]
    if len(messages) <= 2:
        return messages
    for start in range(0, len(middle) + 1, 2):
        kept = head + middle[start:] + new
        if len(prompt_token_ids(engine, kept)) + MAX_TOKENS <= MAX_MODEL_LEN:
            return kept
    raise AssertionError("even the head alone does not fit")


def test_a_twenty_turn_chat_on_a_512_token_model_runs_to_the_end(tiny_qwen2_dir):
    spec = EngineSpec(str(tiny_qwen2_dir), "cpu", {"max_model_len": MAX_MODEL_LEN})
    stdin = io.StringIO("".join(message(i) + "\n" for i in range(20)))
    stdout, stderr = io.StringIO(), io.StringIO()
    chat = PlainChat(spec, ChatSettings(SYSTEM, 0.0, MAX_TOKENS), None, stdin, stdout, stderr)
    engine, sent = chat.engine, []  # per turn: (full conversation, messages sent, prompt ids, prefill counter)
    add_request = engine.add_request

    def recording_add_request(request_id, params=None, **kwargs):
        given = kwargs.get("messages")
        ids = prompt_token_ids(engine, given)
        sent.append((chat.conversation.messages(), given, ids, engine.stats.num_prefill_tokens))
        return add_request(request_id, params=params, **kwargs)

    engine.add_request = recording_add_request
    assert chat.run() == 0, stderr.getvalue()
    assert len(sent) == 20 and [t.role for t in chat.conversation.turns] == ["user", "assistant"] * 20

    num_dropped = []
    for full, given, ids, _ in sent:
        assert given == expected_kept(engine, full)
        assert len(ids) + MAX_TOKENS <= MAX_MODEL_LEN
        num_dropped.append((len(full) - len(given)) // 2)
    assert num_dropped[:3] == [0, 0, 0] and num_dropped[-1] >= 5  # it did have to drop, more as the chat grew
    for count in sorted(set(num_dropped) - {0}):
        turns = "turn" if count == 1 else "turns"
        assert f"lowvram: {count} older {turns} dropped to fit the 512-token context\n" in stderr.getvalue()
    assert "error" not in stderr.getvalue()

    # The kept head (system prompt and first turn) is read from the prefix cache; what follows the dropped turns
    # moved to new positions and is computed again.
    block_size = engine.block_manager.block_size
    prefills = [counter for *_, counter in sent[1:]] + [engine.stats.num_prefill_tokens]
    num_checked = 0
    for k in range(1, 20):
        if num_dropped[k] == num_dropped[k - 1]:
            continue
        ids, previous = sent[k][2], sent[k - 1][2]
        num_common = next((i for i, (a, b) in enumerate(zip(ids, previous)) if a != b), min(len(ids), len(previous)))
        num_head = len(engine.tokenizer.apply_chat_template(sent[k][1][:3], add_generation_prompt=False))
        assert num_common >= num_head >= 2 * block_size
        num_computed = prefills[k] - sent[k][3]
        # exactly the tokens past the head's last full page: the head's full pages are reused
        assert num_computed == len(ids) - num_common // block_size * block_size
        num_checked += 1
    assert num_checked >= 3

    # a message that cannot fit whatever is dropped is refused, and the conversation is as it was
    with pytest.raises(ContextLengthError, match=r"the message has \d+ tokens with the system prompt's \d+"):
        chat.reply("word " * 600)
    assert len(chat.conversation.turns) == 40


class StrictTemplate:
    """A chat template that wants roles to alternate from a user message, as Llama 2's and Mistral's do: a
    message rendered after the one before it may fail. A token is a word, plus 2 per message and 1 for BOS."""

    has_chat_template = True

    def apply_chat_template(self, messages, add_generation_prompt=True):
        if messages[0]["role"] == "assistant":
            raise ValueError("Conversation roles must alternate user/assistant/user/assistant/...")
        return [0] + [1 for m in messages for _ in range(len(m["content"].split()) + 2)] + [2] * add_generation_prompt


def test_a_template_that_refuses_a_lone_reply_is_counted_on_whole_prefixes():
    engine = type("Engine", (), {"tokenizer": StrictTemplate(), "max_model_len": 40})()
    messages = [{"role": r, "content": "w " * n} for r, n in zip(["user", "assistant"] * 3, [5, 5, 6, 6, 7])]
    assert message_token_counts(engine, messages) == [1 + 7 + 1, 7, 8, 8, 9]
    kept, fit = fit_to_context(engine, messages, max_tokens=10)  # 30 for the prompt: the second turn goes
    assert kept == messages[:2] + messages[4:] and fit.num_dropped_turns == 1
