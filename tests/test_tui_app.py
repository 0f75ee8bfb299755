"""The terminal chat against the real engine on the CPU (the bundled demo model when it is installed, else the
tiny fixture checkpoint), driven headless with a Pilot. The screen's own behaviour is in test_tui_screen.py."""

import asyncio
import json
import re
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("textual")

from tui_pilot import (  # noqa: E402
    SIZE,
    UPDATE_SNAPSHOTS,
    panel_text,
    press_now,
    replies,
    run,
    type_and_send,
    wait_for_screen,
    wait_until,
)

import lowvram  # noqa: E402
from lowvram import LLM  # noqa: E402
from lowvram.tui.app import ChatApp  # noqa: E402
from lowvram.tui.backend import ChatBackend, EngineSpec, load_backend  # noqa: E402
from lowvram.tui.conversation import ChatSettings, load_transcript  # noqa: E402
from lowvram.tui.widgets import (  # noqa: E402
    ChatInput,
    EmptyChatHint,
    ErrorDialog,
    LoadingScreen,
    ThresholdSparkline,
    UserMessage,
)

DEMO_WEIGHTS = Path(lowvram.__file__).parent / "demo_model" / "model.safetensors"
DOCS_SCREENSHOT = Path(__file__).parent.parent / "docs" / "chat.svg"
QUESTION = "Sort these words alphabetically: pear, apple, kiwi, plum"

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
