"""Server metrics in the Prometheus text format (0.0.4), written by hand: a client library would be a dependency
for a few lines. Only the event loop thread touches them (no locks); engine gauges come from its latest snapshot."""

from __future__ import annotations

import bisect
import math

from lowvram.engine.engine import EngineSnapshot

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TOKEN_LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


def _labels(labels: dict[str, str]) -> str:
    escaped = {n: str(v).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"') for n, v in labels.items()}
    return "{" + ",".join(f'{n}="{v}"' for n, v in escaped.items()) + "}" if labels else ""


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value)) if isinstance(value, float) and not value.is_integer() else str(int(value))


class Counter:
    """A monotonically increasing count, optionally split by labels."""

    def __init__(self, name: str, help_text: str, label_names: tuple[str, ...] = ()):
        self.name, self.help_text, self.label_names = name, help_text, label_names
        self.values: dict[tuple[str, ...], float] = {} if label_names else {(): 0.0}

    def inc(self, *label_values: str, amount: float = 1.0) -> None:
        key = tuple(label_values)
        self.values[key] = self.values.get(key, 0.0) + amount

    def value(self, *label_values: str) -> float:
        return self.values.get(tuple(label_values), 0.0)

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help_text}", f"# TYPE {self.name} counter"]
        for key, value in sorted(self.values.items()):
            lines.append(f"{self.name}{_labels(dict(zip(self.label_names, key)))} {_number(value)}")
        return lines


class Histogram:
    """Counts of observations at or below each bucket bound, plus their sum."""

    def __init__(self, name: str, help_text: str, buckets: tuple[float, ...]):
        self.name, self.help_text, self.buckets = name, help_text, tuple(sorted(buckets))
        self.bucket_counts = [0] * (len(self.buckets) + 1)  # the last one is +Inf
        self.count = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.bucket_counts[bisect.bisect_left(self.buckets, value)] += 1
        self.count += 1
        self.sum += value

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help_text}", f"# TYPE {self.name} histogram"]
        cumulative = 0
        for bound, num in zip(self.buckets + (math.inf,), self.bucket_counts):
            cumulative += num
            lines.append(f'{self.name}_bucket{{le="{_number(bound)}"}} {cumulative}')
        lines += [f"{self.name}_sum {_number(self.sum)}", f"{self.name}_count {self.count}"]
        return lines


def _gauge(name: str, help_text: str, value: float, **labels: str) -> list[str]:
    return [f"# HELP {name} {help_text}", f"# TYPE {name} gauge", f"{name}{_labels(labels)} {_number(value)}"]


class ServerMetrics:
    """What the server counts itself; `render` adds the engine's gauges."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        answered = "HTTP requests answered, by endpoint and status code."
        self.requests = Counter("lowvram_http_requests_total", answered, ("endpoint", "status"))
        finished = "Generation requests ended, by reason (stop, length, abort, error, shutdown)."
        self.finished = Counter("lowvram_requests_finished_total", finished, ("finish_reason",))
        self.prompt_tokens = Counter("lowvram_prompt_tokens_total", "Prompt tokens of admitted requests.")
        self.generation_tokens = Counter("lowvram_generation_tokens_total", "Tokens generated and delivered.")
        rejected = "Requests refused before generation because the queue was full or the server was stopping."
        self.rejected = Counter("lowvram_requests_rejected_total", rejected, ("reason",))
        ttft = "Time from admission to the first generated token."
        self.ttft = Histogram("lowvram_time_to_first_token_seconds", ttft, TTFT_BUCKETS_S)
        latency = "Time between consecutive tokens of one request."
        self.token_latency = Histogram("lowvram_inter_token_latency_seconds", latency, TOKEN_LATENCY_BUCKETS_S)
        decisions = "Controller decisions seen in engine snapshots, by decision."
        self.controller_events = Counter("lowvram_controller_events_total", decisions, ("decision",))
        self._last_decision: str | None = None

    def observe_snapshot(self, snapshot: EngineSnapshot) -> None:
        """Count a controller decision when the snapshot reports a new one."""
        decision = snapshot.last_decision
        if decision is not None and decision != self._last_decision:
            self.controller_events.inc(decision)
        self._last_decision = decision

    def render(self, snapshot: EngineSnapshot, *, num_in_flight: int, max_queue: int) -> str:
        self.observe_snapshot(snapshot)
        s, on_host = snapshot, snapshot.num_kv_blocks_on_host
        lines = _gauge("lowvram_model_info", "The served model (value is always 1).", 1, model=self.model_name)
        for metric in (self.requests, self.finished, self.rejected, self.prompt_tokens, self.generation_tokens):
            lines += metric.render()
        lines += self.ttft.render() + self.token_latency.render()
        for name, help_text, value in (
            ("requests_in_flight", "Requests admitted by the server and not yet finished.", num_in_flight),
            ("queue_capacity", "Most requests the server holds at once; more get 429.", max_queue),
            ("queue_depth", "Requests waiting in the engine's scheduler for a batch slot.", s.num_waiting),
            ("batch_size", "Requests in the running batch.", s.num_running),
            (
                "decode_tokens_per_second",
                "Decode speed over the last steps, all requests together.",
                s.decode_tokens_per_s,
            ),
        ):
            lines += _gauge(f"lowvram_{name}", help_text, value)
        pages = "KV cache pages in use, by where they live."
        lines += _gauge("lowvram_kv_pages", pages, s.num_kv_blocks_used - on_host, location="device")
        lines.append(f'lowvram_kv_pages{{location="host"}} {_number(on_host)}')
        lines += _gauge("lowvram_kv_pages_capacity", "KV cache pages in the pool.", s.num_kv_blocks)
        lines += _gauge("lowvram_kv_page_size_tokens", "Tokens per KV cache page.", s.kv_block_size)
        info = "KV cache precision in use (value is always 1)."
        lines += _gauge("lowvram_kv_precision_info", info, 1, precision=s.kv_precision)
        mode = "Memory/latency controller mode (value is always 1)."
        lines += _gauge("lowvram_controller_mode_info", mode, 1, mode=s.controller_mode)
        lines += self.controller_events.render()
        lines += _gauge("lowvram_memory_used_bytes", "Memory held by weights and KV cache.", s.memory_used_bytes)
        lines += _gauge("lowvram_memory_budget_bytes", "Memory budget of the profile.", s.memory_budget_bytes)
        return "\n".join(lines) + "\n"
