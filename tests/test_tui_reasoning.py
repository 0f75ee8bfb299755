"""A reasoning model in the chat: its <think> part is a dimmed, folding block above the answer in the screen,
and goes to stderr (or nowhere, with --hide-reasoning) in the plain mode, so stdout keeps only answers."""

import io
import re

import pytest

pytest.importorskip("textual")

from tui_pilot import (  # noqa: E402
    SIZE,
    ScriptedBackend,
    press_now,
    replies,
    run,
    scripted_app,
    started,
    type_and_send,
    wait_until,
)

from lowvram.engine.outputs import CompletionOutput, RequestOutput  # noqa: E402
from lowvram.engine.reasoning import split_reasoning  # noqa: E402
from lowvram.engine.tokenizer import Tokenizer  # noqa: E402
from lowvram.tui import plain  # noqa: E402
from lowvram.tui.backend import EngineSpec  # noqa: E402
from lowvram.tui.conversation import ChatSettings, load_transcript, save_transcript  # noqa: E402
from lowvram.tui.widgets import ReasoningBlock  # noqa: E402

# The scripted backend counts a token per word: the reasoning ends with the 4th.
THINKING = ("Let me", " add.\n</th", "ink>", "\n\nIt is **42**.")
THOUGHT_TITLE = re.compile(r"thought for \d+\.\d s, 4 tokens")


def reasoning_backend() -> ScriptedBackend:
    backend = ScriptedBackend()
    backend.has_reasoning_tags = True
    return backend


def test_the_thinking_is_a_block_above_the_answer_that_folds_when_the_answer_starts(tmp_path):
    async def main():
        app, backend = scripted_app(reasoning_backend())
        async with app.run_test(size=SIZE) as pilot:
            await started(pilot)
            await type_and_send(pilot, "What is 17 + 25?")
            backend.feed(*THINKING[:2], end=False)
            await wait_until(pilot, lambda: app.query(ReasoningBlock), "the thinking block")
            block = app.query_one(ReasoningBlock)
            await wait_until(pilot, lambda: block.text == "Let me add.", "the thinking")
            while_thinking = block.title, block.collapsed, replies(app)[0].text
            backend.feed(*THINKING[2:])
            await wait_until(pilot, lambda: len(app.conversation.turns) == 2, "the reply")
            children = list(app.conversation_view.children)
            is_above = children.index(block) + 1 == children.index(replies(app)[0])
            brightness = [sum(w.rich_style.color.get_truecolor()) for w in (block.body, replies(app)[0])]
            await pilot.pause(0.1)  # laid out, so that the click lands on the title
            await pilot.click(block.query_one("CollapsibleTitle"))  # a click opens it again
            await pilot.pause(0.05)
            return while_thinking, is_above, block.title, block.collapsed, brightness, app.conversation

    while_thinking, is_above, title, is_collapsed_after_click, brightness, conversation = run(main())
    assert while_thinking == ("thinking...", False, "")  # open while it thinks, nothing of the answer yet
    assert is_above and THOUGHT_TITLE.fullmatch(title) and not is_collapsed_after_click
    assert brightness[0] < brightness[1]  # dimmed beside the answer
    answer = conversation.turns[1]
    assert (answer.content, answer.reasoning) == ("It is **42**.", "Let me add.")
    assert conversation.messages()[-1] == {"role": "assistant", "content": "It is **42**."}
    markdown_path, json_path = save_transcript(conversation, tmp_path / "chat.json")
    assert load_transcript(json_path) == conversation and "Let me add." in markdown_path.read_text()


def test_the_answer_folds_the_block_and_the_next_prompt_leaves_the_thinking_out():
    async def main():
        app, backend = scripted_app(reasoning_backend(), is_reasoning_hidden=True)
        async with app.run_test(size=SIZE) as pilot:
            await started(pilot)
            await type_and_send(pilot, "first")
            backend.feed("hmm", end=False)
            await wait_until(pilot, lambda: app.query(ReasoningBlock), "the thinking block")
            is_folded_while_thinking = app.query_one(ReasoningBlock).collapsed
            backend.feed("</think>one")
            await wait_until(pilot, lambda: len(app.conversation.turns) == 2, "the first reply")
            await type_and_send(pilot, "second")
            backend.feed("two")
            await wait_until(pilot, lambda: len(app.conversation.turns) == 4, "the second reply")
            return is_folded_while_thinking, backend.requests[1]

    is_folded_while_thinking, second_request = run(main())
    assert is_folded_while_thinking  # --hide-reasoning
    assert second_request[1] == {"role": "assistant", "content": "one"}


def test_stopping_while_it_thinks_says_so_and_a_loaded_transcript_shows_the_thinking(tmp_path):
    async def main():
        app, backend = scripted_app(reasoning_backend())
        async with app.run_test(size=SIZE) as pilot:
            await started(pilot)
            await type_and_send(pilot, "What is 17 + 25?")
            backend.feed("Let me think about", end=False)
            await wait_until(pilot, lambda: app.query(ReasoningBlock), "the thinking block")
            await press_now(pilot, "escape")
            await wait_until(pilot, lambda: len(app.conversation.turns) == 2, "the stopped reply")
            stopped_title = app.query_one(ReasoningBlock).title
            _, json_path = save_transcript(app.conversation, tmp_path / "chat.json")
            await app.load_transcript(str(json_path))
            await pilot.pause(0.05)
            blocks = list(app.query(ReasoningBlock))
            return stopped_title, app.conversation.turns[1], [(b.text, b.collapsed) for b in blocks]

    stopped_title, turn, blocks = run(main())
    assert re.fullmatch(r"thinking stopped after \d+\.\d s, 4 tokens", stopped_title)
    assert (turn.content, turn.reasoning, turn.finish_reason) == ("", "Let me think about", "abort")
    assert blocks == [("Let me think about", True)]


# -- the plain mode -----------------------------------------------------------------


class ScriptedEngine:
    """What the plain mode needs of LLMEngine, with the reasoning model's real tokenizer and a scripted reply."""

    def __init__(self, model_dir, deltas):
        self.tokenizer, self.deltas = Tokenizer(model_dir), deltas
        self.profile = type("Profile", (), {"name": "cpu"})()
        self.max_model_len, self._pending = 256, []

    def add_request(self, request_id, params=None, messages=None, prompt=None):
        ids, text = self.tokenizer.apply_chat_template(messages), ""
        for n, delta in enumerate(self.deltas, 1):
            text += delta
            is_last = n == len(self.deltas)
            completion = CompletionOutput(0, text, list(range(n)), "stop" if is_last else None)
            self._pending.append(RequestOutput(request_id, None, ids, [completion], is_last, delta))

    def has_unfinished_requests(self):
        return bool(self._pending)

    def step(self):
        return [self._pending.pop(0)]


@pytest.mark.parametrize("is_hidden", [False, True])
def test_plain_mode_puts_the_thinking_on_stderr_unless_hidden(tiny_reasoning_dir, monkeypatch, is_hidden):
    engine = ScriptedEngine(tiny_reasoning_dir, THINKING)
    monkeypatch.setattr(plain, "load_engine", lambda spec, on_stage: engine)
    stdout, stderr = io.StringIO(), io.StringIO()
    streams = dict(stdin=io.StringIO("What is 17 + 25?\n"), stdout=stdout, stderr=stderr)
    assert plain.run_plain(EngineSpec("r1"), ChatSettings(max_tokens=64), is_reasoning_hidden=is_hidden, **streams) == 0
    assert stdout.getvalue() == "It is **42**.\n"
    if is_hidden:
        assert "Let me" not in stderr.getvalue() and "thought for" not in stderr.getvalue()
    else:
        assert re.search(r"Let me add\.\nlowvram: thought for \d+\.\d s, 3 tokens\n", stderr.getvalue())


def test_plain_mode_with_the_real_model_splits_its_reply(tiny_reasoning_dir):
    """The tiny model never closes the reasoning its template opened: all of each reply is thinking."""
    from lowvram import LLM, SamplingParams

    question = [{"role": "user", "content": "What is 17 + 25?"}]
    raw = LLM(str(tiny_reasoning_dir), profile="cpu").chat(question, SamplingParams(temperature=0, max_tokens=8))
    thinking, answer = split_reasoning(raw[0].outputs[0].text, is_open=True)
    stdout, stderr = io.StringIO(), io.StringIO()
    streams = dict(stdin=io.StringIO("What is 17 + 25?\n"), stdout=stdout, stderr=stderr)
    assert plain.run_plain(EngineSpec(str(tiny_reasoning_dir), "cpu"), ChatSettings(max_tokens=8), **streams) == 0
    assert stdout.getvalue() == answer + "\n" and thinking and thinking in stderr.getvalue()


def test_chat_takes_hide_reasoning():
    from lowvram.cli import build_parser

    assert build_parser().parse_args(["chat", "--hide-reasoning"]).hide_reasoning
    assert not build_parser().parse_args(["chat"]).hide_reasoning
