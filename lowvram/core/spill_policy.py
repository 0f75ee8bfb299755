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
- Hit counts: how many steps read each page (`hits`), kept beside the recency order.
- Learning is deferred. Every step reads every page of every scheduled table, so
  writing that down page by page costs a walk of the whole context per step, while
  the order is needed only when pages must move. A decode step reads the same table
  as the step before, grown at its end, so each sequence keeps a run: its table and,
  per page, the first step not yet written down. A run is written down (hits added,
  pages moved to the recent end in the order of that run's last step) when a query
  needs the order or when the run ends: the sequence was not scheduled, or its table
  is no longer an extension of the run's. Open runs all end at the latest step, so
  writing them down in that step's table order gives exactly the per-step order.

Ids are whatever unit the pool moves (a page, or a group of pages that share an OS
memory page); the policy does not care.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable, Mapping, Sequence


class _Run:
    """A sequence's table as read at every step since each page's `since` step."""

    __slots__ = ("pages", "since")

    def __init__(self, pages: list[int], step: int):
        self.pages = pages
        self.since = [step] * len(pages)

    def extend_to(self, table: Sequence[int], step: int) -> bool:
        """Grow the run to `table` when the table extends it; False when it does not."""
        n = len(self.pages)
        if len(table) < n:
            return False
        head = table[:n]
        if head != self.pages and list(head) != self.pages:
            return False
        if len(table) > n:
            self.pages.extend(table[n:])
            self.since.extend([step] * (len(table) - n))
        return True


class SpillPolicy:
    """LRU with hit counts and a hot window near each sequence's decode position."""

    def __init__(self, num_hot_blocks: int = 2):
        if num_hot_blocks < 0:
            raise ValueError(f"num_hot_blocks must be >= 0, got {num_hot_blocks}")
        self.num_hot_blocks = num_hot_blocks
        self._recency: OrderedDict[int, None] = OrderedDict()  # least recently read first (written-down reads)
        self._hits: dict[int, int] = {}
        self._hot_by_seq: dict[int, tuple[int, ...]] = {}
        self._runs: dict[int, _Run] = {}  # seq id -> reads not yet written down, in the latest step's order
        self.num_steps = 0

    # -- learning ----------------------------------------------------------------
    def record_step(self, tables: Mapping[int, Sequence[int]], live_seq_ids: Collection[int] | None = None) -> None:
        """One step read these tables (seq id -> its page ids, oldest position first).

        `live_seq_ids`, when given, are the sequences that still hold pages; hot windows
        of the others are dropped.
        """
        step = self.num_steps
        runs: dict[int, _Run] = {}
        for seq_id, table in tables.items():
            run = self._runs.get(seq_id)
            if run is None or not run.extend_to(table, step):
                run = _Run(list(table), step)
            runs[seq_id] = run
            self._hot_by_seq[seq_id] = tuple(table[-self.num_hot_blocks :]) if self.num_hot_blocks else ()
        # Runs that did not continue last ended at the step before this one, in that step's order.
        for seq_id, run in self._runs.items():
            if runs.get(seq_id) is not run:
                self._write_down(run, step - 1)
        self._runs = runs
        if live_seq_ids is not None:
            for seq_id in [s for s in self._hot_by_seq if s not in live_seq_ids]:
                del self._hot_by_seq[seq_id]
        self.num_steps += 1

    def _write_down(self, run: _Run, last_step: int) -> None:
        """Add a run's reads up to `last_step` to the hit counts and the recency order."""
        recency, hits = self._recency, self._hits
        for page, since in zip(run.pages, run.since):
            num_reads = last_step - since + 1
            if num_reads > 0:
                recency[page] = None
                recency.move_to_end(page)
                hits[page] = hits.get(page, 0) + num_reads

    def _catch_up(self) -> None:
        """Write down every open run (before anything reads the order or the counts)."""
        last_step = self.num_steps - 1
        for run in self._runs.values():
            if run.since and run.since[0] <= last_step:  # some reads not written down
                self._write_down(run, last_step)
                run.since = [last_step + 1] * len(run.pages)

    def forget_sequence(self, seq_id: int) -> None:
        """The sequence stopped running (finished, preempted): its pages are no longer hot."""
        self._hot_by_seq.pop(seq_id, None)

    def forget_pages(self, pages: Iterable[int]) -> None:
        """Drop what is known of these pages (their content is gone)."""
        self._catch_up()
        for page in pages:
            self._recency.pop(page, None)
            self._hits.pop(page, None)

    def clear(self) -> None:
        self._recency.clear()
        self._hits.clear()
        self._hot_by_seq.clear()
        self._runs.clear()

    # -- queries -----------------------------------------------------------------
    def hits(self, page: int) -> int:
        """Steps that read the page since it was last forgotten."""
        self._catch_up()
        return self._hits.get(page, 0)

    @property
    def hot_pages(self) -> set[int]:
        hot: set[int] = set()
        for window in self._hot_by_seq.values():
            hot.update(window)
        return hot

    def eviction_order(self, candidates: Iterable[int], protected: Collection[int] = ()) -> list[int]:
        """`candidates` least worth keeping first: never read, then cold LRU-first, then hot LRU-first.
        Protected pages are left out."""
        self._catch_up()
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
