"""CUDA graphs of the decode step: one replay instead of hundreds of kernel launches.

A decode step of a 28-layer model launches a few hundred small kernels; on a small GPU
each costs more to launch from Python than to run. Captured once, the whole forward pass
(embedding to logits) replays as one graph, so the step costs the GPU time only.

A graph fixes every shape and address it was captured with. So:
- Inputs live in static buffers sized for the largest batch, views of one device buffer
  filled from a pinned host mirror by one copy per step (StagedInputs). Padding rows write
  no KV (slot -1) and attend to nothing (context length 0); their logits are dropped.
- One graph per (batch size, block-table width) bucket. The width fixes how many context
  partitions decode attention splits into, so it is bucketed by powers of four from 64
  pages: short contexts do not pay for the partitions of long ones.
- The KV pages' addresses are baked in: when the pool reallocates them (a precision
  change), every graph is dropped and recaptured on demand.
- Graphs are captured lazily and share one memory pool, so their activations take the
  space of one step; all write their logits into one static buffer, and a replay hands
  out a view of it, which the caller reads before the next replay.
- Warm-up runs and captures go on one stream per device for the whole process: torch
  keeps a cuBLAS workspace (~32 MiB) for every stream that ran a matmul, for good
  (memory.workspace.profile_workspace counts what stays).
- An embedding table in host memory is read by the GPU through unified addressing
  (HostEmbedding.device_view) inside the graph; where the driver cannot map it, each
  replay copies rows the step staged on the host first (HostEmbedding.stage).
Prefill graphs (profile `enable_prefill_graphs`) do the same for one sequence's new tokens
up to 512, padded to a bucket of 64, 128, 256 or 512 (PrefillGraphs). Anything a graph
cannot hold runs eagerly, and so does a bucket whose capture failed (with a warning).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import torch

from lowvram.kernels.kv_quant import KVPages
from lowvram.kv.attention import AttentionMetadata

log = logging.getLogger("lowvram.engine.cuda_graphs")

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
    return tuple(
        value.data_ptr() for pages in kv_pages for value in vars(pages).values() if isinstance(value, torch.Tensor)
    )


class StagedInputs:
    """A graph's static inputs as views of one device buffer, filled from a pinned host mirror
    by one copy per step (one copy per input cost a noticeable share of a batch-1 step).

    The copy is asynchronous, so `host` waits for the previous copy to have read the mirror
    before handing it out to be written again; the copy is queued on the current stream,
    between the replays that read the inputs, so the device side needs no event.

    Args:
        fields: name -> (dtype, number of elements, initial value), laid out in this order at
            8-byte boundaries. Put the largest, partly used input last: `upload` copies the
            front of the buffer up to what a step uses of it.
        device: where the inputs live; on the CPU (tests) the mirror is ordinary memory.
    """

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
        """The mirror's views, to write this step's inputs into (after the last copy read them)."""
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
    """What decode and prefill graphs share: one graph per (row bucket, table width) key,
    captured lazily on the process's capture stream into one memory pool, dropped when the
    KV pages move, a failed capture remembered (that key runs eagerly), the per-row static
    inputs (token ids, positions, KV slots) sized for the largest row bucket and staged with
    the kind's other inputs (`input_fields`) in one StagedInputs, and the logits of every
    graph written into one static buffer of `max_logit_rows` rows."""

    kind = "step"

    def __init__(
        self,
        device: torch.device,
        row_sizes: list[int],
        max_blocks_per_seq: int,
        max_logit_rows: int,
        stage_embeddings: Callable[[list[int], int], None] | None,
        stage_capacity: int | None,
        input_fields: dict[str, tuple[torch.dtype, int, int]],
    ):
        self.device = device
        self.row_sizes = row_sizes
        self.table_widths = table_buckets(max_blocks_per_seq)
        max_rows = row_sizes[-1]
        self.max_logit_rows = max_logit_rows
        # An embedding table in host memory (HostEmbedding.stage): rows gathered before each replay.
        self.stage_embeddings = stage_embeddings
        self.stage_capacity = stage_capacity or max_rows
        self._replayed = torch.cuda.Event() if stage_embeddings is not None else None
        self.staged = StagedInputs(
            {
                "input_ids": (torch.long, max_rows, 0),
                "positions": (torch.long, max_rows, 0),
                "slot_mapping": (torch.long, max_rows, -1),
                **input_fields,
            },
            device,
        )
        self.inputs = self.staged.inputs
        self.input_ids, self.positions = self.inputs["input_ids"], self.inputs["positions"]
        self.slot_mapping = self.inputs["slot_mapping"]
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

    def _fill_rows(
        self, host: dict[str, np.ndarray], size: int, input_ids: list[int], positions: list[int], slots: list[int]
    ) -> None:
        """The per-row inputs of a `size`-row bucket into the host mirror, padded (padding rows store no KV)."""
        num_rows = len(input_ids)
        host["input_ids"][:num_rows] = input_ids
        host["input_ids"][num_rows:size] = 0
        host["positions"][:num_rows] = positions
        host["positions"][num_rows:size] = 0
        host["slot_mapping"][:num_rows] = slots
        host["slot_mapping"][num_rows:size] = -1
        if self.stage_embeddings is not None:
            # The last replay's copy of the staged rows is done (the engine also reads every
            # step's tokens on the host before the next step, so graphs of the other kind are too).
            self._replayed.synchronize()
            self.stage_embeddings(input_ids + [0] * (size - num_rows), self.stage_capacity)

    def _replay(
        self, key: tuple[int, int], kv_pages: list[KVPages], pages_version: int | None, num_rows: int
    ) -> torch.Tensor | None:
        """Replay (capturing first if needed) the graph for `key`, whose inputs are filled;
        logits [num_rows, vocab], or None when the capture failed. The logits are a view of
        the static buffer every graph writes: valid until the next replay of any bucket.

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
        # No copy: the caller samples from these before the next replay overwrites them.
        return self.logits[:num_rows]

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

    def __init__(
        self,
        forward: Callable[..., torch.Tensor],
        max_num_seqs: int,
        max_blocks_per_seq: int,
        device: torch.device,
        stage_embeddings: Callable[[list[int], int], None] | None = None,
        stage_capacity: int | None = None,
    ):
        batch_sizes = batch_buckets(max_num_seqs)
        max_batch, max_width = batch_sizes[-1], table_buckets(max_blocks_per_seq)[-1]
        fields = {
            "context_lens": (torch.int32, max_batch, 0),
            # [max_batch * max_width]: a bucket's tables are packed rows of its own width,
            # so a step copies batch x width entries, not whole rows of the widest bucket. Last, as
            # StagedInputs.upload copies the front of the buffer up to what the step uses.
            "block_tables": (torch.int32, max_batch * max_width, 0),
        }
        super().__init__(device, batch_sizes, max_blocks_per_seq, max_batch, stage_embeddings, stage_capacity, fields)
        self.forward = forward
        self.context_lens, self.block_tables = self.inputs["context_lens"], self.inputs["block_tables"]

    def run(
        self,
        key: tuple[int, int],
        input_ids: list[int],
        positions: list[int],
        slots: list[int],
        tables: list[list[int]],
        context_lens: list[int],
        kv_pages: list[KVPages],
        pages_version: int | None = None,
        device_input_ids: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """Logits [S, vocab] of the decode step, by replaying the graph for `key`; None when the
        graph could not be captured (the caller runs the step eagerly). `device_input_ids`
        [S]: the step's token ids on the device, copied over `input_ids` (placeholders) in
        stream order after the upload, so the host never reads them (not with staged embeddings)."""
        batch, width = key
        if device_input_ids is not None and self.stage_embeddings is not None:
            raise ValueError("staged embedding rows need the input ids on the host")
        self._fill(input_ids, positions, slots, tables, context_lens, batch, width)
        if device_input_ids is not None:
            self.input_ids[: len(input_ids)].copy_(device_input_ids)
        return self._replay(key, kv_pages, pages_version, len(input_ids))

    def _fill(self, input_ids, positions, slots, tables, context_lens, batch: int, width: int) -> None:
        host = self.staged.host()
        self._fill_rows(host, batch, input_ids, positions, slots)
        num_seqs = len(input_ids)
        host["context_lens"][:num_seqs] = context_lens
        host["context_lens"][num_seqs:batch] = 0
        rows = host["block_tables"][: batch * width].reshape(batch, width)  # [B, width]
        for row, table in zip(rows, tables):
            row[: len(table)] = table
            row[len(table) :] = 0
        rows[num_seqs:] = 0
        self.staged.upload("block_tables", batch * width)

    def _logits_of(self, key: tuple[int, int], kv_pages: list[KVPages]) -> torch.Tensor:
        batch, width = key
        block_size = kv_pages[0].block_size
        meta = AttentionMetadata(
            is_prefill=False,
            slot_mapping=self.slot_mapping[:batch],
            block_tables=self.block_tables[: batch * width].view(batch, width),  # [B, width], packed rows
            context_lens=self.context_lens[:batch],
            cu_seqlens_q=torch.arange(batch + 1, dtype=torch.int32, device=self.device),
            max_context_len=width * block_size,
            context_lens_cpu=[width * block_size] * batch,
            query_lens_cpu=[1] * batch,
        )
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

    def __init__(
        self,
        forward: Callable[..., torch.Tensor],
        max_tokens: int,
        max_blocks_per_seq: int,
        device: torch.device,
        stage_embeddings: Callable[[list[int], int], None] | None = None,
        stage_capacity: int | None = None,
    ):
        max_width = table_buckets(max_blocks_per_seq)[-1]
        fields = {
            "last_row": (torch.long, 1, 0),
            "context_lens": (torch.int32, 2, 0),  # [the sequence, the padding]
            "cu_seqlens": (torch.int32, 3, 0),  # [0, new tokens, bucket]
            # [2 * max_width]: the sequence's and the padding's (empty) tables, packed at the bucket's width.
            "block_tables": (torch.int32, 2 * max_width, 0),
        }
        super().__init__(
            device, token_buckets(max_tokens), max_blocks_per_seq, 1, stage_embeddings, stage_capacity, fields
        )
        self.forward = forward
        self.last_row, self.context_lens = self.inputs["last_row"], self.inputs["context_lens"]
        self.cu_seqlens, self.block_tables = self.inputs["cu_seqlens"], self.inputs["block_tables"]

    def run(
        self,
        key: tuple[int, int],
        input_ids: list[int],
        positions: list[int],
        slots: list[int],
        table: list[int],
        context_len: int,
        kv_pages: list[KVPages],
        pages_version: int | None = None,
    ) -> torch.Tensor | None:
        """Logits [1, vocab] at the last of `input_ids` (one sequence's new tokens, ending at
        `context_len`), by replaying the graph for `key`; None when it could not be captured."""
        self._fill(input_ids, positions, slots, table, context_len, *key)
        return self._replay(key, kv_pages, pages_version, 1)

    def _fill(self, input_ids, positions, slots, table, context_len: int, size: int, width: int) -> None:
        host = self.staged.host()
        self._fill_rows(host, size, input_ids, positions, slots)
        num_new = len(input_ids)
        host["last_row"][0] = num_new - 1
        host["context_lens"][:] = (context_len, 0)
        host["cu_seqlens"][:] = (0, num_new, size)
        tables = host["block_tables"][: 2 * width]
        tables[: len(table)] = table
        tables[len(table) :] = 0  # the rest of the sequence's row, and the padding's row
        self.staged.upload("block_tables", 2 * width)

    def _logits_of(self, key: tuple[int, int], kv_pages: list[KVPages]) -> torch.Tensor:
        size, width = key
        block_size = kv_pages[0].block_size
        meta = AttentionMetadata(
            is_prefill=True,
            slot_mapping=self.slot_mapping[:size],
            block_tables=self.block_tables[: 2 * width].view(2, width),  # [2, width]: the sequence, the padding (empty)
            context_lens=self.context_lens,
            cu_seqlens_q=self.cu_seqlens,
            max_context_len=width * block_size,
            context_lens_cpu=[width * block_size, 0],
            query_lens_cpu=[size, 0],  # the grid covers a whole bucket of rows
        )
        return self.forward(self.input_ids[:size], self.positions[:size], meta, kv_pages, self.last_row)
