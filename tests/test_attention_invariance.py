"""Batch invariance of paged attention: a sequence's output, bit for bit, whatever shares its batch.

Greedy generation in a batched server gives the text of the request run alone only if every
kernel gives a row the same bits whatever the other rows are. Decode attention does so with
fixed partitions (`partition_tokens=`); prefill attention whatever the chunking of the prompt.
Each test also checks the outputs against the reference, so two equal wrong answers fail.
"""

from dataclasses import replace

import pytest
import torch
from test_paged_attention import DEVICE, TINY_DIM, TINY_HEADS, PagedCase, _report

from lowvram.errors import KernelError
from lowvram.kernels import paged_attention
from lowvram.kernels.paged_attention import (
    INVARIANT_PARTITION_TOKENS,
    DecodeConfig,
    default_decode_config,
    paged_decode_attention,
    paged_decode_attention_ref,
    paged_prefill_attention,
    paged_prefill_attention_ref,
    plan_decode_partitions,
)

# (page precision, q dtype, pages kept in FP16): q is float16 only over float16 pages on the CPU
# (float16 pages need a float16 q), float32 otherwise, as in test_paged_attention.
CASES = [
    ("fp16", torch.float16, 0),
    ("fp16", torch.float32, 0),
    ("int8", torch.float32, 0),
    ("int8", torch.float32, 3),
    ("int4", torch.float32, 0),
    ("int4", torch.float32, 3),
]
CASE_IDS = [f"{precision}-{str(dtype)[6:]}{'-window' if window else ''}" for precision, dtype, window in CASES]
# The interpreter's decode tile is 16 tokens: 32-token partitions give the 300-token sequence
# more partitions than the merge loads at once.
PARTITION_TOKENS = 32
# Merges of up to 4 partitions in the decode kernel, of more in the merge kernel: short
# sequences alone take the first, the same sequences in a wide batch the second.
MIXED_MERGES = DecodeConfig(block_n=16, num_warps=4, num_stages=1, max_fused_splits=4)


def _case(precision, dtype, num_window_blocks, context_lens, seed):
    pages_dtype = dtype if precision == "fp16" else torch.float32
    return PagedCase(
        precision, pages_dtype, 8, 2, TINY_DIM, context_lens, seed=seed, num_window_blocks=num_window_blocks
    )


def _tolerance(dtype):
    return 2e-3 if dtype == torch.float16 else 1e-5


@pytest.mark.parametrize("precision,dtype,num_window_blocks", CASES, ids=CASE_IDS)
def test_decode_row_is_the_same_alone_and_in_a_batch(precision, dtype, num_window_blocks):
    # 70 to 120 tokens: 3 or 4 partitions, as many as the sequence alone has splits; a sum over the
    # batch's splits rather than the sequence's own would change how they are added.
    context_lens = [150, 37, 5, 300, 0, 120, 70, 100]
    case = _case(precision, dtype, num_window_blocks, context_lens, seed=50)
    q = torch.randn(len(context_lens), TINY_HEADS, TINY_DIM, generator=torch.Generator().manual_seed(51))
    q = q.to(DEVICE, dtype)
    # The batch's block table is wider than any sequence needs, and max_context_len larger
    # still, so the batch has more partitions than any of its sequences.
    padding = torch.full((len(context_lens), 7), -1, dtype=torch.int32, device=DEVICE)
    wide_tables = torch.cat([case.block_tables, padding], dim=1)
    batched = paged_decode_attention(
        q,
        case.pages,
        wide_tables,
        case.context_lens_t,
        0.3,
        partition_tokens=PARTITION_TOKENS,
        max_context_len=500,
        _config=MIXED_MERGES,
    )
    expected = paged_decode_attention_ref(q, case.pages, case.block_tables, case.context_lens_t, 0.3)
    assert _report(f"decode {precision} batched vs reference", batched, expected) <= _tolerance(dtype)

    for seq, context_len in enumerate(context_lens):
        num_blocks = max(1, -(-context_len // 8))
        alone = paged_decode_attention(
            q[seq : seq + 1],
            case.pages,
            case.block_tables[seq : seq + 1, :num_blocks],
            case.context_lens_t[seq : seq + 1],
            0.3,
            partition_tokens=PARTITION_TOKENS,
            _config=MIXED_MERGES,
        )
        # Two other batches: the sequence with the shortest one, and in another slot.
        pair = [seq, 2]
        in_pair = paged_decode_attention(
            q[pair],
            case.pages,
            case.block_tables[pair],
            case.context_lens_t[pair],
            0.3,
            partition_tokens=PARTITION_TOKENS,
            _config=MIXED_MERGES,
        )
        assert torch.equal(alone[0], batched[seq]), f"sequence {seq} ({context_len} tokens): alone != batched"
        assert torch.equal(in_pair[0], batched[seq]), f"sequence {seq} ({context_len} tokens): pair != batched"
    assert not batched[4].any(), "an empty context must give zeros"


@pytest.mark.parametrize("precision,dtype,num_window_blocks", CASES[:3] + CASES[4:5], ids=CASE_IDS[:3] + CASE_IDS[4:5])
def test_both_merges_match_and_fixed_partitions_take_the_merge_kernel(precision, dtype, num_window_blocks, monkeypatch):
    # With the default partitioning, which merge runs depends on the batch (num_splits against
    # max_fused_splits): both must give the reference's result. Fixed partitions always take
    # the merge kernel, so max_fused_splits leaves their bits alone. The decode kernel's own
    # merge is narrowed to 2 lanes here, so it would add the partitions in another order.
    monkeypatch.setattr(paged_attention, "FUSED_MERGE_FLOATS", 1)
    context_lens = [150, 37, 0, 300]
    case = _case(precision, dtype, num_window_blocks, context_lens, seed=59)
    q = torch.randn(len(context_lens), TINY_HEADS, TINY_DIM, generator=torch.Generator().manual_seed(60))
    args = (q.to(DEVICE, dtype), case.pages, case.block_tables, case.context_lens_t, 0.3)
    expected = paged_decode_attention_ref(*args)
    for partitioning in ({"partition_tokens": PARTITION_TOKENS}, {"num_splits": 5}):
        outs = []
        for max_fused_splits in (0, 1 << 30):
            config = DecodeConfig(block_n=16, num_warps=4, num_stages=1, max_fused_splits=max_fused_splits)
            outs.append(paged_decode_attention(*args, **partitioning, _config=config))
            label = f"decode {precision} {partitioning} max_fused_splits={max_fused_splits}"
            assert _report(label, outs[-1], expected) <= _tolerance(dtype)
        if "partition_tokens" in partitioning:
            assert torch.equal(outs[0], outs[1]), f"{partitioning}: fixed partitions merged in the decode kernel"


def test_fused_merge_leaves_its_counters_at_zero():
    # The counters serve every layer and graph replay: a counter left above zero would make the
    # next call's last partition miss its turn and leave its output unwritten.
    case = _case("int4", torch.float32, 0, [150, 37, 0, 300, 64], seed=61)
    q = torch.randn(5, TINY_HEADS, TINY_DIM, generator=torch.Generator().manual_seed(62)).to(DEVICE)
    args = (q, case.pages, case.block_tables, case.context_lens_t, 0.3)
    first = paged_decode_attention(*args, num_splits=6)
    counters = paged_attention.MERGE_COUNTERS.get(torch.device(DEVICE), 1)
    assert counters.numel() >= paged_attention.MIN_MERGE_COUNTERS and not counters.any()
    assert torch.equal(paged_decode_attention(*args, num_splits=6), first)
    assert _report("decode fused merge", first, paged_decode_attention_ref(*args)) <= 1e-5


def test_decode_partitions_are_fixed_by_partition_tokens():
    device = torch.device("cpu")
    assert plan_decode_partitions(1, 2, 1000, device, partition_tokens=256) == (4, 256)
    assert plan_decode_partitions(64, 2, 1000, device, partition_tokens=256) == (4, 256)
    assert plan_decode_partitions(1, 2, 256, device, partition_tokens=256) == (1, 256)
    assert INVARIANT_PARTITION_TOKENS % paged_attention._decode_block_n(torch.device("cuda")) == 0
    assert INVARIANT_PARTITION_TOKENS % paged_attention._decode_block_n(device) == 0
    assert all(INVARIANT_PARTITION_TOKENS % tile == 0 for tile in paged_attention.ASYNC_DECODE_TILE_TOKENS.values())


@pytest.mark.parametrize("partition_tokens", [0, -16, 24, 16.0])
def test_decode_rejects_partitions_that_are_not_whole_tiles(partition_tokens):
    case = _case("int8", torch.float32, 0, [5, 9], seed=52)
    q = torch.zeros(2, TINY_HEADS, TINY_DIM, device=DEVICE)
    with pytest.raises(KernelError, match=f"partition_tokens={partition_tokens!r}"):
        paged_decode_attention(
            q, case.pages, case.block_tables, case.context_lens_t, 1.0, partition_tokens=partition_tokens
        )
    with pytest.raises(KernelError, match="not both"):
        paged_decode_attention(
            q, case.pages, case.block_tables, case.context_lens_t, 1.0, num_splits=2, partition_tokens=32
        )


def _prefill(case, q, seqs, chunks):
    """Prefill attention of one chunk per sequence in `seqs`: `chunks[i] = (first, end)` are the
    positions of sequence seqs[i]'s new tokens (its context is then `end` tokens); returns the rows."""
    num_new = [end - first for first, end in chunks]
    cu_seqlens = torch.tensor([0, *torch.tensor(num_new).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    rows = torch.cat([q[seq][first:end] for seq, (first, end) in zip(seqs, chunks)])
    context_lens = torch.tensor([end for _, end in chunks], dtype=torch.int32, device=DEVICE)
    out = paged_prefill_attention(rows, case.pages, case.block_tables[seqs], cu_seqlens, context_lens, 0.3)
    expected = paged_prefill_attention_ref(rows, case.pages, case.block_tables[seqs], cu_seqlens, context_lens, 0.3)
    return out, expected, cu_seqlens.tolist()


@pytest.mark.parametrize("precision,dtype,num_window_blocks", CASES, ids=CASE_IDS)
def test_prefill_rows_are_the_same_whatever_the_chunks(precision, dtype, num_window_blocks):
    # Every token's K/V is already in the pages, as after the earlier chunks were written.
    context_lens = [45, 21, 70]
    case = _case(precision, dtype, num_window_blocks, context_lens, seed=53)
    generator = torch.Generator().manual_seed(54)
    q = [torch.randn(n, TINY_HEADS, TINY_DIM, generator=generator).to(DEVICE, dtype) for n in context_lens]

    whole, expected, _ = _prefill(case, q, [0], [(0, 45)])
    assert _report(f"prefill {precision} one chunk vs reference", whole, expected) <= _tolerance(dtype)
    for boundaries in ([0, 19, 45], [0, 7, 30, 45], [0, 16, 32, 45], [0, 44, 45]):
        for first, end in zip(boundaries, boundaries[1:]):
            out, _, _ = _prefill(case, q, [0], [(first, end)])
            assert torch.equal(out, whole[first:end]), f"chunk {first}:{end} of {boundaries} != one chunk"

    # Batched with two other sequences (one chunk each, one after a cached prefix), in the middle.
    out, expected, starts = _prefill(case, q, [1, 0, 2], [(3, 21), (0, 45), (50, 70)])
    assert _report(f"prefill {precision} batched vs reference", out, expected) <= _tolerance(dtype)
    assert torch.equal(out[starts[1] : starts[2]], whole), "batched != alone"
    out, _, starts = _prefill(case, q, [2, 0], [(0, 33), (19, 45)])
    assert torch.equal(out[starts[1] : starts[2]], whole[19:45]), "second chunk, batched != one chunk"


# ---------------------------------------------------------------- GPU tests at model shapes


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp16", "int8", "int4"])
def test_decode_row_is_the_same_alone_and_in_a_batch_gpu(precision):
    # 1.5B shape; the batch's longest context gives 33000 / 256 = 129 partitions, the
    # sequence under test 32, so the merge sees very different num_splits.
    context_lens = [8192, 1000, 33000, 17]
    case = PagedCase(precision, torch.float16, 16, 2, 128, context_lens, seed=55, num_window_blocks=0)
    q = torch.randn(len(context_lens), 12, 128, generator=torch.Generator().manual_seed(56)).to(DEVICE, torch.float16)
    args = (case.pages, case.block_tables, case.context_lens_t, 128**-0.5)
    batched = paged_decode_attention(q, *args, partition_tokens=INVARIANT_PARTITION_TOKENS)
    expected = paged_decode_attention_ref(q.float(), *args)
    assert _report(f"decode gpu {precision} batched, fixed partitions", batched, expected) <= 2e-3
    for seq in range(len(context_lens)):
        num_blocks = -(-context_lens[seq] // 16)
        alone = paged_decode_attention(
            q[seq : seq + 1],
            case.pages,
            case.block_tables[seq : seq + 1, :num_blocks],
            case.context_lens_t[seq : seq + 1],
            128**-0.5,
            partition_tokens=INVARIANT_PARTITION_TOKENS,
        )
        assert torch.equal(alone[0], batched[seq]), f"sequence {seq}: alone != batched"


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp16", "int8", "int4"])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(12, 2, 128), (16, 1, 576)])
def test_both_merges_match_and_fixed_partitions_take_the_merge_kernel_gpu(precision, num_heads, num_kv_heads, head_dim):
    # The merge inside the decode kernel (atomics, partials read back from L2) and the merge
    # kernel, at the 1.5B shape and DeepSeek-V2-Lite's latent one (V aliased to K).
    context_lens = [8192, 1000, 4097, 17]
    case = PagedCase(precision, torch.float16, 16, num_kv_heads, head_dim, context_lens, seed=63)
    if head_dim == 576:
        case.pages.v, case.pages.v_scale, case.pages.v_zero = case.pages.k, case.pages.k_scale, case.pages.k_zero
    q = torch.randn(len(context_lens), num_heads, head_dim, generator=torch.Generator().manual_seed(64))
    q = q.to(DEVICE, torch.float16)
    args = (case.pages, case.block_tables, case.context_lens_t, head_dim**-0.5)
    expected = paged_decode_attention_ref(q.float(), *args)
    default = default_decode_config(DEVICE, head_dim, case.pages.bits)
    for partitioning in ({"partition_tokens": INVARIANT_PARTITION_TOKENS}, {"num_splits": 8}, {"num_splits": 40}):
        separate, fused = (
            paged_decode_attention(
                q, *args, **partitioning, _config=replace(default, max_fused_splits=max_fused_splits)
            )
            for max_fused_splits in (0, 1 << 30)
        )
        label = f"decode gpu {precision} D={head_dim} {partitioning}"
        assert _report(f"{label} fused", fused, expected) <= 2e-3
        assert _report(f"{label} separate", separate, expected) <= 2e-3
        if "partition_tokens" in partitioning:  # always the merge kernel
            assert torch.equal(fused, separate), f"{label}: fixed partitions merged in the decode kernel"
    counters = paged_attention.MERGE_COUNTERS.get(torch.device(DEVICE), 1)
    assert not counters.any(), "the fused merge left a counter above zero"


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp16", "int4"])
def test_prefill_rows_are_the_same_whatever_the_chunks_gpu(precision):
    context_lens = [3000, 500]
    case = PagedCase(precision, torch.float16, 16, 2, 128, context_lens, seed=57)
    generator = torch.Generator().manual_seed(58)
    q = [torch.randn(n, 12, 128, generator=generator).to(DEVICE, torch.float16) for n in context_lens]
    whole, _, _ = _prefill(case, q, [0], [(0, 3000)])
    for first, end in ((0, 1000), (1000, 2048), (2048, 3000), (2999, 3000)):
        out, _, _ = _prefill(case, q, [0], [(first, end)])
        assert torch.equal(out, whole[first:end]), f"chunk {first}:{end} != one chunk"
    out, _, starts = _prefill(case, q, [1, 0], [(0, 500), (1000, 3000)])
    assert torch.equal(out[starts[1] :], whole[1000:]), "batched chunk != one chunk"
