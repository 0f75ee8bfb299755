"""The spill policy, exactly: eviction order, hot windows."""

import pytest

from lowvram.core.spill_policy import SpillPolicy


def test_old_positions_of_a_long_context_spill_first_and_the_hot_window_last():
    policy = SpillPolicy(num_hot_blocks=2)
    policy.record_step({7: [10, 11, 12, 13, 14]})
    # Touched oldest position first, so LRU order is position order; 13 and 14 are hot.
    assert policy.eviction_order([10, 11, 12, 13, 14]) == [10, 11, 12, 13, 14]
    assert policy.hot_pages == {13, 14}
    policy.record_step({7: [10, 11, 12, 13, 14, 15]})
    assert policy.hot_pages == {14, 15}
    assert policy.eviction_order([15, 14, 13, 12]) == [12, 13, 14, 15]


def test_pages_of_a_sequence_not_scheduled_age_to_the_front():
    policy = SpillPolicy(num_hot_blocks=1)
    policy.record_step({1: [0, 1], 2: [5, 6]})
    policy.record_step({2: [5, 6]})  # sequence 1 waits: its pages are not read
    policy.record_step({2: [5, 6]})
    # 0 is cold; 1 is sequence 1's hot window, so it goes after every cold page.
    assert policy.eviction_order([0, 1, 5, 6]) == [0, 5, 1, 6]
    policy.record_step({2: [5, 6]}, live_seq_ids={2})  # 1 preempted: its window is no longer hot
    assert policy.eviction_order([0, 1, 5, 6]) == [0, 1, 5, 6]


def test_hot_windows_survive_steps_that_do_not_schedule_the_sequence_until_it_is_gone():
    policy = SpillPolicy(num_hot_blocks=1)
    policy.record_step({1: [0, 1]})
    policy.record_step({2: [4]}, live_seq_ids={1, 2})  # a prefill step of sequence 2
    assert policy.hot_pages == {1, 4}
    policy.record_step({2: [4]}, live_seq_ids={2})  # sequence 1 finished
    assert policy.hot_pages == {4}


def test_never_read_pages_go_first_by_id():
    policy = SpillPolicy()
    policy.record_step({1: [3, 4]})
    assert policy.eviction_order([9, 3, 2]) == [2, 9, 3]
    policy.clear()
    assert policy.eviction_order([4, 3]) == [3, 4]


def test_admission_order_is_the_reverse_of_eviction_order():
    policy = SpillPolicy(num_hot_blocks=1)
    policy.record_step({1: [0, 1, 2, 3]})
    assert policy.admission_order([0, 1, 2, 3]) == [3, 2, 1, 0]


def test_zero_hot_window_is_pure_lru_and_negative_is_refused():
    policy = SpillPolicy(num_hot_blocks=0)
    policy.record_step({1: [0, 1]})
    policy.record_step({2: [2]})
    assert policy.hot_pages == set()
    assert policy.eviction_order([2, 1, 0]) == [0, 1, 2]
    with pytest.raises(ValueError):
        SpillPolicy(num_hot_blocks=-1)


class EveryStepPolicy:
    """The policy's order written down page by page at every step: what the deferred
    bookkeeping must reproduce exactly."""

    def __init__(self, num_hot_blocks: int):
        self.num_hot_blocks = num_hot_blocks
        self.recency: dict[int, None] = {}
        self.hot_by_seq: dict[int, tuple[int, ...]] = {}

    def record_step(self, tables, live_seq_ids=None) -> None:
        for seq_id, table in tables.items():
            for page in table:
                self.recency.pop(page, None)
                self.recency[page] = None
            self.hot_by_seq[seq_id] = tuple(table[-self.num_hot_blocks :]) if self.num_hot_blocks else ()
        if live_seq_ids is not None:
            self.hot_by_seq = {s: w for s, w in self.hot_by_seq.items() if s in live_seq_ids}

    def eviction_order(self, candidates, protected=()) -> list[int]:
        pool = set(candidates) - set(protected)
        hot = {p for window in self.hot_by_seq.values() for p in window}
        fresh = sorted(p for p in pool if p not in self.recency)
        cold = [p for p in self.recency if p in pool and p not in hot]
        warm = [p for p in self.recency if p in pool and p in hot]
        return fresh + cold + warm


@pytest.mark.parametrize("seed", range(12))
def test_deferred_bookkeeping_gives_the_every_step_order(seed):
    """Decoding sequences grow their tables, some share prefix pages, some skip steps, are
    preempted and start over, or change a page; queries come at any point."""
    import random

    rng = random.Random(seed)
    num_hot = rng.choice([0, 1, 2])
    policy, reference = SpillPolicy(num_hot_blocks=num_hot), EveryStepPolicy(num_hot)
    num_pages = 60
    shared = [0, 1, 2]  # a cached prompt prefix some sequences start from
    tables: dict[int, list[int]] = {}
    next_page = 3
    for _ in range(150):
        op = rng.random()
        if op < 0.12 or not tables:  # a new sequence (or a preempted one starting over)
            seq_id = rng.randrange(6)
            start = list(shared[: rng.randrange(4)])
            tables[seq_id] = start + [(next_page + i) % num_pages for i in range(rng.randrange(1, 4))]
            next_page += 4
        elif op < 0.17:  # a finished sequence
            tables.pop(rng.choice(list(tables)))
        elif op < 0.20:  # one page of a table swapped for another (not an extension)
            table = tables[rng.choice(list(tables))]
            table[rng.randrange(len(table))] = rng.randrange(num_pages)
        elif op < 0.21:
            policy.clear()
            reference = EveryStepPolicy(num_hot)
        else:  # a step: some sequences scheduled, in any order, a few growing a page
            for table in tables.values():
                if rng.random() < 0.3:
                    table.append(next_page % num_pages)
                    next_page += 1
            chosen = rng.sample(list(tables), rng.randrange(1, len(tables) + 1))
            step = {s: (tuple(tables[s]) if rng.random() < 0.2 else list(tables[s])) for s in chosen}
            live = set(tables) if rng.random() < 0.5 else None
            policy.record_step(step, live_seq_ids=live)
            reference.record_step(step, live_seq_ids=live)
        if rng.random() < 0.3:
            candidates = rng.sample(range(num_pages), rng.randrange(num_pages))
            kept = set(candidates) - set(rng.sample(range(num_pages), rng.randrange(4)))
            assert policy.eviction_order(kept) == reference.eviction_order(kept)
            assert policy.admission_order(candidates) == reference.eviction_order(candidates)[::-1]
        assert policy.hot_pages == {p for window in reference.hot_by_seq.values() for p in window}
    assert policy.eviction_order(range(num_pages)) == reference.eviction_order(range(num_pages))
