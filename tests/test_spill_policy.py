"""The spill policy, exactly: eviction order, hit counts, hot windows."""

import pytest

from lowvram.spill_policy import SpillPolicy


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
    policy.forget_sequence(1)  # preempted: its window is no longer hot
    assert policy.eviction_order([0, 1, 5, 6]) == [0, 1, 5, 6]


def test_hot_windows_survive_steps_that_do_not_schedule_the_sequence_until_it_is_gone():
    policy = SpillPolicy(num_hot_blocks=1)
    policy.record_step({1: [0, 1]})
    policy.record_step({2: [4]}, live_seq_ids={1, 2})  # a prefill step of sequence 2
    assert policy.hot_pages == {1, 4}
    policy.record_step({2: [4]}, live_seq_ids={2})  # sequence 1 finished
    assert policy.hot_pages == {4}


def test_never_read_pages_go_first_by_id_and_protected_pages_never():
    policy = SpillPolicy()
    policy.record_step({1: [3, 4]})
    assert policy.eviction_order([9, 3, 2, 4], protected=[4]) == [2, 9, 3]
    policy.forget_pages([3])
    assert policy.hits(3) == 0
    assert policy.eviction_order([3, 4]) == [3, 4]


def test_hit_counts_count_steps_that_read_a_page():
    policy = SpillPolicy()
    policy.record_step({1: [0, 1], 2: [1, 2]})  # a shared page is read by two sequences in one step
    policy.record_step({1: [0, 1]})
    assert [policy.hits(p) for p in (0, 1, 2, 3)] == [2, 3, 1, 0]
    assert policy.num_steps == 2


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
