"""Which KV pages stay on the device and which spill to the host. Plain Python, no torch.

Design
- The policy learns from every step which pages it read: each scheduled sequence's
  whole block table (attention reads the whole context). A table is touched from its
  first page to its last, so within one step an old position counts as less recently
  used than a new one, and a long context gives up its oldest pages first.
- The last `num_hot_blocks` pages of each scheduled sequence (the page being written
  and the ones just before it, near the decode position) are hot. They stay hot while
  the sequence holds pages, also through steps that do not schedule it (a prefill
  step does not schedule the decoding sequences).
- Eviction order: pages never read (fresh, or forgotten) first, lowest id first; then
  cold pages, least recently used first; hot pages last. Pages of waiting or preempted
  sequences are not read, so they age to the front by themselves. A page the caller
  protects (the ones the current step reads) is never offered.
- Admission order, for when a step needs more pages than fit on the device and the
  rest can be read where they are: the reverse of eviction order (hot pages first,
  then the most recently used), so the oldest positions are the ones read over the bus.
- Learning is deferred. Every step reads every page of every scheduled table, so
  writing that down page by page costs a walk of the whole context per step, while
  the order is needed only when pages must move. A decode step reads the same table
  as the step before, grown at its end, so each sequence keeps a run: its table, and
  whether it was read since it was last written down. A run is written down (its pages
  moved to the recent end in table order) when a query needs the order or when the run
  ends: the sequence was not scheduled, or its table no longer extends the run's. Open
  runs all end at the latest step, so writing them down in that step's table order
  gives exactly the per-step order.

Ids are whatever unit the pool moves (a page, or a group of pages that share an OS
memory page); the policy does not care.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable, Mapping, Sequence


class _Run:
    """A sequence's table as read at every step since it was last written down."""

    __slots__ = ("pages", "is_pending")

    def __init__(self, pages: list[int]):
        self.pages = pages
        self.is_pending = True  # read since last written down

    def extend_to(self, table: Sequence[int]) -> bool:
        """Grow the run to `table` when the table extends it; False when it does not."""
        n = len(self.pages)
        if len(table) < n:
            return False
        head = table[:n]
        if head != self.pages and list(head) != self.pages:
            return False
        self.pages.extend(table[n:])
        self.is_pending = True
        return True


class SpillPolicy:
    """LRU with a hot window near each sequence's decode position."""

    def __init__(self, num_hot_blocks: int = 2):
        if num_hot_blocks < 0:
            raise ValueError(f"num_hot_blocks must be >= 0, got {num_hot_blocks}")
        self.num_hot_blocks = num_hot_blocks
        self._recency: OrderedDict[int, None] = OrderedDict()  # least recently read first (written-down reads)
        self._hot_by_seq: dict[int, tuple[int, ...]] = {}
        self._runs: dict[int, _Run] = {}  # seq id -> reads not yet written down, in the latest step's order
        self.num_steps = 0

    def record_step(self, tables: Mapping[int, Sequence[int]], live_seq_ids: Collection[int] | None = None) -> None:
        """One step read these tables (seq id -> its page ids, oldest position first).

        `live_seq_ids`, when given, are the sequences that still hold pages; hot windows
        of the others are dropped.
        """
        runs: dict[int, _Run] = {}
        for seq_id, table in tables.items():
            run = self._runs.get(seq_id)
            if run is None or not run.extend_to(table):
                run = _Run(list(table))
            runs[seq_id] = run
            self._hot_by_seq[seq_id] = tuple(table[-self.num_hot_blocks :]) if self.num_hot_blocks else ()
        # Runs that did not continue ended at the step before this one, in that step's order.
        for seq_id, run in self._runs.items():
            if runs.get(seq_id) is not run:
                self._write_down(run)
        self._runs = runs
        if live_seq_ids is not None:
            for seq_id in [s for s in self._hot_by_seq if s not in live_seq_ids]:
                del self._hot_by_seq[seq_id]
        self.num_steps += 1

    def _write_down(self, run: _Run) -> None:
        """Move a run's pages to the recent end of the order, if it was read since last time."""
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
        hot: set[int] = set()
        for window in self._hot_by_seq.values():
            hot.update(window)
        return hot

    def eviction_order(self, candidates: Iterable[int], protected: Collection[int] = ()) -> list[int]:
        """`candidates` least worth keeping first: never read, then cold LRU-first, then hot LRU-first.
        Protected pages are left out."""
        for run in self._runs.values():
            self._write_down(run)
        pool = set(candidates).difference(protected)
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
