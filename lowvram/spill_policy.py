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

Ids are whatever unit the pool moves (a page, or a group of pages that share an OS
memory page); the policy does not care.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable, Mapping, Sequence


class SpillPolicy:
    """LRU with hit counts and a hot window near each sequence's decode position."""

    def __init__(self, num_hot_blocks: int = 2):
        if num_hot_blocks < 0:
            raise ValueError(f"num_hot_blocks must be >= 0, got {num_hot_blocks}")
        self.num_hot_blocks = num_hot_blocks
        self._recency: OrderedDict[int, None] = OrderedDict()  # least recently read first
        self._hits: dict[int, int] = {}
        self._hot_by_seq: dict[int, tuple[int, ...]] = {}
        self.num_steps = 0

    # -- learning ----------------------------------------------------------------
    def record_step(self, tables: Mapping[int, Sequence[int]], live_seq_ids: Collection[int] | None = None) -> None:
        """One step read these tables (seq id -> its page ids, oldest position first).

        `live_seq_ids`, when given, are the sequences that still hold pages; hot windows
        of the others are dropped.
        """
        recency, hits = self._recency, self._hits
        for seq_id, table in tables.items():
            for page in table:
                recency[page] = None
                recency.move_to_end(page)
                hits[page] = hits.get(page, 0) + 1
            self._hot_by_seq[seq_id] = tuple(table[-self.num_hot_blocks:]) if self.num_hot_blocks else ()
        if live_seq_ids is not None:
            for seq_id in [s for s in self._hot_by_seq if s not in live_seq_ids]:
                del self._hot_by_seq[seq_id]
        self.num_steps += 1

    def forget_sequence(self, seq_id: int) -> None:
        """The sequence stopped running (finished, preempted): its pages are no longer hot."""
        self._hot_by_seq.pop(seq_id, None)

    def forget_pages(self, pages: Iterable[int]) -> None:
        """Drop what is known of these pages (their content is gone)."""
        for page in pages:
            self._recency.pop(page, None)
            self._hits.pop(page, None)

    def clear(self) -> None:
        self._recency.clear()
        self._hits.clear()
        self._hot_by_seq.clear()

    # -- queries -----------------------------------------------------------------
    def hits(self, page: int) -> int:
        """Steps that read the page since it was last forgotten."""
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
