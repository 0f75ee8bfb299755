"""Paged decode/prefill attention: kernels against the references, references against dense attention.

Without CUDA the kernels run in the Triton interpreter on tiny shapes; the
`gpu` tests run real model shapes. Every comparison prints its largest difference.
"""

import math
import os

import pytest
import torch

from lowvram.errors import KernelError
from lowvram.kernels import paged_attention
from lowvram.kernels.kv_quant import allocate_pages, dequantize_kv, quantize_kv
from lowvram.kernels.kv_write import write_kv_ref
from lowvram.kernels.paged_attention import (
    paged_decode_attention,
    paged_decode_attention_ref,
    paged_prefill_attention,
    paged_prefill_attention_ref,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TINY_DIM, TINY_HEADS = 16, 4


class PagedCase:
    """Sequences of random K/V written into pages through a shuffled block table.

    Unwritten page slots and unused table entries hold NaN / -1, so a kernel that
    reads past a context shows up as NaN or a crash. With `num_window_blocks`, that many
    pages (every third in table order) are also kept in FP16 (`KVPages.window_row`),
    and their tokens are expected unquantized; `window_pages_at` names them instead, as
    (sequence, page of the sequence) pairs.
    """

    def __init__(
        self,
        precision,
        dtype,
        block_size,
        num_kv_heads,
        head_dim,
        context_lens,
        seed,
        device=DEVICE,
        num_window_blocks=0,
        window_pages_at=(),
    ):
        generator = torch.Generator().manual_seed(seed)
        self.block_size = block_size
        self.context_lens = context_lens
        max_blocks = max(math.ceil(n / block_size) for n in context_lens) + 1
        num_blocks = len(context_lens) * max_blocks + 3
        self.pages = allocate_pages(num_blocks, block_size, num_kv_heads, head_dim, precision, dtype, device)
        if precision == "fp16":
            self.pages.k.fill_(float("nan"))
            self.pages.v.fill_(float("nan"))
        else:
            for name in ("k_scale", "k_zero", "v_scale", "v_zero"):
                getattr(self.pages, name).fill_(float("nan"))
        order = torch.randperm(num_blocks, generator=generator)
        window = order[: 3 * num_window_blocks : 3].tolist()
        if window_pages_at:
            first_block = [
                sum(math.ceil(n / block_size) for n in context_lens[:seq]) for seq in range(len(context_lens))
            ]
            window = [int(order[first_block[seq] + page]) for seq, page in window_pages_at]
        if window:
            shape = (len(window), block_size, num_kv_heads, head_dim)
            self.pages.window_k = torch.full(shape, float("nan"), dtype=dtype, device=device)
            self.pages.window_v = torch.full(shape, float("nan"), dtype=dtype, device=device)
            self.pages.window_row = torch.full((num_blocks,), -1, dtype=torch.int32)
            self.pages.window_row[window] = torch.arange(len(window), dtype=torch.int32).flip(0)
            self.pages.window_row = self.pages.window_row.to(device)
        self.block_tables = torch.full((len(context_lens), max_blocks), -1, dtype=torch.int32)
        self.k_dense, self.v_dense = [], []  # float32 [L, Hkv, D] per sequence, as stored
        next_block = 0
        for seq, context_len in enumerate(context_lens):
            num_seq_blocks = math.ceil(context_len / block_size)
            self.block_tables[seq, :num_seq_blocks] = order[next_block : next_block + num_seq_blocks].int()
            next_block += num_seq_blocks
            k = (torch.randn(context_len, num_kv_heads, head_dim, generator=generator) * 1.5).to(dtype)
            v = torch.randn(context_len, num_kv_heads, head_dim, generator=generator).to(dtype)
            positions = torch.arange(context_len)
            slots = self.block_tables[seq, positions // block_size].long() * block_size + positions % block_size
            write_kv_ref(k.to(device), v.to(device), slots.to(device), self.pages)
            pages_of_tokens = self.block_tables[seq, positions // block_size]
            is_kept = torch.isin(pages_of_tokens, torch.tensor(window, dtype=torch.int32))
            self.k_dense.append(torch.where(is_kept[:, None, None], k.float(), _as_stored(k, precision)).to(device))
            self.v_dense.append(torch.where(is_kept[:, None, None], v.float(), _as_stored(v, precision)).to(device))
        self.block_tables = self.block_tables.to(device)
        self.context_lens_t = torch.tensor(context_lens, dtype=torch.int32, device=device)


def _as_stored(x, precision):
    """What the pages give back for x: itself, or its quantize/dequantize round trip."""
    if precision == "fp16":
        return x.float()
    bits = 8 if precision == "int8" else 4
    return dequantize_kv(*quantize_kv(x, bits), bits, x.shape[-1])


def _dense_attention(q, k, v, scale, q_positions):
    """Textbook attention, one head at a time: q [M, H, D], k/v [L, Hkv, D] -> [M, H, D]."""
    num_heads = q.shape[1]
    group_size = num_heads // k.shape[1]
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for head in range(num_heads):
        k_head = k[:, head // group_size].float()
        v_head = v[:, head // group_size].float()
        scores = q[:, head].float() @ k_head.T * scale  # [M, L]
        is_visible = torch.arange(k.shape[0], device=q.device)[None, :] <= q_positions[:, None]
        scores = torch.where(is_visible, scores, torch.full_like(scores, -1e30))
        weights = torch.exp(scores - scores.max(dim=1, keepdim=True).values) * is_visible
        out[:, head] = (weights / weights.sum(dim=1, keepdim=True)) @ v_head
    return out


def _relative_error(out, expected):
    """Per-row norm of the difference over the norm of the expected row, worst row."""
    out, expected = out.float().flatten(1), expected.float().flatten(1)
    return ((out - expected).norm(dim=1) / expected.norm(dim=1).clamp(min=1e-30)).max().item()


def _report(label, out, expected):
    assert not torch.isnan(out).any(), f"{label}: NaN in the output"
    max_diff = (out.float() - expected.float()).abs().max().item()
    rel = _relative_error(out, expected)
    print(f"{label}: max |diff| {max_diff:.3e}, relative error {rel:.3e}")
    return rel


def _prefill_batch(case, num_new_tokens, num_heads, seed):
    generator = torch.Generator().manual_seed(seed)
    cu_seqlens = torch.tensor([0, *torch.tensor(num_new_tokens).cumsum(0).tolist()], dtype=torch.int32)
    dtype = case.pages.k.dtype if not case.pages.is_quantized else torch.float32
    q = torch.randn(int(cu_seqlens[-1]), num_heads, case.pages.head_dim, generator=generator).to(DEVICE, dtype)
    return q, cu_seqlens.to(DEVICE)


# ---------------------------------------------------------------- CPU (interpreter) tests


def test_page_offsets_widen_only_past_int32():
    """The kernels compute page offsets in int32 unless some page array reaches 2**31
    elements from its start (shapes only: meta tensors hold no memory)."""

    def pages(num_blocks, precision):
        return allocate_pages(num_blocks, 16, 2, 128, precision, device="meta")

    assert not paged_attention._needs_wide_offsets(pages(2**31 // 4096 - 1, "int8"))
    assert paged_attention._needs_wide_offsets(pages(2**31 // 4096, "int8"))
    assert paged_attention._needs_wide_offsets(pages(2**31 // 4096, "fp16"))
    assert not paged_attention._needs_wide_offsets(pages(2**31 // 4096, "int4"))  # half-width codes


@pytest.mark.parametrize("precision", ["fp16", "int8"])
def test_wide_page_offsets_give_the_same_bits(precision, monkeypatch):
    """The int64 page offsets of very large page arrays, forced on small ones: decode and
    prefill give exactly what the int32 ones give."""
    case = PagedCase(
        precision, torch.float32, 4, 2, TINY_DIM, [9, 3], seed=25, num_window_blocks=0 if precision == "fp16" else 1
    )
    q = torch.randn(2, TINY_HEADS, TINY_DIM, generator=torch.Generator().manual_seed(26)).to(DEVICE)
    decode_args = (q, case.pages, case.block_tables, case.context_lens_t, TINY_DIM**-0.5)
    q_new, cu_seqlens = _prefill_batch(case, [3, 2], TINY_HEADS, seed=27)
    prefill_args = (q_new, case.pages, case.block_tables, cu_seqlens, case.context_lens_t, TINY_DIM**-0.5)
    narrow = paged_decode_attention(*decode_args), paged_prefill_attention(*prefill_args)
    monkeypatch.setattr(paged_attention, "_needs_wide_offsets", lambda pages: True)
    wide = paged_decode_attention(*decode_args), paged_prefill_attention(*prefill_args)
    for a, b in zip(narrow, wide):
        assert torch.equal(a, b)


def test_kernel_path_is_exercised():
    # Without this the kernel-vs-reference tests would compare the reference with itself.
    assert paged_attention._use_triton("test", DEVICE, use_reference=False)


@pytest.mark.parametrize("precision", ["fp16", "int8", "int4"])
def test_reference_matches_dense_attention(precision):
    case = PagedCase(precision, torch.float32, 8, 2, TINY_DIM, [1, 9, 24, 30], seed=0)
    generator = torch.Generator().manual_seed(1)
    scale = TINY_DIM**-0.5

    q = torch.randn(4, TINY_HEADS, TINY_DIM, generator=generator).to(DEVICE)
    out = paged_decode_attention_ref(q, case.pages, case.block_tables, case.context_lens_t, scale)
    for seq, context_len in enumerate(case.context_lens):
        last = torch.tensor([context_len - 1], device=DEVICE)
        expected = _dense_attention(q[seq : seq + 1], case.k_dense[seq], case.v_dense[seq], scale, last)
        assert _report(f"decode ref {precision} seq {seq}", out[seq : seq + 1], expected) <= 1e-5

    num_new = [1, 4, 24, 11]  # seq 2 has no cached prefix
    q, cu_seqlens = _prefill_batch(case, num_new, TINY_HEADS, seed=2)
    out = paged_prefill_attention_ref(q, case.pages, case.block_tables, cu_seqlens, case.context_lens_t, scale)
    for seq, context_len in enumerate(case.context_lens):
        rows = slice(int(cu_seqlens[seq]), int(cu_seqlens[seq + 1]))
        positions = torch.arange(context_len - num_new[seq], context_len, device=DEVICE)
        expected = _dense_attention(q[rows], case.k_dense[seq], case.v_dense[seq], scale, positions)
        assert _report(f"prefill ref {precision} seq {seq}", out[rows], expected) <= 1e-5


@pytest.mark.parametrize("num_splits", [1, 3, None])
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("num_kv_heads", [2, 4])
@pytest.mark.parametrize("precision", ["fp16", "int8", "int4"])
def test_decode_kernel_matches_reference(precision, num_kv_heads, block_size, num_splits):
    # Float32 pages and queries: the interpreter's float32 dot is exact, so only
    # summation order separates kernel and reference.
    case = PagedCase(precision, torch.float32, block_size, num_kv_heads, TINY_DIM, [1, 13, 40, 16, 33], seed=3)
    generator = torch.Generator().manual_seed(4)
    q = torch.randn(5, TINY_HEADS, TINY_DIM, generator=generator).to(DEVICE)
    args = (q, case.pages, case.block_tables, case.context_lens_t, 0.3)
    out = paged_decode_attention(*args, num_splits=num_splits)
    expected = paged_decode_attention_ref(*args)
    label = f"decode {precision} Hkv={num_kv_heads} B={block_size} splits={num_splits}"
    assert _report(label, out, expected) <= 1e-5


def test_decode_kernel_fp16():
    case = PagedCase("fp16", torch.float16, 16, 2, TINY_DIM, [1, 40, 17], seed=5)
    q = torch.randn(3, TINY_HEADS, TINY_DIM, generator=torch.Generator().manual_seed(6)).to(DEVICE, torch.float16)
    args = (q, case.pages, case.block_tables, case.context_lens_t, 0.25)
    for num_splits in (1, 3):
        out = paged_decode_attention(*args, num_splits=num_splits)
        assert out.dtype == torch.float16
        assert _report(f"decode fp16 splits={num_splits}", out, paged_decode_attention_ref(*args)) <= 2e-3


@pytest.mark.parametrize("num_splits", [2, 8, 144])
def test_decode_long_contexts(num_splits):
    # 2 splits: several tiles per partition, so the online softmax rescales across tiles.
    # 8 splits: partitions in several lanes of the merge. 144 (one 16-token tile each): more
    # partitions than the merge kernel's lanes, so a lane adds two.
    context_lens = [2300, 97] if num_splits > paged_attention.MERGE_KERNEL_LANES else [150, 97]
    case = PagedCase("int8", torch.float32, 16, 2, TINY_DIM, context_lens, seed=7)
    q = torch.randn(2, TINY_HEADS, TINY_DIM, generator=torch.Generator().manual_seed(8)).to(DEVICE)
    args = (q, case.pages, case.block_tables, case.context_lens_t, 0.25)
    out = paged_decode_attention(*args, num_splits=num_splits)
    assert _report(f"decode long contexts splits={num_splits}", out, paged_decode_attention_ref(*args)) <= 1e-5


@pytest.mark.parametrize("has_prefix", [False, True])
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("num_kv_heads", [2, 4])
@pytest.mark.parametrize("precision", ["fp16", "int8", "int4"])
def test_prefill_kernel_matches_reference(precision, num_kv_heads, block_size, has_prefix):
    context_lens = [1, 21, 37] if has_prefix else [1, 12, 37]
    num_new = [1, 5, 18] if has_prefix else context_lens
    case = PagedCase(precision, torch.float32, block_size, num_kv_heads, TINY_DIM, context_lens, seed=9)
    q, cu_seqlens = _prefill_batch(case, num_new, TINY_HEADS, seed=10)
    args = (q, case.pages, case.block_tables, cu_seqlens, case.context_lens_t, 0.3)
    out = paged_prefill_attention(*args)
    expected = paged_prefill_attention_ref(*args)
    label = f"prefill {precision} Hkv={num_kv_heads} B={block_size} prefix={has_prefix}"
    assert _report(label, out, expected) <= 1e-5


def test_prefill_kernel_fp16_strided_q():
    case = PagedCase("fp16", torch.float16, 16, 2, TINY_DIM, [20, 33], seed=11)
    qkv = torch.randn(30, TINY_HEADS + 4, TINY_DIM, generator=torch.Generator().manual_seed(12))
    q = qkv.to(DEVICE, torch.float16)[:, :TINY_HEADS]  # [T, H, D] view of a fused projection
    cu_seqlens = torch.tensor([0, 10, 30], dtype=torch.int32, device=DEVICE)
    args = (q, case.pages, case.block_tables, cu_seqlens, case.context_lens_t, 0.25)
    out = paged_prefill_attention(*args)
    assert _report("prefill fp16 strided q", out, paged_prefill_attention_ref(*args)) <= 2e-3


def test_attention_rejects_bad_inputs():
    case = PagedCase("int4", torch.float32, 8, 2, TINY_DIM, [5, 9], seed=13)
    q = torch.zeros(2, TINY_HEADS, TINY_DIM, device=DEVICE)
    with pytest.raises(KernelError, match="block_tables"):
        paged_decode_attention(q, case.pages, case.block_tables.long(), case.context_lens_t, 1.0)
    with pytest.raises(KernelError, match="context_lens"):
        paged_decode_attention(q, case.pages, case.block_tables, case.context_lens_t.long(), 1.0)
    with pytest.raises(KernelError, match="not a multiple"):
        paged_decode_attention(q[:, :3], case.pages, case.block_tables, case.context_lens_t, 1.0)
    with pytest.raises(KernelError, match="head_dim"):
        paged_decode_attention(q[:, :, :8], case.pages, case.block_tables, case.context_lens_t, 1.0)
    cu_seqlens = torch.tensor([0, 2], dtype=torch.int32, device=DEVICE)
    with pytest.raises(KernelError, match="cu_seqlens_q"):
        paged_prefill_attention(q, case.pages, case.block_tables, cu_seqlens, case.context_lens_t, 1.0)


def test_int4_heads_not_a_multiple_of_four_go_to_the_reference():
    """The kernels read INT4 heads as 16-bit words of four codes: a head of 18 elements is
    refused with the way out named, and the reference path reads it."""
    case = PagedCase("int4", torch.float32, 8, 2, 18, [5, 9], seed=14)
    q = torch.randn(2, TINY_HEADS, 18, generator=torch.Generator().manual_seed(15)).to(DEVICE)
    args = (q, case.pages, case.block_tables, case.context_lens_t, 18**-0.5)
    with pytest.raises(KernelError, match="multiple of 4.*use_reference=True"):
        paged_decode_attention(*args)
    out = paged_decode_attention(*args, use_reference=True)
    assert _report("decode int4 head 18, reference", out, paged_decode_attention_ref(*args)) == 0.0


@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_pages_kept_in_fp16_are_read_unquantized(precision):
    # Kernels and references against dense attention over the FP16 values of the kept
    # pages and the dequantized values of the others.
    case = PagedCase(precision, torch.float32, 8, 2, TINY_DIM, [1, 9, 24, 30], seed=30, num_window_blocks=4)
    scale = TINY_DIM**-0.5
    q = torch.randn(4, TINY_HEADS, TINY_DIM, generator=torch.Generator().manual_seed(31)).to(DEVICE) * 4.0
    num_new = [1, 4, 24, 11]
    q_new, cu_seqlens = _prefill_batch(case, num_new, TINY_HEADS, seed=32)
    decode_args = (q, case.pages, case.block_tables, case.context_lens_t, scale)
    prefill_args = (q_new, case.pages, case.block_tables, cu_seqlens, case.context_lens_t, scale)

    def expected(q_rows, seq, positions):
        return _dense_attention(q_rows, case.k_dense[seq], case.v_dense[seq], scale, positions.to(DEVICE))

    out = paged_decode_attention(*decode_args, num_splits=2)
    assert _report(f"decode {precision} window, kernel", out, paged_decode_attention_ref(*decode_args)) <= 1e-5
    dense = torch.cat(
        [expected(q[seq : seq + 1], seq, torch.tensor([n - 1])) for seq, n in enumerate(case.context_lens)]
    )
    assert _report(f"decode {precision} window, kernel vs dense", out, dense) <= 1e-5
    out = paged_prefill_attention(*prefill_args)
    assert _report(f"prefill {precision} window, kernel", out, paged_prefill_attention_ref(*prefill_args)) <= 1e-5
    for seq, n in enumerate(case.context_lens):
        rows = slice(int(cu_seqlens[seq]), int(cu_seqlens[seq + 1]))
        assert (
            _report(
                f"prefill {precision} window seq {seq}",
                out[rows],
                expected(q_new[rows], seq, torch.arange(n - num_new[seq], n)),
            )
            <= 1e-5
        )
    # The same pages read without the window: only the codes, far from the FP16 values.
    case.pages.window_row.fill_(-1)
    assert _relative_error(paged_decode_attention(*decode_args, num_splits=2), dense) > 1e-3


@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_float16_queries_over_codes_and_kept_pages(precision):
    # Float16 queries: the decode kernel's codes enter its dots as subnormals with their
    # scales times 2**24; the tiles where prefill mixes kept pages (scale 1) with codes must
    # not, or a row's V scale would push the kept tokens' weights below float16's range.
    case = PagedCase(
        precision, torch.float16, 8, 2, TINY_DIM, [40, 64], seed=82, window_pages_at=[(0, 2), (1, 0), (1, 7)]
    )
    scale = TINY_DIM**-0.5
    q = torch.randn(2, TINY_HEADS, TINY_DIM, generator=torch.Generator().manual_seed(83)).to(DEVICE, torch.float16)
    decode_args = (q, case.pages, case.block_tables, case.context_lens_t, scale)
    out = paged_decode_attention(*decode_args, num_splits=2)
    expected = paged_decode_attention_ref(q.float(), *decode_args[1:])
    assert _report(f"decode {precision} fp16 q, kept pages", out, expected) <= 2e-3
    q_new, cu_seqlens = _prefill_batch(case, [17, 30], TINY_HEADS, seed=84)
    q_new = q_new.to(torch.float16)
    prefill_args = (q_new, case.pages, case.block_tables, cu_seqlens, case.context_lens_t, scale)
    expected = paged_prefill_attention_ref(q_new.float(), *prefill_args[1:])
    assert _report(f"prefill {precision} fp16 q, kept pages", paged_prefill_attention(*prefill_args), expected) <= 2e-3


@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_decode_reads_kept_pages_wherever_they_sit(precision):
    # The decode kernel reads codes in its main loop and the pages kept in FP16 in a pass of
    # their own over the tiles that hold them: a sequence whose pages are all kept (its main
    # loop sees no token), one with a kept page mid-context, one with none, in partitions
    # with and without kept pages (100 tokens in 3 splits: the kept page sits in the first).
    context_lens = [12, 100, 64]
    case = PagedCase(
        precision, torch.float32, 8, 2, TINY_DIM, context_lens, seed=80, window_pages_at=[(0, 0), (0, 1), (1, 5)]
    )
    scale = TINY_DIM**-0.5
    q = torch.randn(3, TINY_HEADS, TINY_DIM, generator=torch.Generator().manual_seed(81)).to(DEVICE) * 4.0
    args = (q, case.pages, case.block_tables, case.context_lens_t, scale)
    dense = torch.cat(
        [
            _dense_attention(
                q[seq : seq + 1], case.k_dense[seq], case.v_dense[seq], scale, torch.tensor([n - 1], device=DEVICE)
            )
            for seq, n in enumerate(context_lens)
        ]
    )
    for partitioning in ({"num_splits": 1}, {"num_splits": 3}):
        out = paged_decode_attention(*args, **partitioning)
        assert _report(f"decode {precision} kept pages {partitioning}", out, dense) <= 1e-5


@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_quantized_pages_keep_float16_queries_accurate(precision):
    # The kernels apply V's scales to the softmax weights before a float16 dot. Tokens whose
    # values span 1e-3 to 10 put small and large scales in one tile; weights scaled down to
    # float16 subnormals, or rounded without the zero term seeing the same rounding, lose
    # the small rows. (Dequantizing each element to float16 first gave relative errors of
    # 0.9-1.0e-3 in decode and 1.2e-3 in prefill here.)
    generator = torch.Generator().manual_seed(60)
    num_tokens, block_size, num_kv_heads, head_dim = 700, 16, 2, 64
    num_blocks = math.ceil(num_tokens / block_size)
    pages = allocate_pages(num_blocks, block_size, num_kv_heads, head_dim, precision, torch.float16, DEVICE)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator) * 1.5
    magnitudes = 10 ** (torch.rand(num_tokens, 1, 1, generator=generator) * 4 - 3)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator) * magnitudes
    write_kv_ref(k.half().to(DEVICE), v.half().to(DEVICE), torch.arange(num_tokens, device=DEVICE), pages)
    tables = torch.arange(num_blocks, dtype=torch.int32, device=DEVICE)[None]
    lens = torch.tensor([num_tokens], dtype=torch.int32, device=DEVICE)
    q = (torch.randn(1, TINY_HEADS, head_dim, generator=generator) * 2).to(DEVICE, torch.float16)
    expected = paged_decode_attention_ref(q.float(), pages, tables, lens, head_dim**-0.5)
    out = paged_decode_attention(q, pages, tables, lens, head_dim**-0.5, num_splits=2)
    assert _report(f"decode {precision} fp16 q, values 1e-3..10", out, expected) <= 6e-4
    # The last 48 tokens as a prefill chunk after a cached prefix (float16 outputs: half of
    # this is their own rounding).
    q_new = (torch.randn(48, TINY_HEADS, head_dim, generator=generator) * 2).to(DEVICE, torch.float16)
    cu_seqlens = torch.tensor([0, 48], dtype=torch.int32, device=DEVICE)
    expected = paged_prefill_attention_ref(q_new.float(), pages, tables, cu_seqlens, lens, head_dim**-0.5)
    out = paged_prefill_attention(q_new, pages, tables, cu_seqlens, lens, head_dim**-0.5)
    assert _report(f"prefill {precision} fp16 q, values 1e-3..10", out, expected) <= 6e-4


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(6, 2, 24), (4, 4, 40), (4, 1, 20), (12, 1, 24)])
@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_codes_become_floats_exactly(precision, num_heads, num_kv_heads, head_dim, dtype):
    # Codes made floats without rounding (subnormals, or OR-ed into a float's mantissa) keep
    # decode within float32 rounding of the reference. Groups of 3, 4 and 1 query heads (one
    # 8-wide tile) and of 12 (a 16-wide one), contexts that end
    # inside a page, and an INT4 head of 20 whose half-head planes are padded.
    case = PagedCase(precision, dtype, 8, num_kv_heads, head_dim, [1, 13, 40, 29], seed=70, num_window_blocks=2)
    q = torch.randn(4, num_heads, head_dim, generator=torch.Generator().manual_seed(71)).to(DEVICE, dtype)
    args = (q, case.pages, case.block_tables, case.context_lens_t, head_dim**-0.5)
    expected = paged_decode_attention_ref(q.float(), *args[1:])
    out = paged_decode_attention(*args, num_splits=3)
    label = f"decode {precision} {dtype} H={num_heads} Hkv={num_kv_heads} D={head_dim}"
    assert _report(label, out, expected) <= (1e-5 if dtype == torch.float32 else 6e-4)


def test_choose_num_splits_fills_the_gpu():
    # 1.5B shape on a 132-SM GPU: one sequence needs many partitions, a big batch none.
    assert paged_attention.choose_num_splits(1, 2, 8192, 132) == 64
    assert paged_attention.choose_num_splits(1, 2, 100, 132) == 1
    assert paged_attention.choose_num_splits(256, 2, 32768, 132) <= 2


def test_decode_tiles_fit_the_grid():
    # The 2-warp defaults of a 132-SM GPU (H200) against the 1.5B shape's grids.
    fit = paged_attention.fit_decode_config
    defaults = {
        bits: paged_attention.DecodeConfig(block_n=tokens, num_warps=2, num_stages=3)
        for bits, tokens in paged_attention.ASYNC_DECODE_TILE_TOKENS.items()
    }
    latency = paged_attention.LATENCY_DECODE_CONFIG
    # No more programs than SMs: one sequence to 8K (64 partitions of 2 KV heads), eight to 512.
    for bits in (16, 8, 4):
        assert fit(defaults[bits], 1, 2, 8192, 132) == latency
        assert fit(defaults[bits], 8, 2, 512, 132) == latency
        assert fit(defaults[bits], 8, 2, 131072, 132) == defaults[bits]
    # Partitions shorter than two tiles: INT4's 128-token tiles halve (to 64 at the least).
    assert fit(defaults[4], 8, 2, 8192, 132).block_n == 64  # 33 partitions of 249 tokens
    assert fit(defaults[4], 1, 2, 32768, 132).block_n == 64  # 264 of 125
    assert fit(defaults[4], 4, 2, 32768, 132).block_n == 128  # 66 of 497
    assert fit(defaults[4], 8, 2, 32768, 132).block_n == 128
    assert fit(defaults[8], 8, 2, 4096, 132) == defaults[8]
    assert fit(defaults[16], 8, 2, 4096, 132) == defaults[16]


@pytest.mark.parametrize("head_dim", [24, 72])
@pytest.mark.parametrize("precision", ["fp16", "int8", "int4"])
def test_kernels_take_head_dims_that_are_not_powers_of_two(precision, head_dim):
    # Tiles are padded to the next power of two with masked columns; a column read past
    # head_dim would pull in the next row (or a NaN) and show up against the reference.
    case = PagedCase(precision, torch.float32, 8, 2, head_dim, [1, 13, 40], seed=40)
    generator = torch.Generator().manual_seed(41)
    q = torch.randn(3, TINY_HEADS, head_dim, generator=generator).to(DEVICE)
    args = (q, case.pages, case.block_tables, case.context_lens_t, head_dim**-0.5)
    for num_splits in (1, 3):
        out = paged_decode_attention(*args, num_splits=num_splits)
        label = f"decode {precision} D={head_dim} splits={num_splits}"
        assert _report(label, out, paged_decode_attention_ref(*args)) <= 1e-5
    q, cu_seqlens = _prefill_batch(case, [1, 5, 40], TINY_HEADS, seed=42)
    args = (q, case.pages, case.block_tables, cu_seqlens, case.context_lens_t, head_dim**-0.5)
    out = paged_prefill_attention(*args)
    assert _report(f"prefill {precision} D={head_dim}", out, paged_prefill_attention_ref(*args)) <= 1e-5


def test_kernels_read_latent_pages_whose_values_are_their_keys():
    # MLA (DeepSeek-V2): one KV head of latent + RoPE values, V the same tensor as K.
    case = PagedCase("fp16", torch.float32, 8, 1, 40, [3, 29], seed=43)
    case.pages.v = case.pages.k
    q = torch.randn(2, TINY_HEADS, 40, generator=torch.Generator().manual_seed(44)).to(DEVICE)
    args = (q, case.pages, case.block_tables, case.context_lens_t, 0.2)
    out = paged_decode_attention(*args, num_splits=2)
    for seq, context_len in enumerate(case.context_lens):
        expected = _dense_attention(
            q[seq : seq + 1], case.k_dense[seq], case.k_dense[seq], 0.2, torch.tensor([context_len - 1], device=DEVICE)
        )
        assert _report(f"decode latent seq {seq}", out[seq : seq + 1], expected) <= 1e-5


# ---------------------------------------------------------------- GPU tests at model shapes

GPU_SHAPES = [(12, 2), (16, 16)]  # (heads, kv heads): R1-Distill-Qwen-1.5B, deepseek-coder-1.3b
GPU_CONTEXTS = [1, 15, 16, 17, 255, 1000, 4097, 8192]


@pytest.fixture
def exact_fp32_matmul():
    """The FP32 reference must not run its matmuls in TF32."""
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = saved


def _gpu_tolerance(precision):
    # FP16 pages against the FP32 reference; quantized pages against their dequantized
    # reference (the kernel rounds the softmax weights, times V's scales, to FP16 for the dot).
    return 1e-3 if precision == "fp16" else 2e-3


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp16", "int8", "int4"])
@pytest.mark.parametrize("num_heads,num_kv_heads", GPU_SHAPES)
def test_decode_real_shapes_gpu(precision, num_heads, num_kv_heads, exact_fp32_matmul):
    case = PagedCase(precision, torch.float16, 16, num_kv_heads, 128, GPU_CONTEXTS, seed=20)
    q = torch.randn(len(GPU_CONTEXTS), num_heads, 128, generator=torch.Generator().manual_seed(21))
    q = q.to(DEVICE, torch.float16)
    args = (q, case.pages, case.block_tables, case.context_lens_t, 128**-0.5)
    expected = paged_decode_attention_ref(q.float(), case.pages, case.block_tables, case.context_lens_t, 128**-0.5)
    for num_splits in (None, 1):
        out = paged_decode_attention(*args, num_splits=num_splits)
        label = f"decode gpu {precision} H={num_heads} Hkv={num_kv_heads} splits={num_splits}"
        assert _report(label, out, expected) <= _gpu_tolerance(precision)


def _prefill_error_gpu(case, num_new, num_heads, head_dim, generator, label):
    """Largest relative difference of the prefill kernel from its reference on fp16 queries drawn
    from `generator` for `num_new` new tokens per sequence (printed under `label`)."""
    cu_seqlens = torch.tensor([0, *torch.tensor(num_new).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    q = torch.randn(sum(num_new), num_heads, head_dim, generator=generator).to(DEVICE, torch.float16)
    args = (case.pages, case.block_tables, cu_seqlens, case.context_lens_t, head_dim**-0.5)
    return _report(label, paged_prefill_attention(q, *args), paged_prefill_attention_ref(q.float(), *args))


def _int8_errors_past_int32_offsets() -> tuple[float, float]:
    """Decode and prefill errors against the references on INT8 pages of 2**31 + 8 * 4096
    codes per array (4 GiB with V), with a sequence in the last pages, past int32 offsets.
    The pages are released before returning or raising."""
    block_size, num_kv_heads, head_dim = 16, 2, 128
    num_blocks = 2**31 // (block_size * num_kv_heads * head_dim) + 8
    pages = allocate_pages(num_blocks, block_size, num_kv_heads, head_dim, "int8", device=DEVICE)
    try:
        assert paged_attention._needs_wide_offsets(pages)
        generator = torch.Generator(device=DEVICE).manual_seed(24)
        last = slice(num_blocks - 8, num_blocks)
        for name in ("k", "v"):
            getattr(pages, name)[last].random_(0, 256, generator=generator)
        for name, high in (("k_scale", 0.02), ("k_zero", 255.0), ("v_scale", 0.02), ("v_zero", 255.0)):
            getattr(pages, name)[last].uniform_(0.005 if high < 1 else 0.0, high, generator=generator)
        block_tables = torch.arange(num_blocks - 8, num_blocks, dtype=torch.int32, device=DEVICE).flip(0)[None]
        context_lens = torch.tensor([8 * block_size - 3], dtype=torch.int32, device=DEVICE)
        q = torch.randn(1, 12, head_dim, device=DEVICE, generator=generator).to(torch.float16)
        args = (pages, block_tables, context_lens, head_dim**-0.5)
        decode = _report(
            "decode gpu int8 past int32 offsets",
            paged_decode_attention(q, *args),
            paged_decode_attention_ref(q.float(), *args),
        )
        cu_seqlens = torch.tensor([0, 5], dtype=torch.int32, device=DEVICE)
        q = torch.randn(5, 12, head_dim, device=DEVICE, generator=generator).to(torch.float16)
        args = (pages, block_tables, cu_seqlens, context_lens, head_dim**-0.5)
        prefill = _report(
            "prefill gpu int8 past int32 offsets",
            paged_prefill_attention(q, *args),
            paged_prefill_attention_ref(q.float(), *args),
        )
        return decode, prefill
    finally:
        for name in ("k", "v", "k_scale", "k_zero", "v_scale", "v_zero"):
            setattr(pages, name, None)


@pytest.mark.gpu
def test_pages_past_int32_offsets_gpu(exact_fp32_matmul):
    """Page arrays too large for int32 offsets are read through int64 ones. They take 4 GiB,
    above the emulated card's cap, which is lifted for this test only. Everything the test
    allocates comes from a memory pool of its own, released at the end, so none of it stays
    in the shared cache: in one full GPU run the tests after this one ran out of memory under
    the cap with 7.5 GiB reserved but unallocated."""
    if torch.cuda.mem_get_info()[0] < 6 * 2**30:
        pytest.skip("needs 6 GiB of free device memory")
    total = torch.cuda.get_device_properties(0).total_memory
    previous_cap = os.environ.get("LOWVRAM_TEST_EMULATE_GIB")
    torch.cuda.set_per_process_memory_fraction(1.0)
    pool = torch.cuda.MemPool()
    try:
        with torch.cuda.use_mem_pool(pool):
            decode, prefill = _int8_errors_past_int32_offsets()
    finally:
        del pool
        torch.cuda.empty_cache()
        if previous_cap:
            torch.cuda.set_per_process_memory_fraction(float(previous_cap) * 2**30 / total)
    assert decode <= _gpu_tolerance("int8")
    assert prefill <= _gpu_tolerance("int8")


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp16", "int8", "int4"])
@pytest.mark.parametrize("context_lens", [[8192], [4096] * 8, [2048, 300, 4097, 1]])
def test_decode_fitted_tiles_gpu(precision, context_lens, exact_fp32_matmul):
    # The default partitioning's configurations as decode_config fits them: 128-token tiles
    # over 4 warps for one sequence at 8K, INT4's 64-token tiles for eight at 4K.
    case = PagedCase(precision, torch.float16, 16, 2, 128, context_lens, seed=28)
    q = torch.randn(len(context_lens), 12, 128, generator=torch.Generator().manual_seed(29))
    q = q.to(DEVICE, torch.float16)
    args = (case.pages, case.block_tables, case.context_lens_t, 128**-0.5)
    max_context_len = case.block_tables.shape[1] * 16
    config = paged_attention.decode_config(DEVICE, 128, case.pages.bits, len(context_lens), 2, max_context_len)
    out = paged_decode_attention(q, *args)
    label = f"decode gpu {precision} {len(context_lens)} x {max(context_lens)} {config}"
    assert _report(label, out, paged_decode_attention_ref(q.float(), *args)) <= _gpu_tolerance(precision)
    assert torch.equal(out, paged_decode_attention(q, *args, _config=config))


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp16", "int4"])
def test_decode_32k_context_gpu(precision, exact_fp32_matmul):
    case = PagedCase(precision, torch.float16, 16, 2, 128, [32768, 3], seed=22)
    q = torch.randn(2, 12, 128, generator=torch.Generator().manual_seed(23)).to(DEVICE, torch.float16)
    out = paged_decode_attention(q, case.pages, case.block_tables, case.context_lens_t, 128**-0.5)
    expected = paged_decode_attention_ref(q.float(), case.pages, case.block_tables, case.context_lens_t, 128**-0.5)
    assert _report(f"decode gpu 32K {precision}", out, expected) <= _gpu_tolerance(precision)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp16", "int8", "int4"])
@pytest.mark.parametrize("num_heads,num_kv_heads", GPU_SHAPES)
def test_prefill_real_shapes_gpu(precision, num_heads, num_kv_heads, exact_fp32_matmul):
    context_lens = [1, 100, 700, 2048, 1500]
    num_new = [1, 100, 300, 2048, 37]  # seqs 2 and 4 continue after a cached prefix
    case = PagedCase(precision, torch.float16, 16, num_kv_heads, 128, context_lens, seed=24)
    generator = torch.Generator().manual_seed(25)
    label = f"prefill gpu {precision} H={num_heads} Hkv={num_kv_heads}"
    assert _prefill_error_gpu(case, num_new, num_heads, 128, generator, label) <= _gpu_tolerance(precision)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_pages_kept_in_fp16_real_shapes_gpu(precision, exact_fp32_matmul):
    context_lens = [1000, 4097, 17]
    case = PagedCase(precision, torch.float16, 16, 2, 128, context_lens, seed=26, num_window_blocks=60)
    generator = torch.Generator().manual_seed(27)
    q = torch.randn(3, 12, 128, generator=generator).to(DEVICE, torch.float16)
    args = (case.pages, case.block_tables, case.context_lens_t, 128**-0.5)
    out = paged_decode_attention(q, *args)
    expected = paged_decode_attention_ref(q.float(), *args)
    assert _report(f"decode gpu {precision} window", out, expected) <= _gpu_tolerance(precision)
    error = _prefill_error_gpu(case, [1000, 97, 17], 12, 128, generator, f"prefill gpu {precision} window")
    assert error <= _gpu_tolerance(precision)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp16", "int8", "int4"])
def test_latent_attention_shape_gpu(precision, exact_fp32_matmul):
    # DeepSeek-V2-Lite: 16 heads over one KV head of 512 + 64 = 576 values, V aliased to K.
    context_lens = [1, 17, 700, 4097]
    case = PagedCase(precision, torch.float16, 16, 1, 576, context_lens, seed=45)
    case.pages.v, case.pages.v_scale, case.pages.v_zero = case.pages.k, case.pages.k_scale, case.pages.k_zero
    generator = torch.Generator().manual_seed(46)
    q = torch.randn(len(context_lens), 16, 576, generator=generator).to(DEVICE, torch.float16)
    args = (case.pages, case.block_tables, case.context_lens_t, 576**-0.5)
    out = paged_decode_attention(q, *args)
    expected = paged_decode_attention_ref(q.float(), *args)
    assert _report(f"decode gpu latent {precision}", out, expected) <= _gpu_tolerance(precision)
    error = _prefill_error_gpu(case, [1, 17, 300, 97], 16, 576, generator, f"prefill gpu latent {precision}")
    assert error <= _gpu_tolerance(precision)
