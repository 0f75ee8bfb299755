"""The KV pool: every layer's pages, where they live, and how they move.

One interface (`KVPool`), three backends (`create_kv_pool` picks one from the profile):

- `device` (`DeviceKVPool`, here): pages on the device only, no spill. On the CPU
  device these are host pages, and every backend asked for becomes this one.
- `um` (`ManagedKVPool`) and `pinned` (`PinnedKVPool`): pages that live on the device
  or the host and move between them (spill and prefetch). They share residency
  bookkeeping and live in `lowvram.kv.tiers`; importing them from here works too.

`set_precision` re-quantizes every page with data into new storage, layer by layer
(peak: the old pool plus one new layer), frees the old storage, and returns the
device bytes freed. Block ids do not change, so running sequences continue. Every
reallocation of `pages` bumps `pages_version`: anything that keeps the pages'
addresses (CUDA graphs) must re-read them when it changes.

The recent FP16 window. When `set_precision` compresses (to INT8/INT4) it may keep
some pages in FP16 as well: the engine passes the pages holding the last
`kv_recent_fp16_tokens` tokens of each running sequence. Those pages get a row in
small FP16 arrays beside the codes (`KVPages.window_k/window_v`, tagged per page by
`window_row`; see `lowvram.kernels.kv_quant`); the write kernel stores their tokens in both
forms and the attention kernels read the FP16 one. The codes stay valid, so nothing
that ignores the window reads garbage. The window is chosen when the precision
changes, not slid every step: tokens written later into a kept page stay FP16 (that
page is usually the one a sequence is filling), pages allocated later get the pool's
precision, and pages keep their FP16 copy when freed and reused, until the next
precision change. Its bytes are counted in `device_bytes`, so a compression that
keeps a window reports fewer bytes freed; when the window would push the pool past
the device bytes it started with, its oldest pages are dropped.

The profiles keep 64 tokens. The newest tokens are the ones attention leans on most in
the next steps (KIVI keeps a full-precision residual of recent tokens for the same
reason), and 64 tokens cost little: for the 1.5B shape at most 5 pages, 2.2 MiB per
sequence (18 MiB for 8 sequences), against about 54 MiB that one 4K-token sequence
frees going to INT8.

The pool counts its own device bytes (`device_bytes`): managed memory is invisible
to torch's allocator statistics.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from lowvram.errors import ConfigError, OutOfMemoryError
from lowvram.kernels.kv_quant import PRECISIONS, KVPages, allocate_pages, copy_page, gather_kv, store_kv
from lowvram.kv.managed_memory import INSTALL_HINT, check_managed_size

log = logging.getLogger("lowvram")
GIB = 2**30
BACKENDS = ("um", "pinned", "device")
# Re-quantization works through float32 copies of this many bytes at a time.
CONVERT_CHUNK_BYTES = 32 * 2**20
_logged: set[str] = set()


def _log_once(message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        log.info(message)


# ---------------------------------------------------------------- shapes and sizes


def _tensors(pages: KVPages) -> list[tuple[str, torch.Tensor]]:
    names = ("k", "v", "k_scale", "k_zero", "v_scale", "v_zero")
    return [(name, getattr(pages, name)) for name in names if getattr(pages, name) is not None]


def _pages_like(template: KVPages, make: Callable[[str, torch.Tensor], torch.Tensor]) -> KVPages:
    """KVPages with the template's layout, each tensor made by `make(name, template tensor)`."""
    made = {name: make(name, tensor) for name, tensor in _tensors(template)}
    return KVPages(precision=template.precision, **made)


@dataclass(frozen=True)
class KVShape:
    """What one page of every layer looks like; `dtype` is the element type of fp16 pages."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float16

    def template(self, precision: str, num_blocks: int = 1) -> KVPages:
        """One layer's pages on the meta device: the layout without memory."""
        return allocate_pages(
            num_blocks, self.block_size, self.num_kv_heads, self.head_dim, precision, self.dtype, "meta"
        )

    def layer_block_bytes(self, precision: str) -> int:
        """One page of one layer: K and V codes plus scales and zeros."""
        # The engine asks several times a step and a template costs tens of microseconds; the
        # answers live on the instance, as a cache keyed by the shape would hash it at every call.
        known = self._layer_block_bytes
        if precision not in known:
            known[precision] = sum(t[0].numel() * t.element_size() for _, t in _tensors(self.template(precision)))
        return known[precision]

    @functools.cached_property
    def _layer_block_bytes(self) -> dict[str, int]:
        return {}

    def code_block_bytes(self, precision: str) -> int:
        """One page of one layer's K codes (V is the same size)."""
        k = self.template(precision).k
        return k[0].numel() * k.element_size()

    def block_bytes(self, precision: str) -> int:
        """One page of every layer."""
        return self.num_layers * self.layer_block_bytes(precision)


def _check_precision(precision: str) -> None:
    if precision not in PRECISIONS:
        raise ConfigError(f"KV precision {precision!r} is not allowed; use one of: {', '.join(PRECISIONS)}")


def _convert_pages(old: KVPages, new: KVPages, src_rows: Sequence[int], dst_rows: Sequence[int]) -> None:
    """Copy pages `src_rows` of `old` into pages `dst_rows` of `new`, re-quantizing to
    `new.precision` (each side's FP16 window is read and written as its pages say).
    Works through bounded float32 chunks."""
    if not src_rows:
        return
    block_size = old.block_size
    per_block = 2 * block_size * old.num_kv_heads * old.head_dim * 4  # float32 K and V
    chunk = max(1, CONVERT_CHUNK_BYTES // per_block)
    src_offsets = torch.arange(block_size, device=old.device)
    dst_offsets = torch.arange(block_size, device=new.device)
    for i in range(0, len(src_rows), chunk):
        src = torch.tensor(src_rows[i : i + chunk], dtype=torch.long, device=old.device)
        dst = torch.tensor(dst_rows[i : i + chunk], dtype=torch.long, device=new.device)
        k, v = gather_kv(old, (src[:, None] * block_size + src_offsets).flatten())  # [n * B, Hkv, D] float32
        k, v = k.to(new.device), v.to(new.device)
        slots = (dst[:, None] * block_size + dst_offsets).flatten()
        if new.device.type == "cuda":
            from lowvram.kernels.kv_write import write_kv

            write_kv(k, v, slots, new)
        else:
            store_kv(new, slots, k, v)


def _release_cached(device: torch.device) -> None:
    """Hand memory torch's allocator keeps cached back to the driver, so a freed pool is really free."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


def recent_window_blocks(seqs: Iterable[tuple[Sequence[int], int]], num_tokens: int, block_size: int) -> list[int]:
    """The pages holding the last `num_tokens` cached tokens of each sequence, given as
    (block table, cached tokens) pairs: whole pages, so up to `num_tokens + block_size - 1`
    tokens each. Ordered newest first across sequences (every sequence's last page, then
    every one's second to last, ...), so a pool that cannot keep them all keeps the newest."""
    if num_tokens <= 0:
        return []
    newest_first = []
    for table, num_cached in seqs:
        if num_cached > 0:
            first, last = max(0, num_cached - num_tokens) // block_size, (num_cached - 1) // block_size
            newest_first.append(list(table[first : last + 1])[::-1])
    order = [
        pages[i] for i in range(max(map(len, newest_first), default=0)) for pages in newest_first if i < len(pages)
    ]
    return list(dict.fromkeys(order))  # a shared prefix page once


# ---------------------------------------------------------------- choosing a backend


@dataclass(frozen=True)
class PoolPlan:
    """What `create_kv_pool` builds: the backend and its sizes, in pages."""

    backend: str
    num_blocks: int  # pages the block manager hands out
    num_device_blocks: int  # most pages resident on the device at once
    num_host_blocks: int  # pages beyond the device share (um) / pinned host slots (pinned)
    block_bytes: int  # one page of every layer
    reason: str

    @property
    def managed_bytes(self) -> int:
        return self.num_blocks * self.block_bytes if self.backend == "um" else 0


def plan_pool(
    *,
    backend: str,
    device_type: str,
    num_device_blocks: int,
    max_num_blocks: int,
    block_bytes: int,
    host_spill_bytes: int,
    allow_oversubscription: bool,
    has_runtime: bool,
    is_concurrent: bool | None,
    free_bytes: int | None,
) -> PoolPlan:
    """Pick the backend and size it. Pure: every probe of the machine is an argument.

    `num_device_blocks` is the device share the memory plan left for KV; the host
    share (`host_spill_bytes`) adds pages up to `max_num_blocks` (every sequence at
    full length). `auto` takes `um` where concurrent managed access works and the
    managed pool fits the free device memory (or oversubscription is allowed), else
    `pinned`. An explicit `um` that cannot work is an error with the numbers.
    """
    if backend not in BACKENDS + ("auto",):
        raise ConfigError(f"kv_backend = {backend!r} is not allowed; use one of: {', '.join(BACKENDS + ('auto',))}")
    device_blocks = num_device_blocks
    if device_type != "cuda":
        note = "" if backend in ("auto", "device") else f" (kv_backend {backend!r} needs CUDA)"
        return PoolPlan(
            "device", device_blocks, device_blocks, 0, block_bytes, f"CPU: KV pages live in host memory{note}"
        )
    if backend == "device":
        return PoolPlan(
            "device",
            device_blocks,
            device_blocks,
            0,
            block_bytes,
            "kv_backend 'device': pages stay on the GPU, no spill",
        )
    host_blocks = int(host_spill_bytes // block_bytes)
    num_blocks = max(device_blocks, min(device_blocks + host_blocks, max_num_blocks))
    managed_bytes = num_blocks * block_bytes
    budget_bytes = device_blocks * block_bytes + int(host_spill_bytes)
    fits_free = free_bytes is None or managed_bytes <= free_bytes or allow_oversubscription
    if backend == "auto":
        if not has_runtime:
            backend, reason = "pinned", "cuda-bindings is not installed or not usable"
        elif not is_concurrent:
            backend, reason = (
                "pinned",
                "this GPU cannot share managed memory with the host while kernels run "
                "(concurrentManagedAccess = 0, as on Windows and WSL2)",
            )
        elif not fits_free:
            backend, reason = (
                "pinned",
                (
                    f"a {managed_bytes / GIB:.2f} GiB managed pool would exceed the "
                    f"{free_bytes / GIB:.2f} GiB free on the GPU"
                ),
            )
        else:
            backend, reason = "um", "concurrent managed access works"
        reason = f"kv_backend auto -> {backend}: {reason}"
    else:
        reason = f"kv_backend {backend!r}"
    if backend == "um":
        if not has_runtime:
            raise ConfigError(INSTALL_HINT)
        if not is_concurrent:
            raise ConfigError(
                "kv_backend 'um' needs concurrent managed access, which this GPU/OS does not offer "
                "(concurrentManagedAccess = 0, as on Windows and WSL2); use kv_backend 'pinned' or 'auto'"
            )
        check_managed_size(
            managed_bytes,
            free_bytes if free_bytes is not None else managed_bytes,
            budget_bytes,
            allow_oversubscription=allow_oversubscription,
        )
        return PoolPlan("um", num_blocks, device_blocks, num_blocks - device_blocks, block_bytes, reason)
    return PoolPlan("pinned", num_blocks, device_blocks, min(host_blocks, num_blocks), block_bytes, reason)


# ---------------------------------------------------------------- the interface and the device backend


@dataclass
class KVPoolStats:
    """Where the pool's pages are and what moving them cost, for gauges and benchmarks."""

    backend: str
    precision: str
    num_blocks: int
    max_device_blocks: int
    num_blocks_on_host: int
    device_bytes: int
    host_bytes: int
    num_page_hits: int = 0  # a step needed a page and it was resident
    num_page_misses: int = 0  # ... and it had to come back (or was read where it was)
    spilled_bytes: int = 0  # moved device -> host so far
    fetched_bytes: int = 0  # moved host -> device so far
    num_window_blocks: int = 0  # pages kept in FP16 beside INT8/INT4 ones


class KVPool:
    """Pages of every layer (`pages`, one KVPages per layer, what the kernels read).

    The base class is the `device` backend's interface with no movement: every page
    is always resident and the spill calls do nothing.
    """

    backend = "device"
    is_translated = False  # block ids must go through device_table (pinned)
    can_spill = False
    can_read_host = False  # kernels may read a page that lives on the host (um)

    def __init__(self, shape: KVShape, num_blocks: int, precision: str, device: torch.device | str):
        _check_precision(precision)
        if num_blocks < 1:
            raise ConfigError(f"a KV pool needs at least one page, got {num_blocks}")
        self.shape = shape
        self.num_blocks = num_blocks
        self.precision = precision
        self.device = torch.device(device)
        self.pages: list[KVPages] = []
        self.pages_version = 0  # bumped whenever the `pages` tensors are reallocated
        self.window_block_ids: list[int] = []  # pages kept in FP16, in the order of their window rows

    # -- sizes -------------------------------------------------------------------
    @property
    def block_size(self) -> int:
        return self.shape.block_size

    @property
    def device_bytes(self) -> int:
        """Device memory the pool's pages occupy (host memory on the CPU device)."""
        return self.num_blocks * self.shape.block_bytes(self.precision) + self.window_bytes()

    def window_bytes(self, num_blocks: int | None = None) -> int:
        """Device bytes of the FP16 window: `num_blocks` pages (default: the pool's) in every layer."""
        num_blocks = len(self.window_block_ids) if num_blocks is None else num_blocks
        return num_blocks * self.shape.block_bytes("fp16")

    @property
    def host_bytes(self) -> int:
        """Host memory holding spilled pages."""
        return 0

    @property
    def max_blocks_per_step(self) -> int | None:
        """Most pages one step may read (None: any number)."""
        return None

    def num_blocks_on_host(self, block_ids: Iterable[int] | None = None) -> int:
        """Pages (of `block_ids`, default all) whose data lives on the host."""
        return 0

    def stats(self) -> KVPoolStats:
        return KVPoolStats(
            self.backend,
            self.precision,
            self.num_blocks,
            self.num_blocks,
            self.num_blocks_on_host(),
            self.device_bytes,
            self.host_bytes,
            num_window_blocks=len(self.window_block_ids),
        )

    # -- residency ---------------------------------------------------------------
    def device_table(self, table: list[int]) -> list[int]:
        """Block ids -> the page indices in `pages` the kernels read."""
        return table

    def record_step(self, tables: Mapping[int, Sequence[int]], live_seq_ids: Collection[int] | None = None) -> None:
        """The step about to run reads these tables (seq id -> block ids)."""

    def ensure_resident(self, block_ids: Iterable[int], free_block_ids: Collection[int] = ()) -> None:
        """Make the pages readable on the device before the compute stream's next kernels.
        `free_block_ids` are pages with no data (moving them copies nothing)."""

    def prefetch(
        self, block_ids: Iterable[int], protected: Iterable[int] = (), free_block_ids: Collection[int] = ()
    ) -> None:
        """Start bringing pages back on the side stream without waiting; never evicts `protected`."""

    def spill(self, block_ids: Iterable[int]) -> int:
        """Move these pages to the host now; returns the device bytes that frees."""
        return 0

    def set_max_device_blocks(self, num_blocks: int) -> int:
        """Keep at most `num_blocks` pages on the device from now on; returns the device bytes freed."""
        return 0

    def synchronize(self) -> None:
        """Finish every transfer in flight (tests, shutdown)."""

    # -- contents ----------------------------------------------------------------
    def copy_block(self, src: int, dst: int) -> None:
        """Copy one page onto another in every layer (copy-on-write of a shared page)."""
        src_row, dst_row = self.device_table([src, dst])
        for pages in self.pages:
            copy_page(pages, src_row, dst_row)

    def set_precision(
        self, precision: str, block_ids: Iterable[int] | None = None, fp16_block_ids: Sequence[int] = ()
    ) -> int:
        """Re-quantize the pages with data (`block_ids`, default all) to `precision`; returns
        device bytes freed (negative when the pool grows). Raises OutOfMemoryError, changing
        nothing, when the new precision would exceed the device bytes the pool started with.

        fp16_block_ids: pages to keep in FP16 as well when `precision` is INT8/INT4 (the
        recent window, newest first: see `recent_window_blocks`); as many as fit those bytes.
        The same precision again changes nothing, the window included.
        """
        raise NotImplementedError

    def _check_device_budget(self, precision: str, needed_bytes: int) -> None:
        if needed_bytes > self.max_device_bytes:
            raise OutOfMemoryError(
                f"KV pages in {precision} would take {needed_bytes / GIB:.2f} GiB of device memory but the pool "
                f"may use {self.max_device_bytes / GIB:.2f} GiB (its size at start); keep a lower KV precision"
            )

    # -- the FP16 window -------------------------------------------------------------
    def _choose_window(self, precision: str, fp16_block_ids: Sequence[int], other_bytes: int) -> list[int]:
        """The pages to keep in FP16 at `precision`: none at fp16, else the first of `fp16_block_ids`
        that fit the device bytes the pool started with beside `other_bytes`."""
        if precision == "fp16":
            return []
        wanted = list(dict.fromkeys(fp16_block_ids))
        room = max(0, self.max_device_bytes - other_bytes)
        window = wanted[: room // self.shape.block_bytes("fp16")]
        if len(window) < len(wanted):
            log.info(
                "KV pages kept in FP16: %d of the %d asked for fit the pool's device bytes", len(window), len(wanted)
            )
        return window

    def _window_rows(self, window: list[int], row_of: Callable[[int], int], num_rows: int) -> torch.Tensor | None:
        """`KVPages.window_row` for `num_rows` page rows: window index at `row_of(block)` of each
        window block (rows < 0 are skipped); None without a window."""
        if not window:
            return None
        table = [-1] * num_rows
        for index, block in enumerate(window):
            row = row_of(block)
            if row >= 0:
                table[row] = index
        return torch.tensor(table, dtype=torch.int32).to(self.device)

    def _with_window(self, pages: KVPages, window_row: torch.Tensor | None, num_window: int) -> KVPages:
        """`pages` with zeroed FP16 window arrays of `num_window` pages, tagged by `window_row`."""
        if window_row is None:
            return pages
        s = self.shape
        window = allocate_pages(num_window, s.block_size, s.num_kv_heads, s.head_dim, "fp16", s.dtype, self.device)
        pages.window_k, pages.window_v, pages.window_row = window.k, window.v, window_row
        return pages


class DeviceKVPool(KVPool):
    """Every page on the device (host memory on the CPU), no spill."""

    def __init__(self, shape: KVShape, num_blocks: int, precision: str, device: torch.device | str):
        super().__init__(shape, num_blocks, precision, device)
        self.pages = [self._allocate(precision) for _ in range(shape.num_layers)]
        self.max_device_bytes = self.device_bytes

    def _allocate(self, precision: str) -> KVPages:
        s = self.shape
        return allocate_pages(
            self.num_blocks, s.block_size, s.num_kv_heads, s.head_dim, precision, s.dtype, self.device
        )

    def set_precision(
        self, precision: str, block_ids: Iterable[int] | None = None, fp16_block_ids: Sequence[int] = ()
    ) -> int:
        _check_precision(precision)
        if precision == self.precision:
            return 0
        codes_bytes = self.num_blocks * self.shape.block_bytes(precision)
        window = self._choose_window(precision, fp16_block_ids, codes_bytes)
        self._check_device_budget(precision, codes_bytes + self.window_bytes(len(window)))
        before = self.device_bytes
        rows = sorted(set(range(self.num_blocks) if block_ids is None else block_ids))
        window_row = self._window_rows(window, lambda b: b, self.num_blocks)
        for layer in range(len(self.pages)):
            new = self._with_window(self._allocate(precision), window_row, len(window))
            _convert_pages(self.pages[layer], new, rows, rows)
            self.pages[layer] = new  # the old layer is freed here, before the next one is allocated
        self.precision = precision
        self.window_block_ids = window
        self.pages_version += 1
        _release_cached(self.device)
        return before - self.device_bytes


# ---------------------------------------------------------------- construction
