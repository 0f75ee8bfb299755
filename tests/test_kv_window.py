"""The recent FP16 window: pages kept in FP16 when the KV pool compresses to INT8/INT4.

Attention over a compressed sequence comes closer to the FP16 result with the window,
compression frees the window's bytes fewer, and the FP16 copies survive everything the
pools do to pages (spill, refetch, slot packing, copy-on-write, another precision change).
"""

import dataclasses

import pytest
import torch
from test_kv_pool import FakeManagedMemory

from lowvram.kernels.kv_quant import gather_kv, store_kv
from lowvram.kernels.kv_write import write_kv
from lowvram.kernels.paged_attention import paged_decode_attention
from lowvram.kv.pool import DeviceKVPool, KVShape, recent_window_blocks
from lowvram.kv.tiers import ManagedKVPool, PinnedKVPool

# 1 layer, pages of 4 tokens, 2 KV heads of 16; fp16 pages hold float32 on the CPU.
SHAPE = KVShape(num_layers=1, block_size=4, num_kv_heads=2, head_dim=16, dtype=torch.float32)
FP16_PAGE_BYTES = SHAPE.block_bytes("fp16")


def _tokens(num_tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shape = (num_tokens, SHAPE.num_kv_heads, SHAPE.head_dim)
    return torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)


def _fill(pool, table: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
    """Tokens 0.. of one sequence into the pages of `table`, in every layer."""
    positions = torch.arange(k.shape[0])
    pool.ensure_resident(table)
    rows = torch.tensor(pool.device_table(table))
    slots = rows[positions // SHAPE.block_size] * SHAPE.block_size + positions % SHAPE.block_size
    for pages in pool.pages:
        store_kv(pages, slots, k, v)


def _read_page(pool, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    pool.ensure_resident([block])
    row = pool.device_table([block])[0]
    return gather_kv(pool.pages[0], torch.arange(row * SHAPE.block_size, (row + 1) * SHAPE.block_size))


def _page_of(k: torch.Tensor, index: int) -> torch.Tensor:
    return k[index * SHAPE.block_size : (index + 1) * SHAPE.block_size]


def _codes_of_page(pool, block: int) -> torch.Tensor:
    """K of a page as its INT8/INT4 codes give it, ignoring any FP16 copy."""
    codes = dataclasses.replace(pool.pages[0], window_k=None, window_v=None, window_row=None)
    return gather_kv(codes, torch.arange(block * SHAPE.block_size, (block + 1) * SHAPE.block_size))[0]


def test_recent_window_blocks_are_whole_pages_newest_first():
    tables = [([10, 11, 12, 13], 14), ([20, 21], 8), ([30, 31, 32], 0)]
    # 5 tokens back from 14 is position 9 (page 2 of seq 0); from 8 it is 3 (page 0).
    assert recent_window_blocks(tables, 5, 4) == [13, 21, 12, 20]
    assert recent_window_blocks(tables, 0, 4) == []
    shared = [([1, 2, 3], 12), ([1, 2, 4], 12)]  # a shared prefix page appears once
    assert recent_window_blocks(shared, 12, 4) == [3, 4, 2, 1]


def test_window_brings_attention_closer_to_fp16_and_frees_fewer_bytes():
    # One 38-token sequence; its last 8 tokens (positions 30-37: pages 7-9, page 9 half full) stay FP16.
    table = list(range(10))
    k, v = _tokens(38, seed=0)
    q = k[-6:].sum(0).repeat_interleave(2, dim=0)[None]  # [1, 4 heads, D]: favours recent tokens
    block_tables = torch.tensor([table], dtype=torch.int32)
    context_lens = torch.tensor([38], dtype=torch.int32)
    fp16 = DeviceKVPool(SHAPE, 10, "fp16", "cpu")
    _fill(fp16, table, k, v)
    expected = paged_decode_attention(q, fp16.pages[0], block_tables, context_lens, 0.25)
    errors, freed = {}, {}
    for num_window_tokens in (0, 8):
        pool = DeviceKVPool(SHAPE, 10, "fp16", "cpu")
        _fill(pool, table, k, v)
        window = recent_window_blocks([(table, 38)], num_window_tokens, SHAPE.block_size)
        freed[num_window_tokens] = pool.set_precision("int4", table, fp16_block_ids=window)
        out = paged_decode_attention(q, pool.pages[0], block_tables, context_lens, 0.25)
        errors[num_window_tokens] = ((out - expected).norm() / expected.norm()).item()
        assert pool.window_block_ids == window
    print(f"relative attention error after INT4: {errors[0]:.4f} without the window, {errors[8]:.4f} with it")
    assert errors[8] < 0.5 * errors[0]
    assert freed[0] == 10 * (SHAPE.block_bytes("fp16") - SHAPE.block_bytes("int4"))
    assert window == [9, 8, 7] and freed[8] == freed[0] - 3 * FP16_PAGE_BYTES
    assert pool.device_bytes == 10 * SHAPE.block_bytes("int4") + 3 * FP16_PAGE_BYTES
    # Tokens written after the change into the half-full kept page are kept unquantized too.
    k_new, v_new = _tokens(2, seed=1)
    write_kv(k_new, v_new, torch.tensor([38, 39]), pool.pages[0])
    k_page, v_page = _read_page(pool, 9)
    assert torch.equal(k_page, torch.cat([_page_of(k, 9)[:2], k_new])) and torch.equal(v_page[2:], v_new)


def test_window_is_cut_to_the_bytes_the_pool_started_with():
    pool = DeviceKVPool(SHAPE, 10, "int8", "cpu")
    room = pool.max_device_bytes - 10 * SHAPE.block_bytes("int4")
    pool.set_precision("int4", fp16_block_ids=list(range(9, -1, -1)))
    assert pool.window_block_ids == list(range(9, 9 - room // FP16_PAGE_BYTES, -1))  # the newest ones
    assert 0 < len(pool.window_block_ids) < 10 and pool.device_bytes <= pool.max_device_bytes


def test_window_survives_another_compression_and_goes_on_the_way_back():
    pool = DeviceKVPool(SHAPE, 6, "fp16", "cpu")
    k, v = _tokens(24, seed=2)
    _fill(pool, list(range(6)), k, v)
    version = pool.pages_version
    pool.set_precision("int8", fp16_block_ids=[5, 4])
    pool.set_precision("int4", fp16_block_ids=[5])  # page 4 leaves the window: quantized from FP16
    assert pool.pages_version == version + 2 and pool.window_block_ids == [5]
    assert torch.equal(_read_page(pool, 5)[0], _page_of(k, 5))
    int4_error = (_read_page(pool, 4)[0] - _page_of(k, 4)).abs().max()
    assert 0 < int4_error < 0.6
    assert pool.set_precision("fp16") < 0 and pool.window_block_ids == [] and not pool.pages[0].has_window
    assert torch.equal(_read_page(pool, 5)[0], _page_of(k, 5))


def test_copy_on_write_passes_the_fp16_copy_on():
    pool = DeviceKVPool(SHAPE, 4, "fp16", "cpu")
    k, v = _tokens(16, seed=3)
    _fill(pool, list(range(4)), k, v)
    pool.set_precision("int8", fp16_block_ids=[0, 3])
    pool.copy_block(0, 3)  # kept -> kept: the FP16 rows
    assert torch.equal(_read_page(pool, 3)[0], _page_of(k, 0))
    pool.copy_block(0, 1)  # kept -> not kept: the codes (written with the FP16 copy)
    assert torch.equal(_read_page(pool, 1)[0], _codes_of_page(pool, 0))
    assert not torch.equal(_read_page(pool, 1)[0], _page_of(k, 0))
    pool.copy_block(2, 0)  # not kept -> kept: the codes, dequantized into the FP16 rows
    assert torch.equal(_read_page(pool, 0)[0], _read_page(pool, 2)[0])


def test_pinned_window_follows_its_page_through_spill_refetch_and_packing():
    # Tags are indexed by device slot: a page that comes back in another slot must find
    # its FP16 copy, and the page that takes its old slot must not.
    pool = PinnedKVPool(SHAPE, 8, "fp16", "cpu", max_device_blocks=4, num_host_blocks=8)
    k, v = _tokens(20, seed=4)
    for block in range(5):  # four slots: page 0 goes to the host for page 4
        _fill(pool, [block], _page_of(k, block), _page_of(v, block))
    assert not pool.is_resident(0)
    pool.set_precision("int8", list(range(5)), fp16_block_ids=[4, 3, 0])
    assert pool.window_block_ids == [4, 3]  # the window lives on the device: a page on the host does not join
    pool.ensure_resident([0, 5, 6, 7], free_block_ids={5, 6, 7})  # every other page goes to the host
    assert not pool.is_resident(3) and not pool.is_resident(4)
    assert not torch.equal(_read_page(pool, 0)[0], _page_of(k, 0))  # in a slot 3 or 4 had: codes, no copy
    for block in (3, 4):
        assert torch.equal(_read_page(pool, block)[0], _page_of(k, block)), f"page {block} lost its FP16 copy"
    pool.set_max_device_blocks(2)  # packs the resident pages into two new slots
    assert pool.pages[0].window_row.shape == (2,)
    assert pool.device_bytes == 2 * SHAPE.block_bytes("int8") + 2 * FP16_PAGE_BYTES
    for block in (4, 3, 1, 0):
        is_exact = torch.equal(_read_page(pool, block)[0], _page_of(k, block))
        assert is_exact == (block in (3, 4)), f"page {block}"


def test_managed_pool_keeps_the_window_in_device_memory():
    memory = FakeManagedMemory(page_bytes=SHAPE.code_block_bytes("fp16"))
    pool = ManagedKVPool(SHAPE, 8, "fp16", "cpu", max_device_blocks=8, memory=memory, budget_bytes=2**30)
    k, v = _tokens(32, seed=5)
    _fill(pool, list(range(8)), k, v)
    before = pool.device_bytes
    freed = pool.set_precision("int4", fp16_block_ids=[7, 6])
    assert pool.window_block_ids == [7, 6] and freed == before - pool.device_bytes
    assert (
        pool.device_bytes == pool._scale_bytes("int4") + pool._num_resident * pool._unit_bytes() + 2 * FP16_PAGE_BYTES
    )
    assert torch.equal(_read_page(pool, 6)[0], _page_of(k, 6))
    assert not torch.equal(_read_page(pool, 5)[0], _page_of(k, 5))


@pytest.mark.parametrize("precision", ["fp16", "int8"])
def test_same_precision_again_changes_nothing(precision):
    pool = DeviceKVPool(SHAPE, 4, precision, "cpu")
    assert pool.set_precision(precision, fp16_block_ids=[1]) == 0 and pool.window_block_ids == []


def test_profile_field_is_validated_and_on_by_default():
    from lowvram.config import load_profile, profile_from_dict
    from lowvram.errors import ConfigError

    assert load_profile("4gb").kv_recent_fp16_tokens == 64
    assert profile_from_dict({"kv_recent_fp16_tokens": 0}).kv_recent_fp16_tokens == 0
    with pytest.raises(ConfigError, match="kv_recent_fp16_tokens = -1"):
        profile_from_dict({"kv_recent_fp16_tokens": -1})
