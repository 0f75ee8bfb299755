"""The chat's widgets: the input box, the two kinds of message, and the side panel that shows what the engine
is doing. Colours are component classes styled in chat.tcss; the panel's drawing is plain functions over
numbers, so it can be checked without a terminal."""

from __future__ import annotations

import contextlib

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.css.query import NoMatches
from textual.reactive import reactive
from textual.widget import Widget
from textual.widgets import Input, Markdown, Static

from lowvram.engine.engine import EngineSnapshot

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


# -- the engine panel ------------------------------------------------------------------
BAR_CHARS = " ▁▂▃▄▅▆▇█"
THRESHOLD_CHAR = "┈"
SCALE_HEADROOM = 1.15  # above the larger of peak and threshold, so the threshold line is never the top edge


def sparkline_cells(
    values: list[float], threshold: float, num_rows: int, is_high_bad: bool
) -> list[list[tuple[str, str]]]:
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
    """Memory, KV pages, batch, decode speed and latency, and the controller."""

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
