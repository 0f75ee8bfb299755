"""`lowvram chat`: the conversation on the left, what the engine is doing on the right.

The model loads in a thread worker; replies come from the engine's own loop thread through an async worker,
and cancelling that worker aborts the request (freeing its KV pages). Both hand their results to the UI with
`call_later`. A message sent while a reply streams waits in a visible queue; Esc stops the reply and the queue.
"""

from __future__ import annotations

import logging
from collections import deque
from functools import partial
from pathlib import Path

from textual import work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Vertical, VerticalScroll
from textual.widgets import Footer, Header, Input, Static

from lowvram.config import builtin_profile_names, load_profile
from lowvram.core.sampling_params import SamplingParams
from lowvram.errors import LowvramError
from lowvram.tui import conversation as chat
from lowvram.tui import widgets as ui
from lowvram.tui.backend import ChatBackend, EngineSpec, LogForwarder, ReplyText, load_backend

PANEL_REFRESH_S = 0.25
KEY_NAMES = {"escape": "Esc", "pageup": "PgUp", "pagedown": "PgDn"}
# The slash commands that are the same as a key's action.
COMMAND_ACTIONS = {"help": "help", "new": "new_chat", "stop": "stop", "profile": "pick_profile", "quit": "quit"}


def key_label(keys: str) -> str:
    """'ctrl+n' -> 'Ctrl+N', 'escape' -> 'Esc', as the help screen and the docs show them."""
    return " / ".join(
        "+".join(KEY_NAMES.get(part, part.capitalize() if len(part) > 1 else part.upper()) for part in key.split("+"))
        for key in keys.split(",")
    )


class ChatApp(App):
    """The terminal chat. `loader(spec, on_stage)` builds the backend (the real engine by default).
    is_reasoning_hidden: a reasoning model's thinking blocks start folded."""

    CSS_PATH = "chat.tcss"
    TITLE = "lowvram chat"
    ENABLE_COMMAND_PALETTE = False  # F1 lists everything; the footer keeps room for the chat's own keys
    # The footer shows these in order, as far as the terminal's width goes.
    BINDINGS = [
        Binding("escape", "stop", "Stop"),
        Binding("f1", "help", "Help"),
        Binding("f5", "toggle_panel", "Panel", tooltip="Show or hide the engine panel"),
        Binding("ctrl+n", "new_chat", "New chat"),
        Binding("ctrl+s", "save", "Save"),
        Binding("ctrl+o", "load", "Load"),
        Binding("f2", "system_prompt", "System prompt"),
        Binding("f3", "settings", "Reply settings", tooltip="Temperature and max tokens per reply"),
        Binding("f4", "pick_profile", "Profile"),
        Binding("pageup", "scroll_conversation(-1)", "Scroll the chat up", show=False),
        Binding("pagedown", "scroll_conversation(1)", "Scroll the chat down", show=False),
        Binding("ctrl+q", "quit", "Quit", priority=True),  # from any dialog too
    ]

    def __init__(
        self,
        spec: EngineSpec | None = None,
        settings=None,
        *,
        transcript_dir=None,
        loader=load_backend,
        is_reasoning_hidden=False,
    ):
        super().__init__()
        self.is_reasoning_hidden = is_reasoning_hidden
        self.spec = spec or EngineSpec()
        self.conversation = chat.Conversation(settings or chat.ChatSettings(), model=self.spec.model_label)
        self.transcript_dir = transcript_dir
        self.loader = loader
        self.backend: ChatBackend | None = None
        self.load_error: BaseException | None = None
        self.last_kv_restore = None  # the result of restoring a loaded transcript's KV pages
        self._reply: ui.AssistantMessage | None = None  # the reply streaming now
        self._queue: deque[ui.UserMessage] = deque()
        self._num_dropped_turns = 0  # older turns the last prompt left out to fit the context
        self._is_fitting = False
        # Engine warnings become notifications (thread-safe): a line on stderr would tear the screen.
        self._log_forwarder = LogForwarder(logging.WARNING, partial(self.notify, title="engine", severity="warning"))
        self._was_propagating = True

    def compose(self) -> ComposeResult:
        yield Header(show_clock=False, icon="▣")
        with ui.ChatBody(id="body"):
            with Vertical(id="chat"):
                yield VerticalScroll(id="conversation")
                yield Static("", id="status", markup=False)
                yield ui.ChatInput(placeholder="Ask something · /help lists the commands", id="prompt")
            yield ui.EnginePanel(id="panel")
        yield Footer()

    @property
    def main_screen(self):
        """The chat's own screen, whatever dialog is on top of it."""
        return self.screen_stack[0]

    @property
    def conversation_view(self) -> VerticalScroll:
        return self.main_screen.query_one("#conversation", VerticalScroll)

    def on_mount(self) -> None:
        logger = logging.getLogger("lowvram")
        logger.addHandler(self._log_forwarder)
        self._was_propagating, logger.propagate = logger.propagate, False
        self.conversation_view.anchor()
        self.set_interval(PANEL_REFRESH_S, self._refresh_panel)
        self._start_loading()

    def on_unmount(self) -> None:
        if self._reply is not None:
            self._reply.worker.cancel()
        if self.backend is not None:
            self.backend.stop()
            self.backend = None
        logger = logging.getLogger("lowvram")
        logger.removeHandler(self._log_forwarder)
        logger.propagate = self._was_propagating

    # -- loading --------------------------------------------------------------
    def _start_loading(self, old_backend: ChatBackend | None = None) -> None:
        self.sub_title = f"{self.spec.model_label} · loading"
        self.load_error = None
        self.push_screen(ui.LoadingScreen(self.spec.model_label, self.spec.profile))
        self._update_status()
        self._load(self.spec, old_backend)

    @work(thread=True, exclusive=True, group="load")
    def _load(self, spec: EngineSpec, old_backend: ChatBackend | None) -> None:
        if old_backend is not None:
            old_backend.stop()  # its pages and weights go before the next model's arrive
        try:
            backend = self.loader(spec, lambda text: self.call_later(self._show_stage, text))
        except Exception as exc:  # every failure reaches the dialog; a traceback would tear the screen
            self.call_later(self._loaded, None, exc)
            return
        if not self.call_later(self._loaded, backend):
            backend.stop()  # the app closed while loading

    def _show_stage(self, text: str) -> None:
        if isinstance(self.screen, ui.LoadingScreen):
            self.screen.query_one("#loading-stage", Static).update(text)

    async def _loaded(self, backend: ChatBackend | None, error: BaseException | None = None) -> None:
        self.backend, self.load_error = backend, error
        if isinstance(self.screen, ui.LoadingScreen):
            self.pop_screen()
        self._update_status()
        if error is not None:
            self.sub_title = f"{self.spec.model_label} · not loaded"
            dialog = ui.ErrorDialog(
                "Could not load the model", error, [("profile", "Pick a profile"), ("quit", "Quit")]
            )
            return self.push_screen(dialog, self._after_load_error)
        self.conversation.model, self.conversation.profile = backend.model_label, backend.profile_name
        self.sub_title = f"{backend.model_label} · profile {backend.profile_name}"
        self._fit_max_tokens()
        self._refresh_panel()
        await self._show_hint()
        self.main_screen.query_one(ui.ChatInput).focus()
        await self._pump()

    def _after_load_error(self, choice: str | None) -> None:
        if choice == "profile":
            self.action_pick_profile()
        else:
            self.exit(return_code=2)

    # -- sending and streaming ------------------------------------------------
    async def on_input_submitted(self, event: Input.Submitted) -> None:
        text = event.value.strip()
        if not isinstance(event.input, ui.ChatInput) or not text:
            return
        event.input.remember(text)
        event.input.value = ""
        try:
            command = chat.parse_command(text)
            if command is not None:
                return await self._run_command(command)
        except LowvramError as exc:
            return self.notify(str(exc), title="command", severity="error")
        await self.send(chat.message_text(text))

    async def _show_hint(self) -> None:
        """In an empty chat with a model loaded: what the model is good at."""
        if self.backend is not None and not self.conversation_view.children:
            await self.conversation_view.mount(ui.EmptyChatHint(self.backend.model_label, self.backend.is_demo_model))

    async def send(self, text: str) -> None:
        """Show the message and send it now, or queue it behind the reply that is streaming."""
        await self.conversation_view.query(ui.EmptyChatHint).remove()
        is_waiting = self._reply is not None or self._is_fitting or self.backend is None or bool(self._queue)
        view = ui.UserMessage(text, is_queued=is_waiting)
        self._queue.append(view)
        await self.conversation_view.mount(view)
        self.conversation_view.anchor()  # sending is a jump to the newest message
        if is_waiting:
            self._update_status()
        await self._pump()

    async def _pump(self) -> None:
        if self._reply is not None or self._is_fitting or self.backend is None or not self._queue:
            return
        user_view = self._queue.popleft()
        user_view.set_queued(False)
        self.conversation.turns.append(chat.Turn("user", user_view.text))
        params = self.conversation.settings.sampling_params()
        self._is_fitting = True  # what is sent meanwhile waits in the queue
        try:
            messages, fit = await self.backend.fit(self.conversation.messages(), params.max_tokens)
        except Exception as exc:  # the message alone does not fit: it goes back out, the chat goes on
            self._is_fitting = False
            self.conversation.turns.pop()
            await user_view.remove()
            self.push_screen(ui.ErrorDialog("The message does not fit the context", exc, [("ok", "OK")]))
            return await self._pump()
        self._is_fitting = False
        if fit.num_dropped_turns and fit.num_dropped_turns != self._num_dropped_turns:
            notice = chat.dropped_turns_notice(fit.num_dropped_turns, self.backend.max_model_len)
            await self.conversation_view.mount(ui.ContextNotice(notice), before=user_view)
        self._num_dropped_turns = fit.num_dropped_turns
        view = self._reply = ui.AssistantMessage(self.backend.model_label)
        await self.conversation_view.mount(view, after=user_view)
        view.start_streaming()
        view.reply_text = ReplyText(self.backend.reasoning_parser)
        view.worker = self._stream_reply(view, messages, params)
        self._update_status()

    @work(group="reply")
    async def _stream_reply(self, view: ui.AssistantMessage, messages: list[dict], params: SamplingParams) -> None:
        finish_reason, error, num_tokens = "abort", None, 0
        reply = view.reply_text
        try:
            async for out in self.backend.stream(messages, params):
                num_tokens = len(out.outputs[0].token_ids)
                reasoning, answer, thought = reply.add(out)
                if reasoning or answer or thought:
                    self.call_later(self._on_reply, view, answer, num_tokens, reasoning=reasoning, thought=thought)
                if out.finished:
                    finish_reason = out.outputs[0].finish_reason or "stop"
        except Exception as exc:  # shown in a dialog; the chat goes on
            finish_reason, error = "error", exc
        finally:
            self.call_later(self._on_reply, view, "", num_tokens, finish_reason, error)

    async def _on_reply(
        self, view, text: str, num_tokens: int, finish_reason=None, error=None, *, reasoning="", thought=None
    ) -> None:
        """New text of a reply and of its reasoning (`thought`: the reasoning's summary, once it has ended);
        with finish_reason set, its end."""
        if view is not self._reply:  # a stopped reply's last words
            return
        view.num_tokens = num_tokens
        if reasoning:
            await view.write_reasoning(reasoning, is_hidden=self.is_reasoning_hidden)
        if thought and view.reasoning_block is not None:
            view.reasoning_block.finish(thought)
        if text:
            await view.write(text)
        if finish_reason is not None:
            await self._finish_reply(finish_reason, error)

    async def _finish_reply(self, finish_reason: str, error: BaseException | None = None) -> None:
        view, self._reply = self._reply, None
        await view.finish(finish_reason, f"{view.num_tokens} token{'' if view.num_tokens == 1 else 's'}")
        block = view.reasoning_block
        if block is not None and block.title == block.THINKING_TITLE:  # stopped while thinking
            block.finish(view.reply_text.thought())
        if error is None:
            reasoning = block.text if block is not None else None
            self.conversation.turns.append(chat.Turn("assistant", view.text, finish_reason, reasoning))
        else:
            self.conversation.turns.pop()  # the question goes back out of the history with its failed reply
            self.push_screen(ui.ErrorDialog("The reply failed", error, [("ok", "OK")]))
        self._update_status()
        self._refresh_panel()
        await self._pump()

    # -- actions ---------------------------------------------------------------
    async def action_stop(self) -> None:
        """Abort the reply now (its pages are freed) and drop the messages queued behind it."""
        num_dropped = len(self._queue)
        for view in self._queue:
            await view.remove()
        self._queue.clear()
        dropped = f"dropped {num_dropped} queued message(s)" if num_dropped else ""
        if self._reply is None:
            if num_dropped:
                self.notify(f"{dropped}; Up recalls them")
            return
        self._reply.worker.cancel()
        await self._finish_reply("abort")
        self.notify("stopped" + (f"; {dropped}, Up recalls them" if num_dropped else ""))

    async def action_new_chat(self) -> None:
        await self.action_stop()
        await self.conversation_view.remove_children()
        self.conversation, self._num_dropped_turns = self.conversation.cleared(), 0
        await self._show_hint()
        self.notify("new chat")
        self._update_status()

    def action_save(self, target: str | None = None) -> None:
        try:
            markdown_path, json_path = chat.save_transcript(self.conversation, target or self.transcript_dir)
        except LowvramError as exc:
            return self.push_screen(ui.ErrorDialog("Could not save the transcript", exc, [("ok", "OK")]))
        self.notify(f"{markdown_path}\n{json_path}", title="saved the transcript")
        if self.backend is not None and self.backend.has_chat_template and self.conversation.turns:
            self.run_worker(self._save_kv(json_path.with_suffix(".kv")), group="kv-files")

    async def _save_kv(self, path: Path) -> None:
        """The conversation's KV pages beside the transcript: loading it later skips the prefill."""
        try:
            saved = await self.backend.save_kv(self.conversation.messages(), path)
        except LowvramError as exc:
            return self.notify(str(exc), title="KV pages not saved", severity="warning")
        self.notify(str(saved), title="saved the KV pages")

    def action_load(self) -> None:
        files = (self.transcript_dir or chat.default_transcript_dir()).glob("*.json")
        recent = sorted(files, key=lambda p: p.stat().st_mtime, reverse=True)[:20]  # the newest first
        choices = [(str(p), p.stem) for p in recent]
        prompt = ui.TextPrompt(
            "Load a transcript (.json)",
            placeholder="path to a .json transcript",
            choices=choices,
            empty_message="type the path of a .json transcript" + (", or pick one above" if choices else ""),
        )
        self.push_screen(prompt, self.load_transcript)

    async def load_transcript(self, path: str | None) -> None:
        """Replace the chat with a saved one (its settings included) and continue it."""
        if not path:
            return
        try:
            conversation = chat.load_transcript(path)
        except LowvramError as exc:
            return self.push_screen(ui.ErrorDialog("Could not load the transcript", exc, [("ok", "OK")]))
        await self.action_stop()
        conversation.model, conversation.profile = self.conversation.model, self.conversation.profile
        self.conversation, self._num_dropped_turns = conversation, 0
        await self.conversation_view.remove_children()
        label = self.backend.model_label if self.backend else self.spec.model_label
        views = []
        for t in conversation.turns:
            if t.reasoning:
                views.append(ui.ReasoningBlock(t.reasoning, "reasoning"))
            is_user = t.role == "user"
            views.append(
                ui.UserMessage(t.content) if is_user else ui.AssistantMessage(label, t.content, t.finish_reason)
            )
        await self.conversation_view.mount_all(views)
        self.conversation_view.anchor()
        self.notify(f"{len(conversation.turns)} messages from {path}", title="loaded")
        self._fit_max_tokens()
        kv_path = Path(path).with_suffix(".kv")
        if self.backend is not None and kv_path.is_file():
            result = self.last_kv_restore = await self.backend.restore_kv(kv_path)
            self.notify(result.message, title="KV pages", severity="information" if result.is_restored else "warning")
        self._update_status()

    def action_system_prompt(self) -> None:
        text = self.conversation.settings.system_prompt
        prompt = ui.TextPrompt("System prompt (empty = none)", text, placeholder="e.g. You are a concise assistant.")
        self.push_screen(prompt, self._set_system_prompt)

    def _set_system_prompt(self, text: str | None) -> None:
        if text is not None:
            self._change_settings(system_prompt=text.strip())

    def action_settings(self) -> None:
        max_model_len = self.backend.max_model_len if self.backend else None
        self.push_screen(ui.SettingsDialog(self.conversation.settings, max_model_len), self._set_settings)

    def _change_settings(self, **changes) -> None:
        self._set_settings(self.conversation.settings.with_changes(**changes))

    def _set_settings(self, settings: chat.ChatSettings | None) -> None:
        if settings is not None:
            self.conversation.settings = settings
            self._update_status()
            self.notify("applies to the next reply", title="settings changed")

    def _fit_max_tokens(self) -> None:
        """A max tokens the loaded model's context cannot hold (from --max-tokens, a transcript, a reload under
        a shorter context) comes down to what fits, and the user is told."""
        settings, max_model_len = self.conversation.settings, self.backend.max_model_len if self.backend else 0
        if max_model_len and settings.max_tokens > (limit := chat.max_reply_tokens(max_model_len)):
            self.conversation.settings = settings.with_changes(max_tokens=limit)
            self._update_status()
            message = f"max tokens {settings.max_tokens} does not fit the model's {max_model_len}-token context"
            self.notify(f"{message}; lowered to {limit}", title="settings", severity="warning")

    def action_pick_profile(self) -> None:
        choices = [(name, f"{name:5}  {load_profile(name).description}") for name in builtin_profile_names()]
        prompt = ui.TextPrompt(
            "Profile (the model reloads)",
            placeholder="or a path to a profile YAML file",
            choices=choices,
            empty_message="type a profile name or the path of a profile YAML file, or pick one above",
        )
        self.push_screen(prompt, self._switch_profile)

    async def _switch_profile(self, profile: str | None) -> None:
        if not profile:
            if self.backend is None and self.load_error is not None:
                self.exit(return_code=2)  # nothing loaded and nothing picked: nothing to chat with
            return
        await self.action_stop()
        old_backend, self.backend = self.backend, None
        self.spec = self.spec.with_profile(profile)
        self._start_loading(old_backend)

    def action_help(self) -> None:
        self.push_screen(ui.HelpScreen([(key_label(b.key), b.tooltip or b.description) for b in self.BINDINGS]))

    def action_toggle_panel(self) -> None:
        """Show or hide the engine panel (it hides by itself when the terminal is narrow)."""
        self.main_screen.query_one(ui.ChatBody).toggle_panel()

    def action_scroll_conversation(self, direction: int) -> None:
        view = self.conversation_view
        if direction < 0:
            view.scroll_page_up()
        elif view.scroll_target_y + view.scrollable_content_region.height >= view.max_scroll_y:
            view.scroll_end()  # reaching the bottom re-attaches the view to the newest text
        else:
            view.scroll_page_down()

    async def _run_command(self, command: chat.Command) -> None:
        name, arg = command.name, command.arg
        if (changes := chat.setting_changes(command)) is not None:
            if "max_tokens" in changes and self.backend is not None:
                chat.check_max_tokens(changes["max_tokens"], self.backend.max_model_len)
            self._change_settings(**changes)
        elif name == "save":
            self.action_save(arg or None)
        elif name == "load":
            await self.load_transcript(arg)
        elif name == "profile" and arg:
            await self._switch_profile(arg)
        else:
            await self.run_action(COMMAND_ACTIONS[name])

    # -- gauges and status -------------------------------------------------------
    def _refresh_panel(self) -> None:
        if not self.screen_stack:  # the timer can fire once more after the app's screens are gone
            return
        panels = self.main_screen.query(ui.EnginePanel)  # none while the app closes
        if self.backend is not None and panels:
            panels.first().show(self.backend.snapshot(), self.backend.profile_name)

    def _update_status(self) -> None:
        if self.backend is None:
            text = "no model loaded: F4 picks a profile" if self.load_error else "loading the model"
        elif self._reply is not None:
            text = "replying · Esc stops"
        else:
            text = self.conversation.settings.describe()
        if self._queue:
            text += f" · {len(self._queue)} queued"
        self.main_screen.query_one("#status", Static).update(text)
