import pytest

from lowvram.core.block_manager import BlockManager


def test_allocation_order_growth_and_free():
    bm = BlockManager(num_blocks=6, block_size=4)
    assert bm.allocate(1, 5) == [0, 1]  # 5 tokens -> 2 pages
    assert bm.allocate(2, 4) == [2]
    assert bm.allocate(1, 8) == [0, 1]  # still fits
    assert bm.allocate(1, 9) == [0, 1, 3]
    assert bm.num_free_blocks == 2
    bm.free(1)
    # freed pages go to the back of the free list, last page first
    assert list(bm.free_blocks) == [4, 5, 3, 1, 0]
    assert bm.allocate(3, 12) == [4, 5, 3]
    assert bm.block_table(1) == []


def test_can_allocate_counts_only_missing_pages():
    bm = BlockManager(num_blocks=3, block_size=16)
    bm.allocate(7, 30)
    assert bm.can_allocate(7, 48)  # one more page needed, one free
    assert not bm.can_allocate(7, 49)
    assert not bm.can_allocate(8, 17)
    with pytest.raises(MemoryError):
        bm.allocate(8, 33)
    assert bm.num_free_blocks == 1  # a failed allocation takes nothing


def test_free_unknown_sequence_is_harmless():
    bm = BlockManager(num_blocks=2, block_size=16)
    bm.free(42)
    assert bm.num_free_blocks == 2


def _filled(bm, seq_id, tokens, num_computed=None):
    """Allocate and commit as the engine does once the tokens' KV is computed."""
    bm.allocate(seq_id, len(tokens))
    bm.commit(seq_id, tokens, len(tokens) if num_computed is None else num_computed)


def test_full_pages_are_shared_by_prefix_with_ref_counts():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = list(range(100, 110))  # 2 full pages + 2 tokens
    _filled(bm, 1, a)
    assert bm.block_table(1) == [0, 1, 2]
    match = bm.match_prefix(a[:8] + [7, 7, 7])
    assert match.block_ids == [0, 1] and match.num_tokens == 8 and match.copy_from is None
    assert bm.acquire(2, match) is None
    assert [bm.ref_counts[b] for b in (0, 1, 2)] == [2, 2, 1]
    bm.allocate(2, 11)
    assert bm.block_table(2) == [0, 1, 3]
    # The live pages a step counts are exactly those with a holder.
    assert bm.used_block_ids() == {0, 1, 2, 3} == {b for b, n in enumerate(bm.ref_counts) if n > 0}
    bm.free(1)
    assert bm.used_block_ids() == {0, 1, 3} == {b for b, n in enumerate(bm.ref_counts) if n > 0}


def test_uncommitted_pages_are_the_full_pages_commit_would_record():
    bm = BlockManager(num_blocks=8, block_size=4)
    tokens = list(range(100, 111))
    bm.allocate(1, 11)
    assert [bm.num_uncommitted(1, n) for n in (0, 3, 4, 7, 8, 11)] == [0, 0, 1, 1, 2, 2]
    bm.commit(1, tokens, 5)
    assert bm.num_uncommitted(1, 5) == 0 and bm.num_uncommitted(1, 8) == 1
    bm.commit(1, tokens, 11)
    assert bm.num_uncommitted(1, 11) == 0
    assert bm.num_uncommitted(1, 12) == 1  # the third page just filled
    assert bm.num_uncommitted(2, 8) == 0  # no table
    assert BlockManager(8, 4, enable_prefix_caching=False).num_uncommitted(1, 8) == 0


def test_a_prefix_must_match_from_the_start_and_leave_one_token():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = list(range(8))
    _filled(bm, 1, a)
    assert bm.match_prefix([9] + a[1:]).block_ids == []  # same second page, different first page
    assert bm.match_prefix(a).block_ids == [0]  # whole prompt cached: the last page is recomputed
    assert bm.match_prefix(a + [50]).block_ids == [0, 1]


def test_freed_hashed_pages_stay_cached_and_count_as_free_then_evict_lru_tail_first():
    bm = BlockManager(num_blocks=4, block_size=2)
    _filled(bm, 1, [1, 2, 3, 4])  # pages 0, 1
    _filled(bm, 2, [5, 6, 7, 8])  # pages 2, 3
    bm.free(1)
    bm.free(2)
    assert bm.num_free_blocks == 4 and bm.num_cached_blocks == 4 and not bm.free_blocks
    # LRU order: seq 1's pages (tail first), then seq 2's
    assert list(bm.cached_free) == [1, 0, 3, 2]
    # reuse of seq 2's prefix refreshes nothing until it is acquired
    match = bm.match_prefix([5, 6, 7, 8, 9])
    assert match.block_ids == [2, 3]
    bm.acquire(3, match)
    assert list(bm.cached_free) == [1, 0] and bm.num_free_blocks == 2
    assert bm.num_used_blocks == sum(count > 0 for count in bm.ref_counts) == 2
    # a new sequence needing 1 page evicts the least recently freed one: page 1
    bm.allocate(4, 2)
    assert bm.num_used_blocks == sum(count > 0 for count in bm.ref_counts) == 3
    assert bm.block_table(4) == [1]
    assert bm.match_prefix([1, 2, 3, 4, 5]).block_ids == [0]  # page 1's content is gone, page 0 is still there


def test_a_partly_filled_last_page_is_copied_on_write():
    bm = BlockManager(num_blocks=6, block_size=4)
    conv = [1, 2, 3, 4, 5, 6]  # one full page + 2 tokens in page 1
    _filled(bm, 1, conv)
    bm.commit_partial(1, conv, 6)
    bm.free(1)
    nxt = conv + [7, 8, 9]
    match = bm.match_prefix(nxt)
    assert match.block_ids == [0] and match.copy_from == 1 and match.copy_tokens == 2 and match.num_tokens == 6
    assert bm.can_acquire(match, len(nxt))
    src, dst = bm.acquire(2, match)
    assert (src, dst) == (1, 2)  # page 1 stays cached for others; the new sequence writes into its own copy
    assert bm.block_table(2) == [0, 2] and bm.ref_counts[1] == 0 and 1 in bm.cached_free
    assert bm.match_prefix(conv + [0, 0]).copy_from == 1


def test_hash_collisions_never_reuse_wrong_pages(monkeypatch):
    import lowvram.core.block_manager as bm_module

    monkeypatch.setattr(bm_module, "chain_hash", lambda parent, tokens: 42)  # every page collides
    bm = BlockManager(num_blocks=4, block_size=2)
    _filled(bm, 1, [1, 2, 3])
    assert bm.match_prefix([9, 9, 9]).block_ids == []
    assert bm.match_prefix([1, 2, 3]).block_ids == [0]


def test_prefix_caching_off_matches_nothing():
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=False)
    _filled(bm, 1, [1, 2, 3, 4])
    bm.free(1)
    assert bm.match_prefix([1, 2, 3, 4, 5]).num_tokens == 0 and bm.num_cached_blocks == 0


def test_recomputing_cached_content_under_pressure_keeps_it_findable():
    """Scoring the same text twice with a pool that holds it once: the second copy evicts
    the first as it goes, and the content must stay matchable through the second copy."""
    bm = BlockManager(num_blocks=4, block_size=2)
    tokens = [1, 2, 3, 4, 5, 6, 7, 8]
    _filled(bm, 1, tokens)
    bm.free(1)
    for chunk_end in (2, 4, 6, 8):  # a second pass, chunk by chunk, evicting the first pass's pages
        bm.allocate(2, chunk_end)
        bm.commit(2, tokens, chunk_end)
    bm.free(2)
    assert bm.match_prefix(tokens + [9]).num_tokens == 8
