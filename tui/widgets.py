"""The conversation's widgets: the input box and the two kinds of message."""

from __future__ import annotations

from textual.binding import Binding
from textual.widgets import Input, Markdown, Static

FINISH_NOTES = {"abort": "stopped", "length": "cut at max tokens", "error": "failed"}


class ChatInput(Input):
    """The message box. Up and Down walk through what was sent before; the unsent draft comes back last."""

    BINDINGS = [
        Binding("up", "history(-1)", "Previous message", show=False),
        Binding("down", "history(1)", "Next message", show=False),
    ]

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.history: list[str] = []
        self._history_index: int | None = None  # None: showing the draft
        self._draft = ""

    def remember(self, text: str) -> None:
        if not self.history or self.history[-1] != text:
            self.history.append(text)
        self._history_index = None

    def action_history(self, step: int) -> None:
        if self._history_index is None:
            if step > 0 or not self.history:
                return
            self._draft, self._history_index = self.value, len(self.history)
        index = self._history_index + step
        if index < 0:
            return
        self._history_index = index if index < len(self.history) else None
        self.value = self.history[index] if index < len(self.history) else self._draft
        self.cursor_position = len(self.value)


class UserMessage(Static):
    """What the user sent, shown as typed (no markup). Marked while it waits its turn."""

    def __init__(self, text: str, *, is_queued: bool = False):
        super().__init__(text, markup=False)
        self.text = text
        self.border_title = "you"
        self.set_queued(is_queued)

    def set_queued(self, is_queued: bool) -> None:
        self.set_class(is_queued, "-queued")
        self.border_subtitle = "queued: sent when the reply above ends" if is_queued else ""


class AssistantMessage(Markdown):
    """A reply, rendered as Markdown (code blocks highlighted) while it streams in."""

    def __init__(self, model_label: str, text: str = ""):
        super().__init__(text)
        self.text = text
        self.border_title = model_label
        self._stream = None
        self.worker = None  # while it streams: the worker whose cancellation stops it
        self.num_tokens = 0

    def start_streaming(self) -> None:
        self.add_class("-streaming")
        self.border_subtitle = "replying... Esc stops"
        self._stream = Markdown.get_stream(self)

    async def write(self, delta: str) -> None:
        self.text += delta
        await self._stream.write(delta)

    async def finish(self, finish_reason: str, detail: str = "") -> None:
        """Flush the stream and label the reply with how it ended."""
        if self._stream is not None:
            await self._stream.stop()
            self._stream = None
        self.remove_class("-streaming")
        self.show_finish(finish_reason, detail)

    def show_finish(self, finish_reason: str | None, detail: str = "") -> None:
        note = FINISH_NOTES.get(finish_reason or "", "")
        self.set_class(finish_reason in FINISH_NOTES, "-cut")
        self.border_subtitle = " · ".join(part for part in (note, detail) if part)
