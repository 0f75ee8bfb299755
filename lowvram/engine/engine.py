"""LLMEngine: add requests, step, get outputs. One step = schedule, run, postprocess; after it
the controller observes the memory and latency and its actions are carried out here."""

from __future__ import annotations

import gc
import itertools
import json
import logging
import time
from collections import deque
from dataclasses import asdict, dataclass, replace

import torch

from lowvram.config import Profile, load_profile
from lowvram.core.block_manager import BlockManager
from lowvram.core.controller import KV_LADDER, ControllerState, Event, Observation, decide, escalate_after_oom
from lowvram.core.sampling_params import SamplingParams
from lowvram.core.scheduler import ScheduledBatch, Scheduler
from lowvram.core.sequence import Sequence
from lowvram.engine.grammar import Grammars
from lowvram.engine.model_runner import ModelRunner
from lowvram.engine.outputs import RequestOutput, append_token, request_output
from lowvram.engine.tokenizer import Detokenizer, Tokenizer
from lowvram.errors import OutOfMemoryError, RequestError
from lowvram.kv.backend import create_kv_pool
from lowvram.memory.device import apply_emulation, pick_device, pick_dtype, tune_cpu_threads
from lowvram.memory.plan import host_kv_blocks, plan_kv
from lowvram.models.layer_streaming import load_model_for_profile
from lowvram.models.loader import resolve_model_path

log = logging.getLogger("lowvram")

ALLOCATOR_READ_EVERY_STEPS = 16  # decode steps between the controller's readings of the allocator


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
    memory_pressure_bytes: int = 0  # what the controller compares with the budget (may exceed it)


@dataclass
class EngineStats:
    """Cumulative counters; tokens/s are split into prefill and decode."""

    num_prefill_tokens: int = 0
    prefill_s: float = 0.0
    num_decode_tokens: int = 0
    decode_s: float = 0.0
    num_steps: int = 0
    num_preemptions: int = 0
    num_pipelined_steps: int = 0  # decode steps queued before the host read the step before them

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.num_prefill_tokens / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        return self.num_decode_tokens / self.decode_s if self.decode_s else 0.0


class LLMEngine:
    """The engine behind LLM, the server and the chat UI. model: Hugging Face directory or hub id
    (None: the demo model); profile: name, YAML path or Profile (None: 4gb with CUDA, cpu without);
    the keywords override the profile; timeline_path: a JSONL log of steps and decisions."""

    def __init__(
        self,
        model: str | None = None,
        profile: str | Profile | None = None,
        *,
        device: str | None = None,
        dtype: str | None = None,
        emulate_vram_gib: float | None = None,
        max_model_len: int | None = None,
        max_num_seqs: int | None = None,
        timeline_path: str | None = None,
    ):
        base = profile if isinstance(profile, Profile) else load_profile(profile)
        self.profile = p = base.replace(
            device=device,
            dtype=dtype,
            emulate_vram_gib=emulate_vram_gib,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
        )
        self.device = pick_device(p.device)
        self.dtype = pick_dtype(p.dtype, self.device)
        apply_emulation(p, self.device)
        self.model_dir = resolve_model_path(model)
        # What the process already holds (the caller's tensors, a live engine's); a dropped engine whose
        # objects refer to each other is collected first, not counted against this one's budget.
        if self.device.type == "cuda":
            gc.collect()
        self.held_bytes = held = torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0
        self.model, self.config = load_model_for_profile(self.model_dir, p, self.device, self.dtype, held_bytes=held)
        if self.device.type == "cuda" and getattr(self.model, "layer_streamer", None) is None:
            # Plan from what loading really allocated (allocator rounding, uncounted buffers).
            loaded = torch.cuda.memory_allocated(self.device) - held
            if loaded > self.model.weight_bytes:
                log.info(
                    "loading allocated %.1f MiB beyond the weights' %.1f MiB; the plan counts it",
                    (loaded - self.model.weight_bytes) / 2**20,
                    self.model.weight_bytes / 2**20,
                )
                self.model.weight_bytes = loaded
        self.tokenizer = Tokenizer(self.model_dir)
        tune_cpu_threads(self.device, self.config.num_params())
        self.eos_token_ids = set(self.config.eos_token_ids) | self.tokenizer.eos_token_ids
        self.grammars = Grammars(self.tokenizer.hf, self.config.vocab_size, self.eos_token_ids)
        self.max_model_len = min(p.max_model_len, self.config.max_position_embeddings)
        element_bytes = torch.finfo(self.dtype).bits // 8
        # A unified-memory pool may hold a sequence longer than its device share; others may not.
        host_blocks = host_kv_blocks(self.config, p, element_bytes, self.device.type)
        plan_args = (self.config, p, self.model.weight_bytes, element_bytes, self.max_model_len)
        kind = self.device.type
        self.kv_plan = plan = plan_kv(*plan_args, device_type=kind, host_blocks=host_blocks, held_bytes=held)
        self.kv_precision = precision = "fp16" if p.kv_precision == "auto" else p.kv_precision
        # Batch-invariant mode may not compress: a request would decode unlike it does alone.
        self.min_kv_precision = precision if p.batch_invariant else KV_LADDER[-1]
        pool_args = (self.config, p, plan.num_blocks, self.device, self.dtype, precision)
        self.kv_pool = create_kv_pool(*pool_args, max_model_len=self.max_model_len)
        if host_blocks and not self.kv_pool.can_read_host:
            plan_kv(*plan_args, device_type=kind, held_bytes=held)  # the error, if it is one
        caching = p.enable_prefix_caching
        self.block_manager = BlockManager(self.kv_pool.num_blocks, plan.block_size, enable_prefix_caching=caching)
        # Pipelined decode overlaps the host's work with the next step; a CPU has nothing to overlap.
        self.pipelines_decode = self.device.type == "cuda" and p.pipelined_decode
        lookahead = int(self.pipelines_decode)
        self.scheduler = Scheduler(self.block_manager, p.max_num_seqs, p.max_num_batched_tokens, lookahead)
        self.runner = ModelRunner(
            self.model,
            self.kv_pool,
            max_num_seqs=p.max_num_seqs,
            max_model_len=self.max_model_len,
            use_cuda_graphs=p.enable_cuda_graphs,
            max_prefill_graph_tokens=p.max_num_batched_tokens if p.enable_prefill_graphs else 0,
            is_pipelined=self.pipelines_decode,
        )
        self.requests: dict[str, Sequence] = {}
        self.controller_state = ControllerState(kv_precision=self.kv_precision)
        self.controller_events: deque[Event] = deque(maxlen=256)
        self.num_controller_events = 0
        self.last_crash_report = None
        self.timeline_path = timeline_path
        self.stats = EngineStats()
        self.recent_token_latency_ms: deque[float] = deque(maxlen=120)
        self._seq_ids = itertools.count()
        self._allocated_reading: tuple[int, int] | None = None  # (step, bytes) the controller last read
        log.info("KV pool: %d pages of %d tokens (%.1f MiB)", plan.num_blocks, plan.block_size, plan.kv_bytes / 2**20)

    def add_request(
        self,
        request_id: str,
        prompt: str | None = None,
        params: SamplingParams | None = None,
        *,
        prompt_token_ids: list[int] | None = None,
        messages: list[dict] | None = None,
    ) -> None:
        """Queue a request given as text, token ids, or chat messages (rendered with the chat template)."""
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        params = params or SamplingParams()
        if messages is not None:
            prompt_token_ids = self.tokenizer.apply_chat_template(messages)
        elif prompt_token_ids is None:
            if not isinstance(prompt, str):
                raise RequestError("give a prompt string, prompt_token_ids or chat messages")
            prompt_token_ids = self.tokenizer.encode(prompt)
        if not prompt_token_ids:
            raise RequestError("the prompt is empty")
        if any(not isinstance(t, int) or not 0 <= t < self.config.vocab_size for t in prompt_token_ids):
            raise RequestError(f"prompt token ids must be integers in 0..{self.config.vocab_size - 1}")
        if len(prompt_token_ids) >= self.max_model_len:
            raise RequestError(
                f"the prompt has {len(prompt_token_ids)} tokens but the context limit (max_model_len) is "
                f"{self.max_model_len}; shorten the prompt or raise max_model_len"
            )
        matcher = None if params.json_schema is None else self.grammars.matcher(params.json_schema)
        generator = None if params.seed is None else torch.Generator(device="cpu").manual_seed(params.seed)
        ids = list(prompt_token_ids)
        seq = Sequence(next(self._seq_ids), request_id, prompt, ids, params, Detokenizer(self.tokenizer), generator)
        seq.matcher = matcher
        self.requests[request_id] = seq
        self.scheduler.waiting.append(seq)

    def abort_request(self, request_id: str) -> bool:
        """Stop a request now and free its pages. Returns False if it was unknown or done."""
        seq = self.requests.pop(request_id, None)
        if seq is None or seq.is_finished:
            return False
        seq.finish_reason = "abort"
        seq.finish_time = time.perf_counter()
        self.scheduler.finish(seq)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running)

    def score(self, token_ids: list[int]) -> list[float]:
        """Log-probability of each token given those before it, computed through the cache as a prefill."""
        if not 2 <= len(token_ids) <= self.max_model_len:
            raise RequestError(f"score needs 2..{self.max_model_len} tokens, got {len(token_ids)}")
        if self.has_unfinished_requests():
            raise RequestError("score runs alone: finish or abort the running requests first")
        seq = Sequence(next(self._seq_ids), "score", None, list(token_ids), SamplingParams(), detokenizer=None)
        logprobs: list[float] = []
        try:
            while seq.num_uncomputed_tokens:
                num_new = min(seq.num_uncomputed_tokens, self.profile.max_num_batched_tokens)
                self.block_manager.allocate(seq.seq_id, seq.num_computed_tokens + num_new)
                batch = self.scheduler.with_pages(ScheduledBatch(True, [seq], [num_new]))
                logits = self.runner.run(batch, is_all_rows=True)  # [num_new, V]
                start = seq.num_computed_tokens
                targets = token_ids[start + 1 : start + num_new + 1]
                rows = torch.log_softmax(logits[: len(targets)], dim=-1)
                logprobs += rows.gather(1, torch.tensor(targets, device=rows.device)[:, None])[:, 0].tolist()
                seq.num_computed_tokens += num_new
                self.block_manager.commit(seq.seq_id, token_ids, seq.num_computed_tokens)
            self.block_manager.commit_partial(seq.seq_id, token_ids, seq.num_computed_tokens)
        finally:
            self.block_manager.free(seq.seq_id)
        return logprobs

    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        self.stats.num_preemptions += len(batch.preempted)
        if not batch.seqs:
            return []
        start = time.perf_counter()
        num_captures = self.runner.num_graph_captures
        try:
            tokens = self.runner.step(batch)
        except torch.OutOfMemoryError as exc:
            self._recover_from_oom(batch, exc)
            return []
        now = time.perf_counter()
        outputs = []
        runner = self.runner
        for row, (seq, num_new, token) in enumerate(zip(batch.seqs, batch.num_new_tokens, tokens)):
            seq.num_computed_tokens += num_new
            # A decode step fills a page one token in block_size: the ids are gathered only then.
            if self.block_manager.num_uncommitted(seq.seq_id, seq.num_computed_tokens):
                self.block_manager.commit(seq.seq_id, seq.all_token_ids, seq.num_computed_tokens)
            if row in runner.last_prompt_logprobs:  # a recomputed (preempted) prompt adds only what is new
                first, entries = runner.last_prompt_logprobs[row]
                if first <= len(seq.prompt_logprobs):
                    seq.prompt_logprobs += entries[len(seq.prompt_logprobs) - first :]
            if token is None:  # a prompt chunk with more to come
                continue
            if row in runner.last_logprobs:
                seq.logprobs.append(runner.last_logprobs[row])
            append_token(seq, token, self.eos_token_ids, self.max_model_len, now)
            if seq.finish_reason is not None:
                self.scheduler.finish(seq)
                self.requests.pop(seq.request_id, None)
            outputs.append(request_output(seq))
        elapsed_s = time.perf_counter() - start
        stats = self.stats
        stats.num_steps += 1
        stats.num_pipelined_steps = self.runner.num_pipelined_steps
        if batch.is_prefill:
            stats.num_prefill_tokens += sum(batch.num_new_tokens)
            stats.prefill_s += elapsed_s
        else:
            stats.num_decode_tokens += len(batch.seqs)
            stats.decode_s += elapsed_s
            self.recent_token_latency_ms.append(elapsed_s * 1000)
        # A capture's one-off cost or a queued step run while the host worked says nothing of the card.
        is_plain_decode = not batch.is_prefill and self.runner.num_graph_captures == num_captures
        self._control(elapsed_s * 1000 if is_plain_decode and not self.runner.is_tail else None, is_plain_decode)
        return outputs

    def num_kv_blocks_on_host(self) -> int:
        """Pages in use whose data lives on the host."""
        pool = self.kv_pool
        return pool.num_blocks_on_host(self.block_manager.used_block_ids()) if pool.can_spill else 0

    def _page_bytes(self, precision: str | None = None) -> int:
        return self.kv_pool.shape.block_bytes(precision or self.kv_pool.precision)

    def kv_bytes_in_use(self, num_blocks_on_host: int | None = None) -> int:
        """Device bytes of live pages (not reclaimable cached ones, nor those on the host)."""
        on_host = self.num_kv_blocks_on_host() if num_blocks_on_host is None else num_blocks_on_host
        return max(0, self.block_manager.num_used_blocks - on_host) * self._page_bytes() + self.kv_pool.window_bytes()

    @property
    def memory_budget_bytes(self) -> int:
        """This engine's plan plus what the process held before it loaded."""
        return self.kv_plan.budget_bytes + self.held_bytes

    def memory_in_use_bytes(self, num_blocks_on_host: int | None = None, allocated_bytes: int | None = None) -> int:
        """All device memory but the KV pool's (a recent `allocated_bytes` reading) plus live resident pages."""
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
        """Memory in use plus live pages waiting on the host plus (CUDA) a step's workspace: what the
        controller compares with the budget (pools that spill would otherwise hide the pressure)."""
        on_host = self.num_kv_blocks_on_host() if num_blocks_on_host is None else num_blocks_on_host
        in_use = self.memory_in_use_bytes(on_host) if memory_in_use_bytes is None else memory_in_use_bytes
        workspace = self.kv_plan.activation_bytes if self.device.type == "cuda" else 0
        return in_use + on_host * self._page_bytes() + workspace

    def _control(self, token_latency_ms: float | None, is_plain_decode: bool) -> None:
        """Let the controller see a step (latency None: not one that measures the card). A plain
        decode step reuses the allocator reading unless ALLOCATOR_READ_EVERY_STEPS old."""
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
        p = self.profile
        self.controller_state, events = decide(
            self.controller_state, obs, p.controller, max_num_seqs=p.max_num_seqs, min_precision=self.min_kv_precision
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
            bm = self.block_manager
            cold = list(bm.cached_free) + [b for seq in self.scheduler.waiting for b in bm.block_table(seq.seq_id)]
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
        """Requeue an out-of-memory step's sequences, step the controller down, write a crash report."""
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
        """Re-quantize the KV cache between steps; returns the device bytes freed. Compressing keeps
        each running sequence's last `kv_recent_fp16_tokens` in FP16 too."""
        self.runner.drop_queued()  # it would run over what changes
        from lowvram.kv.pool import recent_window_blocks

        bm = self.block_manager
        free = set(bm.free_blocks)
        used = [b for b in range(bm.num_blocks) if b not in free]
        running = [(bm.block_table(seq.seq_id), seq.num_computed_tokens) for seq in self.scheduler.running]
        recent = recent_window_blocks(running, self.profile.kv_recent_fp16_tokens, bm.block_size)
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
            memory_pressure_bytes=self.memory_pressure_bytes(used),
        )
