"""Turns a ScheduledBatch into tensors, runs the model and samples each sequence's next token,
making the batch's pages resident and prefetching the next step's. Pipelined decode: a steady
step sampled on the device queues the next one on its device tokens before the host reads
them; the next step uses it if it asks for exactly that, else drops it. A step with a constrained
(grammar) sequence queues nothing: its next mask needs the token this step samples."""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field, replace

import torch

from lowvram.core.scheduler import ScheduledBatch
from lowvram.engine.cuda_graphs import MAX_PREFILL_GRAPH_TOKENS, DecodeGraphs, PrefillGraphs
from lowvram.engine.sampler import (
    apply_token_masks,
    device_generator,
    has_penalties,
    prompt_logprobs,
    sample_tokens,
    sample_tokens_on_device,
    sampled_logprobs,
)
from lowvram.kv.attention import AttentionMetadata
from lowvram.kv.pool import KVPool
from lowvram.models.dense import CausalLM

log = logging.getLogger("lowvram")


@dataclass(eq=False)
class _Launched:
    """A step queued on the device, and its sampled tokens once read."""

    batch: ScheduledBatch
    rows: list[int]  # the rows of batch.seqs that sample a token
    tokens: list[int] | None = None  # on the host
    device_tokens: torch.Tensor | None = None  # [len(rows)] int64, when every row sampled on the device
    host_tokens: torch.Tensor | None = None  # pinned copy of device_tokens, valid once `copied` is reached
    copied: torch.cuda.Event | None = None
    generator_states: dict[int, torch.Tensor] = field(default_factory=dict)  # row -> state before its draw
    picked: list[int] | None = None  # the entries of host_tokens that are this step's (a narrowed queued step)
    logprobs: dict[int, tuple] = field(default_factory=dict)  # row -> sampler.sampled_logprobs' entry
    prompt_logprobs: dict[int, tuple] = field(default_factory=dict)  # row -> sampler.prompt_logprobs' entry

    def read(self) -> list[int]:
        if self.tokens is None:
            if self.copied is not None:
                self.copied.synchronize()
            tokens = self.host_tokens.tolist()
            self.tokens = tokens if self.picked is None else [tokens[i] for i in self.picked]
        return self.tokens

    def rewind(self, rows) -> None:
        """Give back the draws of `rows`: their tokens will be sampled again."""
        for row in rows:
            state = self.generator_states.get(row)
            if state is not None:
                self.batch.seqs[row].device_generator.set_state(state)


class ModelRunner:
    """max_num_seqs, max_model_len: size the decode graphs (use_cuda_graphs, CUDA only);
    max_prefill_graph_tokens: replay single-sequence prefills up to this many tokens (0 = off)."""

    def __init__(
        self,
        model: CausalLM,
        kv_pool: KVPool,
        *,
        max_num_seqs: int = 1,
        max_model_len: int = 0,
        use_cuda_graphs: bool = False,
        max_prefill_graph_tokens: int = 0,
        is_pipelined: bool = False,
    ):
        self.model = model
        self.kv_pool = kv_pool
        self.device = kv_pool.device
        self.block_size = kv_pool.block_size
        self.max_model_len = max_model_len
        self.is_pipelined = is_pipelined
        # Every step samples on the device alike, so a seeded request draws the same queued or not.
        self.samples_on_device = self.device.type == "cuda" or is_pipelined
        self.num_pipelined_steps = 0  # steps taken from the queue
        self.is_tail = False  # the last step came from the queue and nothing was queued after it
        self._queued: _Launched | None = None
        # The last step's log-probabilities, by batch row, for the sequences that asked.
        self.last_logprobs: dict[int, tuple] = {}
        self.last_prompt_logprobs: dict[int, tuple] = {}
        self.graphs = None
        self.prefill_graphs = None
        if use_cuda_graphs and self.device.type == "cuda" and model.supports_cuda_graphs:
            max_blocks = -(-max(max_model_len, 1) // self.block_size)  # of the longest context
            # The rotary tables must not be replaced after a graph captured them.
            model.reserve_positions(max_blocks * self.block_size, self.device)
            # A host-memory embedding table the GPU cannot read has each replay's rows staged.
            embed = model.model.embed_tokens
            stage = getattr(embed, "stage", None) if getattr(embed, "device_view", None) is None else None
            prefill_tokens = min(max_prefill_graph_tokens, MAX_PREFILL_GRAPH_TOKENS)
            capacity = max(max_num_seqs, prefill_tokens)  # one staging buffer serves both
            staging = dict(stage_embeddings=stage, stage_capacity=capacity)
            self.graphs = DecodeGraphs(self._logits, max_num_seqs, max_blocks, self.device, **staging)
            if prefill_tokens > 0:
                self.prefill_graphs = PrefillGraphs(self._logits, prefill_tokens, max_blocks, self.device, **staging)

    @property
    def num_graph_captures(self) -> int:
        return sum(g.num_captures for g in (self.graphs, self.prefill_graphs) if g is not None)

    def gather(self, batch: ScheduledBatch) -> tuple[list[int], list[int], list[int], list[int], list[list[int]]]:
        """Host lists: token ids, positions, KV slots per new token; context length, device table per sequence."""
        input_ids, positions, slots, context_lens, tables = [], [], [], [], []
        for seq, start, num_new, block_table in zip(
            batch.seqs, batch.positions, batch.num_new_tokens, batch.block_tables
        ):
            end = start + num_new
            table = self.kv_pool.device_table(block_table)
            # A queued step's input ids are on the device only (its tokens are not sampled yet).
            input_ids.extend(seq.token_ids_between(start, end) if end <= seq.num_tokens else [0] * num_new)
            positions.extend(range(start, end))
            slots.extend(table[p // self.block_size] * self.block_size + p % self.block_size for p in range(start, end))
            context_lens.append(end)
            tables.append(table)
        return input_ids, positions, slots, context_lens, tables

    @torch.inference_mode()
    def step(self, batch: ScheduledBatch) -> list[int | None]:
        """Run `batch`; each sequence's next token (None for a prompt chunk with more to come)."""
        # The queued step, narrowed to `batch`'s rows, when it computed what `batch` asks.
        launched, queued, self._queued = None, self._queued, None
        if queued is not None:
            row_of = {seq.seq_id: row for row, seq in enumerate(queued.batch.seqs)}
            rows = [row_of.get(seq.seq_id) for seq in batch.seqs]
            is_match = not batch.is_prefill and all(
                row is not None and queued.batch.positions[row] == p for row, p in zip(rows, batch.positions)
            )
            queued.rewind(set(queued.rows) - set(rows) if is_match else queued.rows)
            if is_match and rows == queued.rows:
                launched = replace(queued, batch=batch)
            elif is_match:
                narrowed = queued.device_tokens[torch.tensor(rows, device=queued.device_tokens.device)]
                launched = _Launched(
                    batch, list(range(len(rows))), None, narrowed, queued.host_tokens, queued.copied, picked=rows
                )
        is_queued = launched is not None
        if launched is None:
            launched = self._launch(batch)
        if self._can_queue_after(launched):
            ahead = replace(batch, positions=[p + 1 for p in batch.positions], copies=[], preempted=[])
            try:
                self._queued = self._launch(ahead, input_ids=launched.device_tokens)
            except torch.OutOfMemoryError:  # the next step runs unqueued, and recovers if it must
                log.warning("no device memory to queue the next decode step; it runs on its own")
        self.num_pipelined_steps += is_queued
        self.last_logprobs, self.last_prompt_logprobs = launched.logprobs, launched.prompt_logprobs
        self.is_tail = is_queued and self._queued is None
        tokens: list[int | None] = [None] * len(batch.seqs)
        for row, token in zip(launched.rows, launched.read()):
            tokens[row] = token
        return tokens

    def drop_queued(self) -> None:
        """Forget a queued step (before the pages, the batch or the model under it change)."""
        if self._queued is not None:
            self._queued.rewind(self._queued.rows)
            self._queued = None

    def _can_queue_after(self, launched: _Launched) -> bool:
        """Whether the next step can be queued before `launched`'s tokens are read: a steady decode
        step sampled on the device (not with staged embeddings) whose sequences go on and hold the page."""
        batch, graphs = launched.batch, self.graphs
        if not (self.is_pipelined and batch.is_steady and launched.device_tokens is not None):
            return False
        if graphs is not None and graphs.stage_embeddings is not None:
            return False
        if any(seq.matcher is not None for seq in batch.seqs):  # its next mask needs this step's token
            return False
        return all(  # with the token this step samples, the sequence goes on and holds its next page
            (n := position + 2) - len(seq.prompt_token_ids) < seq.params.max_tokens
            and n < self.max_model_len
            and n <= len(table) * self.block_size
            for seq, position, table in zip(batch.seqs, batch.positions, batch.block_tables)
        )

    def _launch(self, batch: ScheduledBatch, input_ids: torch.Tensor | None = None) -> _Launched:
        """Queue `batch` and its sampling (device-sampled tokens are read later, behind an event)."""
        # Scoring the prompt needs every position's logits: only for the requests that ask.
        is_all_rows = batch.is_prefill and any(seq.params.prompt_logprobs is not None for seq in batch.seqs)
        logits = self.run(batch, input_ids=input_ids, is_all_rows=is_all_rows)
        rows = [
            row
            for row, (seq, start, num_new) in enumerate(zip(batch.seqs, batch.positions, batch.num_new_tokens))
            if not batch.is_prefill
            or start + num_new == seq.num_tokens  # a prompt chunk that is not the last samples nothing
        ]
        launched = _Launched(batch, rows)
        if is_all_rows:  # [T, V] -> each sequence's last row [S, V]
            launched.prompt_logprobs = prompt_logprobs(logits, batch.seqs, batch.positions, batch.num_new_tokens)
            logits = logits[[end - 1 for end in itertools.accumulate(batch.num_new_tokens)]]
        seqs = [batch.seqs[row] for row in rows]
        logits = apply_token_masks(logits, rows, seqs)
        # Rows that want log-probabilities are sampled and read now: such a step is never pipelined.
        on_host = any(has_penalties(seq.params) or seq.params.logprobs is not None for seq in seqs)
        if not (seqs and self.samples_on_device and not on_host):
            launched.tokens = sample_tokens(logits, rows, seqs, on_device=self.samples_on_device)
            launched.logprobs = sampled_logprobs(logits, rows, seqs, launched.tokens)
            return launched
        launched.generator_states = {
            row: generator.get_state()
            for row, seq in zip(rows, seqs)
            if (generator := device_generator(seq, logits.device)) is not None
        }
        launched.device_tokens = sample_tokens_on_device(logits, rows, seqs)
        if launched.device_tokens.is_cuda:
            launched.host_tokens = torch.empty(len(rows), dtype=torch.long, pin_memory=True)
            launched.host_tokens.copy_(launched.device_tokens, non_blocking=True)
            launched.copied = torch.cuda.Event()
            launched.copied.record()
        else:
            launched.host_tokens = launched.device_tokens
        return launched

    @torch.inference_mode()
    def run(
        self, batch: ScheduledBatch, *, is_all_rows: bool = False, input_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """FP32 logits [S, vocab] at each sequence's last new token ([T, vocab] with is_all_rows).
        input_ids: a queued step's ids [S] on the device. A graph replay returns a view: read it first."""
        for src, dst in batch.copies:  # copy-on-write of a shared page, before the step reads dst
            self.kv_pool.copy_block(src, dst)
        pool = self.kv_pool
        if not pool.can_spill:
            return self._forward(batch, is_all_rows, input_ids)
        tables = {seq.seq_id: table for seq, table in zip(batch.seqs, batch.block_tables)}
        pool.record_step(tables, live_seq_ids=batch.live_tables.keys())
        parts = self._split(batch, tables)
        free = batch.free_block_ids
        logits = []
        first_row = 0
        for i, (part, blocks) in enumerate(parts):
            pool.ensure_resident(blocks, free_block_ids=free)
            # Queued before this part's kernels, to overlap them: the next part's, or idle sequences' pages.
            if i + 1 < len(parts):
                upcoming = parts[i + 1][1]
            else:
                upcoming = [b for seq_id, table in batch.live_tables.items() if seq_id not in tables for b in table]
            if upcoming:
                pool.prefetch(upcoming, protected=blocks, free_block_ids=free)
            part_ids = None if input_ids is None else input_ids[first_row : first_row + len(part.seqs)]
            first_row += len(part.seqs)
            part_logits = self._forward(part, is_all_rows, part_ids)
            # The next part's replay would overwrite a graph's logits before the cat reads them.
            logits.append(part_logits.clone() if i + 1 < len(parts) else part_logits)
        return logits[0] if len(logits) == 1 else torch.cat(logits)

    def _forward(self, batch: ScheduledBatch, is_all_rows: bool, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        gathered = None
        graphs = self.prefill_graphs if batch.is_prefill else self.graphs
        if graphs is not None and not is_all_rows and (not batch.is_prefill or len(batch.seqs) == 1):
            # The bucket first, from the block tables: a batch no graph holds is gathered once, eagerly.
            num_rows = batch.num_new_tokens[0] if batch.is_prefill else len(batch.seqs)
            key = graphs.bucket(num_rows, max(len(table) for table in batch.block_tables))
            if key is not None:
                gathered = self.gather(batch)
                logits = graphs.run(key, *gathered, self.kv_pool.pages, self.kv_pool.pages_version, input_ids)
                if logits is not None:
                    return logits
        host_ids, positions, slots, context_lens, tables = gathered or self.gather(batch)
        cu_seqlens = list(itertools.accumulate(batch.num_new_tokens, initial=0))
        max_blocks = max(len(t) for t in tables)
        dev = self.device
        meta = AttentionMetadata(
            is_prefill=batch.is_prefill,
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            block_tables=torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.int32, device=dev),
            context_lens=torch.tensor(context_lens, dtype=torch.int32, device=dev),
            cu_seqlens_q=torch.tensor(cu_seqlens, dtype=torch.int32, device=dev),
            max_context_len=max(context_lens),
            context_lens_cpu=context_lens,
            query_lens_cpu=list(batch.num_new_tokens),
        )
        # A queued step's ids are on the device already: one new token per sequence, the rows line up.
        ids = input_ids if input_ids is not None else torch.tensor(host_ids, dtype=torch.long, device=dev)
        hidden = self.model(ids, torch.tensor(positions, dtype=torch.long, device=dev), meta, self.kv_pool.pages)
        return self.model.compute_logits(hidden if is_all_rows else hidden[[end - 1 for end in cu_seqlens[1:]]])

    def _logits(self, input_ids, positions, meta, kv_pages, last_row=None) -> torch.Tensor:
        """What a graph captures: logits [T, vocab], or [1, vocab] at `last_row` [1] (a prefill's)."""
        hidden = self.model(input_ids, positions, meta, kv_pages)  # [T, hidden]
        return self.model.compute_logits(hidden if last_row is None else hidden.index_select(0, last_row))

    def _split(self, batch: ScheduledBatch, tables: dict[int, list[int]]) -> list[tuple[ScheduledBatch, list[int]]]:
        """The batch in parts whose pages fit the device share (half of it each, when one part is not enough)."""
        limit = self.kv_pool.max_blocks_per_step
        if limit is None:  # one part; the pool takes each page once however often it is listed
            return [(batch, list(itertools.chain.from_iterable(tables.values())))]
        if len(tables) == 1:  # one table holds no page twice: nothing to merge (every batch-1 step)
            every = list(next(iter(tables.values())))
        else:
            every = list(dict.fromkeys(itertools.chain.from_iterable(tables.values())))
        if len(every) <= limit:
            return [(batch, every)]
        budget = max(1, limit // 2)
        parts: list[tuple[ScheduledBatch, list[int]]] = []
        rows: list[int] = []
        blocks: dict[int, None] = {}

        def part() -> tuple[ScheduledBatch, list[int]]:
            fields = ("seqs", "num_new_tokens", "block_tables", "positions")
            picked = {name: [getattr(batch, name)[row] for row in rows] for name in fields}
            return replace(batch, copies=[], **picked), list(blocks)

        for row, table in enumerate(batch.block_tables):
            if rows and len(blocks.keys() | set(table)) > budget:
                parts.append(part())
                rows, blocks = [], {}
            rows.append(row)
            blocks.update(dict.fromkeys(table))
        parts.append(part())
        return parts
