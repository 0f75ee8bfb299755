"""The feedback controller, a pure (state, observation) -> (state, events) function keeping a small
card out of OOM and latency near target: after `patience_tokens` pressured steps one rung (KV
fp16 -> int8 -> int4, spill, halve the batch, throttle; latency: the last two), undone after
`cooldown_steps` calm ones, KV only when its projected size stays calm. Nothing drops a request."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from lowvram.config import ControllerConfig

KV_LADDER = ("fp16", "int8", "int4")


@dataclass(frozen=True)
class Observation:
    """What the engine measured after one step."""

    step: int
    memory_used_bytes: int  # what the running requests need of the device (LLMEngine.memory_pressure_bytes)
    memory_budget_bytes: int
    token_latency_ms: float | None = None  # this step's per-token decode latency; None for prefill steps
    num_running: int = 0
    num_waiting: int = 0
    # The live KV pages' bytes at each KV precision ("fp16", "int8", "int4"); empty when unknown.
    kv_bytes_by_precision: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Action:
    kind: str  # "kv_precision", "spill", "batch_limit", "throttle"
    value: object


@dataclass(frozen=True)
class Event:
    """One decision, with the reason and the observation that caused it."""

    step: int
    action: Action
    reason: str
    mode: str


@dataclass(frozen=True)
class ControllerState:
    kv_precision: str = "fp16"
    is_spilling: bool = False
    batch_limit: int = 0  # 0 = the profile's max_num_seqs
    is_throttled: bool = False
    applied: tuple[str, ...] = ()  # rungs taken, in order, so relaxing can undo the last one
    memory_streak: int = 0
    latency_streak: int = 0
    calm_streak: int = 0

    @property
    def mode(self) -> str:
        flags = (
            (self.kv_precision != "fp16", f"kv-{self.kv_precision}"),
            (self.is_spilling, "spill"),
            (self.batch_limit, f"batch<={self.batch_limit}"),
            (self.is_throttled, "throttled"),
        )
        return "+".join(name for is_on, name in flags if is_on and self.applied) or "normal"


def _escalate_memory(
    state: ControllerState, max_num_seqs: int, min_precision: str
) -> tuple[ControllerState, Action, str] | None:
    ladder = KV_LADDER[: KV_LADDER.index(min_precision) + 1]
    if state.kv_precision != ladder[-1]:
        nxt = ladder[ladder.index(state.kv_precision) + 1]
        return replace(state, kv_precision=nxt), Action("kv_precision", nxt), f"compress KV to {nxt}"
    if not state.is_spilling:
        return replace(state, is_spilling=True), Action("spill", True), "spill cold KV pages to host"
    return _escalate_batch(state, max_num_seqs)


def _escalate_batch(state: ControllerState, max_num_seqs: int) -> tuple[ControllerState, Action, str] | None:
    limit = state.batch_limit or max_num_seqs
    if limit > 1:
        new = max(1, limit // 2)
        return replace(state, batch_limit=new), Action("batch_limit", new), f"halve the batch limit to {new}"
    if not state.is_throttled:
        return replace(state, is_throttled=True), Action("throttle", True), "throttle admission of new requests"
    return None


def _relaxed_kv_fits(state: ControllerState, obs: Observation, config: ControllerConfig) -> bool:
    """Whether storing KV one precision higher keeps memory below the low-water mark."""
    sizes = obs.kv_bytes_by_precision
    prev = KV_LADDER[KV_LADDER.index(state.kv_precision) - 1]
    if state.kv_precision not in sizes or prev not in sizes:
        return True
    projected = obs.memory_used_bytes - sizes[state.kv_precision] + sizes[prev]
    return projected < config.memory_low_water * obs.memory_budget_bytes


def _relax(state: ControllerState, max_num_seqs: int) -> tuple[ControllerState, Action, str]:
    last = state.applied[-1]
    state = replace(state, applied=state.applied[:-1])
    if last == "throttle":
        return replace(state, is_throttled=False), Action("throttle", False), "admit new requests again"
    if last == "batch_limit":
        limit = min(max_num_seqs, state.batch_limit * 2)
        new = 0 if limit >= max_num_seqs else limit
        shown = new or max_num_seqs
        return replace(state, batch_limit=new), Action("batch_limit", shown), f"raise the batch limit to {shown}"
    if last == "spill":
        return replace(state, is_spilling=False), Action("spill", False), "stop spilling KV pages"
    prev = KV_LADDER[KV_LADDER.index(state.kv_precision) - 1]
    return replace(state, kv_precision=prev), Action("kv_precision", prev), f"store new KV at {prev} again"


def decide(
    state: ControllerState, obs: Observation, cfg: ControllerConfig, *, max_num_seqs: int, min_precision: str = "int4"
) -> tuple[ControllerState, list[Event]]:
    """One controller step. Returns the new state and the events it decided (0 or 1)."""
    if not cfg.is_enabled:
        return state, []
    mem = obs.memory_used_bytes / obs.memory_budget_bytes if obs.memory_budget_bytes else 0.0
    latency = obs.token_latency_ms
    is_calm = mem < cfg.memory_low_water and (latency is None or latency < cfg.latency_low_ms)
    latency_streak = state.latency_streak
    if latency is not None:
        latency_streak = latency_streak + 1 if latency > cfg.latency_high_ms else 0
    memory_streak = state.memory_streak + 1 if mem > cfg.memory_high_water else 0
    calm_streak = state.calm_streak + 1 if is_calm else 0
    # One copy a step: every decode step comes through here.
    state = replace(state, memory_streak=memory_streak, latency_streak=latency_streak, calm_streak=calm_streak)
    step = None
    if state.memory_streak >= cfg.patience_tokens:
        step = _escalate_memory(state, max_num_seqs, min_precision)
        reason = f"memory {100 * mem:.0f}% of budget > high water {100 * cfg.memory_high_water:.0f}%"
    elif latency is not None and state.latency_streak >= cfg.patience_tokens:
        step = _escalate_batch(state, max_num_seqs)
        reason = f"token latency {latency:.1f} ms > {cfg.latency_high_ms:.1f} ms for {state.latency_streak} tokens"
    elif (
        state.calm_streak >= max(1, cfg.cooldown_steps)
        and state.applied
        and (state.applied[-1] != "kv_precision" or _relaxed_kv_fits(state, obs, cfg))
    ):
        new_state, action, what = _relax(state, max_num_seqs)
        reason = (
            f"memory {100 * mem:.0f}% < low water {100 * cfg.memory_low_water:.0f}% and latency below "
            f"{cfg.latency_low_ms:.1f} ms for {state.calm_streak} steps"
        )
        new_state = replace(new_state, calm_streak=0)
        return new_state, [Event(obs.step, action, f"{what}: {reason}", new_state.mode)]
    return _take(state, step, obs.step, reason) if step is not None else (state, [])


def _take(state, rung, step: int, reason: str) -> tuple[ControllerState, list[Event]]:
    new_state, action, what = rung
    new_state = replace(
        new_state, applied=new_state.applied + (action.kind,), memory_streak=0, latency_streak=0, calm_streak=0
    )
    return new_state, [Event(step, action, f"{what}: {reason}", new_state.mode)]


def escalate_after_oom(
    state: ControllerState, step: int, max_num_seqs: int, min_precision: str = "int4"
) -> tuple[ControllerState, list[Event]]:
    """A real out-of-memory in a step: take the next memory rung at once, without patience."""
    rung = _escalate_memory(state, max_num_seqs, min_precision)
    return (state, []) if rung is None else _take(state, rung, step, "a step ran out of device memory")
