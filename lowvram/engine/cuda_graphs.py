"""CUDA graphs of decode steps and short prefills: one replay instead of hundreds of launches.
Inputs live in static buffers (padding rows write no KV and read nothing); one graph per (rows,
table width) bucket, dropped when the pool reallocates its pages; graphs share a memory pool, a
logits buffer and one capture stream per device (each stream keeps ~32 MiB of cuBLAS workspace)."""

from __future__ import annotations

import functools
import logging

import numpy as np
import torch

from lowvram.kernels.kv_quant import KVPages
from lowvram.kv.attention import AttentionMetadata

log = logging.getLogger("lowvram.engine.cuda_graphs")

MAX_PREFILL_GRAPH_TOKENS = 512  # short prompts are launch-bound, long ones not; a pool keeps its largest bucket


def geometric_buckets(first: int, factor: int, largest: int) -> list[int]:
    """first, first * factor, ... below `largest`, then `largest` (always a bucket)."""
    sizes = []
    size = first
    while size < largest:
        sizes.append(size)
        size *= factor
    return sizes + [largest]


batch_buckets = functools.partial(geometric_buckets, 1, 2)
table_buckets = functools.partial(geometric_buckets, 64, 4)  # pages
token_buckets = functools.partial(geometric_buckets, 64, 2)


def _bucket(value: int, buckets: list[int]) -> int | None:
    return next((b for b in buckets if b >= value), None)


@functools.cache
def capture_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


class StagedInputs:
    """A graph's static inputs: views of one device buffer filled from a pinned host mirror by one
    copy per step. fields: name -> (dtype, numel, initial value), 8-byte aligned, in order; the
    largest, partly used input goes last (`upload` copies the buffer's front)."""

    def __init__(self, fields: dict[str, tuple[torch.dtype, int, int]], device: torch.device):
        self.offsets: dict[str, int] = {}
        num_bytes = 0
        for name, (dtype, numel, _) in fields.items():
            self.offsets[name] = num_bytes
            num_bytes += -(-numel * dtype.itemsize // 8) * 8
        is_cuda = device.type == "cuda"
        self._device_bytes = torch.empty(num_bytes, dtype=torch.uint8, device=device)
        self._host_bytes = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=is_cuda)
        self._copied = torch.cuda.Event() if is_cuda else None
        self.inputs: dict[str, torch.Tensor] = {}
        self._host: dict[str, np.ndarray] = {}
        for name, (dtype, numel, initial) in fields.items():
            start, end = self.offsets[name], self.offsets[name] + numel * dtype.itemsize
            self._host[name] = self._host_bytes[start:end].view(dtype).numpy()
            self._host[name][:] = initial
            self.inputs[name] = self._device_bytes[start:end].view(dtype)
        self._device_bytes.copy_(self._host_bytes)

    def host(self) -> dict[str, np.ndarray]:
        """The mirror's views to write, once the last upload has read them."""
        if self._copied is not None:
            self._copied.synchronize()
        return self._host

    def upload(self, last: str, num_elements: int) -> None:
        """Copy the mirror to the device up to the first `num_elements` of input `last`."""
        end = self.offsets[last] + num_elements * self._host[last].itemsize
        self._device_bytes[:end].copy_(self._host_bytes[:end], non_blocking=True)
        if self._copied is not None:
            self._copied.record()


class _StepGraphs:
    """Graphs by (row bucket, table width) key, failed keys remembered (they run eagerly).
    forward: the model plus its head, FP32 logits, with no host synchronisation. row_sizes: the
    row buckets; input_fields: the kind's inputs besides ids, positions and slots (StagedInputs).
    stage_embeddings, stage_capacity: HostEmbedding.stage and the most rows any graph stages."""

    kind = "step"

    def __init__(
        self, forward, device, row_sizes, max_blocks_per_seq, input_fields, stage_embeddings=None, stage_capacity=None
    ):
        self.forward = forward
        self.device = device
        self.row_sizes = row_sizes
        self.table_widths = table_buckets(max_blocks_per_seq)
        max_rows = row_sizes[-1]
        self.stage_embeddings = stage_embeddings
        self.stage_capacity = stage_capacity or max_rows
        self._replayed = torch.cuda.Event() if stage_embeddings is not None else None
        per_row = {"input_ids": (torch.long, max_rows, 0), "positions": (torch.long, max_rows, 0)}
        self.staged = StagedInputs({**per_row, "slot_mapping": (torch.long, max_rows, -1), **input_fields}, device)
        for name, tensor in self.staged.inputs.items():  # self.input_ids, self.positions, ...
            setattr(self, name, tensor)
        self.logits: torch.Tensor | None = None  # [max_logit_rows, vocab] float32, made at the first capture
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.failed: set[tuple[int, int]] = set()
        self.pool = None
        self.signature: tuple[int, ...] = ()
        self.pages_version: int | None = None
        self.num_replays = 0
        self.num_captures = 0

    def bucket(self, num_rows: int, num_table_blocks: int) -> tuple[int, int] | None:
        """The graph key for these rows over tables of these widths; None when no graph holds them."""
        rows, width = _bucket(num_rows, self.row_sizes), _bucket(num_table_blocks, self.table_widths)
        return None if rows is None or width is None or (rows, width) in self.failed else (rows, width)

    def run(
        self, key, input_ids, positions, slots, context_lens, tables, kv_pages, version=None, device_input_ids=None
    ):
        """The step's logits ([S, vocab] decode, [1, vocab] prefill) from the graph for `key`,
        captured first if need be (None if it cannot be): a view of the shared buffer, valid
        until the next replay. The host lists are ModelRunner.gather's; device_input_ids [S]:
        a queued decode step's ids on the device. Page addresses (kv_pages) are re-read only
        when `version` (the pool's pages_version) changes."""
        if device_input_ids is not None and self.stage_embeddings is not None:
            raise ValueError("staged embedding rows need the input ids on the host")
        self._fill(input_ids, positions, slots, context_lens, tables, *key)
        if device_input_ids is not None:
            self.input_ids[: len(input_ids)].copy_(device_input_ids)
        if version is None or version != self.pages_version:
            signature = tuple(  # the device addresses a graph bakes in
                t.data_ptr() for pages in kv_pages for t in vars(pages).values() if isinstance(t, torch.Tensor)
            )
            if signature != self.signature:
                if self.graphs:
                    log.info("KV pages moved (precision change): dropping %d %s graphs", len(self.graphs), self.kind)
                self.graphs.clear()
                self.pool = None
                self.signature = signature
            self.pages_version = version
        graph = self.graphs.get(key)
        if graph is None:
            try:
                # An eager run first compiles the Triton kernels and settles the allocator, as no capture may.
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
        graph.replay()
        if self._replayed is not None:
            self._replayed.record()
        self.num_replays += 1
        return self.logits[: min(len(input_ids), self.max_logit_rows)]

    def _fill_rows(self, size: int, input_ids: list[int], positions: list[int], slots: list[int]) -> dict:
        host = self.staged.host()
        num_rows = len(input_ids)
        for name, values, pad in zip(
            ("input_ids", "positions", "slot_mapping"), (input_ids, positions, slots), (0, 0, -1)
        ):
            host[name][:num_rows] = values
            host[name][num_rows:size] = pad  # padding rows store no KV (slot -1)
        if self.stage_embeddings is not None:
            # The last replay (of either kind: every step's tokens are read) has read the staged rows.
            self._replayed.synchronize()
            self.stage_embeddings(input_ids + [0] * (size - num_rows), self.stage_capacity)
        return host

    def _logits_of(self, key: tuple[int, int], kv_pages: list[KVPages]) -> torch.Tensor:
        """The captured computation: logits [rows of key, vocab] from the static inputs."""
        raise NotImplementedError


class DecodeGraphs(_StepGraphs):
    """Decode steps of up to `max_num_seqs` sequences. forward: (input_ids [B], positions [B],
    meta, kv_pages) -> logits [B, vocab]. max_blocks_per_seq: pages of the longest context."""

    kind = "decode"

    def __init__(self, forward, max_num_seqs: int, max_blocks_per_seq: int, device: torch.device, **staging):
        sizes, max_width = batch_buckets(max_num_seqs), table_buckets(max_blocks_per_seq)[-1]
        self.max_logit_rows = sizes[-1]
        fields = {
            "context_lens": (torch.int32, sizes[-1], 0),
            # A bucket's tables are packed rows of its own width, so a step copies batch x width entries.
            "block_tables": (torch.int32, sizes[-1] * max_width, 0),
        }
        super().__init__(forward, device, sizes, max_blocks_per_seq, fields, **staging)

    def _fill(self, input_ids, positions, slots, context_lens, tables, batch: int, width: int) -> None:
        host = self._fill_rows(batch, input_ids, positions, slots)
        host["context_lens"][:batch] = context_lens + [0] * (batch - len(context_lens))
        rows = host["block_tables"][: batch * width].reshape(batch, width)  # [B, width]
        rows[:] = 0
        for row, table in zip(rows, tables):
            row[: len(table)] = table
        self.staged.upload("block_tables", batch * width)

    def _logits_of(self, key: tuple[int, int], kv_pages: list[KVPages]) -> torch.Tensor:
        batch, width = key
        max_len = width * kv_pages[0].block_size
        meta = AttentionMetadata(
            is_prefill=False,
            slot_mapping=self.slot_mapping[:batch],
            block_tables=self.block_tables[: batch * width].view(batch, width),
            context_lens=self.context_lens[:batch],
            cu_seqlens_q=torch.arange(batch + 1, dtype=torch.int32, device=self.device),
            max_context_len=max_len,
            context_lens_cpu=[max_len] * batch,
            query_lens_cpu=[1] * batch,
        )
        return self.forward(self.input_ids[:batch], self.positions[:batch], meta, kv_pages)


class PrefillGraphs(_StepGraphs):
    """One sequence's new tokens padded to a token bucket, for the last token's logits. The padding
    is a second, empty sequence, so the real rows come out as an eager step computes them.
    forward: (input_ids, positions, meta, kv_pages, last_row [1]) -> logits [1, vocab]."""

    kind = "prefill"
    max_logit_rows = 1

    def __init__(self, forward, max_tokens: int, max_blocks_per_seq: int, device: torch.device, **staging):
        max_width = table_buckets(max_blocks_per_seq)[-1]
        fields = {
            "last_row": (torch.long, 1, 0),
            "context_lens": (torch.int32, 2, 0),  # [the sequence, the padding]
            "cu_seqlens": (torch.int32, 3, 0),  # [0, new tokens, bucket]
            "block_tables": (torch.int32, 2 * max_width, 0),  # the sequence's and the padding's
        }
        super().__init__(forward, device, token_buckets(max_tokens), max_blocks_per_seq, fields, **staging)

    def _fill(self, input_ids, positions, slots, context_lens, tables, size: int, width: int) -> None:
        host = self._fill_rows(size, input_ids, positions, slots)
        num_new, table = len(input_ids), tables[0]
        host["last_row"][0] = num_new - 1
        host["context_lens"][:] = (context_lens[0], 0)
        host["cu_seqlens"][:] = (0, num_new, size)
        tables = host["block_tables"][: 2 * width]
        tables[: len(table)] = table
        tables[len(table) :] = 0  # the rest of the sequence's row, and the padding's row
        self.staged.upload("block_tables", 2 * width)

    def _logits_of(self, key: tuple[int, int], kv_pages: list[KVPages]) -> torch.Tensor:
        size, width = key
        max_len = width * kv_pages[0].block_size
        meta = AttentionMetadata(
            is_prefill=True,
            slot_mapping=self.slot_mapping[:size],
            block_tables=self.block_tables[: 2 * width].view(2, width),
            context_lens=self.context_lens,
            cu_seqlens_q=self.cu_seqlens,
            max_context_len=max_len,
            context_lens_cpu=[max_len, 0],
            query_lens_cpu=[size, 0],  # the grid covers a whole bucket of rows
        )
        return self.forward(self.input_ids[:size], self.positions[:size], meta, kv_pages, self.last_row)
