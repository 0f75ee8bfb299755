"""LLMEngine: add requests, step, get outputs. One step = schedule, run, postprocess."""

from __future__ import annotations

import itertools
import json
import logging
import time
from collections import deque
from dataclasses import asdict, dataclass, field, replace

import torch

from lowvram.config import Profile, load_profile
from lowvram.core.block_manager import BlockManager
from lowvram.core.controller import KV_LADDER, ControllerState, Event, Observation, decide, escalate_after_oom
from lowvram.core.sampling_params import SamplingParams
from lowvram.core.scheduler import ScheduledBatch, Scheduler
from lowvram.core.sequence import Sequence, SequenceStatus
from lowvram.engine.model_runner import ModelRunner
from lowvram.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from lowvram.engine.sampler import device_generator, has_penalties, sample_tokens, sample_tokens_on_device
from lowvram.engine.tokenizer import Detokenizer, Tokenizer
from lowvram.errors import ConfigError, OutOfMemoryError, RequestError
from lowvram.kv.backend import create_kv_pool
from lowvram.memory.device import apply_emulation, pick_device, pick_dtype, tune_cpu_threads
from lowvram.memory.plan import host_kv_blocks, plan_kv
from lowvram.models.batch_invariance import make_batch_invariant
from lowvram.models.fusion import fuse_projections
from lowvram.models.layer_streaming import load_model_for_profile
from lowvram.models.loader import is_deepseek_v2_checkpoint, load_model, resolve_model_path

log = logging.getLogger("lowvram")

# Decode steps between two readings of the allocator's counters by the controller (_allocated_bytes).
ALLOCATOR_READ_EVERY_STEPS = 16


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


# The output token of a step whose successor was queued before it was read (LLMEngine._continue).
PENDING_TOKEN = -1


@dataclass(eq=False)
class _Launched:
    """A step queued on the device whose tokens the engine has not read yet."""

    batch: ScheduledBatch
    sampled: list[Sequence]  # the sequences that sample a token
    start: float
    is_warmup: bool  # it captured a graph
    is_tail: bool = False  # read right after the step before it, nothing queued after it (step)
    tokens: list[int] | None = None  # sampled on the host already
    device_tokens: torch.Tensor | None = None  # [S] int64 argmax on the device, for the next step's inputs
    host_tokens: torch.Tensor | None = None  # pinned copy of device_tokens, valid once `copied` is reached
    copied: torch.cuda.Event | None = None
    num_preemptions: dict[int, int] = field(default_factory=dict)
    generator_states: dict[int, torch.Tensor] = field(default_factory=dict)  # seq id -> device generator state

    def __post_init__(self):
        self.num_preemptions = {seq.seq_id: seq.num_preemptions for seq in self.sampled}


class LLMEngine:
    """The engine behind LLM, the server and the chat UI.

    model: local Hugging Face directory or hub id; None = the bundled demo model.
    profile: built-in profile name, YAML path or Profile; None = `4gb` with CUDA, `cpu` without.
    device, dtype, emulate_vram_gib, max_model_len, max_num_seqs: override the profile.
    timeline_path: append every step's observation and every controller decision to
    this JSONL file (for plots and post-mortems).
    """

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
        self.profile = base.replace(
            device=device,
            dtype=dtype,
            emulate_vram_gib=emulate_vram_gib,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
        )
        self.device = pick_device(self.profile.device)
        self.dtype = pick_dtype(self.profile.dtype, self.device)
        apply_emulation(self.profile, self.device)
        self.model_dir = resolve_model_path(model)
        # The budget is the process's: what it already holds on the device (an earlier engine's
        # cuBLAS workspaces, the caller's tensors) leaves that much less for this one.
        self.held_bytes = held = torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0
        is_deepseek_v2 = is_deepseek_v2_checkpoint(self.model_dir)
        if self.profile.batch_invariant and is_deepseek_v2:
            raise ConfigError(
                f"batch_invariant: true is not available for DeepSeek-V2 models ({self.model_dir}): "
                f"its MLA attention and expert routing have no batch-invariant kernels; set "
                f"batch_invariant: false in profile '{self.profile.name}'"
            )
        if is_deepseek_v2:
            # MoE: routed experts leave the device through their own cache, sized from the profile.
            self.model, self.config = load_model(
                self.model_dir, self.device, self.dtype, profile=self.profile, held_bytes=held
            )
        else:
            # Projections are fused before any weight offload, so the fused tensors are the ones that stream.
            self.model, self.config = load_model_for_profile(
                self.model_dir, self.profile, self.device, self.dtype, prepare=fuse_projections, held_bytes=held
            )
        if self.device.type == "cuda" and getattr(self.model, "layer_streamer", None) is None:
            # Plan from what loading really allocated when that is more than the tensors' own bytes
            # (allocator rounding, buffers no weight report counts), so the pool leaves room for it.
            loaded = torch.cuda.memory_allocated(self.device) - held
            if loaded > self.model.weight_bytes:
                log.info(
                    "loading allocated %.1f MiB beyond the weights' %.1f MiB; the plan counts it",
                    (loaded - self.model.weight_bytes) / 2**20,
                    self.model.weight_bytes / 2**20,
                )
                self.model.weight_bytes = loaded
        if self.profile.batch_invariant:
            log.info(
                "batch-invariant kernels in %d layers: every request decodes as it would alone",
                make_batch_invariant(self.model),
            )
        self.tokenizer = Tokenizer(self.model_dir)
        tune_cpu_threads(self.device, self.config.num_params())
        self.eos_token_ids = set(self.config.eos_token_ids) | self.tokenizer.eos_token_ids
        self.max_model_len = min(self.profile.max_model_len, self.config.max_position_embeddings)
        element_bytes = torch.finfo(self.dtype).bits // 8
        # A unified-memory pool may hold a sequence longer than its device share (the rest of
        # its pages wait in host memory and are read over the bus); other pools may not.
        host_blocks = host_kv_blocks(self.config, self.profile, element_bytes, self.device.type)
        plan_args = (self.config, self.profile, self.model.weight_bytes, element_bytes, self.max_model_len)
        self.kv_plan = plan_kv(*plan_args, device_type=self.device.type, host_blocks=host_blocks, held_bytes=held)
        self.kv_precision = "fp16" if self.profile.kv_precision == "auto" else self.profile.kv_precision
        # The lowest precision the controller may compress to. Batch-invariant mode keeps the
        # starting one: compressed pages change what a request reads, so it would not decode
        # as it does alone.
        self.min_kv_precision = self.kv_precision if self.profile.batch_invariant else KV_LADDER[-1]
        self.kv_pool = create_kv_pool(
            self.config,
            self.profile,
            self.kv_plan.num_blocks,
            self.device,
            self.dtype,
            self.kv_precision,
            max_model_len=self.max_model_len,
        )
        if host_blocks and not self.kv_pool.can_read_host:
            plan_kv(*plan_args, device_type=self.device.type, held_bytes=held)  # the error, if it is one
        self.block_manager = BlockManager(
            self.kv_pool.num_blocks, self.kv_plan.block_size, enable_prefix_caching=self.profile.enable_prefix_caching
        )
        self.scheduler = Scheduler(self.block_manager, self.profile.max_num_seqs, self.profile.max_num_batched_tokens)
        self.runner = ModelRunner(
            self.model,
            self.kv_pool,
            max_num_seqs=self.profile.max_num_seqs,
            max_model_len=self.max_model_len,
            use_cuda_graphs=self.profile.enable_cuda_graphs,
            max_prefill_graph_tokens=(self.profile.max_num_batched_tokens if self.profile.enable_prefill_graphs else 0),
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
        self._allocated_reading: tuple[int, int] | None = None  # (step, bytes): the controller's last reading
        # Pipelined decode (step): on a GPU the host's work between steps then overlaps the
        # next step. On the CPU a step runs as it is queued, so there is nothing to overlap,
        # and a step queued behind a request's last token would be computed for nothing.
        self.pipelines_decode = self.device.type == "cuda" and self.profile.pipelined_decode
        self._inflight: _Launched | None = None  # a pipelined decode step queued but not read (step)
        self._drained: list[RequestOutput] = []  # outputs of a queued step finished early (_drain)
        self._oom_in_queue: tuple[ScheduledBatch, BaseException] | None = None  # _continue's, for step
        self._last_finish = 0.0
        log.info(
            "KV pool: %d pages of %d tokens (%.1f MiB)",
            self.kv_plan.num_blocks,
            self.kv_plan.block_size,
            self.kv_plan.kv_bytes / 2**20,
        )

    # -- requests -----------------------------------------------------------
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
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device="cpu").manual_seed(params.seed)
        seq = Sequence(
            next(self._seq_ids),
            request_id,
            prompt,
            list(prompt_token_ids),
            params,
            Detokenizer(self.tokenizer),
            generator,
        )
        self.requests[request_id] = seq
        self.scheduler.add(seq)

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
        return self.scheduler.num_unfinished > 0

    def score(self, token_ids: list[int]) -> list[float]:
        """Log-probability of each token given the ones before it (len - 1 values).

        Runs the text through the paged cache in chunks of the profile's token budget,
        exactly as a prefill would; used for perplexity.
        """
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

    # -- the step -----------------------------------------------------------
    @property
    def samples_on_device(self) -> bool:
        """Whether rows without penalties sample on the device: on a GPU, and wherever decode
        is pipelined. A seeded request's draw on the host first copies its probabilities there."""
        return self.device.type == "cuda" or self.pipelines_decode

    def step(self) -> list[RequestOutput]:
        """Run one step and return the outputs it produced.

        Decode steps are pipelined: step N + 1 is queued on the GPU, its input tokens taken
        from step N's tokens sampled on the device, before the host reads step N's tokens
        and turns them into outputs, so the GPU does not wait for the host between steps
        (_continue). Anything else (a prefill, a request with penalties, which samples on the
        host, a request waiting to be admitted, a sequence at its length limit) runs its step
        alone, as before; a controller action first finishes the queued step (_drain)."""
        launched, self._inflight = self._inflight, None
        was_queued = launched is not None
        if launched is None:
            batch = self.scheduler.schedule()
            self.stats.num_preemptions += len(batch.preempted)
            if batch.is_empty:
                return []
            try:
                launched = self._launch(batch)
            except torch.OutOfMemoryError as exc:
                self._recover_from_oom(batch, exc)
                return []
        if self._can_continue(launched):
            self._inflight = self._continue(launched)
        # A queued step read with nothing queued after it ran while the host worked on the
        # step before: its token comes right after that one's, which says nothing of how
        # fast the card is, so the controller does not see its latency.
        launched.is_tail = was_queued and self._inflight is None
        outputs = self._finish(launched)
        if self._oom_in_queue is not None:
            # The step after `launched` could not be queued: now that `launched`'s tokens are
            # in, recover as a step that ran out of memory does.
            (batch, exc), self._oom_in_queue = self._oom_in_queue, None
            self._recover_from_oom(batch, exc)
        queued = self._inflight
        if queued is not None and not any(seq.status is SequenceStatus.RUNNING for seq in queued.batch.seqs):
            self._inflight = None  # every sequence of the queued step finished: nothing to read from it
        if self._drained:
            outputs += self._drained
            self._drained = []
        return outputs

    def _launch(self, batch: ScheduledBatch, input_ids: torch.Tensor | None = None) -> _Launched:
        """Queue `batch` on the device and count its tokens as computed. Its tokens are read
        later (_finish). On a GPU (and wherever decode is pipelined), rows without penalties
        sample on the device (sample_tokens_on_device: an argmax for greedy rows, a Gumbel-max
        draw from the request's device generator for the others), for every step of the
        request, prefill included, so a seeded request draws the same way whether its step is
        pipelined or not; when every row does, the tokens go to pinned host memory behind an event and the
        step may be continued (_continue). Other rows sample on the host now.
        `input_ids`: a decode step's input tokens on the device (_continue)."""
        num_captures = self.runner.num_graph_captures
        start = time.perf_counter()
        logits = self.runner.run(batch, input_ids=input_ids)
        rows, sampled = [], []
        for row, (seq, num_new) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            seq.num_computed_tokens += num_new
            if seq.num_uncomputed_tokens == 0:  # a chunked prefill that is not done samples nothing
                rows.append(row)
                sampled.append(seq)
        launched = _Launched(batch, sampled, start, self.runner.num_graph_captures != num_captures)
        # All before the next replay overwrites the graphs' logits.
        on_device = [i for i, seq in enumerate(sampled) if self.samples_on_device and not has_penalties(seq.params)]
        if sampled and len(on_device) == len(sampled):
            # Where each seeded generator stood before this step's draws: a row dropped
            # because its request was preempted meanwhile gives its draw back (_finish).
            launched.generator_states = {
                seq.seq_id: generator.get_state()
                for seq in sampled
                if (generator := device_generator(seq, logits.device)) is not None
            }
            launched.device_tokens = sample_tokens_on_device(logits, rows, sampled)
            if launched.device_tokens.is_cuda:
                launched.host_tokens = torch.empty(len(rows), dtype=torch.long, pin_memory=True)
                launched.host_tokens.copy_(launched.device_tokens, non_blocking=True)
                launched.copied = torch.cuda.Event()
                launched.copied.record()
            else:
                launched.host_tokens = launched.device_tokens
            return launched
        tokens = [0] * len(sampled)
        on_host = [i for i in range(len(sampled)) if i not in set(on_device)]
        for i, token in zip(on_host, sample_tokens(logits, [rows[i] for i in on_host], [sampled[i] for i in on_host])):
            tokens[i] = token
        if on_device:
            picked = sample_tokens_on_device(logits, [rows[i] for i in on_device], [sampled[i] for i in on_device])
            for i, token in zip(on_device, picked.tolist()):
                tokens[i] = token
        launched.tokens = tokens
        return launched

    def _can_continue(self, launched: _Launched) -> bool:
        """Whether the step after `launched` can be queued before `launched`'s tokens are
        known: `launched` is a decode step of every running sequence that sampled on the
        device (no penalties), no waiting request may be admitted now (one waiting for a
        place in a full batch does not stop the pipeline), none reaches its length limit with
        the token it samples, and the pages the next step needs are free (no one is
        preempted for them)."""
        if (
            not self.pipelines_decode
            or launched.device_tokens is None
            or launched.batch.is_prefill
            or self.scheduler.may_admit()
            or not self.runner.accepts_device_input_ids
        ):
            return False
        seqs = launched.batch.seqs
        if len(seqs) != len(self.scheduler.running):
            return False
        missing = 0
        for seq in seqs:
            num_tokens = seq.num_tokens + 1  # with the token `launched` samples
            if len(seq.output_token_ids) + 1 >= seq.params.max_tokens or num_tokens >= self.max_model_len:
                return False
            missing += self.block_manager.num_missing(seq.seq_id, num_tokens)
        return missing <= self.block_manager.num_free_blocks

    def _continue(self, launched: _Launched) -> _Launched | None:
        """Queue the decode step after `launched`, before its tokens are read. Each sequence
        gets a placeholder for the token `launched` samples, so the scheduler and the page
        tables see the next step's shape; the runner copies the device argmax into the
        step's input ids. _finish puts the real tokens in place of the placeholders."""
        for seq in launched.batch.seqs:
            seq.output_token_ids.append(PENDING_TOKEN)
        batch = self.scheduler.schedule()
        self.stats.num_preemptions += len(batch.preempted)
        if batch.is_prefill or batch.preempted or batch.seqs != launched.batch.seqs:
            # Not expected (_can_continue rules it out). Nothing is queued: the sequences go
            # on from `launched`'s tokens, and the scheduler, which keeps no state of its own
            # about a batch, schedules whatever this one held again at the next step.
            log.warning(
                "a pipelined decode step was scheduled with other sequences than the step before it "
                "(%d against %d); it runs on its own",
                len(batch.seqs),
                len(launched.batch.seqs),
            )
            self._drop_placeholders(launched.batch.seqs)
            return None
        try:
            queued = self._launch(batch, input_ids=launched.device_tokens)
            self.stats.num_pipelined_steps += 1
            return queued
        except torch.OutOfMemoryError as exc:
            # Not queued: the tokens come from `launched` alone; step() then recovers.
            self._drop_placeholders(batch.seqs)
            self._oom_in_queue = (batch, exc)
            return None

    @staticmethod
    def _drop_placeholders(seqs: list[Sequence]) -> None:
        for seq in seqs:
            if seq.output_token_ids and seq.output_token_ids[-1] == PENDING_TOKEN:
                seq.output_token_ids.pop()

    def _finish(self, launched: _Launched) -> list[RequestOutput]:
        """Read a launched step's tokens and turn them into outputs: commit full pages, append
        each token (in place of its placeholder), finish sequences, count, and let the
        controller see the step. Sequences finished or preempted meanwhile are skipped."""
        if launched.tokens is None:
            if launched.copied is not None:
                launched.copied.synchronize()
            launched.tokens = launched.host_tokens.tolist()
        block_manager = self.block_manager
        # The queued next step counts this step's token as computed already: in place of its
        # placeholder it completes the ids that pages are committed with.
        placeheld = []
        for seq, token in zip(launched.sampled, launched.tokens):
            if seq.output_token_ids and seq.output_token_ids[-1] == PENDING_TOKEN:
                seq.output_token_ids[-1] = token
                placeheld.append(seq)
        for seq in launched.batch.seqs:
            # A decode step fills a page one token in block_size: the ids are gathered only then.
            if seq.status is SequenceStatus.RUNNING and block_manager.num_uncommitted(
                seq.seq_id, seq.num_computed_tokens
            ):
                block_manager.commit(seq.seq_id, seq.all_token_ids, seq.num_computed_tokens)
        for seq in placeheld:
            seq.output_token_ids.pop()  # _append_token adds it again, with its checks
        outputs = []
        for seq, token in zip(launched.sampled, launched.tokens):
            if seq.num_preemptions != launched.num_preemptions[seq.seq_id] and seq.seq_id in launched.generator_states:
                # Preempted: its recomputation samples this token again, from the same draw.
                seq.device_generator.set_state(launched.generator_states[seq.seq_id])
            if seq.status is not SequenceStatus.RUNNING or seq.num_preemptions != launched.num_preemptions[seq.seq_id]:
                continue  # aborted, finished by the step before, or preempted: nothing to add
            outputs.append(self._append_token(seq, token))
        now = time.perf_counter()
        # A pipelined step was queued while the one before it ran: its latency runs from the later of the two.
        elapsed = now - max(launched.start, self._last_finish)
        self._last_finish = now
        batch = launched.batch
        self.stats.num_steps += 1
        if batch.is_prefill:
            self.stats.num_prefill_tokens += sum(batch.num_new_tokens)
            self.stats.prefill_s += elapsed
        else:
            self.stats.num_decode_tokens += len(batch.seqs)
            self.stats.decode_s += elapsed
            self.recent_token_latency_ms.append(elapsed * 1000)
        # A step that captured a graph paid a one-off cost that says nothing about the
        # load: the controller does not see its latency (else new batch sizes in a row
        # would read as a slow card and compress the KV).
        is_plain_decode = not batch.is_prefill and not launched.is_warmup
        self._control(elapsed * 1000 if is_plain_decode and not launched.is_tail else None, is_plain_decode)
        return outputs

    def _drain(self) -> None:
        """Finish a queued decode step now, before something changes the pages, the batch or
        the model under it; its outputs go out with the current step's."""
        if self._inflight is not None:
            launched, self._inflight = self._inflight, None
            launched.is_tail = True
            self._drained += self._finish(launched)

    # -- the feedback controller --------------------------------------------------
    def num_kv_blocks_on_host(self) -> int:
        """Pages in use whose data lives on the host."""
        if not self.kv_pool.can_spill:
            return 0
        return self.kv_pool.num_blocks_on_host(self.block_manager.used_block_ids())

    def kv_bytes_in_use(self, num_blocks_on_host: int | None = None) -> int:
        """Device bytes of pages that hold live sequences' KV (cached-but-unused pages are
        reclaimable and not counted; pages spilled to the host are not on the device).
        `num_blocks_on_host`: num_kv_blocks_on_host() when the caller has it."""
        if num_blocks_on_host is None:
            num_blocks_on_host = self.num_kv_blocks_on_host()
        # Pages nobody holds are on the free list or cached: used = the rest (no per-page scan per step).
        num_live = self.block_manager.num_used_blocks - num_blocks_on_host
        return max(0, num_live) * self.kv_pool.shape.block_bytes(self.kv_pool.precision) + self.kv_pool.window_bytes()

    @property
    def memory_budget_bytes(self) -> int:
        """The process's budget the controller and reports compare with: this engine's plan
        plus what the process held before it loaded (memory_in_use_bytes counts that too)."""
        return self.kv_plan.budget_bytes + self.held_bytes

    def memory_in_use_bytes(self, num_blocks_on_host: int | None = None, allocated_bytes: int | None = None) -> int:
        """Device memory held now: everything but the KV pool as the allocator reports it,
        plus the pool's live resident pages (the controller watches memory_pressure_bytes).
        `allocated_bytes`: a recent reading of the allocator's bytes in use, when the caller has one."""
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

    def _allocated_bytes(self, is_plain_decode: bool) -> int | None:
        """The allocator's bytes in use for the controller (None off CUDA), read afresh only
        when they may have moved.

        A reading builds a dict of every allocator statistic, a noticeable share of the host
        time of a decode step replayed from a graph. Between decode steps the KV pages are
        what grows, and the controller counts those from the block manager every step; what
        else the allocator holds (weights, graph pools, buffers) moves with a prefill, a graph
        capture or a controller action, after which the counters are read at once. Otherwise
        they are read every ALLOCATOR_READ_EVERY_STEPS steps, for anything else that allocates."""
        if self.device.type != "cuda":
            return None
        step = self.stats.num_steps
        reading = self._allocated_reading
        if not is_plain_decode or reading is None or step - reading[0] >= ALLOCATOR_READ_EVERY_STEPS:
            reading = self._allocated_reading = (step, self._read_allocated_bytes())
        return reading[1]

    def memory_pressure_bytes(
        self, memory_in_use_bytes: int | None = None, num_blocks_on_host: int | None = None
    ) -> int:
        """What the controller compares with the budget: memory in use, plus the live KV
        pages that wait on the host, plus (on CUDA) the workspace the plan reserves for
        a step. Above the budget when the running sequences outgrow the card.

        The um and pinned pools hand out pages for every sequence at full length but
        keep at most the plan's device share resident; the rest waits on the host and
        each step reads it over the bus or swaps it in. Counting resident pages only,
        the fraction would top out at (weights + device share) / budget, which is
        1 - workspace / budget, and stay flat however far the live pages outgrew the
        device share: below the high-water mark wherever the workspace is a tenth of
        the budget, so the controller would never see the pressure it exists to
        relieve. Live pages therefore count at their current size wherever they are,
        and the step's planned workspace counts because a step needs it on top of
        what stays allocated between steps (on the CPU memory_in_use_bytes already
        holds it). Compressing the KV or shrinking the batch lowers this number.
        """
        if num_blocks_on_host is None:
            num_blocks_on_host = self.num_kv_blocks_on_host()
        if memory_in_use_bytes is None:
            memory_in_use_bytes = self.memory_in_use_bytes(num_blocks_on_host)
        on_host = num_blocks_on_host * self.kv_pool.shape.block_bytes(self.kv_pool.precision)
        workspace = self.kv_plan.activation_bytes if self.device.type == "cuda" else 0
        return memory_in_use_bytes + on_host + workspace

    def kv_bytes_by_precision(self) -> dict[str, int]:
        """The live pages' bytes at each KV precision (what compressing or relaxing would make them)."""
        num_live = self.block_manager.num_used_blocks
        return {p: num_live * self.kv_pool.shape.block_bytes(p) for p in KV_LADDER}

    def _control(self, token_latency_ms: float | None, is_plain_decode: bool) -> None:
        """Let the controller see a step: its latency (None: not one that measures the card)
        and the memory in use. `is_plain_decode` lets the step go without a fresh reading of
        the allocator (_allocated_bytes)."""
        if not self.profile.controller.is_enabled and not self.timeline_path:
            return  # nobody reads the observation: skip gathering it
        on_host = self.num_kv_blocks_on_host()  # a scan of the pages: once per step
        in_use = self.memory_in_use_bytes(on_host, self._allocated_bytes(is_plain_decode=is_plain_decode))
        obs = Observation(
            self.stats.num_steps,
            self.memory_pressure_bytes(in_use, on_host),
            self.memory_budget_bytes,
            token_latency_ms,
            len(self.scheduler.running),
            len(self.scheduler.waiting),
            kv_bytes_by_precision=self.kv_bytes_by_precision(),
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
            record = {k: v for k, v in asdict(obs).items() if k != "kv_bytes_by_precision"}
            self._write_timeline(
                {
                    "type": "step",
                    **record,
                    "device_memory_bytes": in_use,
                    "num_kv_blocks_used": self.block_manager.num_used_blocks,
                    "batch_limit": self.scheduler.batch_limit,
                    "kv_precision": self.kv_precision,
                    "mode": self.controller_state.mode,
                    "time": time.time(),
                }
            )

    def _apply(self, event: Event) -> None:
        """Carry out one controller decision. Nothing here drops a request."""
        self._drain()
        kind, value = event.action.kind, event.action.value
        self._allocated_reading = None  # what it moves, the next step reads afresh
        note = ""
        if kind == "kv_precision":
            try:
                freed = self.set_kv_precision(value)
                note = f"; {freed / 2**20:+.1f} MiB freed"
            except OutOfMemoryError as exc:
                note = f"; not applied: {exc}"
        elif kind == "spill":
            if value and self.kv_pool.can_spill:
                cold = list(self.block_manager.cached_free) + [
                    b for seq in self.scheduler.waiting for b in self.block_manager.block_table(seq.seq_id)
                ]
                note = f"; {self.kv_pool.spill(cold) / 2**20:.1f} MiB moved to host"
            elif value:
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
                {
                    "type": "event",
                    "step": event.step,
                    "action": kind,
                    "value": value,
                    "reason": event.reason,
                    "mode": event.mode,
                    "time": time.time(),
                }
            )

    def _recover_from_oom(self, batch, exc: BaseException) -> None:
        """A step ran out of device memory: nothing it computed is kept, its sequences go
        back to the queue to be recomputed, the controller steps down a rung at once, and
        a crash report says what held the memory. The engine keeps serving."""
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
            path = write_oom_crash_report(exc, engine=self, controller_events=events_json)
            self.last_crash_report = path
            log.warning("%s", format_doctor_hint(path))
        except OSError as write_error:  # a full disk must not take the engine down too
            log.warning("out of device memory in a step; the crash report could not be written: %s", write_error)

    def _write_timeline(self, record: dict) -> None:
        with open(self.timeline_path, "a") as f:
            f.write(json.dumps(record) + "\n")

    def set_kv_precision(self, precision: str) -> int:
        """Re-quantize the KV cache to "fp16", "int8" or "int4" between steps; running
        sequences keep their pages and continue. Returns the device bytes freed (negative
        when it grows). New tokens are stored at the new precision from the next step.
        Compressing keeps the pages of each running sequence's last `kv_recent_fp16_tokens`
        tokens in FP16 as well (see `lowvram.kv.pool`)."""
        self._drain()
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
            num_kv_blocks_used=self.block_manager.num_blocks - self.block_manager.num_free_blocks,
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

    def _append_token(self, seq: Sequence, token: int) -> RequestOutput:
        now = time.perf_counter()
        seq.first_token_time = seq.first_token_time or now
        params = seq.params
        seq.output_token_ids.append(token)
        is_eos = token in self.eos_token_ids and not params.ignore_eos
        if is_eos or token in params.stop_token_ids:
            seq.finish_reason = "stop"
        else:
            seq.text += seq.detokenizer.add(token)
            hit = self._find_stop(seq)
            if hit is not None:
                seq.text = seq.text[:hit]
                seq.finish_reason = "stop"
            elif len(seq.output_token_ids) >= params.max_tokens or seq.num_tokens >= self.max_model_len:
                seq.finish_reason = "length"
        if seq.finish_reason is not None:
            seq.finish_time = now
            self.scheduler.finish(seq)
            self.requests.pop(seq.request_id, None)
        return self._output(seq)

    @staticmethod
    def _find_stop(seq: Sequence) -> int | None:
        stops = seq.params.stop
        if not stops:
            return None
        window_start = max(0, seq.num_emitted_chars - max(len(s) for s in stops))
        hits = [i for i in (seq.text.find(s, window_start) for s in stops) if i >= 0]
        return min(hits) if hits else None

    def _output(self, seq: Sequence) -> RequestOutput:
        # Hold back a tail that could still become a stop string.
        stops = seq.params.stop
        hold = max(len(s) for s in stops) - 1 if stops and not seq.is_finished else 0
        visible = len(seq.text) - hold
        delta = seq.text[seq.num_emitted_chars : max(visible, seq.num_emitted_chars)]
        seq.num_emitted_chars += len(delta)
        token_ids = list(seq.output_token_ids)
        completion = CompletionOutput(0, seq.text, token_ids, seq.finish_reason)
        metrics = RequestMetrics(
            seq.arrival_time, seq.first_token_time, seq.finish_time, len(seq.prompt_token_ids), len(token_ids)
        )
        return RequestOutput(
            seq.request_id, seq.prompt, seq.prompt_token_ids, [completion], seq.is_finished, delta, metrics
        )
