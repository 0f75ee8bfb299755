"""The tiered KV pools: pages that live on the device or in host memory and move between them.

- `um` (`ManagedKVPool`): K/V codes in CUDA Unified Memory, spilled by advising a range to the
  host and migrating it, brought back by advising the GPU and prefetching. The GPU maps every
  page, so a context longer than the device share keeps its oldest pages on the host and still
  reads them. Scales, zeros and the FP16 window stay on the device. Migration works on OS pages:
  pages move in units of as many KV pages as fill whole OS pages.
- `pinned` (`PinnedKVPool`): fixed device slots plus a pinned-host tier, asynchronous copies on a
  side stream, block ids translated to slots (`device_table`). For Windows and WSL2.

At most `max_device_blocks` pages are resident. `ensure_resident` brings a step's pages back on
the side stream and makes the compute stream wait on the GPU; `prefetch` does not wait. Victims
follow `SpillPolicy` (cold and LRU first, pages near a decode position last, never the step's).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Collection, Iterable, Mapping, Sequence

import torch

from lowvram.core.spill_policy import SpillPolicy
from lowvram.errors import ConfigError, KernelError, OutOfMemoryError
from lowvram.kernels.kv_quant import KVPages
from lowvram.kv.managed_memory import ManagedMemory, check_managed_size
from lowvram.kv.pool import GIB, KVPool, KVShape, _convert_pages, _release_cached, _tensors


def _all_tensors(layers: list[KVPages]) -> list[torch.Tensor]:
    return [t for pages in layers for _, t in _tensors(pages)]


def _runs(units: Iterable[int]) -> list[tuple[int, int]]:
    """Sorted ids merged into [start, end) runs."""
    runs: list[tuple[int, int]] = []
    for u in sorted(units):
        if runs and runs[-1][1] == u:
            runs[-1] = (runs[-1][0], u + 1)
        else:
            runs.append((u, u + 1))
    return runs


class _TieredKVPool(KVPool):
    """Residency of units of `unit_size` pages. Subclasses move data in `_swap(victims, incoming,
    dataless)` (side stream; dataless victims need no copy) and size a unit in `_unit_bytes()`."""

    can_spill = True

    def __init__(self, shape: KVShape, num_blocks: int, precision: str, device, *, max_device_blocks: int):
        super().__init__(shape, num_blocks, precision, device)
        if max_device_blocks < 1:
            raise ConfigError(f"max_device_blocks must be at least 1, got {max_device_blocks}")
        self.max_device_blocks = min(max_device_blocks, num_blocks)  # the device share, in pages
        self.max_device_blocks_budget = self.max_device_blocks
        self.policy = SpillPolicy()
        self.num_page_hits = self.num_page_misses = self.spilled_bytes = self.fetched_bytes = 0
        self._side = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._has_transfers = False
        self._set_units(1)

    def _set_units(self, unit_size: int) -> None:
        self.unit_size = unit_size
        self.num_units = -(-self.num_blocks // unit_size)
        self.max_device_units = max(1, self.max_device_blocks // unit_size)
        self._host_units = set(range(self.num_units))  # per-step questions become set operations

    @property
    def _num_resident(self) -> int:
        return self.num_units - len(self._host_units)

    def _host_room(self, incoming: list[int]) -> int:
        """How many more units may move to the host if `incoming` come back."""
        return self.num_units

    def _reclaim_host(self, dataless: set[int]) -> None:
        """Forget host copies of units that no longer hold data."""

    def _resize_device(self) -> None:
        """Match device storage to `max_device_units` (managed memory needs nothing)."""

    @property
    def max_blocks_per_step(self) -> int | None:
        return None if self.can_read_host else self.max_device_units * self.unit_size

    def num_blocks_on_host(self, block_ids: Iterable[int] | None = None) -> int:
        g = self.unit_size
        if block_ids is None:
            return sum(min(g, self.num_blocks - u * g) for u in self._host_units)
        if g == 1 and isinstance(block_ids, (set, frozenset)):  # the live pages, every step
            return len(self._host_units.intersection(block_ids))
        return sum(1 for b in block_ids if b // g in self._host_units)

    def is_resident(self, block_id: int) -> bool:
        return block_id // self.unit_size not in self._host_units

    def _units_of(self, block_ids: Iterable[int]) -> list[int]:
        g = self.unit_size
        return list(dict.fromkeys(block_ids if g == 1 else (b // g for b in block_ids)))

    def record_step(self, tables: Mapping[int, Sequence[int]], live_seq_ids: Collection[int] | None = None) -> None:
        if self.unit_size > 1:
            tables = {seq_id: self._units_of(table) for seq_id, table in tables.items()}
        self.policy.record_step(tables, live_seq_ids)

    def ensure_resident(self, block_ids: Iterable[int], free_block_ids: Collection[int] = ()) -> None:
        self.prefetch(block_ids, (), free_block_ids, is_required=True)
        self._wait_for_transfers()

    def prefetch(
        self, block_ids, protected: Iterable[int] = (), free_block_ids: Collection[int] = (), is_required=False
    ):
        """As in KVPool; `is_required` (ensure_resident): count hits and misses, fail if the step cannot fit."""
        if self.unit_size == 1:
            block_ids = block_ids if isinstance(block_ids, (list, tuple, set, frozenset)) else list(block_ids)
            if self._host_units.isdisjoint(block_ids):  # every page resident: the usual step
                if is_required:
                    self.num_page_hits += len(set(block_ids))
                return
        units = self._units_of(block_ids)
        missing = [u for u in units if u in self._host_units]
        if is_required:
            self.num_page_hits += len(units) - len(missing)
            self.num_page_misses += len(missing)
        if not missing:
            return
        room = self.max_device_units - self._num_resident
        victims: list[int] = []
        dataless: set[int] = set()
        if len(missing) > room:
            keep = set(units).union(self._units_of(protected))
            free, g = set(free_block_ids), self.unit_size
            whole = (
                u for u in {b // g for b in free} if free.issuperset(range(u * g, min(u * g + g, self.num_blocks)))
            )
            dataless = free if g == 1 else set(whole)  # units whose every page is free
            self._reclaim_host(dataless)
            victims = self._choose_victims(len(missing) - room, keep, dataless, missing)
            short = len(missing) - room - len(victims)
            if short > 0 and is_required and self.can_read_host:
                # The step reads more than fits (um): the most valuable units come to the device, the
                # kernels read the rest on the host.
                ranked = self.policy.admission_order(units)
                keep = set(ranked[: self.max_device_units])
                skip = keep | set(victims) | self._host_units
                missing = [u for u in missing if u in keep]
                demote = [u for u in reversed(ranked) if u not in skip]
                victims += demote[: max(0, len(missing) - room - len(victims))]
                missing = missing[: room + len(victims)]
            elif short > 0 and is_required:
                raise OutOfMemoryError(
                    f"a step reads {len(units) * self.unit_size} KV pages but at most "
                    f"{self.max_device_units * self.unit_size} fit on the device and only {room + len(victims)} "
                    f"could be freed; lower max_model_len or max_num_seqs, or raise the device budget"
                )
            elif short > 0:
                missing = self.policy.admission_order(missing)[: room + len(victims)]
        if victims or missing:
            self._swap(victims, missing, dataless)

    def _choose_victims(self, count: int, keep: set[int], dataless: set[int], incoming: list[int]) -> list[int]:
        """Up to `count` resident units outside `keep`: pages without data first, then in policy order."""
        resident = [u for u in range(self.num_units) if u not in self._host_units and u not in keep]
        order = self.policy.eviction_order(resident)
        if dataless:
            order = [u for u in order if u in dataless] + [u for u in order if u not in dataless]
        host_room = self._host_room(incoming)
        victims = []
        for u in order:
            if len(victims) == count:
                break
            if u not in dataless:
                if host_room == 0:
                    continue
                host_room -= 1
            victims.append(u)
        return victims

    def _mark(self, units: Iterable[int], is_resident: bool) -> None:
        (self._host_units.difference_update if is_resident else self._host_units.update)(units)

    def _wait_for_transfers(self) -> None:
        """Make the compute stream wait (on the GPU) for every transfer enqueued so far."""
        if self._side is not None and self._has_transfers:
            torch.cuda.current_stream(self.device).wait_stream(self._side)
            self._has_transfers = False

    def _start_transfers(self) -> None:
        """Order the side stream after the compute stream's queued work, which may still use the pages."""
        if self._side is not None:
            self._side.wait_stream(torch.cuda.current_stream(self.device))
            self._has_transfers = True

    def spill(self, block_ids: Iterable[int]) -> int:
        units = [u for u in self._units_of(block_ids) if u not in self._host_units][: self._host_room([])]
        before = self.device_bytes
        if units:
            self._swap(units, [], set())
        return before - self.device_bytes

    def set_max_device_blocks(self, num_blocks: int) -> int:
        limit = max(self.unit_size, min(num_blocks, self.max_device_blocks_budget))
        new_units = max(1, limit // self.unit_size)
        before = self.device_bytes
        excess = self._num_resident - new_units
        if excess > 0:
            victims = self._choose_victims(excess, set(), set(), [])
            if len(victims) < excess:
                raise OutOfMemoryError(
                    f"cannot keep only {new_units * self.unit_size} KV pages on the device: the host tier has room "
                    f"for {len(victims) * self.unit_size} more; raise host_spill_gib"
                )
            self._swap(victims, [], set())
        self.max_device_units = new_units
        self.max_device_blocks = new_units * self.unit_size
        self._resize_device()
        return before - self.device_bytes

    def synchronize(self) -> None:
        if self._side is not None:
            self._side.synchronize()
        self._wait_for_transfers()


class ManagedKVPool(_TieredKVPool):
    """K/V codes in managed memory, one allocation per layer ([2, pages, B, Hkv, Dc]: K then V)."""

    backend = "um"
    can_read_host = True

    def __init__(self, *args, memory: ManagedMemory, budget_bytes: int, allow_oversubscription=False, **kwargs):
        super().__init__(*args, **kwargs)
        self.memory = memory
        self.budget_bytes = budget_bytes
        self.allow_oversubscription = allow_oversubscription
        precision = self.precision
        self._set_units(self._unit_size_for(precision))
        self._check_size(precision, memory.free_bytes())
        resident = [u < self.max_device_units for u in range(self.num_units)]
        layers = [self._allocate_layer(precision, resident) for _ in range(self.shape.num_layers)]
        self.pages, self._flats = [pages for pages, _ in layers], [flat for _, flat in layers]
        self._mark([u for u in range(self.num_units) if resident[u]], True)
        self.max_device_bytes = self.device_bytes

    def _unit_size_for(self, precision: str) -> int:
        page = self.memory.page_bytes
        return page // math.gcd(page, self.shape.code_block_bytes(precision))

    def _num_alloc_blocks(self, precision: str) -> int:
        g = self._unit_size_for(precision)
        return -(-self.num_blocks // g) * g  # padding pages are never handed out nor touched

    def _managed_bytes(self, precision: str) -> int:
        return self.shape.num_layers * 2 * self._num_alloc_blocks(precision) * self.shape.code_block_bytes(precision)

    def _check_size(self, precision: str, free_bytes: int) -> None:
        check_managed_size(self._managed_bytes(precision), free_bytes, self.budget_bytes, self.allow_oversubscription)

    def _place(self, flats: list[torch.Tensor], precision: str, units: Iterable[int], *, on_host: bool, migrate: bool):
        """Advise the K and V codes of `units` to the host or the GPU; `migrate` moves them there too."""
        code_bytes = self.shape.code_block_bytes(precision)
        unit_bytes = self._unit_size_for(precision) * code_bytes
        half_bytes = self._num_alloc_blocks(precision) * code_bytes
        for start, end in _runs(units):
            for flat in flats:
                for base in (0, half_bytes):
                    span = (flat, base + start * unit_bytes, (end - start) * unit_bytes)
                    if migrate:
                        self.memory.place(*span, on_host=on_host, stream=self._side)
                    else:
                        self.memory.advise_preferred(*span, on_host=on_host)

    def _allocate_layer(self, precision: str, resident: list[bool]) -> tuple[KVPages, torch.Tensor]:
        """One layer's pages: codes in a new managed allocation advised per unit, scales on the device."""
        num_alloc = self._num_alloc_blocks(precision)
        template = self.shape.template(precision, num_alloc)
        flat = self.memory.allocate(2 * num_alloc * self.shape.code_block_bytes(precision))
        codes = flat.view(template.k.dtype).view(2, *template.k.shape)  # [2, pages, B, Hkv, Dc]: K, V
        for on_host in (False, True):
            units = [u for u, r in enumerate(resident) if r != on_host]
            self._place([flat], precision, units, on_host=on_host, migrate=False)
        scales = {name: torch.zeros(t.shape, dtype=t.dtype, device=self.device) for name, t in _tensors(template)[2:]}
        return KVPages(precision=precision, k=codes[0], v=codes[1], **scales), flat

    def _unit_bytes(self) -> int:
        return self.shape.num_layers * 2 * self.unit_size * self.shape.code_block_bytes(self.precision)

    def _scale_bytes(self, precision: str) -> int:
        per_block = self.shape.layer_block_bytes(precision) - 2 * self.shape.code_block_bytes(precision)
        return self.shape.num_layers * self._num_alloc_blocks(precision) * per_block

    @property
    def device_bytes(self) -> int:
        """Scales, zeros and the FP16 window plus every resident unit's codes, touched by a kernel
        or not: an upper bound on what the pool holds."""
        return self._scale_bytes(self.precision) + self._num_resident * self._unit_bytes() + self.window_bytes()

    @property
    def host_bytes(self) -> int:
        return (self.num_units - self._num_resident) * self._unit_bytes()

    def _swap(self, victims: list[int], incoming: list[int], dataless: set[int]) -> None:
        # Managed pages carry their data wherever they are, so a page without data still
        # moves: that is what releases its device memory.
        self._start_transfers()
        self._place(self._flats, self.precision, victims, on_host=True, migrate=True)
        self._place(self._flats, self.precision, incoming, on_host=False, migrate=True)
        self._mark(victims, False)
        self._mark(incoming, True)
        self.spilled_bytes += len(victims) * self._unit_bytes()
        self.fetched_bytes += len(incoming) * self._unit_bytes()

    def _device_codes_bytes(self, precision: str) -> int:
        """Scales and zeros plus the codes of as many units as may be resident at `precision`."""
        unit = self._unit_size_for(precision)
        code_bytes = self.shape.num_layers * 2 * unit * self.shape.code_block_bytes(precision)
        return self._scale_bytes(precision) + max(1, self.max_device_blocks // unit) * code_bytes

    def _convert(self, precision: str, rows: list[int], window: list[int]) -> None:
        # The old allocation is freed layer by layer as the new one grows, so it counts as free.
        self._check_size(precision, self.memory.free_bytes() + self._managed_bytes(self.precision))
        old_unit, new_unit = self.unit_size, self._unit_size_for(precision)
        new_num_units = -(-self.num_blocks // new_unit)
        new_max_units = max(1, self.max_device_blocks // new_unit)
        # A new unit is resident when any of its pages was; the lowest ids win when that is too many.
        spans = (range(u * new_unit, min(u * new_unit + new_unit, self.num_blocks)) for u in range(new_num_units))
        resident = [any(b // old_unit not in self._host_units for b in span) for span in spans]
        kept = 0
        for u, is_resident in enumerate(resident):
            kept += is_resident
            resident[u] = is_resident and kept <= new_max_units
        window_row = self._window_rows(window, lambda b: b, self._num_alloc_blocks(precision))
        for layer in range(len(self.pages)):
            pages, flat = self._allocate_layer(precision, resident)
            pages = self._with_window(pages, window_row, len(window))
            _convert_pages(self.pages[layer], pages, rows)
            # Dropping the last views frees the old allocation (cudaFree synchronizes first).
            self.pages[layer], self._flats[layer] = pages, flat
        self._set_units(new_unit)
        self.max_device_units = new_max_units
        self._mark([u for u in range(new_num_units) if resident[u]], True)
        self.policy.clear()  # unit ids changed meaning


class PinnedKVPool(_TieredKVPool):
    """A fixed number of device slots and a host tier of pinned pages; blocks map to slots."""

    backend = "pinned"
    is_translated = True

    def __init__(self, *args, num_host_blocks: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.num_slots = self.max_device_blocks
        self.num_host_slots = num_host_blocks
        self.pages = [self._allocate(self.precision, self.num_slots) for _ in range(self.shape.num_layers)]
        self.host_pages = [self._allocate_host(self.precision) for _ in range(self.shape.num_layers)]
        self._slot_of = list(range(self.num_slots)) + [-1] * (self.num_blocks - self.num_slots)
        self._block_in_slot = list(range(self.num_slots))
        self._free_slots: list[int] = []
        self._host_slot_of = [-1] * self.num_blocks
        self._free_host_slots = list(range(num_host_blocks - 1, -1, -1))  # pop() hands out the lowest
        self._pending: list[tuple[object, torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]] = []
        self._window_index: dict[int, int] = {}  # block id -> its row in the FP16 window
        self._mark(range(self.num_slots), True)
        self.max_device_bytes = self.device_bytes

    def _allocate_host(self, precision: str) -> KVPages:
        template = self.shape.template(precision, max(1, self.num_host_slots))
        is_pinned = self.device.type == "cuda"
        try:
            zeros = {name: torch.zeros(t.shape, dtype=t.dtype, pin_memory=is_pinned) for name, t in _tensors(template)}
            return KVPages(precision=precision, **zeros)
        except RuntimeError as exc:
            need = self.num_host_slots * self.shape.block_bytes(precision)
            raise OutOfMemoryError(
                f"could not pin {need / GIB:.2f} GiB of host memory for spilled KV pages ({exc}); lower host_spill_gib"
            ) from None

    def _unit_bytes(self) -> int:
        return self.shape.block_bytes(self.precision)

    def _device_codes_bytes(self, precision: str) -> int:
        return self.num_slots * self.shape.block_bytes(precision)  # used or not: allocated up front

    @property
    def host_bytes(self) -> int:
        return self.num_host_slots * self.shape.block_bytes(self.precision)

    def num_blocks_on_host(self, block_ids: Iterable[int] | None = None) -> int:
        ids = range(self.num_blocks) if block_ids is None else block_ids
        return sum(1 for b in ids if self._host_slot_of[b] >= 0)

    def _host_room(self, incoming: list[int]) -> int:
        return len(self._free_host_slots) + sum(1 for b in incoming if self._host_slot_of[b] >= 0)

    def _free_host(self, blocks: Iterable[int]) -> None:
        for b in blocks:
            self._free_host_slots.append(self._host_slot_of[b])
            self._host_slot_of[b] = -1

    def _reclaim_host(self, dataless: set[int]) -> None:
        stale = [b for b in dataless if self._host_slot_of[b] >= 0]
        if stale:
            self._complete_spills()  # a pending copy must not land in a slot handed to another page
            self._free_host(stale)

    def device_table(self, table: list[int]) -> list[int]:
        slots = [self._slot_of[b] for b in table]
        if -1 in slots:
            raise KernelError("a KV page is read while it is not on the device; call ensure_resident first")
        return slots

    def copy_block(self, src: int, dst: int) -> None:
        self.ensure_resident([src, dst])
        super().copy_block(src, dst)

    def _swap(self, victims: list[int], incoming: list[int], dataless: set[int]) -> None:
        fetch = [b for b in incoming if self._host_slot_of[b] >= 0]
        if fetch and self._pending:
            self._complete_spills()
        staged = []  # the incoming pages' host rows, read out first: that frees their slots for the victims
        if fetch:
            index = torch.tensor([self._host_slot_of[b] for b in fetch], dtype=torch.long)
            for t in _all_tensors(self.host_pages):
                rows = torch.empty((len(fetch), *t.shape[1:]), dtype=t.dtype, pin_memory=self._side is not None)
                staged.append(torch.index_select(t, 0, index, out=rows))
        self._free_host(fetch)
        out = [b for b in victims if b not in dataless]
        host_slots = [self._free_host_slots.pop() for _ in out]
        if out:  # gathered and copied on the side stream now, scattered into the host tier by _complete_spills
            entries = []
            with self._on_side():
                index = self._device_index([self._slot_of[b] for b in out])
                for host_t, dev_t in zip(_all_tensors(self.host_pages), _all_tensors(self.pages)):
                    rows = dev_t.index_select(0, index)
                    if self._side is not None:
                        rows = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True).copy_(rows, non_blocking=True)
                    entries.append((host_t, rows))
                event = None if self._side is None else torch.cuda.Event()
                if event is not None:
                    event.record()
            self._pending.append((event, torch.tensor(host_slots, dtype=torch.long), entries))
        for b, h in zip(out, host_slots):
            self._host_slot_of[b] = h
        for b in victims:
            slot = self._slot_of[b]
            self._slot_of[b] = -1
            self._block_in_slot[slot] = -1
            self._free_slots.append(slot)
        for b in incoming:
            slot = self._free_slots.pop()
            self._slot_of[b] = slot
            self._block_in_slot[slot] = b
        if fetch:  # staged host rows -> device slots, on the side stream
            with self._on_side():
                index = self._device_index([self._slot_of[b] for b in fetch])
                for tensor, rows in zip(_all_tensors(self.pages), staged):
                    # The pinned source stays reserved by torch's host allocator until this copy ran.
                    tensor.index_copy_(0, index, rows.to(self.device, non_blocking=True))
        if any(b in self._window_index for b in victims + incoming):
            self._tag_window()
        self._mark(victims, False)
        self._mark(incoming, True)
        self.spilled_bytes += len(out) * self._unit_bytes()
        self.fetched_bytes += len(fetch) * self._unit_bytes()

    def _device_index(self, values: list[int]) -> torch.Tensor:
        index = torch.tensor(values, dtype=torch.long)
        # From pinned memory the copy is asynchronous; from pageable memory torch would
        # block the CPU until the side stream (and so all queued compute) had finished.
        return index.pin_memory().to(self.device, non_blocking=True) if self._side is not None else index

    def _on_side(self):
        """Where copies are enqueued: the side stream, after the compute stream's queued work."""
        if self._side is None:
            return contextlib.nullcontext()
        self._start_transfers()
        return torch.cuda.stream(self._side)

    def _tag_window(self) -> None:
        """Tag each slot with its page's FP16 window row, on the compute stream (queued steps keep theirs)."""
        tags = torch.tensor([self._window_index.get(b, -1) for b in self._block_in_slot], dtype=torch.int32)
        self.pages[0].window_row.copy_(tags.pin_memory() if self._side is not None else tags, non_blocking=True)

    def _complete_spills(self) -> None:
        for event, host_index, entries in self._pending:
            if event is not None:
                event.synchronize()
            for host_t, staged in entries:
                host_t.index_copy_(0, host_index, staged)
        self._pending.clear()

    def synchronize(self) -> None:
        super().synchronize()
        self._complete_spills()

    def _resize_device(self) -> None:
        """Reallocate fewer (or more) slots, resident pages first: that is what returns device memory."""
        if self.max_device_units == self.num_slots:
            return
        self.synchronize()
        resident = [b for b in self._block_in_slot if b >= 0]
        old_slots = torch.tensor([self._slot_of[b] for b in resident], dtype=torch.long, device=self.device)
        window_row = None
        if self.window_block_ids:  # tags are indexed by slot: a new size needs new tags
            window_row = torch.full((self.max_device_units,), -1, dtype=torch.int32, device=self.device)
        for layer in range(len(self.pages)):
            old = self.pages[layer]
            new = self._allocate(self.precision, self.max_device_units)
            for (_, new_t), (_, old_t) in zip(_tensors(new), _tensors(old)):
                new_t[: len(resident)] = old_t.index_select(0, old_slots)
            if window_row is not None:
                new.window_k, new.window_v, new.window_row = old.window_k, old.window_v, window_row
            self.pages[layer] = new
        self.num_slots = self.max_device_units
        for slot, b in enumerate(resident):
            self._slot_of[b] = slot
        self._block_in_slot = resident + [-1] * (self.num_slots - len(resident))
        self._free_slots = list(range(self.num_slots - 1, len(resident) - 1, -1))
        if window_row is not None:
            self._tag_window()
        self.pages_version += 1
        _release_cached(self.device)

    def _can_hold_window(self, block_id: int) -> bool:
        return self._slot_of[block_id] >= 0  # the window lives on the device: only pages in a slot join

    def _convert(self, precision: str, rows: list[int], window: list[int]) -> None:
        slot_rows = [self._slot_of[b] for b in rows if self._slot_of[b] >= 0]
        host_rows = [self._host_slot_of[b] for b in rows if self._host_slot_of[b] >= 0]
        window_row = self._window_rows(window, lambda b: self._slot_of[b], self.num_slots)
        for layer in range(len(self.pages)):
            new = self._with_window(self._allocate(precision, self.num_slots), window_row, len(window))
            _convert_pages(self.pages[layer], new, slot_rows)
            self.pages[layer] = new
            host = self._allocate_host(precision)
            _convert_pages(self.host_pages[layer], host, host_rows)
            self.host_pages[layer] = host
        self._window_index = {b: i for i, b in enumerate(window)}
