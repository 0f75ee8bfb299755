"""The engine's side of the feedback controller (LLMEngine inherits it): what the device
holds, an observation after every step, the controller's actions carried out, recovery
from out-of-memory steps, and the timeline of both."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass, replace

import torch

from lowvram.core.controller import KV_LADDER, Event, Observation, decide, escalate_after_oom
from lowvram.errors import OutOfMemoryError

log = logging.getLogger("lowvram")

# Decode steps between two readings of the allocator's counters by the controller.
ALLOCATOR_READ_EVERY_STEPS = 16


@dataclass
class EngineSnapshot:
    """What the engine is doing now, for gauges (chat UI, /metrics). Cheap to take."""

    device: str
    memory_used_bytes: int
    memory_budget_bytes: int
    num_kv_blocks: int
    num_kv_blocks_used: int
    num_kv_blocks_on_host: int
    kv_block_size: int
    kv_precision: str
    num_running: int
    num_waiting: int
    decode_tokens_per_s: float
    token_latency_ms: float | None
    recent_token_latency_ms: list[float]
    latency_high_ms: float
    controller_mode: str
    last_decision: str | None
    num_controller_events: int = 0
    num_kv_blocks_cached: int = 0
    memory_pressure_bytes: int = 0  # what the controller compares with the budget (may exceed it)


class EngineControl:
    """Memory accounting and the controller's actions, over LLMEngine's attributes."""

    def num_kv_blocks_on_host(self) -> int:
        """Pages in use whose data lives on the host."""
        if not self.kv_pool.can_spill:
            return 0
        return self.kv_pool.num_blocks_on_host(self.block_manager.used_block_ids())

    def _page_bytes(self, precision: str | None = None) -> int:
        return self.kv_pool.shape.block_bytes(precision or self.kv_pool.precision)

    def kv_bytes_in_use(self, num_blocks_on_host: int | None = None) -> int:
        """Device bytes of live sequences' pages (not cached-but-unused ones, which are
        reclaimable, nor those spilled to the host)."""
        if num_blocks_on_host is None:
            num_blocks_on_host = self.num_kv_blocks_on_host()
        num_live = self.block_manager.num_used_blocks - num_blocks_on_host
        return max(0, num_live) * self._page_bytes() + self.kv_pool.window_bytes()

    @property
    def memory_budget_bytes(self) -> int:
        """This engine's plan plus what the process held before it loaded."""
        return self.kv_plan.budget_bytes + self.held_bytes

    def memory_in_use_bytes(self, num_blocks_on_host: int | None = None, allocated_bytes: int | None = None) -> int:
        """Device memory held now: everything but the KV pool as the allocator reports it (or
        `allocated_bytes`, a recent reading), plus the pool's live resident pages."""
        if self.device.type == "cuda":
            allocated = self._read_allocated_bytes() if allocated_bytes is None else allocated_bytes
            pool_in_allocator = 0 if self.kv_pool.backend == "um" else self.kv_pool.device_bytes
            other = max(0, allocated - pool_in_allocator)
        else:
            other = self.model.weight_bytes + self.kv_plan.activation_bytes
        return other + self.kv_bytes_in_use(num_blocks_on_host)

    def _read_allocated_bytes(self) -> int:
        # The nested form skips memory_allocated()'s flattening of every statistic (~0.1 ms a step).
        return torch.cuda.memory_stats_as_nested_dict(self.device)["allocated_bytes"]["all"]["current"]

    def memory_pressure_bytes(
        self, memory_in_use_bytes: int | None = None, num_blocks_on_host: int | None = None
    ) -> int:
        """What the controller compares with the budget: memory in use, plus live pages waiting
        on the host, plus (on CUDA) a step's workspace. The um and pinned pools keep only the
        device share resident, so counting resident pages only would hide the very pressure
        the controller exists to relieve."""
        if num_blocks_on_host is None:
            num_blocks_on_host = self.num_kv_blocks_on_host()
        if memory_in_use_bytes is None:
            memory_in_use_bytes = self.memory_in_use_bytes(num_blocks_on_host)
        workspace = self.kv_plan.activation_bytes if self.device.type == "cuda" else 0
        return memory_in_use_bytes + num_blocks_on_host * self._page_bytes() + workspace

    def _control(self, token_latency_ms: float | None, is_plain_decode: bool) -> None:
        """Let the controller see a step: its latency (None: not one that measures the card)
        and the memory in use. The allocator's counters cost a noticeable share of a replayed
        decode step to read, so a plain decode step (whose KV growth the block manager counts)
        reuses the last reading unless it is ALLOCATOR_READ_EVERY_STEPS old."""
        if not self.profile.controller.is_enabled and not self.timeline_path:
            return  # nobody reads the observation
        allocated = None
        if self.device.type == "cuda":
            step, reading = self.stats.num_steps, self._allocated_reading
            if not is_plain_decode or reading is None or step - reading[0] >= ALLOCATOR_READ_EVERY_STEPS:
                reading = self._allocated_reading = (step, self._read_allocated_bytes())
            allocated = reading[1]
        on_host = self.num_kv_blocks_on_host()  # a scan of the pages: once per step
        in_use = self.memory_in_use_bytes(on_host, allocated)
        num_live = self.block_manager.num_used_blocks
        obs = Observation(
            self.stats.num_steps,
            self.memory_pressure_bytes(in_use, on_host),
            self.memory_budget_bytes,
            token_latency_ms,
            len(self.scheduler.running),
            len(self.scheduler.waiting),
            kv_bytes_by_precision={p: num_live * self._page_bytes(p) for p in KV_LADDER},
        )
        self.controller_state, events = decide(
            self.controller_state,
            obs,
            self.profile.controller,
            max_num_seqs=self.profile.max_num_seqs,
            min_precision=self.min_kv_precision,
        )
        for event in events:
            self._apply(event)
        if self.timeline_path:
            self._write_timeline(
                "step",
                **{k: v for k, v in asdict(obs).items() if k != "kv_bytes_by_precision"},
                device_memory_bytes=in_use,
                num_kv_blocks_used=self.block_manager.num_used_blocks,
                batch_limit=self.scheduler.batch_limit,
                kv_precision=self.kv_precision,
                mode=self.controller_state.mode,
            )

    def _apply(self, event: Event) -> None:
        """Carry out one controller decision. Nothing here drops a request."""
        self.runner.drop_queued()  # it would run over what changes
        kind, value = event.action.kind, event.action.value
        self._allocated_reading = None  # what it moves, the next step reads afresh
        note = ""
        if kind == "kv_precision":
            try:
                note = f"; {self.set_kv_precision(value) / 2**20:+.1f} MiB freed"
            except OutOfMemoryError as exc:
                note = f"; not applied: {exc}"
        elif kind == "spill" and value and self.kv_pool.can_spill:
            cold = list(self.block_manager.cached_free) + [
                b for seq in self.scheduler.waiting for b in self.block_manager.block_table(seq.seq_id)
            ]
            note = f"; {self.kv_pool.spill(cold) / 2**20:.1f} MiB moved to host"
        elif kind == "spill" and value:
            note = f"; the {self.kv_pool.backend} backend keeps every page on the device"
        elif kind == "batch_limit":
            preempted = self.scheduler.set_batch_limit(value)
            self.stats.num_preemptions += len(preempted)
            note = f"; {len(preempted)} sequences preempted to resume later" if preempted else ""
        elif kind == "throttle":
            self.scheduler.is_throttled = bool(value)
        if note:
            event = replace(event, reason=event.reason + note)
        self.controller_events.append(event)
        self.num_controller_events += 1
        log.info("controller: %s", event.reason)
        if self.timeline_path:
            self._write_timeline(
                "event", step=event.step, action=kind, value=value, reason=event.reason, mode=event.mode
            )

    def _recover_from_oom(self, batch, exc: BaseException) -> None:
        """A step ran out of device memory: nothing it computed is kept, its sequences are
        queued to be recomputed, the controller steps down a rung at once, and a crash report
        says what held the memory. The engine keeps serving."""
        from lowvram.memory.crash_report import format_doctor_hint, write_oom_crash_report

        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        for seq in batch.seqs:
            if seq in self.scheduler.running:
                self.scheduler.preempt(seq)
                self.stats.num_preemptions += 1
        # Escalate even with the controller off: retrying the same step as it was would fail again.
        self.controller_state, events = escalate_after_oom(
            self.controller_state, self.stats.num_steps, self.profile.max_num_seqs, self.min_kv_precision
        )
        for event in events:
            self._apply(event)
        events_json = [
            {"step": e.step, "action": e.action.kind, "value": e.action.value, "reason": e.reason}
            for e in self.controller_events
        ]
        try:
            self.last_crash_report = write_oom_crash_report(exc, engine=self, controller_events=events_json)
            log.warning("%s", format_doctor_hint(self.last_crash_report))
        except OSError as write_error:  # a full disk must not take the engine down too
            log.warning("out of device memory in a step; the crash report could not be written: %s", write_error)

    def _write_timeline(self, kind: str, **record) -> None:
        with open(self.timeline_path, "a") as f:
            f.write(json.dumps({"type": kind, **record, "time": time.time()}) + "\n")

    def set_kv_precision(self, precision: str) -> int:
        """Re-quantize the KV cache to "fp16", "int8" or "int4" between steps; running
        sequences keep their pages. Returns the device bytes freed (negative when it grows).
        Compressing keeps each running sequence's last `kv_recent_fp16_tokens` in FP16 too."""
        self.runner.drop_queued()  # it would run over what changes
        from lowvram.kv.pool import recent_window_blocks

        free = set(self.block_manager.free_blocks)
        used = [b for b in range(self.block_manager.num_blocks) if b not in free]
        running = [
            (self.block_manager.block_table(seq.seq_id), seq.num_computed_tokens) for seq in self.scheduler.running
        ]
        recent = recent_window_blocks(running, self.profile.kv_recent_fp16_tokens, self.block_manager.block_size)
        freed = self.kv_pool.set_precision(precision, used, fp16_block_ids=recent)
        self.kv_precision = precision
        self._allocated_reading = None  # the pool's pages were reallocated
        return freed

    def snapshot(self) -> EngineSnapshot:
        used = self.memory_in_use_bytes()
        latencies = list(self.recent_token_latency_ms)
        recent = latencies[-16:]
        return EngineSnapshot(
            device=str(self.device),
            memory_used_bytes=int(used),
            memory_budget_bytes=self.memory_budget_bytes,
            num_kv_blocks=self.block_manager.num_blocks,
            num_kv_blocks_used=self.block_manager.num_used_blocks,
            num_kv_blocks_on_host=self.num_kv_blocks_on_host(),
            kv_block_size=self.block_manager.block_size,
            kv_precision=self.kv_precision,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            decode_tokens_per_s=1000 * len(recent) / sum(recent) if recent else 0.0,
            token_latency_ms=latencies[-1] if latencies else None,
            recent_token_latency_ms=latencies,
            latency_high_ms=self.profile.controller.latency_high_ms,
            controller_mode=self.controller_state.mode if self.profile.controller.is_enabled else "off",
            last_decision=self.controller_events[-1].reason if self.controller_events else None,
            num_controller_events=self.num_controller_events,
            num_kv_blocks_cached=self.block_manager.num_cached_blocks,
            memory_pressure_bytes=self.memory_pressure_bytes(used),
        )
