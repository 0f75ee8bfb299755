"""The chat's screen (queueing, scrolling, dialogs, small terminals, SVG snapshots) against a scripted backend,
so its replies and gauges are the same on every machine."""

import asyncio

import pytest

pytest.importorskip("textual")

from tui_pilot import (  # noqa: E402
    SIZE,
    ScriptedBackend,
    assert_snapshot,
    failing_loader,
    main_screen,
    press_now,
    replies,
    run,
    screen_rows,
    scripted_app,
    started,
    type_and_send,
    wait_for_screen,
    wait_until,
)

from lowvram.demo.tasks import heldout_tasks  # noqa: E402
from lowvram.tui.app import ChatApp  # noqa: E402
from lowvram.tui.backend import EngineSpec  # noqa: E402
from lowvram.tui.conversation import ChatSettings  # noqa: E402
from lowvram.tui.widgets import (  # noqa: E402
    ChatInput,
    ContextNotice,
    EmptyChatHint,
    EnginePanel,
    ErrorDialog,
    HelpScreen,
    SettingsDialog,
    TextPrompt,
    UserMessage,
)


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


def test_older_turns_are_dropped_to_fit_the_context_and_the_chat_says_so():
    backend = ScriptedBackend()
    backend.max_model_len = 60  # a scripted token is a word: 50 for the prompt, 10 for the reply
    ten_words = " ".join(["word"] * 9)

    async def main():
        app, _ = scripted_app(backend, settings=ChatSettings(max_tokens=10))
        async with app.run_test(size=SIZE) as pilot:
            await started(pilot)
            for i in range(5):
                await type_and_send(pilot, f"q{i} {ten_words}")
                backend.feed(f"a{i} {ten_words}")
                await wait_until(pilot, lambda: len(app.conversation.turns) == 2 * i + 2, "the reply")
            notices = [str(notice.content) for notice in app.query(ContextNotice)]
            order = [type(w).__name__ for w in app.conversation_view.children]
            await type_and_send(pilot, " ".join(["long"] * 51))  # more than the context, whatever is dropped
            await wait_for_screen(pilot, ErrorDialog, "#error-buttons Button", "the error dialog")
            error = f"{app.screen.message} {app.screen.hint}"
            await pilot.press("enter")
            await type_and_send(pilot, "after")
            backend.feed("ok")
            await wait_until(pilot, lambda: len(app.conversation.turns) == 12, "the reply after the error")
            return notices, order, error, [[m["content"].split()[0] for m in r] for r in backend.requests]

    notices, order, error, sent = run(main())
    assert sent[:5] == [
        ["q0"],
        ["q0", "a0", "q1"],
        ["q0", "a0", "q1", "a1", "q2"],
        ["q0", "a0", "q2", "a2", "q3"],  # the first turn stays, the oldest after it goes
        ["q0", "a0", "q3", "a3", "q4"],
    ]
    assert sent[5] == ["q0", "a0", "q4", "a4", "after"]  # the message that did not fit left no trace
    assert notices == [
        "1 older turn dropped to fit the 60-token context",
        "2 older turns dropped to fit the 60-token context",
    ]
    assert order.count("ContextNotice") == 2 and order.index("ContextNotice") == 6  # above the message it concerns
    assert "the message has 51 tokens" in error and "60-token context" in error


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


def test_dialogs_fit_a_narrow_terminal():
    async def main():
        app, _ = scripted_app()
        async with app.run_test(size=(50, 15)) as pilot:
            await started(pilot)
            edges = []
            for key in ("f1", "f3", "f4"):
                await pilot.press(key)
                await pilot.pause(0.1)
                box = app.screen.query_one("#help-box, .dialog").region
                edges.append((box.x, box.right))
                await pilot.press("escape")
            return edges

    assert all(left >= 0 and right <= 50 for left, right in run(main()))


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
