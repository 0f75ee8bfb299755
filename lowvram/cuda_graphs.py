"""CUDA graphs of the decode step: one replay instead of hundreds of kernel launches.

A decode step of a 28-layer model launches a few hundred small kernels; on a small GPU
each costs more to launch from Python than to run. Captured once, the whole forward pass
(embedding to logits) replays as one graph, so the step costs the GPU time only.

A graph fixes every shape and address it was captured with. So:
- Inputs live in static buffers sized for the largest batch; a step copies its token ids,
  positions, KV slots, block tables and context lengths in and replays. Padding rows
  write no KV (slot -1) and attend to nothing (context length 0); their logits are dropped.
- One graph per (batch size, block-table width) bucket. The width fixes how many context
  partitions the decode attention kernel splits into, so it is bucketed by powers of four
  from 64 pages up to the model's longest context: short contexts do not pay for the
  partitions of long ones.
- The KV pages' addresses are baked in. When the pool reallocates its pages (a precision
  change), every graph is dropped and recaptured on demand.
- Graphs are captured lazily, the first time a bucket is needed, and share one memory
  pool, so their activations take the space of one step, not one per graph. Every graph
  writes its logits into one static buffer sized for the largest batch.
- Warm-up runs and captures go on one stream per device for the whole process: torch
  keeps a cuBLAS workspace (~32 MiB) for every stream that ran a matmul, for the life of
  the process, so a fresh stream per capture held one more workspace per graph, and
  dropped engines left theirs behind. memory_plan.decode_graph_bytes counts what stays.

- An embedding table in host memory cannot be read inside a graph: each replay copies its
  rows from a pinned buffer the step fills on the host first (HostEmbedding.stage).
Prefill graphs (profile `enable_prefill_graphs`, off by default until measured) do the same
for one sequence's new tokens up to 512, padded to a bucket of 64, 128, 256 or 512 tokens;
see PrefillGraphs. Anything a graph cannot hold (a longer or multi-sequence prefill, a
batch larger than the largest bucket, a model that syncs with the host inside its forward
pass) runs eagerly, and so does every bucket whose capture failed, with a warning logged once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from lowvram.attention import AttentionMetadata
from lowvram.kv_quant import KVPages

log = logging.getLogger("lowvram.cuda_graphs")

MIN_TABLE_BLOCKS = 64
TABLE_GROWTH = 4


def batch_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, ... up to max_num_seqs (which is always a bucket)."""
    sizes = []
    size = 1
    while size < max_num_seqs:
        sizes.append(size)
        size *= 2
    return sizes + [max_num_seqs]


def table_buckets(max_blocks_per_seq: int) -> list[int]:
    """Block-table widths: 64, 256, 1024, ... pages, capped at max_blocks_per_seq (always a bucket)."""
    widths = []
    width = MIN_TABLE_BLOCKS
    while width < max_blocks_per_seq:
        widths.append(width)
        width *= TABLE_GROWTH
    return widths + [max_blocks_per_seq]


def _bucket(value: int, buckets: list[int]) -> int | None:
    return next((b for b in buckets if b >= value), None)


_capture_streams: dict[torch.device, torch.cuda.Stream] = {}


def capture_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream every decode graph of this process warms up and is captured on."""
    if device not in _capture_streams:
        _capture_streams[device] = torch.cuda.Stream(device)
    return _capture_streams[device]


def pages_signature(kv_pages: list[KVPages]) -> tuple[int, ...]:
    """The device addresses a graph bakes in; a change means the graphs are stale."""
    return tuple(value.data_ptr() for pages in kv_pages for value in vars(pages).values()
                 if isinstance(value, torch.Tensor))


class _StepGraphs:
    """What decode and prefill graphs share: one graph per (row bucket, table width) key,
    captured lazily on the process's capture stream into one memory pool, dropped when the
    KV pages move, a failed capture remembered (that key runs eagerly), the per-row static
    inputs (token ids, positions, KV slots) sized for the largest row bucket, and the logits
    of every graph written into one static buffer of `max_logit_rows` rows."""

    kind = "step"

    def __init__(self, device: torch.device, row_sizes: list[int], max_blocks_per_seq: int, max_logit_rows: int,
                 stage_embeddings: Callable[[list[int], int], None] | None, stage_capacity: int | None):
        self.device = device
        self.row_sizes = row_sizes
        self.table_widths = table_buckets(max_blocks_per_seq)
        max_rows = row_sizes[-1]
        self.max_logit_rows = max_logit_rows
        # An embedding table in host memory (HostEmbedding.stage): rows gathered before each replay.
        self.stage_embeddings = stage_embeddings
        self.stage_capacity = stage_capacity or max_rows
        self._replayed = torch.cuda.Event() if stage_embeddings is not None else None
        self.input_ids = torch.zeros(max_rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_rows, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((max_rows,), -1, dtype=torch.long, device=device)
        self.logits: torch.Tensor | None = None  # [max_logit_rows, vocab] float32, made at the first capture
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.failed: set[tuple[int, int]] = set()
        self.pool = None
        self.signature: tuple[int, ...] = ()
        self.pages_version: int | None = None
        self.num_replays = 0
        self.num_captures = 0

    def bucket(self, num_rows: int, num_table_blocks: int) -> tuple[int, int] | None:
        """The graph key for `num_rows` rows (sequences to decode, or one sequence's new tokens)
        over tables of `num_table_blocks` pages, or None when no graph holds them."""
        rows, width = _bucket(num_rows, self.row_sizes), _bucket(num_table_blocks, self.table_widths)
        if rows is None or width is None or (rows, width) in self.failed:
            return None
        return rows, width

    def _fill_rows(self, size: int, input_ids: list[int], positions: list[int], slots: list[int]) -> None:
        """The per-row inputs of a `size`-row bucket, padded (padding rows store no KV)."""
        padding = size - len(input_ids)
        # Built on the host and copied in one go per buffer: a handful of small copies per step.
        self.input_ids[:size].copy_(torch.tensor(input_ids + [0] * padding), non_blocking=True)
        self._stage(input_ids + [0] * padding)
        self.positions[:size].copy_(torch.tensor(positions + [0] * padding), non_blocking=True)
        self.slot_mapping[:size].copy_(torch.tensor(slots + [-1] * padding), non_blocking=True)

    def _stage(self, token_ids: list[int]) -> None:
        if self.stage_embeddings is not None:
            # The last replay's copy of the staged rows is done (the engine also reads every
            # step's tokens on the host before the next step, so graphs of the other kind are too).
            self._replayed.synchronize()
            self.stage_embeddings(token_ids, self.stage_capacity)

    def _replay(self, key: tuple[int, int], kv_pages: list[KVPages], pages_version: int | None,
                num_rows: int) -> torch.Tensor | None:
        """Replay (capturing first if needed) the graph for `key`, whose inputs are filled;
        logits [num_rows, vocab], or None when the capture failed.

        `pages_version` is the pool's count of page reallocations: while it stays the same the
        page addresses are not read again (a few hundred tensors, a noticeable share of a step)."""
        if pages_version is None or pages_version != self.pages_version:
            self._check_pages(kv_pages)
            self.pages_version = pages_version
        graph = self.graphs.get(key)
        if graph is None:
            graph = self._capture(key, kv_pages)
            if graph is None:
                return None
        graph.replay()
        if self._replayed is not None:
            self._replayed.record()
        self.num_replays += 1
        # Every graph writes the same buffer, and the next replay overwrites it: hand out a copy.
        return self.logits[:num_rows].clone()

    def _check_pages(self, kv_pages: list[KVPages]) -> None:
        signature = pages_signature(kv_pages)
        if signature != self.signature:
            if self.graphs:
                log.info("KV pages moved (precision change): dropping %d %s graphs", len(self.graphs), self.kind)
            self.graphs.clear()
            self.pool = None
            self.signature = signature

    def _logits_of(self, key: tuple[int, int], kv_pages: list[KVPages]) -> torch.Tensor:
        """The captured computation: logits [rows of key, vocab] from the static inputs."""
        raise NotImplementedError

    def _capture(self, key: tuple[int, int], kv_pages: list[KVPages]):
        try:
            # One eager run first: it compiles the Triton kernels and lets the allocator settle,
            # neither of which may happen inside a capture.
            stream = capture_stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                warm = self._logits_of(key, kv_pages)
                num_rows, vocab_size, dtype = warm.shape[0], warm.shape[-1], warm.dtype
                del warm
            torch.cuda.current_stream(self.device).wait_stream(stream)
            if self.logits is None:  # on the engine's stream, which reads it after every replay
                self.logits = torch.empty((self.max_logit_rows, vocab_size), dtype=dtype, device=self.device)
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            # thread_local: the server's and the chat's other threads may call CUDA meanwhile.
            with torch.cuda.graph(graph, pool=self.pool, stream=stream, capture_error_mode="thread_local"):
                self.logits[:num_rows].copy_(self._logits_of(key, kv_pages))
        except Exception as exc:  # a capture failure costs speed, never the request
            self.failed.add(key)
            log.warning("%s graph for %s could not be captured (%s); that bucket runs eagerly", self.kind, key, exc)
            return None
        # The capture run wrote nothing real: its inputs are this step's, replayed next.
        self.graphs[key] = graph
        self.num_captures += 1
        return graph


class DecodeGraphs(_StepGraphs):
    """Captures and replays the decode forward pass of `model` for batches up to `max_num_seqs`.

    Args:
        forward: (input_ids [B], positions [B], meta, kv_pages) -> FP32 logits [B, vocab]; the
            model's forward plus its head. It must not synchronise with the host.
        max_num_seqs: the largest batch a graph serves (the profile's max_num_seqs).
        max_blocks_per_seq: pages of the longest context (max_model_len / block_size, rounded up).
        device: the CUDA device.
        stage_embeddings, stage_capacity: HostEmbedding.stage and the most rows any graph stages.
    """

    kind = "decode"

    def __init__(self, forward: Callable[..., torch.Tensor], max_num_seqs: int, max_blocks_per_seq: int,
                 device: torch.device, stage_embeddings: Callable[[list[int], int], None] | None = None,
                 stage_capacity: int | None = None):
        batch_sizes = batch_buckets(max_num_seqs)
        super().__init__(device, batch_sizes, max_blocks_per_seq, batch_sizes[-1], stage_embeddings, stage_capacity)
        self.forward = forward
        max_batch, max_width = batch_sizes[-1], self.table_widths[-1]
        self.context_lens = torch.zeros(max_batch, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros((max_batch, max_width), dtype=torch.int32, device=device)

    def run(self, key: tuple[int, int], input_ids: list[int], positions: list[int], slots: list[int],
            tables: list[list[int]], context_lens: list[int], kv_pages: list[KVPages],
            pages_version: int | None = None) -> torch.Tensor | None:
        """Logits [S, vocab] of the decode step, by replaying the graph for `key`; None when the
        graph could not be captured (the caller runs the step eagerly)."""
        batch, width = key
        self._fill(input_ids, positions, slots, tables, context_lens, batch, width)
        return self._replay(key, kv_pages, pages_version, len(input_ids))

    def _fill(self, input_ids, positions, slots, tables, context_lens, batch: int, width: int) -> None:
        padding = batch - len(input_ids)
        self._fill_rows(batch, input_ids, positions, slots)
        self.context_lens[:batch].copy_(torch.tensor(context_lens + [0] * padding, dtype=torch.int32),
                                        non_blocking=True)
        rows = [t + [0] * (width - len(t)) for t in tables] + [[0] * width] * padding
        self.block_tables[:batch, :width].copy_(torch.tensor(rows, dtype=torch.int32), non_blocking=True)

    def _meta(self, batch: int, width: int, block_size: int) -> AttentionMetadata:
        return AttentionMetadata(
            is_prefill=False,
            slot_mapping=self.slot_mapping[:batch],
            block_tables=self.block_tables[:batch, :width],  # [B, width], row stride = the widest bucket
            context_lens=self.context_lens[:batch],
            cu_seqlens_q=torch.arange(batch + 1, dtype=torch.int32, device=self.device),
            max_context_len=width * block_size,
            context_lens_cpu=[width * block_size] * batch,
            query_lens_cpu=[1] * batch,
        )

    def _logits_of(self, key: tuple[int, int], kv_pages: list[KVPages]) -> torch.Tensor:
        batch, width = key
        meta = self._meta(batch, width, kv_pages[0].block_size)
        return self.forward(self.input_ids[:batch], self.positions[:batch], meta, kv_pages)


# Prefill graphs serve prompts (or prompt chunks) of one sequence up to this many new tokens:
# the time to first token of a short prompt is launch-bound, a long one is not, and a graph's
# pool keeps the activations of its largest bucket for good.
MAX_PREFILL_GRAPH_TOKENS = 512
MIN_PREFILL_GRAPH_TOKENS = 64


def token_buckets(max_tokens: int) -> list[int]:
    """New-token counts a prefill graph is captured for: 64, 128, ... up to max_tokens."""
    sizes = []
    size = MIN_PREFILL_GRAPH_TOKENS
    while size < max_tokens:
        sizes.append(size)
        size *= 2
    return sizes + [max_tokens]


class PrefillGraphs(_StepGraphs):
    """Captures and replays the prefill of one sequence's new tokens (a prompt, or a chunk of
    one after a cached prefix), padded up to a token bucket, for the logits of its last token.

    The padding rows are a second, empty sequence (no context, KV slot -1): the attention
    kernel gives them nothing to read and every other layer works row by row, so the real
    rows come out as an eager step computes them at that row count.

    Args:
        forward: (input_ids [T], positions [T], meta, kv_pages, last_row [1] int64) -> FP32
            logits [1, vocab] of row `last_row`; must not synchronise with the host.
        max_tokens: the largest bucket (at most the step's token budget).
        max_blocks_per_seq, device, stage_embeddings, stage_capacity: as for DecodeGraphs.
    """

    kind = "prefill"

    def __init__(self, forward: Callable[..., torch.Tensor], max_tokens: int, max_blocks_per_seq: int,
                 device: torch.device, stage_embeddings: Callable[[list[int], int], None] | None = None,
                 stage_capacity: int | None = None):
        super().__init__(device, token_buckets(max_tokens), max_blocks_per_seq, 1, stage_embeddings, stage_capacity)
        self.forward = forward
        max_width = self.table_widths[-1]
        self.context_lens = torch.zeros(2, dtype=torch.int32, device=device)  # [the sequence, the padding]
        self.cu_seqlens = torch.zeros(3, dtype=torch.int32, device=device)  # [0, new tokens, bucket]
        self.block_tables = torch.zeros((2, max_width), dtype=torch.int32, device=device)
        self.last_row = torch.zeros(1, dtype=torch.long, device=device)

    def run(self, key: tuple[int, int], input_ids: list[int], positions: list[int], slots: list[int],
            table: list[int], context_len: int, kv_pages: list[KVPages],
            pages_version: int | None = None) -> torch.Tensor | None:
        """Logits [1, vocab] at the last of `input_ids` (one sequence's new tokens, ending at
        `context_len`), by replaying the graph for `key`; None when it could not be captured."""
        size, width = key
        num_new = len(input_ids)
        self._fill_rows(size, input_ids, positions, slots)
        self.context_lens.copy_(torch.tensor([context_len, 0], dtype=torch.int32), non_blocking=True)
        self.cu_seqlens.copy_(torch.tensor([0, num_new, size], dtype=torch.int32), non_blocking=True)
        self.block_tables[0, :width].copy_(torch.tensor(table + [0] * (width - len(table)), dtype=torch.int32),
                                           non_blocking=True)
        self.last_row.fill_(num_new - 1)
        return self._replay(key, kv_pages, pages_version, 1)

    def _logits_of(self, key: tuple[int, int], kv_pages: list[KVPages]) -> torch.Tensor:
        size, width = key
        block_size = kv_pages[0].block_size
        meta = AttentionMetadata(
            is_prefill=True,
            slot_mapping=self.slot_mapping[:size],
            block_tables=self.block_tables[:, :width],  # [2, width]: the sequence, the padding (empty)
            context_lens=self.context_lens,
            cu_seqlens_q=self.cu_seqlens,
            max_context_len=width * block_size,
            context_lens_cpu=[width * block_size, 0],
            query_lens_cpu=[size, 0],  # the grid covers a whole bucket of rows
        )
        return self.forward(self.input_ids[:size], self.positions[:size], meta, kv_pages, self.last_row)
