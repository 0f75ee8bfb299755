"""What the chat's tests share: pilot helpers that do not wait for a streaming screen to go idle, a scripted
backend whose replies and gauges are the same on every machine, and the SVG snapshots' text comparison."""

import asyncio
import html
import math
import os
import re
import time
from pathlib import Path

import pytest

pytest.importorskip("textual")

from textual import events  # noqa: E402

from lowvram import SamplingParams  # noqa: E402
from lowvram.core.context import fit_messages  # noqa: E402
from lowvram.engine.engine import EngineSnapshot  # noqa: E402
from lowvram.engine.outputs import CompletionOutput, RequestOutput  # noqa: E402
from lowvram.engine.reasoning import ReasoningParser  # noqa: E402
from lowvram.tui.app import ChatApp  # noqa: E402
from lowvram.tui.backend import EngineSpec  # noqa: E402
from lowvram.tui.widgets import (  # noqa: E402
    AssistantMessage,
    ChatInput,
    EnginePanel,
    LoadingScreen,
)

SNAPSHOT_DIR = Path(__file__).parent / "snapshots"
UPDATE_SNAPSHOTS = bool(os.environ.get("LOWVRAM_UPDATE_SNAPSHOTS"))
SIZE = (120, 36)


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
    has_reasoning_tags = False  # True: a reasoning model whose template opens <think> for the reply

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

    async def fit(self, messages, max_tokens):
        """The real context policy, counting a message's words as its tokens."""
        roles, num_tokens = [m["role"] for m in messages], [len(m["content"].split()) for m in messages]
        fit = fit_messages(roles, num_tokens, max_model_len=self.max_model_len, max_tokens=max_tokens)
        return [messages[i] for i in fit.kept], fit

    def snapshot(self) -> EngineSnapshot:
        return self._snapshot

    def reasoning_parser(self, prompt_token_ids):
        return ReasoningParser(is_open=True) if self.has_reasoning_tags else None

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


def failing_loader(spec, on_stage):
    from lowvram.errors import OutOfMemoryError

    raise OutOfMemoryError(
        "the model needs 5.2 GiB but profile '4gb' allows 3.6 GiB; use a smaller model or an AWQ INT4 checkpoint"
    )


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
