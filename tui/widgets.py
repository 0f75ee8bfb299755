"""The chat's widgets and screens: the input box, the two kinds of message, the side panel that shows what the
engine is doing, and the loading, error, help and settings screens. Colours are component classes styled in
chat.tcss; the panel's drawing is plain functions over numbers, so it can be checked without a terminal."""

from __future__ import annotations

import contextlib
import time

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.css.query import NoMatches
from textual.reactive import reactive
from textual.screen import ModalScreen, Screen
from textual.widget import Widget
from textual.widgets import (
    Button,
    Collapsible,
    DataTable,
    Input,
    Label,
    LoadingIndicator,
    Markdown,
    OptionList,
    Static,
)
from textual.widgets.option_list import Option

from lowvram import errors
from lowvram.demo.tasks import heldout_tasks
from lowvram.engine.engine import EngineSnapshot
from lowvram.tui.conversation import ChatSettings, check_max_tokens, help_lines, max_reply_tokens

FINISH_NOTES = {"abort": "stopped", "length": "cut at max tokens", "error": "failed"}
DEMO_EXAMPLE_KINDS = ("add", "sort", "weekday")  # the demo model's task kinds the empty chat offers as examples


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


class EmptyChatHint(Static):
    """Shown before the first message: what the loaded model is good at. The bundled demo model answers only
    its training tasks' kinds, so it names them and offers one held-out question of three of them."""

    def __init__(self, model_label: str, is_demo_model: bool):
        if is_demo_model:
            tasks = heldout_tasks(1)
            examples = "\n".join(f"  {t.messages[-1]['content']}" for t in tasks if t.kind in DEMO_EXAMPLE_KINDS)
            kinds = ", ".join(t.kind for t in tasks)
            text = f"The {model_label} is tiny: it answers only its kinds of task ({kinds}), with the bare result."
            text += f" Try:\n{examples}"
        else:
            text = f"{model_label} is ready: type a message below. F2 sets a system prompt, F3 the reply settings, "
            text += "F1 lists the keys."
        super().__init__(text, markup=False)


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


class ContextNotice(Static):
    """A dim line in the conversation: older turns were left out of the prompt to fit the context."""

    def __init__(self, text: str):
        super().__init__(text, markup=False)


class ReasoningBlock(Collapsible):
    """A reasoning model's thinking, dimmed above its answer: open while it thinks (unless `is_hidden`), folded
    once the answer starts; its title says how long it thought and for how many tokens. Enter or a click on
    the title opens or folds it."""

    THINKING_TITLE = "thinking..."

    def __init__(self, text: str = "", title: str = THINKING_TITLE, *, is_hidden: bool = False):
        self.body = Static(text, markup=False, classes="reasoning-text")
        super().__init__(self.body, title=title, collapsed=is_hidden or title != self.THINKING_TITLE)
        self.text = text

    def write(self, delta: str) -> None:
        self.text += delta
        self.body.update(self.text)

    def finish(self, title: str) -> None:
        self.title, self.collapsed = title, True


class AssistantMessage(Markdown):
    """A reply, rendered as Markdown (code blocks highlighted) while it streams in; a reasoning model's
    thinking goes to a ReasoningBlock mounted above it."""

    def __init__(self, model_label: str, text: str = "", finish_reason: str | None = None):
        super().__init__(text)
        self.text = text
        self.reasoning_block: ReasoningBlock | None = None
        self.reply_text = None  # while it streams: its lowvram.tui.backend.ReplyText
        self.border_title = model_label
        self._stream = None
        self.worker = None  # while it streams: the worker whose cancellation stops it
        self.num_tokens = 0
        self.show_finish(finish_reason)

    def start_streaming(self) -> None:
        self.add_class("-streaming")
        self.border_subtitle = "replying... Esc stops"
        self._stream = Markdown.get_stream(self)

    async def write(self, delta: str) -> None:
        self.text += delta
        await self._stream.write(delta)

    async def write_reasoning(self, delta: str, *, is_hidden: bool = False) -> None:
        if self.reasoning_block is None:
            self.reasoning_block = ReasoningBlock(is_hidden=is_hidden)
            await self.parent.mount(self.reasoning_block, before=self)
        self.reasoning_block.write(delta)

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


# -- the engine panel ------------------------------------------------------------------
BAR_CHARS = " ▁▂▃▄▅▆▇█"
THRESHOLD_CHAR = "┈"
SCALE_HEADROOM = 1.15  # above the larger of peak and threshold, so the threshold line is never the top edge


def sparkline_cells(values: list[float], threshold: float, num_rows: int, is_high_bad: bool) -> list[list]:
    """Rows (top first) of (character, kind) cells, one column per value; kind is "bar", "bad" (a bar on the
    wrong side of the threshold), "threshold" (the dotted line, where no bar covers it) or "empty"."""
    top = max(max(values, default=0.0), threshold) * SCALE_HEADROOM
    num_levels = num_rows * 8
    threshold_row = num_rows - 1 - min(int(threshold / top * num_levels) // 8, num_rows - 1) if top > 0 else None
    rows: list[list[tuple[str, str]]] = [[] for _ in range(num_rows)]
    for value in values:
        level = round(value / top * num_levels) if top > 0 else 0
        level = max(level, 1) if value > 0 else level  # anything measured shows at least a sliver
        is_bad = value > threshold if is_high_bad else value < threshold
        for row in range(num_rows):
            fill = min(max(level - (num_rows - 1 - row) * 8, 0), 8)
            if fill:
                rows[row].append((BAR_CHARS[fill], "bad" if is_bad else "bar"))
            elif row == threshold_row:
                rows[row].append((THRESHOLD_CHAR, "threshold"))
            else:
                rows[row].append((" ", "empty"))
    return rows


def gauge_cells(fraction: float, width: int) -> tuple[int, int]:
    """(filled, empty) cell counts of a bar `width` wide; any use shows at least one cell."""
    fraction = min(max(fraction, 0.0), 1.0)
    filled = max(round(fraction * width), 1 if fraction > 0 else 0)
    return filled, width - filled


class ThresholdSparkline(Widget):
    """Recent values as bars a few rows high, the threshold a dotted line. is_high_bad: values above the
    threshold are bad (latency), else those below it (tokens/s)."""

    COMPONENT_CLASSES = {"sparkline--bar", "sparkline--bad", "sparkline--threshold"}
    values: reactive[list[float]] = reactive(list)
    threshold = reactive(0.0)

    def __init__(self, *, is_high_bad: bool, id: str | None = None):
        super().__init__(id=id)
        self.is_high_bad = is_high_bad

    def render(self) -> Text:
        width, num_rows = self.content_size.width, max(self.content_size.height, 1)
        if width <= 0:
            return Text()
        rows = sparkline_cells(self.values[-width:], self.threshold, num_rows, self.is_high_bad)
        styles = {kind: self.get_component_rich_style(f"sparkline--{kind}") for kind in ("bar", "bad", "threshold")}
        text = Text()
        for i, row in enumerate(rows):
            for char, kind in row:
                text.append(char, styles.get(kind))
            if not row:  # nothing measured yet: the threshold alone marks the scale
                text.append(THRESHOLD_CHAR * width if i == num_rows - 1 else "", styles["threshold"])
            if i < num_rows - 1:
                text.append("\n")
        return text


class Gauge(Widget):
    """A horizontal bar of used against available."""

    COMPONENT_CLASSES = {"gauge--fill", "gauge--high", "gauge--empty"}
    HIGH_FRACTION = 0.9
    fraction = reactive(0.0)

    def render(self) -> Text:
        filled, empty = gauge_cells(self.fraction, self.content_size.width)
        fill_class = "gauge--high" if self.fraction >= self.HIGH_FRACTION else "gauge--fill"
        return Text.assemble(
            ("█" * filled, self.get_component_rich_style(fill_class)),
            ("░" * empty, self.get_component_rich_style("gauge--empty")),
        )


def format_bytes(num_bytes: int) -> str:
    if num_bytes >= 2**30:
        return f"{num_bytes / 2**30:.2f} GiB"
    return f"{num_bytes / 2**20:.1f} MiB"


class EnginePanel(Vertical):
    """Memory, KV pages, batch, decode speed and latency, and the controller. Each line is one row, shortened
    with an ellipsis when the panel is narrow; on a short terminal the gaps between sections go first, then the
    sparklines, so the controller's lines at the bottom stay whole."""

    # Content rows the layout needs with the gaps, and without them; the last decision counted as 4 lines.
    MIN_ROWS_FULL, MIN_ROWS_SHORT = 25, 20

    def compose(self) -> ComposeResult:
        yield Static("", markup=False, id="device")
        yield Static("", markup=False, id="memory-label", classes="label")
        yield Gauge(id="memory")
        yield Static("", markup=False, id="kv-label", classes="label")
        yield Gauge(id="kv")
        yield Static("", markup=False, id="kv-precision")
        yield Static("", markup=False, id="batch")
        yield Static("", markup=False, id="decode-label", classes="label")
        yield ThresholdSparkline(is_high_bad=False, id="decode-spark")
        yield Static("", markup=False, id="latency-label", classes="label")
        yield ThresholdSparkline(is_high_bad=True, id="latency-spark")
        yield Static("", markup=False, id="controller", classes="label")
        yield Static("", markup=False, id="decision")

    def on_mount(self) -> None:
        self.border_title = "engine"

    def on_resize(self) -> None:
        self.set_class(self.size.height < self.MIN_ROWS_FULL, "-short")
        self.set_class(self.size.height < self.MIN_ROWS_SHORT, "-tiny")

    def show(self, snap: EngineSnapshot, profile_name: str) -> None:
        used, budget = snap.memory_used_bytes, snap.memory_budget_bytes
        # Per-token latency and decode speed are the same measurement; the floor on speed is the latency limit.
        speed_floor = 1000 / snap.latency_high_ms if snap.latency_high_ms else 0.0
        latency = "-" if snap.token_latency_ms is None else f"{snap.token_latency_ms:.1f}"
        texts = {
            "device": f"{snap.device} · profile {profile_name}",
            "memory-label": f"memory {format_bytes(used)} / {format_bytes(budget)}",
            "kv-label": f"KV pages {snap.num_kv_blocks_used}/{snap.num_kv_blocks} · host {snap.num_kv_blocks_on_host}",
            "kv-precision": f"KV {snap.kv_precision} · {snap.kv_block_size} tokens/page",
            "batch": f"batch {snap.num_running} running · {snap.num_waiting} waiting",
            "decode-label": f"decode {snap.decode_tokens_per_s:.1f} tok/s (floor {speed_floor:.1f})",
            "latency-label": f"latency {latency} ms (limit {snap.latency_high_ms:g})",
            "controller": f"controller {snap.controller_mode}",
            "decision": f"last: {snap.last_decision or 'no decision yet'}",
        }
        with contextlib.suppress(NoMatches):  # the lines are still being mounted; the next refresh fills them in
            for widget_id, text in texts.items():
                widget = self.query_one(f"#{widget_id}", Static)
                if widget.content != text:
                    widget.update(text)
            self.query_one("#memory", Gauge).fraction = used / budget if budget else 0.0
            kv = self.query_one("#kv", Gauge)
            kv.fraction = snap.num_kv_blocks_used / snap.num_kv_blocks if snap.num_kv_blocks else 0.0
            speeds = [1000 / ms for ms in snap.recent_token_latency_ms if ms > 0]
            decode = self.query_one("#decode-spark", ThresholdSparkline)
            decode.values, decode.threshold = speeds, speed_floor
            spark = self.query_one("#latency-spark", ThresholdSparkline)
            spark.values, spark.threshold = list(snap.recent_token_latency_ms), snap.latency_high_ms


class ChatBody(Horizontal):
    """The conversation beside the engine panel. On a terminal too narrow for both the panel hides, so the
    conversation keeps room to read; `toggle_panel` shows or hides it whatever the width."""

    MIN_WIDTH_WITH_PANEL = 76  # the panel's 36 columns and 40 for the conversation

    def __init__(self, *children, **kwargs):
        super().__init__(*children, **kwargs)
        self.is_panel_wanted: bool | None = None  # None: shown when the width allows

    def on_resize(self) -> None:
        self._place_panel()

    def toggle_panel(self) -> None:
        self.is_panel_wanted = not self.query_one(EnginePanel).display
        self._place_panel()

    def _place_panel(self) -> None:
        is_wide = self.size.width >= self.MIN_WIDTH_WITH_PANEL
        self.query_one(EnginePanel).display = is_wide if self.is_panel_wanted is None else self.is_panel_wanted


# -- screens over the chat ----------------------------------------------------------------
# What to try next, by error type; the error's own message names the value at fault.
ERROR_HINTS = {
    errors.OutOfMemoryError: "Pick a smaller profile (F4), or lower --max-model-len.",
    errors.ModelLoadError: "Check that --model names a Hugging Face model directory with config.json, "
    "safetensors weights and tokenizer files.",
    errors.UnsupportedModelError: "lowvram runs Llama- and Qwen2-architecture DeepSeek checkpoints; "
    "pass one with --model.",
    errors.ConfigError: "`lowvram profiles` lists the built-in profiles; "
    "`lowvram profiles --fields` explains every field.",
    errors.RequestError: "Shorten the conversation (Ctrl+N starts a new chat) or change the settings (F3).",
}


def describe_error(error: BaseException) -> tuple[str, str]:
    """(message, suggested fix) for a dialog; never a traceback."""
    if not isinstance(error, errors.LowvramError):
        bug = "This is a bug in lowvram. Run `lowvram -v chat --plain` to see the details, and report them."
        return f"{type(error).__name__}: {error}", bug
    return str(error), next((hint for kind, hint in ERROR_HINTS.items() if isinstance(error, kind)), "")


class LoadingScreen(Screen):
    """Shown while the model loads; the stage line is the engine's own progress report."""

    def __init__(self, model_label: str, profile: str | None):
        super().__init__()
        self.title_text = f"Loading {model_label} · profile {profile or 'default for this machine'}"
        self._started = time.monotonic()

    def compose(self) -> ComposeResult:
        with Vertical(id="loading-box"):
            yield Label(self.title_text, id="loading-title", markup=False)
            yield LoadingIndicator()
            yield Static("", id="loading-stage", markup=False)
            yield Static("", id="loading-elapsed")

    def on_mount(self) -> None:
        elapsed = self.query_one("#loading-elapsed", Static)
        self.set_interval(0.5, lambda: elapsed.update(f"{time.monotonic() - self._started:.0f} s"))


class Dialog(ModalScreen):
    """A modal screen that Esc dismisses with None."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def action_cancel(self) -> None:
        self.dismiss(None)


class ErrorDialog(ModalScreen[str]):
    """An error as a readable dialog: what happened, what to do, and buttons; dismissed with the button id."""

    BINDINGS = [Binding("escape", "dismiss_default", "Close")]

    def __init__(self, title: str, error: BaseException, buttons: list[tuple[str, str]]):
        super().__init__()
        self.title_text, self.buttons = title, buttons
        self.message, self.hint = describe_error(error)

    def compose(self) -> ComposeResult:
        with Vertical(id="error-box"):
            yield Label(self.title_text, id="error-title", markup=False)
            yield Static(self.message, id="error-message", markup=False)
            if self.hint:
                yield Static("Fix: " + self.hint, id="error-hint", markup=False)
            with Horizontal(id="error-buttons"):
                for button_id, label in self.buttons:
                    yield Button(label, id=button_id)

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id)

    def action_dismiss_default(self) -> None:
        self.dismiss(self.buttons[-1][0])


class HelpScreen(Dialog):
    """Every key binding and slash command."""

    BINDINGS = [Binding("escape,f1,q", "cancel", "Close")]

    def __init__(self, bindings: list[tuple[str, str]]):
        super().__init__()
        self.bindings = bindings

    def compose(self) -> ComposeResult:
        with Vertical(id="help-box"):
            yield Label("Keys and commands", id="help-title")
            yield DataTable(id="help-table", show_cursor=False, zebra_stripes=True)
            yield Static("Esc closes this help", id="help-footer")

    def on_mount(self) -> None:
        table = self.query_one(DataTable)
        table.add_columns("key or command", "what it does")
        for key, doc in self.bindings + help_lines():
            table.add_row(key, doc)


class TextPrompt(Dialog):
    """Ask for one line of text, optionally offering choices to pick from. Dismissed with None on Esc.
    With `empty_message`, an empty line is not an answer: the message shows and the dialog stays."""

    AUTO_FOCUS = "#prompt-input"

    def __init__(self, title: str, value: str = "", *, placeholder="", choices=(), empty_message=""):
        super().__init__()
        self.title_text, self.value, self.placeholder, self.choices = title, value, placeholder, choices
        self.empty_message = empty_message

    def compose(self) -> ComposeResult:
        with Vertical(id="prompt-box", classes="dialog"):
            yield Label(self.title_text, classes="dialog-title", markup=False)
            if self.choices:
                yield OptionList(*(Option(label, id=value) for value, label in self.choices), id="prompt-choices")
            yield Input(self.value, placeholder=self.placeholder, id="prompt-input")
            yield Static("", id="prompt-error", classes="dialog-error", markup=False)
            yield Static("Enter accepts · Esc cancels", classes="dialog-help")

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(event.option.id)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        if self.empty_message and not event.value.strip():
            return self.query_one("#prompt-error", Static).update(self.empty_message)
        self.dismiss(event.value)


class SettingsDialog(Dialog):
    """Temperature and max tokens, what can change between replies (the profile reloads the model: F4); a bad
    value, or a max tokens the model's context cannot hold, is named under the fields and nothing changes."""

    AUTO_FOCUS = "#temperature"

    def __init__(self, settings: ChatSettings, max_model_len: int | None = None):
        super().__init__()
        self.settings, self.max_model_len = settings, max_model_len

    def compose(self) -> ComposeResult:
        with Vertical(id="settings-box", classes="dialog"):
            yield Label("Reply settings (from the next reply on)", classes="dialog-title")
            yield Label("temperature (0 = greedy)")
            yield Input(f"{self.settings.temperature:g}", id="temperature")
            limit = f", at most {max_reply_tokens(n)} of the {n}-token context" if (n := self.max_model_len) else ""
            yield Label(f"max tokens per reply{limit}", markup=False)
            yield Input(str(self.settings.max_tokens), id="max-tokens")
            yield Static("", id="settings-error", classes="dialog-error", markup=False)
            yield Static("Enter saves · Esc cancels", classes="dialog-help")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        temperature = self.query_one("#temperature", Input).value
        max_tokens = self.query_one("#max-tokens", Input).value
        try:
            settings = self.settings.with_changes(temperature=float(temperature), max_tokens=int(max_tokens))
            if self.max_model_len:
                check_max_tokens(settings.max_tokens, self.max_model_len)
            self.dismiss(settings)
        except ValueError:
            self.query_one("#settings-error", Static).update("temperature needs a number and max tokens a whole number")
        except errors.LowvramError as exc:
            self.query_one("#settings-error", Static).update(str(exc))
