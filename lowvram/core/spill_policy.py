"""Which KV pages stay on the device (no torch): evict never-read pages (by id), then cold ones
LRU-first, then each sequence's last `num_hot_blocks`; admit in the reverse order. Reads are
written down lazily, per run of a growing table, only when an order is asked for."""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass


@dataclass(slots=True)
class _Run:
    """A sequence's table as read at every step since it was last written down."""

    pages: list[int]
    is_pending: bool = True  # read since last written down


class SpillPolicy:
    """LRU with a hot window near each sequence's decode position."""

    def __init__(self, num_hot_blocks: int = 2):
        if num_hot_blocks < 0:
            raise ValueError(f"num_hot_blocks must be >= 0, got {num_hot_blocks}")
        self.num_hot_blocks = num_hot_blocks
        self._recency: OrderedDict[int, None] = OrderedDict()  # least recently read first (written-down reads)
        self._hot_by_seq: dict[int, tuple[int, ...]] = {}
        self._runs: dict[int, _Run] = {}  # seq id -> reads not yet written down, in the latest step's order

    def record_step(self, tables: Mapping[int, Sequence[int]], live_seq_ids: Collection[int] | None = None) -> None:
        """One step read these tables (seq id -> page ids); sequences not in `live_seq_ids` go cold."""
        runs: dict[int, _Run] = {}
        for seq_id, table in tables.items():
            run = self._runs.get(seq_id)
            n = len(run.pages) if run is not None else 0
            if run is not None and len(table) >= n and (table[:n] == run.pages or list(table[:n]) == run.pages):
                run.pages.extend(table[n:])  # the table extends the run
                run.is_pending = True
            else:
                run = _Run(list(table))
            runs[seq_id] = run
            self._hot_by_seq[seq_id] = tuple(table[-self.num_hot_blocks :]) if self.num_hot_blocks else ()
        # Runs that did not continue ended at the step before this one, in that step's order.
        for seq_id, run in self._runs.items():
            if runs.get(seq_id) is not run:
                self._write_down(run)
        self._runs = runs
        if live_seq_ids is not None:
            self._hot_by_seq = {s: w for s, w in self._hot_by_seq.items() if s in live_seq_ids}

    def _write_down(self, run: _Run) -> None:
        if run.is_pending:
            for page in run.pages:
                self._recency[page] = None
                self._recency.move_to_end(page)
            run.is_pending = False

    def clear(self) -> None:
        self._recency.clear()
        self._hot_by_seq.clear()
        self._runs.clear()

    @property
    def hot_pages(self) -> set[int]:
        return set(itertools.chain.from_iterable(self._hot_by_seq.values()))

    def eviction_order(self, candidates: Iterable[int]) -> list[int]:
        """`candidates` least worth keeping first: never read, then cold LRU-first, then hot LRU-first."""
        for run in self._runs.values():
            self._write_down(run)
        pool = set(candidates)
        hot = self.hot_pages
        fresh = sorted(p for p in pool if p not in self._recency)
        cold, warm = [], []
        for page in self._recency:
            if page in pool:
                (warm if page in hot else cold).append(page)
        return fresh + cold + warm

    def admission_order(self, pages: Iterable[int]) -> list[int]:
        """`pages` most worth a place on the device first (the reverse of eviction order)."""
        return self.eviction_order(pages)[::-1]
