"""`lowvram chat`: the conversation on the left, what the engine is doing on the right.

Nothing slow runs on the UI's event loop. Loading the model is one blocking call,
made in a thread worker. Replies are computed by the engine's own loop thread
(AsyncLLMEngine); an async worker relays each token as a message, and cancelling
that worker aborts the request, which frees its KV pages. A message sent while a
reply streams waits in a visible queue; Esc stops the reply and drops the queue.
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from textual import work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.message import Message
from textual.widgets import Footer, Header, Input, Static
from textual.worker import Worker

from lowvram.config import builtin_profile_names, load_profile
from lowvram.core.sampling_params import SamplingParams
from lowvram.errors import LowvramError, RequestError
from lowvram.tui.backend import ChatBackend, EngineSpec, LogForwarder, load_backend
from lowvram.tui.commands import Command, message_text, parse_command, setting_changes
from lowvram.tui.conversation import (
    ChatSettings,
    Conversation,
    Turn,
    load_transcript,
    recent_transcripts,
    save_transcript,
)
from lowvram.tui.panel import EnginePanel
from lowvram.tui.screens import ErrorDialog, HelpScreen, LoadingScreen, SettingsDialog, TextPrompt
from lowvram.tui.widgets import AssistantMessage, ChatInput, UserMessage

PANEL_REFRESH_S = 0.25


@dataclass
class LoadingStage(Message):
    text: str


@dataclass
class EngineReady(Message):
    backend: ChatBackend


@dataclass
class EngineFailed(Message):
    error: BaseException


@dataclass
class ReplyUpdate(Message):
    """New text of a reply; with finish_reason set, its end."""

    reply_id: int
    text: str
    num_tokens: int
    finish_reason: str | None = None
    error: BaseException | None = None


@dataclass
class EngineLog(Message):
    text: str


@dataclass
class ActiveReply:
    reply_id: int
    view: AssistantMessage
    worker: Worker
    num_tokens: int = 0


KEY_NAMES = {"escape": "Esc", "pageup": "PgUp", "pagedown": "PgDn"}


def key_label(keys: str) -> str:
    """'ctrl+n' -> 'Ctrl+N', 'escape' -> 'Esc', as the help screen and the docs show them."""

    def one(key: str) -> str:
        return "+".join(
            KEY_NAMES.get(part, part.capitalize() if len(part) > 1 else part.upper()) for part in key.split("+")
        )

    return " / ".join(one(key) for key in keys.split(","))


class ChatApp(App):
    """The terminal chat. `loader(spec, on_stage)` builds the backend (the real engine by default)."""

    CSS_PATH = "chat.tcss"
    TITLE = "lowvram chat"
    ENABLE_COMMAND_PALETTE = False  # F1 lists everything; the footer keeps room for the chat's own keys
    BINDINGS = [
        Binding("escape", "stop", "Stop"),
        Binding("ctrl+n", "new_chat", "New chat"),
        Binding("ctrl+s", "save", "Save"),
        Binding("ctrl+o", "load", "Load"),
        Binding("f2", "system_prompt", "System prompt"),
        Binding("f3", "settings", "Temperature, max tokens"),
        Binding("f4", "pick_profile", "Profile"),
        Binding("f1", "help", "Help"),
        Binding("pageup", "scroll_conversation(-1)", "Scroll the chat up", show=False),
        Binding("pagedown", "scroll_conversation(1)", "Scroll the chat down", show=False),
        Binding("ctrl+q", "quit", "Quit"),
    ]

    def __init__(
        self,
        spec: EngineSpec | None = None,
        settings: ChatSettings | None = None,
        *,
        transcript_dir: Path | None = None,
        loader: Callable[[EngineSpec, Callable[[str], None]], ChatBackend] = load_backend,
    ):
        super().__init__()
        self.spec = spec or EngineSpec()
        self.conversation = Conversation(settings or ChatSettings(), model=self.spec.model_label)
        self.transcript_dir = transcript_dir
        self.loader = loader
        self.backend: ChatBackend | None = None
        self.load_error: BaseException | None = None
        self.last_kv_restore = None  # the result of restoring a loaded transcript's KV pages
        self._reply: ActiveReply | None = None
        self._queue: deque[UserMessage] = deque()
        self._reply_ids = itertools.count()
        # Engine warnings become notifications: a line on stderr would tear the screen.
        self._log_forwarder = LogForwarder(logging.WARNING, lambda text: self.post_message(EngineLog(text)))
        self._was_propagating = True

    def compose(self) -> ComposeResult:
        yield Header(show_clock=False, icon="▣")
        with Horizontal(id="body"):
            with Vertical(id="chat"):
                yield VerticalScroll(id="conversation")
                yield Static("", id="status", markup=False)
                yield ChatInput(placeholder="Ask something · /help lists the commands", id="prompt")
            yield EnginePanel(id="panel")
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
        self.push_screen(LoadingScreen(self.spec.model_label, self.spec.profile))
        self._update_status()
        self._load(self.spec, old_backend)

    @work(thread=True, exclusive=True, group="load")
    def _load(self, spec: EngineSpec, old_backend: ChatBackend | None) -> None:
        if old_backend is not None:
            old_backend.stop()  # its pages and weights go before the next model's arrive
        try:
            backend = self.loader(spec, lambda text: self.post_message(LoadingStage(text)))
        except Exception as exc:  # every failure reaches the dialog; a traceback would tear the screen
            self.post_message(EngineFailed(exc))
            return
        if not self.post_message(EngineReady(backend)):
            backend.stop()  # the app closed while loading

    def on_loading_stage(self, message: LoadingStage) -> None:
        if isinstance(self.screen, LoadingScreen):
            self.screen.set_stage(message.text)

    async def on_engine_ready(self, message: EngineReady) -> None:
        self.backend = message.backend
        self.load_error = None
        if isinstance(self.screen, LoadingScreen):
            self.pop_screen()
        self.conversation.model = self.backend.model_label
        self.conversation.profile = self.backend.profile_name
        self.sub_title = f"{self.backend.model_label} · profile {self.backend.profile_name}"
        self._refresh_panel()
        self.main_screen.query_one(ChatInput).focus()
        self._update_status()
        await self._pump()

    def on_engine_failed(self, message: EngineFailed) -> None:
        self.load_error = message.error
        if isinstance(self.screen, LoadingScreen):
            self.pop_screen()
        self.sub_title = f"{self.spec.model_label} · not loaded"
        self._update_status()
        dialog = ErrorDialog(
            "Could not load the model", message.error, [("profile", "Pick a profile"), ("quit", "Quit")]
        )
        self.push_screen(dialog, self._after_load_error)

    def _after_load_error(self, choice: str | None) -> None:
        if choice == "profile":
            self.action_pick_profile()
        else:
            self.exit(return_code=2)

    def on_engine_log(self, message: EngineLog) -> None:
        self.notify(message.text, title="engine", severity="warning")

    # -- sending and streaming ------------------------------------------------
    async def on_input_submitted(self, event: Input.Submitted) -> None:
        if not isinstance(event.input, ChatInput):
            return
        text = event.value.strip()
        if not text:
            return
        event.input.remember(text)
        event.input.value = ""
        try:
            command = parse_command(text)
            if command is not None:
                await self._run_command(command)
                return
        except LowvramError as exc:
            self.notify(str(exc), title="command", severity="error")
            return
        await self.send(message_text(text))

    async def send(self, text: str) -> None:
        """Show the message and send it now, or queue it behind the reply that is streaming."""
        is_waiting = self._reply is not None or self.backend is None or bool(self._queue)
        view = UserMessage(text, is_queued=is_waiting)
        self._queue.append(view)
        conversation_view = self.conversation_view
        await conversation_view.mount(view)
        conversation_view.anchor()  # sending is a jump to the newest message
        if is_waiting:
            self._update_status()
        await self._pump()

    async def _pump(self) -> None:
        if self._reply is not None or self.backend is None or not self._queue:
            return
        user_view = self._queue.popleft()
        user_view.set_queued(False)
        self.conversation.turns.append(Turn("user", user_view.text))
        view = AssistantMessage(self.backend.model_label)
        await self.conversation_view.mount(view, after=user_view)
        view.start_streaming()
        reply_id = next(self._reply_ids)
        worker = self._stream_reply(
            reply_id, self.conversation.messages(), self.conversation.settings.sampling_params()
        )
        self._reply = ActiveReply(reply_id, view, worker)
        self._update_status()

    @work(group="reply")
    async def _stream_reply(self, reply_id: int, messages: list[dict], params: SamplingParams) -> None:
        finish_reason, error, num_tokens = "abort", None, 0
        try:
            async for out in self.backend.stream(messages, params):
                num_tokens = len(out.outputs[0].token_ids)
                if out.text_delta:
                    self.post_message(ReplyUpdate(reply_id, out.text_delta, num_tokens))
                if out.finished:
                    finish_reason = out.outputs[0].finish_reason or "stop"
        except Exception as exc:  # shown in a dialog; the chat goes on
            finish_reason, error = "error", exc
        finally:
            self.post_message(ReplyUpdate(reply_id, "", num_tokens, finish_reason, error))

    async def on_reply_update(self, message: ReplyUpdate) -> None:
        reply = self._reply
        if reply is None or reply.reply_id != message.reply_id:  # a stopped reply's last words
            return
        reply.num_tokens = message.num_tokens
        if message.text:
            await reply.view.write(message.text)
        if message.finish_reason is not None:
            await self._finish_reply(message.finish_reason, message.error)

    async def _finish_reply(self, finish_reason: str, error: BaseException | None = None) -> None:
        reply, self._reply = self._reply, None
        await reply.view.finish(finish_reason, f"{reply.num_tokens} token{'' if reply.num_tokens == 1 else 's'}")
        if error is None:
            self.conversation.turns.append(Turn("assistant", reply.view.text, finish_reason))
        else:
            self.conversation.turns.pop()  # the question goes back out of the history with its failed reply
            self.push_screen(ErrorDialog("The reply failed", error, [("ok", "OK")]))
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
        if self._reply is None:
            if num_dropped:
                self.notify(f"dropped {num_dropped} queued message(s); Up recalls them")
            return
        self._reply.worker.cancel()
        await self._finish_reply("abort")
        note = f"; dropped {num_dropped} queued message(s), Up recalls them" if num_dropped else ""
        self.notify("stopped" + note)

    async def action_new_chat(self) -> None:
        await self.action_stop()
        await self.conversation_view.remove_children()
        self.conversation = self.conversation.cleared()
        self.notify("new chat")
        self._update_status()

    def action_save(self) -> None:
        self._save(None)

    def _save(self, target: str | None) -> None:
        try:
            markdown_path, json_path = save_transcript(self.conversation, target or self.transcript_dir)
        except LowvramError as exc:
            self.push_screen(ErrorDialog("Could not save the transcript", exc, [("ok", "OK")]))
            return
        self.notify(f"{markdown_path}\n{json_path}", title="saved the transcript")
        if self.backend is not None and self.backend.has_chat_template and self.conversation.turns:
            self.run_worker(self._save_kv(json_path.with_suffix(".kv")), group="kv-files")

    async def _save_kv(self, path) -> None:
        """The conversation's KV pages beside the transcript: loading it later skips the prefill."""
        try:
            saved = await self.backend.save_kv(self.conversation.messages(), path)
        except LowvramError as exc:
            self.notify(str(exc), title="KV pages not saved", severity="warning")
            return
        self.notify(str(saved), title="saved the KV pages")

    def action_load(self) -> None:
        choices = [(str(p), p.stem) for p in recent_transcripts(self.transcript_dir)]
        prompt = TextPrompt("Load a transcript (.json)", placeholder="path to a .json transcript", choices=choices)
        self.push_screen(prompt, self._load_chosen)

    async def _load_chosen(self, path: str | None) -> None:
        if path:
            await self.load_transcript(path)

    async def load_transcript(self, path: str) -> None:
        """Replace the chat with a saved one (its settings included) and continue it."""
        try:
            conversation = load_transcript(path)
        except LowvramError as exc:
            self.push_screen(ErrorDialog("Could not load the transcript", exc, [("ok", "OK")]))
            return
        await self.action_stop()
        conversation.model = self.conversation.model
        conversation.profile = self.conversation.profile
        self.conversation = conversation
        conversation_view = self.conversation_view
        await conversation_view.remove_children()
        label = self.backend.model_label if self.backend else self.spec.model_label
        views = []
        for turn in conversation.turns:
            if turn.role == "user":
                views.append(UserMessage(turn.content))
            else:
                view = AssistantMessage(label, turn.content)
                view.show_finish(turn.finish_reason)
                views.append(view)
        await conversation_view.mount_all(views)
        conversation_view.anchor()
        self.notify(f"{len(conversation.turns)} messages from {path}", title="loaded")
        kv_path = Path(path).with_suffix(".kv")
        if self.backend is not None and kv_path.is_file():
            result = await self.backend.restore_kv(kv_path)
            self.last_kv_restore = result
            self.notify(result.message, title="KV pages", severity="information" if result.is_restored else "warning")
        self._update_status()

    def action_system_prompt(self) -> None:
        prompt = TextPrompt(
            "System prompt (empty = none)",
            self.conversation.settings.system_prompt,
            placeholder="e.g. You are a concise assistant.",
        )
        self.push_screen(prompt, self._set_system_prompt)

    def _set_system_prompt(self, text: str | None) -> None:
        if text is not None:
            self._change_settings(system_prompt=text.strip())

    def action_settings(self) -> None:
        self.push_screen(SettingsDialog(self.conversation.settings), self._set_settings)

    def _set_settings(self, settings: ChatSettings | None) -> None:
        if settings is not None:
            self._change_settings(temperature=settings.temperature, max_tokens=settings.max_tokens)

    def _change_settings(self, **changes) -> None:
        self.conversation.settings = self.conversation.settings.with_changes(**changes)
        self._update_status()
        self.notify("applies to the next reply", title="settings changed")

    def action_pick_profile(self) -> None:
        choices = [(name, f"{name:5}  {load_profile(name).description}") for name in builtin_profile_names()]
        prompt = TextPrompt(
            "Profile (the model reloads)", placeholder="or a path to a profile YAML file", choices=choices
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
        bindings = [(key_label(b.key), b.description) for b in self.BINDINGS]
        self.push_screen(HelpScreen(bindings))

    def action_scroll_conversation(self, direction: int) -> None:
        view = self.conversation_view
        if direction < 0:
            view.scroll_page_up()
        elif view.scroll_target_y + view.scrollable_content_region.height >= view.max_scroll_y:
            view.scroll_end()  # reaching the bottom re-attaches the view to the newest text
        else:
            view.scroll_page_down()

    async def _run_command(self, command: Command) -> None:
        name, arg = command.name, command.arg
        if name == "help":
            self.action_help()
        elif name == "new":
            await self.action_new_chat()
        elif name == "stop":
            await self.action_stop()
        elif name == "save":
            self._save(arg or None)
        elif name == "load":
            await self.load_transcript(arg)
        elif setting_changes(command) is not None:
            self._change_settings(**setting_changes(command))
        elif name == "profile":
            if arg:
                await self._switch_profile(arg)
            else:
                self.action_pick_profile()
        elif name == "quit":
            self.exit()
        else:  # pragma: no cover - parse_command admits only the names above
            raise RequestError(f"/{name} is not handled")

    # -- gauges and status -------------------------------------------------------
    def _refresh_panel(self) -> None:
        if not self.screen_stack:  # the timer can fire once more after the app's screens are gone
            return
        panels = self.main_screen.query(EnginePanel)  # none while the app closes
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
