"""The KV pool: every layer's pages, where they live, and how they move. `KVPool` is the
interface and the `device` backend's base (`DeviceKVPool`, the only one on the CPU); `um` and
`pinned` move pages between device and host (`lowvram.kv.tiers`).

`set_precision` re-quantizes layer by layer; block ids stay, so running sequences continue.
Each reallocation of `pages` bumps `pages_version` (CUDA graphs re-read the addresses). It may
keep each running sequence's newest pages in FP16 too (the recent window, `KVPages.window_k/v`
tagged by `window_row`): attention leans on the newest tokens most (as KIVI's residual), and
64 tokens cost 2.2 MiB per sequence at 1.5B. The window is chosen when the precision changes
and counts in `device_bytes`; its oldest pages go first when it would not fit.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from lowvram.errors import ConfigError, OutOfMemoryError
from lowvram.kernels.kv_quant import PRECISIONS, KVPages, allocate_pages, copy_page, gather_kv, store_kv

log = logging.getLogger("lowvram")
GIB = 2**30
CONVERT_CHUNK_BYTES = 32 * 2**20  # re-quantization works through float32 chunks of this size


def _tensors(pages: KVPages) -> list[tuple[str, torch.Tensor]]:
    names = ("k", "v", "k_scale", "k_zero", "v_scale", "v_zero")
    return [(name, getattr(pages, name)) for name in names if getattr(pages, name) is not None]


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
        # Asked several times a step and a template costs tens of microseconds: cached on the
        # instance, as an lru_cache keyed by the shape would hash it at every call.
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


def _convert_pages(old: KVPages, new: KVPages, rows: Sequence[int]) -> None:
    """Copy pages `rows` of `old` into the same pages of `new`, re-quantizing to `new.precision`."""
    block_size = old.block_size
    per_block = 2 * block_size * old.num_kv_heads * old.head_dim * 4  # float32 K and V
    chunk = max(1, CONVERT_CHUNK_BYTES // per_block)
    offsets = torch.arange(block_size, device=old.device)
    for i in range(0, len(rows), chunk):
        pages = torch.tensor(rows[i : i + chunk], dtype=torch.long, device=old.device)
        slots = (pages[:, None] * block_size + offsets).flatten()  # [n * B]
        k, v = gather_kv(old, slots)  # [n * B, Hkv, D] float32
        k, v, slots = k.to(new.device), v.to(new.device), slots.to(new.device)
        if new.device.type == "cuda":
            from lowvram.kernels.kv_write import write_kv

            write_kv(k, v, slots, new)
        else:
            store_kv(new, slots, k, v)


def _release_cached(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()  # hand torch's cached blocks back, so a freed pool is really free


def recent_window_blocks(seqs: Iterable[tuple[Sequence[int], int]], num_tokens: int, block_size: int) -> list[int]:
    """The pages holding the last `num_tokens` cached tokens of each (block table, cached tokens)
    pair, whole pages, newest first across sequences (every last page, then every second to
    last, ...), so a pool that cannot keep them all keeps the newest."""
    if num_tokens <= 0:
        return []
    newest_first = [
        list(table[max(0, n - num_tokens) // block_size : (n - 1) // block_size + 1])[::-1]
        for table, n in seqs
        if n > 0
    ]
    order = [
        pages[i] for i in range(max(map(len, newest_first), default=0)) for pages in newest_first if i < len(pages)
    ]
    return list(dict.fromkeys(order))  # a shared prefix page once


class KVPool:
    """Pages of every layer (`pages`, one KVPages per layer, what the kernels read); in the base
    class every page is always resident and the spill calls do nothing."""

    backend = "device"
    is_translated = False  # block ids must go through device_table (pinned)
    can_spill = False
    can_read_host = False  # kernels may read a page that lives on the host (um)
    host_bytes = 0  # host memory holding spilled pages
    max_blocks_per_step: int | None = None  # most pages one step may read (None: any number)

    def __init__(self, shape: KVShape, num_blocks: int, precision: str, device: torch.device | str):
        _check_precision(precision)
        if num_blocks < 1:
            raise ConfigError(f"a KV pool needs at least one page, got {num_blocks}")
        self.shape = shape
        self.num_blocks = num_blocks
        self.precision = precision
        self.device = torch.device(device)
        self.pages: list[KVPages] = []
        self.pages_version = 0
        self.window_block_ids: list[int] = []  # pages kept in FP16, in the order of their window rows

    @property
    def block_size(self) -> int:
        return self.shape.block_size

    @property
    def device_bytes(self) -> int:
        """Device memory the pool's pages occupy (host memory on the CPU device)."""
        return self._device_codes_bytes(self.precision) + self.window_bytes()

    def window_bytes(self, num_blocks: int | None = None) -> int:
        """Bytes of an FP16 window of `num_blocks` pages (default: the pool's) in every layer."""
        return (len(self.window_block_ids) if num_blocks is None else num_blocks) * self.shape.block_bytes("fp16")

    def num_blocks_on_host(self, block_ids: Iterable[int] | None = None) -> int:
        """Pages (of `block_ids`, default all) whose data lives on the host."""
        return 0

    def device_table(self, table: list[int]) -> list[int]:
        """Block ids -> the page indices in `pages` the kernels read."""
        return table

    def record_step(self, tables: Mapping[int, Sequence[int]], live_seq_ids: Collection[int] | None = None) -> None:
        """The step about to run reads these tables (seq id -> block ids)."""

    def ensure_resident(self, block_ids: Iterable[int], free_block_ids: Collection[int] = ()) -> None:
        """Make the pages readable by the compute stream's next kernels (`free_block_ids`: no data to copy)."""

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
        """Finish every transfer in flight."""

    def copy_block(self, src: int, dst: int) -> None:
        """Copy one page onto another in every layer (copy-on-write of a shared page)."""
        src_row, dst_row = self.device_table([src, dst])
        for pages in self.pages:
            copy_page(pages, src_row, dst_row)

    def set_precision(
        self, precision: str, block_ids: Iterable[int] | None = None, fp16_block_ids: Sequence[int] = ()
    ) -> int:
        """Re-quantize the pages with data (`block_ids`, default all); returns device bytes freed.
        OutOfMemoryError, changing nothing, past the device bytes the pool started with.
        `fp16_block_ids`: the recent window (newest first, `recent_window_blocks`), as much as fits.
        The same precision again changes nothing."""
        _check_precision(precision)
        if precision == self.precision:
            return 0
        codes_bytes = self._device_codes_bytes(precision)
        window = [] if precision == "fp16" else [b for b in dict.fromkeys(fp16_block_ids) if self._can_hold_window(b)]
        num_fit = max(0, self.max_device_bytes - codes_bytes) // self.shape.block_bytes("fp16")
        if len(window) > num_fit:
            log.info("KV pages kept in FP16: %d of the %d asked for fit the pool's device bytes", num_fit, len(window))
            window = window[:num_fit]
        needed_bytes = codes_bytes + self.window_bytes(len(window))
        if needed_bytes > self.max_device_bytes:
            raise OutOfMemoryError(
                f"KV pages in {precision} would take {needed_bytes / GIB:.2f} GiB of device memory but the pool "
                f"may use {self.max_device_bytes / GIB:.2f} GiB (its size at start); keep a lower KV precision"
            )
        self.synchronize()
        before = self.device_bytes
        self._convert(precision, sorted(set(range(self.num_blocks) if block_ids is None else block_ids)), window)
        self.precision = precision
        self.window_block_ids = window
        self.pages_version += 1
        _release_cached(self.device)
        return before - self.device_bytes

    def _device_codes_bytes(self, precision: str) -> int:
        """Device bytes of the pages (the window aside) at `precision`."""
        return self.num_blocks * self.shape.block_bytes(precision)

    def _can_hold_window(self, block_id: int) -> bool:
        return True  # pinned: only pages in a device slot

    def _convert(self, precision: str, rows: list[int], window: list[int]) -> None:
        """New storage at `precision` holding pages `rows` and the FP16 `window`, layer by layer."""
        window_row = self._window_rows(window, lambda b: b, self.num_blocks)
        for layer in range(len(self.pages)):
            new = self._with_window(self._allocate(precision, self.num_blocks), window_row, len(window))
            _convert_pages(self.pages[layer], new, rows)
            self.pages[layer] = new

    def _allocate(self, precision: str, num_blocks: int) -> KVPages:
        s = self.shape
        return allocate_pages(num_blocks, s.block_size, s.num_kv_heads, s.head_dim, precision, s.dtype, self.device)

    def _window_rows(self, window: list[int], row_of: Callable[[int], int], num_rows: int) -> torch.Tensor | None:
        """`KVPages.window_row`: each window block's index at its row `row_of(block)` (if >= 0)."""
        if not window:
            return None
        table = [-1] * num_rows
        for index, block in enumerate(window):
            if row_of(block) >= 0:
                table[row_of(block)] = index
        return torch.tensor(table, dtype=torch.int32).to(self.device)

    def _with_window(self, pages: KVPages, window_row: torch.Tensor | None, num_window: int) -> KVPages:
        """`pages` with zeroed FP16 window arrays of `num_window` pages, tagged by `window_row`."""
        if window_row is not None:
            window = self._allocate("fp16", num_window)
            pages.window_k, pages.window_v, pages.window_row = window.k, window.v, window_row
        return pages


class DeviceKVPool(KVPool):
    """Every page on the device (host memory on the CPU), no spill."""

    def __init__(self, shape: KVShape, num_blocks: int, precision: str, device: torch.device | str):
        super().__init__(shape, num_blocks, precision, device)
        self.pages = [self._allocate(precision, num_blocks) for _ in range(shape.num_layers)]
        self.max_device_bytes = self.device_bytes
