"""LLMEngine: add requests, step, get outputs. One step = schedule, run, postprocess."""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass

import torch

from lowvram.config import Profile, load_profile
from lowvram.core.block_manager import BlockManager
from lowvram.core.controller import KV_LADDER, ControllerState, Event
from lowvram.core.sampling_params import SamplingParams
from lowvram.core.scheduler import ScheduledBatch, Scheduler
from lowvram.core.sequence import Sequence
from lowvram.engine.control import EngineControl, EngineSnapshot
from lowvram.engine.model_runner import ModelRunner
from lowvram.engine.outputs import RequestOutput, append_token, request_output
from lowvram.engine.tokenizer import Detokenizer, Tokenizer
from lowvram.errors import RequestError
from lowvram.kv.backend import create_kv_pool
from lowvram.memory.device import apply_emulation, pick_device, pick_dtype, tune_cpu_threads
from lowvram.memory.plan import host_kv_blocks, plan_kv
from lowvram.models.layer_streaming import load_model_for_profile
from lowvram.models.loader import resolve_model_path

log = logging.getLogger("lowvram")

__all__ = ["EngineSnapshot", "EngineStats", "LLMEngine"]


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


class LLMEngine(EngineControl):
    """The engine behind LLM, the server and the chat UI.

    model: local Hugging Face directory or hub id; None = the bundled demo model.
    profile: built-in profile name, YAML path or Profile; None = `4gb` with CUDA, `cpu` without.
    device, dtype, emulate_vram_gib, max_model_len, max_num_seqs: override the profile.
    timeline_path: append every step's observation and controller decision to this JSONL file.
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
        # What the process already holds on the device (an earlier engine's cuBLAS workspaces,
        # the caller's tensors) leaves that much less for this one.
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
        self.max_model_len = min(p.max_model_len, self.config.max_position_embeddings)
        element_bytes = torch.finfo(self.dtype).bits // 8
        # A unified-memory pool may hold a sequence longer than its device share; others may not.
        host_blocks = host_kv_blocks(self.config, p, element_bytes, self.device.type)
        plan_args = (self.config, p, self.model.weight_bytes, element_bytes, self.max_model_len)
        self.kv_plan = plan = plan_kv(
            *plan_args, device_type=self.device.type, host_blocks=host_blocks, held_bytes=held
        )
        self.kv_precision = "fp16" if p.kv_precision == "auto" else p.kv_precision
        # The lowest precision the controller may compress to. Batch-invariant mode keeps the
        # starting one: compressed pages would make a request decode unlike it does alone.
        self.min_kv_precision = self.kv_precision if p.batch_invariant else KV_LADDER[-1]
        self.kv_pool = create_kv_pool(
            self.config,
            p,
            plan.num_blocks,
            self.device,
            self.dtype,
            self.kv_precision,
            max_model_len=self.max_model_len,
        )
        if host_blocks and not self.kv_pool.can_read_host:
            plan_kv(*plan_args, device_type=self.device.type, held_bytes=held)  # the error, if it is one
        self.block_manager = BlockManager(
            self.kv_pool.num_blocks, plan.block_size, enable_prefix_caching=p.enable_prefix_caching
        )
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
        generator = None if params.seed is None else torch.Generator(device="cpu").manual_seed(params.seed)
        ids = list(prompt_token_ids)
        seq = Sequence(next(self._seq_ids), request_id, prompt, ids, params, Detokenizer(self.tokenizer), generator)
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
        """Whether a request waits or runs: `step` has work."""
        return self.scheduler.num_unfinished > 0

    def score(self, token_ids: list[int]) -> list[float]:
        """Log-probability of each token given the ones before it (len - 1 values), computed
        through the paged cache in chunks of the token budget as a prefill is (for perplexity)."""
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
        """Run one step and return the outputs it produced."""
        batch = self.scheduler.schedule()
        self.stats.num_preemptions += len(batch.preempted)
        if batch.is_empty:
            return []
        start = time.perf_counter()
        num_captures = self.runner.num_graph_captures
        try:
            tokens = self.runner.step(batch)
        except torch.OutOfMemoryError as exc:
            self._recover_from_oom(batch, exc)
            return []
        outputs = self._postprocess(batch, tokens)
        self._count(batch, time.perf_counter() - start, is_warmup=self.runner.num_graph_captures != num_captures)
        return outputs

    def _postprocess(self, batch: ScheduledBatch, tokens: list[int | None]) -> list[RequestOutput]:
        """Count the computed tokens, record full pages for the prefix cache, append the sampled
        tokens and finish the sequences that are done."""
        now = time.perf_counter()
        outputs = []
        for seq, num_new, token in zip(batch.seqs, batch.num_new_tokens, tokens):
            seq.num_computed_tokens += num_new
            # A decode step fills a page one token in block_size: the ids are gathered only then.
            if self.block_manager.num_uncommitted(seq.seq_id, seq.num_computed_tokens):
                self.block_manager.commit(seq.seq_id, seq.all_token_ids, seq.num_computed_tokens)
            if token is None:  # a prompt chunk with more to come
                continue
            append_token(seq, token, self.eos_token_ids, self.max_model_len, now)
            if seq.finish_reason is not None:
                self.scheduler.finish(seq)
                self.requests.pop(seq.request_id, None)
            outputs.append(request_output(seq))
        return outputs

    def _count(self, batch: ScheduledBatch, elapsed_s: float, is_warmup: bool) -> None:
        """Add a step to the stats and let the controller see it."""
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
        # Neither a step that captured a graph (a one-off cost) nor a queued step read with nothing
        # queued after it (it ran while the host worked) says how fast the card is.
        is_plain_decode = not batch.is_prefill and not is_warmup
        latency_ms = elapsed_s * 1000 if is_plain_decode and not self.runner.is_tail else None
        self._control(latency_ms, is_plain_decode)
