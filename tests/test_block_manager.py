import pytest

from lowvram.block_manager import BlockManager


def test_allocation_order_growth_and_free():
    bm = BlockManager(num_blocks=6, block_size=4)
    assert bm.allocate(1, 5) == [0, 1]  # 5 tokens -> 2 pages
    assert bm.allocate(2, 4) == [2]
    assert bm.allocate(1, 8) == [0, 1]  # still fits
    assert bm.allocate(1, 9) == [0, 1, 3]
    assert bm.num_free_blocks == 2
    bm.free(1)
    # freed pages go to the back of the free list, in table order
    assert list(bm.free_blocks) == [4, 5, 0, 1, 3]
    assert bm.allocate(3, 12) == [4, 5, 0]
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
