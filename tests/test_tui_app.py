"""The terminal chat, driven headless with a Pilot.

The first group drives the real engine on the CPU (the bundled demo model when it
is installed, else the tiny fixture checkpoint). The second group is about the
screen itself (queueing, scrolling, dialogs, SVG snapshots) and uses a scripted
backend, so its replies and gauges are the same on every machine.
"""

import asyncio
import html
import json
import math
import os
import re
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("textual")

from textual import events  # noqa: E402

import lowvram  # noqa: E402
from lowvram import LLM, SamplingParams  # noqa: E402
from lowvram.demo.tasks import heldout_tasks  # noqa: E402
from lowvram.engine.engine import EngineSnapshot  # noqa: E402
from lowvram.engine.outputs import CompletionOutput, RequestOutput  # noqa: E402
from lowvram.tui.app import ChatApp  # noqa: E402
from lowvram.tui.backend import ChatBackend, EngineSpec, load_backend  # noqa: E402
from lowvram.tui.conversation import ChatSettings, load_transcript  # noqa: E402
from lowvram.tui.widgets import (  # noqa: E402
    AssistantMessage,
    ChatInput,
    EmptyChatHint,
    EnginePanel,
    ErrorDialog,
    HelpScreen,
    LoadingScreen,
    SettingsDialog,
    TextPrompt,
    ThresholdSparkline,
    UserMessage,
)

DEMO_WEIGHTS = Path(lowvram.__file__).parent / "demo_model" / "model.safetensors"
SNAPSHOT_DIR = Path(__file__).parent / "snapshots"
DOCS_SCREENSHOT = Path(__file__).parent.parent / "docs" / "chat.svg"
UPDATE_SNAPSHOTS = bool(os.environ.get("LOWVRAM_UPDATE_SNAPSHOTS"))
SIZE = (120, 36)
QUESTION = "Sort these words alphabetically: pear, apple, kiwi, plum"


async def wait_until(pilot, predicate, what: str, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.005)  # not pilot.pause: that waits for the screen to go idle, which a stream delays


async def wait_for_screen(pilot, screen_type, ready: str, what: str) -> None:
    """Waits until `screen_type` is on top with `ready` laid out: a pushed screen mounts and sizes its widgets
    a moment later, and a click before that lands nowhere."""
    app = pilot.app

    def is_ready() -> bool:
        return isinstance(app.screen, screen_type) and any(w.region.area for w in app.screen.query(ready))

    await wait_until(pilot, is_ready, what)


async def press_now(pilot, key: str) -> None:
    """A key press that does not wait for the screen to go idle, which a streaming reply delays."""
    pilot.app.post_message(events.Key(key, key if len(key) == 1 else None))
    await asyncio.sleep(0.01)


async def type_and_send(pilot, text: str) -> None:
    box = pilot.app.query_one(ChatInput)
    box.value = text
    await press_now(pilot, "enter")
    await wait_until(pilot, lambda: box.value == "", "the input to take the message")


def replies(app) -> list[AssistantMessage]:
    return list(app.query(AssistantMessage))


def panel_text(app, widget_id: str) -> str:
    return str(app.query_one(EnginePanel).query_one(f"#{widget_id}").content)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


# -- the real engine -------------------------------------------------------------


@pytest.fixture(scope="module")
def chat_model(request):
    """None (the bundled model, as `lowvram chat` without --model) when it is installed, else the tiny checkpoint."""
    if DEMO_WEIGHTS.is_file():
        return None
    return str(request.getfixturevalue("tiny_qwen2_dir"))


@pytest.fixture(scope="module")
def llm(chat_model):
    return LLM(chat_model, profile="cpu")


@pytest.fixture
def engine(llm, monkeypatch):
    """The loaded engine, with each step slowed to 10 ms (a slow card) so a stream can be watched and stopped."""
    step = llm.engine.step

    def slow_step():
        time.sleep(0.01)
        return step()

    monkeypatch.setattr(llm.engine, "step", slow_step)
    llm.engine.recent_token_latency_ms.clear()
    return llm.engine


def reuse(engine, label="test model"):
    def loader(spec, on_stage):
        on_stage("reusing the loaded engine")
        return ChatBackend(engine, label)

    return loader


def test_a_question_streams_the_models_answer(llm, engine, chat_model):
    settings = ChatSettings(max_tokens=24)
    expected = llm.chat([{"role": "user", "content": QUESTION}], settings.sampling_params())[0].outputs[0].text
    assert expected

    async def main():
        app = ChatApp(EngineSpec(chat_model, "cpu"), settings, loader=reuse(engine))
        async with app.run_test(size=SIZE) as pilot:
            await wait_until(pilot, lambda: app.backend is not None, "the engine")
            await pilot.pause(0.05)
            is_demo_model, num_hints = app.backend.is_demo_model, len(app.query(EmptyChatHint))
            await type_and_send(pilot, QUESTION)
            await wait_until(pilot, lambda: replies(app) and replies(app)[0].text, "the first words")
            first_view = replies(app)[0]
            partial, was_streaming = first_view.text, first_view.has_class("-streaming")
            await wait_until(pilot, lambda: len(app.conversation.turns) == 2, "the reply to finish")
            await pilot.pause(0.05)
            return partial, was_streaming, first_view, app.conversation.turns, is_demo_model, num_hints

    partial, was_streaming, view, turns, is_demo_model, num_hints = run(main())
    assert is_demo_model == (chat_model is None) and num_hints == 1
    assert was_streaming and expected.startswith(partial) and len(partial) < len(expected)
    assert turns[0].content == QUESTION
    assert turns[1].content == expected and view.source == expected
    assert not view.has_class("-streaming")


def test_stop_aborts_mid_answer_and_frees_pages(llm, engine, chat_model, monkeypatch):
    monkeypatch.setattr(engine, "eos_token_ids", set())  # only the stop can end this reply
    num_blocks = engine.block_manager.num_blocks

    async def main():
        app = ChatApp(EngineSpec(chat_model, "cpu"), ChatSettings(max_tokens=2000), loader=reuse(engine))
        async with app.run_test(size=SIZE) as pilot:
            await wait_until(pilot, lambda: app.backend is not None, "the engine")
            await type_and_send(pilot, "Tell me a very long story.")
            await wait_until(pilot, lambda: replies(app) and len(replies(app)[0].text) > 5, "the reply to start")
            await wait_until(pilot, lambda: "1 running" in panel_text(app, "batch"), "the batch gauge")
            used_while_streaming = panel_text(app, "kv-label")
            await press_now(pilot, "escape")
            await wait_until(pilot, lambda: app._reply is None, "the stop")
            view = replies(app)[0]
            text_at_stop = view.text
            await wait_until(pilot, lambda: engine.block_manager.num_free_blocks == num_blocks, "pages to be freed", 5)
            await asyncio.sleep(0.3)  # a reply that kept going would grow in this time
            await wait_until(pilot, lambda: panel_text(app, "kv-label").startswith("KV pages 0/"), "the KV gauge", 5)
            return app.conversation.turns, view, text_at_stop, used_while_streaming

    turns, view, text_at_stop, used_while_streaming = run(main())
    assert not re.match(r"KV pages 0/", used_while_streaming)
    assert turns[-1].finish_reason == "abort" and turns[-1].content == view.text == text_at_stop
    num_tokens = int(re.search(r"(\d+) tokens?", view.border_subtitle).group(1))
    assert 0 < num_tokens < 2000 and "stopped" in view.border_subtitle and view.has_class("-cut")
    assert not engine.has_unfinished_requests()


def test_gauges_follow_the_engine(engine, chat_model):
    async def main():
        app = ChatApp(EngineSpec(chat_model, "cpu"), ChatSettings(max_tokens=16), loader=reuse(engine))
        async with app.run_test(size=SIZE) as pilot:
            await wait_until(pilot, lambda: app.backend is not None, "the engine")
            await pilot.pause(0.3)
            before = {k: panel_text(app, k) for k in ("decode-label", "latency-label", "kv-label")}
            spark = app.query_one("#latency-spark", ThresholdSparkline)
            num_points_before = len(spark.values)
            await type_and_send(pilot, QUESTION)
            await wait_until(pilot, lambda: len(app.conversation.turns) == 2, "the reply")
            await pilot.pause(0.4)  # one panel refresh
            after = {k: panel_text(app, k) for k in ("decode-label", "latency-label", "kv-label")}
            return before, after, num_points_before, list(spark.values), spark.threshold

    before, after, num_points_before, points, threshold = run(main())
    assert before["decode-label"].startswith("decode 0.0 tok/s") and before["latency-label"].startswith("latency - ms")
    assert num_points_before == 0 and len(points) >= 1 and threshold == 500.0  # the cpu profile's latency limit
    speed = float(re.match(r"decode ([\d.]+) tok/s", after["decode-label"]).group(1))
    latency = re.match(r"latency ([\d.]+) ms", after["latency-label"]).group(1)
    assert speed > 0 and latency == f"{points[-1]:.1f}"  # the label is the newest point of the sparkline
    assert after["kv-label"].startswith("KV pages 0/")  # the finished reply gave its pages back


def test_save_writes_markdown_and_json_that_load_back(llm, chat_model, tmp_path):
    async def main():
        app = ChatApp(
            EngineSpec(chat_model, "cpu"),
            ChatSettings(system_prompt="Be brief.", max_tokens=12),
            transcript_dir=tmp_path,
            loader=reuse(llm.engine),
        )
        async with app.run_test(size=SIZE) as pilot:
            await wait_until(pilot, lambda: app.backend is not None, "the engine")
            await type_and_send(pilot, QUESTION)
            await wait_until(pilot, lambda: len(app.conversation.turns) == 2, "the reply")
            await pilot.press("ctrl+s")
            await pilot.pause(0.05)
            saved = app.conversation.to_json()
            await pilot.press("ctrl+n")
            await wait_until(pilot, lambda: not app.query(UserMessage), "the new chat")
            await type_and_send(pilot, f"/load {next(tmp_path.glob('*.json'))}")
            await wait_until(pilot, lambda: len(app.query(UserMessage)) == 1, "the loaded chat")
            await pilot.pause(0.1)
            return saved, app.conversation.to_json(), [v.text for v in replies(app)]

    saved, reloaded, shown = run(main())
    markdown_files, json_files = list(tmp_path.glob("*.md")), list(tmp_path.glob("*.json"))
    assert len(markdown_files) == 1 and len(json_files) == 1
    answer = saved["turns"][1]["content"]
    assert json.loads(json_files[0].read_text())["turns"] == saved["turns"]
    markdown = markdown_files[0].read_text()
    assert QUESTION in markdown and answer in markdown and "Be brief." in markdown
    assert load_transcript(json_files[0]).to_json() == saved
    assert reloaded == saved and shown == [answer]


def test_loading_screen_shows_stages_then_the_chat(chat_model):
    gate = threading.Event()

    def gated(spec, on_stage):
        on_stage("waiting for the test")
        gate.wait(10)
        return load_backend(spec, on_stage)

    async def main():
        app = ChatApp(EngineSpec(chat_model, "cpu"), loader=gated)
        async with app.run_test(size=SIZE) as pilot:
            await wait_for_screen(pilot, LoadingScreen, "#loading-stage", "the loading screen")
            await wait_until(pilot, lambda: "waiting" in str(app.screen.query_one("#loading-stage").content), "a stage")
            title = str(app.screen.query_one("#loading-title").content)
            gate.set()
            await wait_until(pilot, lambda: app.backend is not None, "the engine", 30)
            await type_and_send(pilot, "hello")
            await wait_until(pilot, lambda: len(app.conversation.turns) == 2, "the reply")
            return title, app.screen

    title, screen = run(main())
    assert "profile cpu" in title and not isinstance(screen, LoadingScreen)


def test_a_load_error_is_a_dialog_with_a_fix_not_a_traceback(tmp_path):
    async def main():
        app = ChatApp(EngineSpec(str(tmp_path / "no-such-model"), "cpu"))
        async with app.run_test(size=SIZE) as pilot:
            await wait_for_screen(pilot, ErrorDialog, "#error-buttons Button", "the error dialog")
            dialog = app.screen
            texts = [str(w.content) for w in dialog.query("Static")]
            await pilot.click("#quit")
            await wait_until(pilot, lambda: app.return_code is not None, "the exit")
            return texts, app.return_code

    texts, return_code = run(main())
    assert any("does not exist" in t for t in texts) and any(t.startswith("Fix: ") for t in texts)
    assert not any("Traceback" in t for t in texts)
    assert return_code == 2


# -- the screen, with a scripted backend -------------------------------------------

SCRIPTED_SNAPSHOT = EngineSnapshot(
    device="cuda:0",
    memory_used_bytes=int(3.02 * 2**30),
    memory_budget_bytes=int(3.6 * 2**30),
    num_kv_blocks=512,
    num_kv_blocks_used=137,
    num_kv_blocks_on_host=24,
    kv_block_size=16,
    kv_precision="int8",
    num_running=1,
    num_waiting=0,
    decode_tokens_per_s=31.4,
    token_latency_ms=31.9,
    recent_token_latency_ms=[30 + 8 * math.sin(i / 2) + (110 if i in (17, 18) else 0) for i in range(40)],
    latency_high_ms=120.0,
    controller_mode="compress",
    last_decision="KV fp16 -> int8: memory at 0.92 of the budget, above the 0.90 high water mark",
)

SCRIPTED_QUESTION = "Sort these numbers from smallest to largest: 42, 7, 19, 88, 3"
SCRIPTED_REPLY = """Sorted: **3, 7, 19, 42, 88**. In Python:

```python
numbers = [42, 7, 19, 88, 3]
print(sorted(numbers))  # [3, 7, 19, 42, 88]
```
"""


class ScriptedBackend:
    """Stands in for the engine where a test is about the screen: replies come from `feed`."""

    model_label = "demo model"
    profile_name = "4gb"
    is_demo_model = True
    max_model_len = 2048

    def __init__(self, snapshot: EngineSnapshot = SCRIPTED_SNAPSHOT):
        self._snapshot = snapshot
        self.chunks: asyncio.Queue = asyncio.Queue()
        self.requests: list[list[dict]] = []
        self.params: list[SamplingParams] = []
        self.num_aborted = 0
        self.is_stopped = False

    def feed(self, *chunks: str, end: bool = True) -> None:
        for chunk in chunks:
            self.chunks.put_nowait(chunk)
        if end:
            self.chunks.put_nowait(None)

    async def stream(self, messages, params):
        self.requests.append(messages)
        self.params.append(params)
        text, is_finished = "", False
        try:
            while not is_finished:
                chunk = await self.chunks.get()
                is_finished = chunk is None
                text += chunk or ""
                yield RequestOutput(
                    "r",
                    None,
                    [1],
                    [CompletionOutput(0, text, [0] * len(text.split()), "stop" if is_finished else None)],
                    is_finished,
                    chunk or "",
                )
        finally:
            self.num_aborted += not is_finished

    def snapshot(self) -> EngineSnapshot:
        return self._snapshot

    def stop(self) -> None:
        self.is_stopped = True


def scripted_app(backend=None, **kwargs):
    backend = backend or ScriptedBackend()
    app = ChatApp(EngineSpec(None, "4gb"), loader=lambda spec, on_stage: backend, **kwargs)
    app.animation_level = "none"  # scrolling lands at once: quicker tests, steadier snapshots
    return app, backend


async def started(pilot):
    app = pilot.app
    await wait_until(
        pilot, lambda: app.backend is not None and not isinstance(app.screen, LoadingScreen), "the backend"
    )
    app.query_one(ChatInput).cursor_blink = False
    await pilot.pause(0.3)  # the panel's first refresh


def test_a_second_message_while_streaming_waits_in_a_visible_queue():
    async def main():
        app, backend = scripted_app()
        async with app.run_test(size=SIZE) as pilot:
            await started(pilot)
            await type_and_send(pilot, "first")
            backend.feed("one ", end=False)
            await type_and_send(pilot, "second")
            await pilot.pause(0.05)
            queued = app.query(UserMessage)[1]
            seen = (
                queued.has_class("-queued"),
                queued.border_subtitle,
                str(app.query_one("#status").content),
                len(backend.requests),
            )
            backend.feed("two")
            await wait_until(pilot, lambda: len(backend.requests) == 2, "the queued message to be sent")
            backend.feed("three")
            await wait_until(pilot, lambda: len(app.conversation.turns) == 4, "both replies")
            return seen, queued.has_class("-queued"), backend.requests

    (was_queued, subtitle, status, num_requests), is_still_queued, requests = run(main())
    assert was_queued and "queued" in subtitle and "1 queued" in status and num_requests == 1
    assert not is_still_queued
    assert requests[1] == [
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "one two"},
        {"role": "user", "content": "second"},
    ]


def test_stop_also_drops_queued_messages():
    async def main():
        app, backend = scripted_app()
        async with app.run_test(size=SIZE) as pilot:
            await started(pilot)
            await type_and_send(pilot, "first")
            backend.feed("partial ", end=False)
            await type_and_send(pilot, "second")
            await wait_until(pilot, lambda: replies(app) and replies(app)[0].text, "the first words")
            await press_now(pilot, "escape")
            await wait_until(pilot, lambda: backend.num_aborted == 1, "the stream to be closed")
            return len(app.query(UserMessage)), [t.role for t in app.conversation.turns], len(backend.requests)

    num_user_views, roles, num_requests = run(main())
    assert num_user_views == 1 and roles == ["user", "assistant"] and num_requests == 1


def test_auto_scroll_follows_only_at_the_bottom():
    async def main():
        app, backend = scripted_app()
        async with app.run_test(size=SIZE) as pilot:
            await started(pilot)
            view = app.query_one("#conversation")

            def is_at_bottom():
                return view.scroll_y == view.max_scroll_y

            await type_and_send(pilot, "long please")
            backend.feed(*[f"line {i}\n\n" for i in range(24)], end=False)
            await wait_until(pilot, lambda: view.max_scroll_y > 20 and is_at_bottom(), "following a tall reply")
            await press_now(pilot, "pageup")
            await wait_until(pilot, lambda: view.scroll_y < view.max_scroll_y - 10, "the page up")
            parked_y, max_y_before = view.scroll_y, view.max_scroll_y
            backend.feed(*[f"more {i}\n\n" for i in range(8)], end=False)
            await wait_until(pilot, lambda: view.max_scroll_y > max_y_before + 8, "the new lines")
            await asyncio.sleep(0.1)
            kept_y = view.scroll_y
            for _ in range(3):
                await press_now(pilot, "pagedown")
            await wait_until(pilot, is_at_bottom, "the view back at the bottom")
            max_y_before = view.max_scroll_y
            backend.feed(*[f"last {i}\n\n" for i in range(4)])
            await wait_until(pilot, lambda: view.max_scroll_y > max_y_before and is_at_bottom(), "following again", 5)
            return parked_y, kept_y

    parked_y, kept_y = run(main())
    assert kept_y == parked_y  # scrolled up: new text did not pull the view down


@pytest.mark.parametrize("is_demo_model", [True, False])
def test_an_empty_chat_says_what_the_model_is_good_at(is_demo_model):
    async def main():
        backend = ScriptedBackend()
        backend.is_demo_model = is_demo_model
        app, _ = scripted_app(backend)
        async with app.run_test(size=SIZE) as pilot:
            await started(pilot)

            def hints():
                return [str(w.content) for w in app.query(EmptyChatHint)]

            before = hints()
            await type_and_send(pilot, "hello")
            backend.feed("hi")
            await wait_until(pilot, lambda: len(app.conversation.turns) == 2, "the reply")
            after_send = hints()
            await pilot.press("ctrl+n")
            await pilot.pause(0.05)
            return before, after_send, hints()

    before, after_send, after_new_chat = run(main())
    assert len(before) == 1 and after_send == [] and after_new_chat == before
    questions = [line.strip() for line in before[0].splitlines()[1:]]
    if is_demo_model:
        kind_of = {task.messages[-1]["content"]: task.kind for task in heldout_tasks()}
        assert len(questions) == 3 and len({kind_of[q] for q in questions}) == 3  # three of its task kinds
    else:
        assert questions == [] and "type a message" in before[0]


def test_input_history_walks_back_and_forth():
    async def main():
        app, backend = scripted_app()
        async with app.run_test(size=SIZE) as pilot:
            await started(pilot)
            box = app.query_one(ChatInput)
            for text in ("alpha", "beta"):
                await type_and_send(pilot, text)
                backend.feed("ok")
                await wait_until(pilot, lambda: app._reply is None and not app._queue, "the reply")
            box.value = "draft"
            seen = []
            for key in ("up", "up", "up", "down", "down"):
                await pilot.press(key)
                seen.append(box.value)
            return seen

    assert run(main()) == ["beta", "alpha", "alpha", "beta", "draft"]


def test_settings_and_system_prompt_reach_the_next_request():
    async def main():
        app, backend = scripted_app()
        async with app.run_test(size=SIZE) as pilot:
            await started(pilot)
            await pilot.press("f3")
            await wait_for_screen(pilot, SettingsDialog, "#temperature", "the settings dialog")
            app.screen.query_one("#temperature").value = "-1"
            await pilot.press("enter")
            error = str(app.screen.query_one("#settings-error").content)
            app.screen.query_one("#temperature").value = "0.7"
            app.screen.query_one("#max-tokens").value = "64"
            await pilot.press("enter")
            await pilot.press("f2")
            await wait_for_screen(pilot, TextPrompt, "#prompt-input", "the system prompt dialog")
            app.screen.query_one("#prompt-input").value = "Answer in French."
            await pilot.press("enter")
            await type_and_send(pilot, "hello")
            backend.feed("bonjour")
            await wait_until(pilot, lambda: len(app.conversation.turns) == 2, "the reply")
            return error, app.conversation.settings, backend.requests[0], str(app.query_one("#status").content)

    error, settings, request, status = run(main())
    assert "temperature" in error and "-1" in error
    assert (settings.temperature, settings.max_tokens) == (0.7, 64)
    assert request[0] == {"role": "system", "content": "Answer in French."}
    assert "temperature 0.7" in status and "max 64 tokens" in status


def test_max_tokens_must_leave_room_for_the_prompt():
    async def main():
        app, backend = scripted_app(settings=ChatSettings(max_tokens=4000))  # the model holds 2048 tokens
        notes = []
        app.notify = lambda message, **kwargs: notes.append(message)
        async with app.run_test(size=SIZE) as pilot:
            await started(pilot)
            max_tokens_after_load = app.conversation.settings.max_tokens
            await type_and_send(pilot, "/max 2000")
            await pilot.press("f3")
            await wait_for_screen(pilot, SettingsDialog, "#max-tokens", "the settings dialog")
            dialog_labels = [str(label.content) for label in app.screen.query("Label")]
            app.screen.query_one("#max-tokens").value = "2000"
            await pilot.press("enter")
            error, is_still_open = (
                str(app.screen.query_one("#settings-error").content),
                app.screen is not app.main_screen,
            )
            app.screen.query_one("#max-tokens").value = "1000"
            await pilot.press("enter")
            await type_and_send(pilot, "hello")
            backend.feed("hi")
            await wait_until(pilot, lambda: len(app.conversation.turns) == 2, "the reply")
            return max_tokens_after_load, notes, dialog_labels, error, is_still_open, backend.params[0].max_tokens

    max_tokens_after_load, notes, labels, error, is_still_open, sent_max_tokens = run(main())
    assert max_tokens_after_load == 1536 and "max tokens 4000 does not fit the model's 2048-token context" in notes[0]
    assert "max tokens 2000 leaves 48 of the model's 2048 context tokens" in notes[1] and "at most 1536" in notes[1]
    assert any("at most 1536 of the 2048-token context" in label for label in labels)
    assert "max tokens 2000 leaves 48" in error and is_still_open
    assert sent_max_tokens == 1000  # what F3 set is what the next reply asks for


def test_picking_a_profile_reloads_the_engine():
    specs = []
    backends = []

    def loader(spec, on_stage):
        specs.append(spec)
        backends.append(ScriptedBackend())
        return backends[-1]

    async def main():
        app = ChatApp(EngineSpec(None, "4gb"), loader=loader)
        async with app.run_test(size=SIZE) as pilot:
            await started(pilot)
            await pilot.press("f4")
            await wait_for_screen(pilot, TextPrompt, "#prompt-input", "the profile picker")
            app.screen.query_one("#prompt-input").value = "2gb"
            await pilot.press("enter")
            await wait_until(pilot, lambda: len(specs) == 2 and app.backend is backends[1], "the reload")
            return str(app.sub_title)

    sub_title = run(main())
    assert [s.profile for s in specs] == ["4gb", "2gb"] and backends[0].is_stopped
    assert "profile" in sub_title


def test_an_empty_path_keeps_the_dialog_open_and_says_what_to_type(tmp_path):
    async def main():
        app, _ = scripted_app(transcript_dir=tmp_path)
        seen = []
        async with app.run_test(size=SIZE) as pilot:
            await started(pilot)
            for key in ("ctrl+o", "f4"):
                await pilot.press(key)
                await wait_for_screen(pilot, TextPrompt, "#prompt-input", f"the {key} dialog")
                await pilot.press("enter")
                await pilot.pause(0.05)
                seen.append((isinstance(app.screen, TextPrompt), str(app.screen.query_one("#prompt-error").content)))
                await pilot.press("escape")
            return seen, app.return_code

    [(load_open, load_message), (profile_open, profile_message)], return_code = run(main())
    assert load_open and "type the path of a .json transcript" in load_message
    assert profile_open and "type a profile name" in profile_message
    assert return_code is None


def failing_loader(spec, on_stage):
    from lowvram.errors import OutOfMemoryError

    raise OutOfMemoryError(
        "the model needs 5.2 GiB but profile '4gb' allows 3.6 GiB; use a smaller model or an AWQ INT4 checkpoint"
    )


@pytest.mark.parametrize("opener", ["load error", "f1", "f3", "f4", "ctrl+o"])
def test_ctrl_q_quits_from_any_dialog(opener, tmp_path):
    async def main():
        if opener == "load error":
            app = ChatApp(EngineSpec(None, "4gb"), loader=failing_loader)
        else:
            app, _ = scripted_app(transcript_dir=tmp_path)
        async with app.run_test(size=SIZE) as pilot:
            if opener == "load error":
                await wait_for_screen(pilot, ErrorDialog, "#error-buttons Button", "the error dialog")
            else:
                await started(pilot)
                await pilot.press(opener)
                await wait_until(pilot, lambda: app.screen is not app.main_screen, "the dialog")
            dialog = type(app.screen)
            await pilot.press("ctrl+q")
            await wait_until(pilot, lambda: app.return_code is not None, "the exit", 5)
            return dialog

    assert run(main()) in (ErrorDialog, HelpScreen, SettingsDialog, TextPrompt)


def test_help_lists_every_key_binding_and_command():
    async def main():
        app, _ = scripted_app()
        async with app.run_test(size=SIZE) as pilot:
            await started(pilot)
            await pilot.press("f1")
            await wait_for_screen(pilot, HelpScreen, "DataTable", "the help screen")
            table = app.screen.query_one("DataTable")
            rows = [str(table.get_row_at(i)[0]) for i in range(table.row_count)]
            await pilot.press("escape")
            await pilot.pause(0.05)
            return rows, app.screen

    rows, screen = run(main())
    for key in (
        "Esc",
        "Ctrl+N",
        "Ctrl+S",
        "Ctrl+O",
        "F1",
        "F2",
        "F3",
        "F4",
        "F5",
        "Ctrl+Q",
        "/save [PATH]",
        "/load PATH",
    ):
        assert key in rows
    assert not isinstance(screen, HelpScreen)


# -- SVG snapshots ----------------------------------------------------------------


def screen_rows(svg: str) -> list[str]:
    """The characters of each terminal row of an exported screenshot. The styling around them
    (colours, class names) changes with Textual's version; what the screen says does not."""
    rows: dict[int, list[str]] = {}
    for match in re.finditer(r'<text[^>]*clip-path="url\(#terminal-\d+-line-(\d+)\)"[^>]*>(.*?)</text>', svg):
        rows.setdefault(int(match.group(1)), []).append(html.unescape(match.group(2)))
    return ["".join(rows.get(row, [])) for row in range(max(rows, default=-1) + 1)]


def assert_snapshot(svg: str, name: str, tmp_path: Path) -> None:
    """Compare the screen's text with tests/snapshots/NAME.svg; LOWVRAM_UPDATE_SNAPSHOTS=1 rewrites it."""
    path = SNAPSHOT_DIR / f"{name}.svg"
    if UPDATE_SNAPSHOTS:
        path.parent.mkdir(exist_ok=True)
        path.write_text(svg, encoding="utf-8")
        return
    actual = tmp_path / f"{name}.svg"
    actual.write_text(svg, encoding="utf-8")
    assert path.is_file(), f"no stored snapshot {path}; run with LOWVRAM_UPDATE_SNAPSHOTS=1 to create it"
    expected_rows, actual_rows = screen_rows(path.read_text(encoding="utf-8")), screen_rows(svg)
    differing = [row for row, (want, got) in enumerate(zip(expected_rows, actual_rows)) if want != got]
    if differing or len(actual_rows) != len(expected_rows):
        row = differing[0] if differing else min(len(expected_rows), len(actual_rows))
        pytest.fail(
            f"the screen differs from {path} in {len(differing)} rows, first row {row}: "
            f"{expected_rows[row : row + 1]!r} became {actual_rows[row : row + 1]!r}; the new one is {actual} "
            "(LOWVRAM_UPDATE_SNAPSHOTS=1 accepts it)"
        )


async def main_screen(pilot, backend) -> None:
    await started(pilot)
    await type_and_send(pilot, SCRIPTED_QUESTION)
    backend.feed(SCRIPTED_REPLY)
    await wait_until(pilot, lambda: len(pilot.app.conversation.turns) == 2, "the reply")
    await pilot.pause(0.3)


def test_snapshot_main_screen(tmp_path):
    async def main():
        app, backend = scripted_app()
        async with app.run_test(size=SIZE) as pilot:
            await main_screen(pilot, backend)
            return app.export_screenshot()

    assert_snapshot(run(main()), "chat_main", tmp_path)


@pytest.mark.parametrize("size", [(80, 24), (50, 15)])
def test_a_small_terminal_keeps_the_panel_whole_or_hides_it(size, tmp_path):
    async def main():
        app, backend = scripted_app()
        async with app.run_test(size=size) as pilot:
            await main_screen(pilot, backend)
            panel = app.query_one(EnginePanel)
            bottom_rows = [panel.query_one(f"#{widget_id}").region for widget_id in ("controller", "decision")]
            is_whole = all(panel.content_region.contains_region(region) for region in bottom_rows)
            seen = panel.display, is_whole, app.query_one("#conversation").region.width, app.export_screenshot()
            await pilot.press("f5")
            await pilot.pause(0.1)
            return seen, panel.display

    (is_shown, is_whole, chat_width, svg), is_shown_after_f5 = run(main())
    assert chat_width >= 40
    if size == (80, 24):
        assert is_shown and is_whole and not is_shown_after_f5
        assert any("controller\xa0compress" in row for row in screen_rows(svg))  # &#160; in the SVG
    else:
        assert not is_shown and is_shown_after_f5
    assert_snapshot(svg, f"chat_{size[0]}x{size[1]}", tmp_path)


def test_snapshot_help_screen(tmp_path):
    async def main():
        app, backend = scripted_app()
        async with app.run_test(size=SIZE) as pilot:
            await started(pilot)
            await pilot.press("f1")
            await pilot.pause(0.2)
            return app.export_screenshot()

    assert_snapshot(run(main()), "chat_help", tmp_path)


def test_snapshot_load_error(tmp_path):
    async def main():
        app = ChatApp(EngineSpec(None, "4gb"), loader=failing_loader)
        async with app.run_test(size=SIZE) as pilot:
            await wait_for_screen(pilot, ErrorDialog, "#error-buttons Button", "the error dialog")
            app.query_one(ChatInput).cursor_blink = False
            await pilot.pause(0.2)
            return app.export_screenshot()

    assert_snapshot(run(main()), "chat_load_error", tmp_path)


def test_docs_screenshot_is_the_app(tmp_path):
    """docs/chat.svg is a real session on the bundled model; LOWVRAM_UPDATE_SNAPSHOTS=1 retakes it."""
    if UPDATE_SNAPSHOTS and DEMO_WEIGHTS.is_file():

        async def main():
            app = ChatApp(EngineSpec(None, "cpu"), ChatSettings(max_tokens=64))
            async with app.run_test(size=SIZE) as pilot:
                await wait_until(pilot, lambda: app.backend is not None, "the bundled model", 60)
                for question in ("What is 17 + 25?", QUESTION, "What day comes 2 weeks and 3 days after Monday?"):
                    await type_and_send(pilot, question)
                    await wait_until(pilot, lambda: app._reply is None, "the reply")
                app.query_one(ChatInput).cursor_blink = False
                await pilot.pause(0.5)
                return app.export_screenshot(title="lowvram chat")

        DOCS_SCREENSHOT.write_text(run(main()), encoding="utf-8")
    svg = DOCS_SCREENSHOT.read_text(encoding="utf-8")
    assert svg.startswith("<svg") and "lowvram&#160;chat" in svg and "KV&#160;pages" in svg


def test_saved_chat_keeps_its_kv_pages_and_loading_restores_them(chat_model, tmp_path):
    first_engine = LLM(chat_model, profile="cpu").engine

    async def save():
        app = ChatApp(
            EngineSpec(chat_model, "cpu"),
            ChatSettings(max_tokens=12),
            transcript_dir=tmp_path,
            loader=reuse(first_engine),
        )
        async with app.run_test(size=SIZE) as pilot:
            await wait_until(pilot, lambda: app.backend is not None, "the engine")
            await type_and_send(pilot, QUESTION)
            await wait_until(pilot, lambda: len(app.conversation.turns) == 2, "the reply")
            await pilot.press("ctrl+s")
            await wait_until(pilot, lambda: any(tmp_path.glob("*.kv")), "the KV file")

    run(save())
    second_engine = LLM(chat_model, profile="cpu").engine  # another process's engine, as after a restart

    async def load():
        app = ChatApp(EngineSpec(chat_model, "cpu"), transcript_dir=tmp_path, loader=reuse(second_engine))
        async with app.run_test(size=SIZE) as pilot:
            await wait_until(pilot, lambda: app.backend is not None, "the engine")
            await type_and_send(pilot, f"/load {next(tmp_path.glob('*.json'))}")
            await wait_until(pilot, lambda: app.last_kv_restore is not None, "the KV restore")
            return app.last_kv_restore

    result = run(load())
    assert result.is_restored and result.num_tokens > 10, result.message
    assert second_engine.block_manager.num_cached_blocks > 0


def test_quantize_on_load_reports_each_layer_and_chats_with_int4_weights(chat_model, tmp_path, monkeypatch):
    from lowvram.tui.backend import load_engine

    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    spec = EngineSpec(chat_model, "cpu", is_quantized_on_load=True, num_calib_samples=2)
    stages: list[str] = []
    engine = load_engine(spec, stages.append)
    num_layers = engine.config.num_layers
    assert any(s.startswith("quantizing ") and "once" in s for s in stages)
    assert [s for s in stages if s.startswith("quantizing: layer")][
        -1
    ] == f"quantizing: layer {num_layers} of {num_layers}"
    assert engine.config.quantization is not None and engine.model.weight_report.int4_layer_bytes > 0
    again: list[str] = []
    load_engine(spec, again.append)  # the INT4 copy is made once
    assert any("made earlier" in s for s in again) and not any(s.startswith("quantizing: layer") for s in again)

    async def main():
        app = ChatApp(spec, ChatSettings(max_tokens=12))
        async with app.run_test(size=SIZE) as pilot:
            await wait_until(pilot, lambda: app.backend is not None, "the engine", 60)
            await type_and_send(pilot, QUESTION)
            await wait_until(pilot, lambda: len(app.conversation.turns) == 2, "the reply")
            return app.backend.llm_engine.config.quantization, app.conversation.turns[1].content

    quantization, reply = run(main())
    assert quantization is not None and reply


def test_the_gauge_timer_firing_after_the_screens_are_gone_is_harmless():
    # The panel's refresh timer can fire once more while the app closes, after its screens
    # are popped; it must not raise (it did: an IndexError on the empty screen stack).
    async def main():
        app, _ = scripted_app()
        async with app.run_test(size=SIZE) as pilot:
            await started(pilot)
        return app

    app = run(main())
    assert not app.screen_stack
    app._refresh_panel()
