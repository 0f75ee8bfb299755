"""Batch invariance of prefill attention: a row's output, bit for bit, whatever the chunking of
its prompt and whatever shares its batch.

Greedy generation in a batched server gives the text of the request run alone only if every
kernel gives a row the same bits whatever the other rows are; the batch-invariant mode sends
decode rows through the prefill kernel too (lowvram.kv.attention). Each test also checks the
outputs against the reference, so two equal wrong answers fail.
"""

import pytest
import torch
from test_paged_attention import DEVICE, TINY_DIM, TINY_HEADS, PagedCase, _report

from lowvram.kernels.paged_attention import paged_prefill_attention, paged_prefill_attention_ref

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


def _case(precision, dtype, num_window_blocks, context_lens, seed):
    pages_dtype = dtype if precision == "fp16" else torch.float32
    return PagedCase(
        precision, pages_dtype, 8, 2, TINY_DIM, context_lens, seed=seed, num_window_blocks=num_window_blocks
    )


def _tolerance(dtype):
    return 2e-3 if dtype == torch.float16 else 1e-5


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
