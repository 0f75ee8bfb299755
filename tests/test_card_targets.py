"""Every Triton kernel as the 4 GB cards run it: compiled for sm_75 (GTX 1650) and sm_86
(RTX 3050 Laptop), loaded as PTX on the test GPU (tests/card_targets.py explains how), and
checked through its public wrapper against the plain-torch reference at the shapes of
R1-Distill-Qwen-1.5B (hidden 1536, intermediate 8960, 12 query heads and 2 KV heads of 128,
INT4 AWQ in groups of 128) and of DeepSeek-V2-Lite's latent attention (16 heads over one KV
head of 576). A wrapper that takes its plain-torch fallback on a card is tested on that path.
Each check prints the largest difference and the kernels that ran.

pytest runs a module-scoped parameter's tests together, so each card's kernels are compiled
once; the last test of each card checks that every kernel of lowvram.kernels ran.
"""

import math

import pytest
import torch
from card_targets import CARDS, emulate, jit_functions

from lowvram.kernels.activation import silu_and_mul, silu_and_mul_ref
from lowvram.kernels.kv_quant import allocate_pages
from lowvram.kernels.kv_write import rotary_write_kv, write_kv, write_kv_ref
from lowvram.kernels.linear_invariant import invariant_linear, invariant_linear_ref
from lowvram.kernels.paged_attention import (
    paged_decode_attention,
    paged_decode_attention_ref,
    paged_prefill_attention,
    paged_prefill_attention_ref,
)
from lowvram.kernels.rms_norm import rms_norm, rms_norm_ref
from lowvram.kernels.rotary import apply_rotary, apply_rotary_ref
from lowvram.kernels.w4a16 import InputNorm, RopeKVWrite, awq_linear, awq_linear_one_row, awq_linear_ref

pytestmark = pytest.mark.gpu

HIDDEN, INTERMEDIATE, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 1536, 8960, 12, 2, 128
GROUP_SIZE, BLOCK_SIZE, EPS = 128, 16, 1e-6
QKV_OUTPUTS = (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM
# (K, N) of the 1.5B model's projections, q/k/v and gate/up fused as the runner loads them
LAYERS = {
    "qkv": (HIDDEN, QKV_OUTPUTS),
    "o": (HIDDEN, HIDDEN),
    "gate_up": (HIDDEN, 2 * INTERMEDIATE),
    "down": (INTERMEDIATE, HIDDEN),
}
PRECISIONS = ["fp16", "int8", "int4"]
PAGE_NAMES = ("k", "v", "k_scale", "k_zero", "v_scale", "v_zero", "window_k", "window_v")
# Largest difference over the reference's largest magnitude. FP16 outputs round once (2^-11);
# the W4A16 and quantized-attention kernels also round an FP16 operand of their dots.
FP16_TOLERANCE, DOT_TOLERANCE = 1e-3, 2e-3


@pytest.fixture(scope="module", params=list(CARDS))
def card(request):
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # the references' float32 matmuls stay float32
    with emulate(CARDS[request.param]) as emulation:
        yield emulation
    torch.backends.cuda.matmul.allow_tf32 = saved


@pytest.fixture(autouse=True)
def _case(card):
    card.new_case()


def check(card, label, got, expected, tolerance):
    """Print the largest difference of `got` from `expected` and the kernels that made it; bound it."""
    assert torch.isfinite(got).all(), f"{label}: NaN or inf in the output"
    diff = (got.float() - expected.float()).abs().max().item()
    relative = diff / expected.float().abs().max().item()
    path = ", ".join(card.ran()) or "plain-torch fallback"
    print(f"{card.card.name} {label}: max |diff| {diff:.3e} ({relative:.1e} of the largest) via {path}")
    assert relative <= tolerance, label


def check_equal_pages(card, label, got, expected):
    """The stored K/V bytes (codes, scales, zeros, FP16 window) must match exactly."""
    path = ", ".join(card.ran()) or "plain-torch fallback"
    for name in PAGE_NAMES:
        if getattr(expected, name) is not None:
            num_diff = int((getattr(got, name) != getattr(expected, name)).sum())
            assert num_diff == 0, f"{label}: {num_diff} elements of {name} differ from the reference"
    print(f"{card.card.name} {label}: pages equal to the reference's via {path}")


def randn(*shape, seed, scale=1.0, dtype=torch.float16):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to("cuda", dtype)


def random_awq(num_inputs, num_outputs, seed):
    generator = torch.Generator().manual_seed(seed)
    words = (num_inputs, num_outputs // 8), (num_inputs // GROUP_SIZE, num_outputs // 8)
    qweight, qzeros = (torch.randint(-(2**31), 2**31 - 1, w, dtype=torch.int32, generator=generator) for w in words)
    scales = torch.rand(num_inputs // GROUP_SIZE, num_outputs, generator=generator) * 0.02 + 1e-3
    bias = torch.randn(num_outputs, generator=generator)
    return qweight.cuda(), qzeros.cuda(), scales.half().cuda(), bias.half().cuda()


def rope_tables(num_positions=4096):
    inv_freq = 1.0 / (10000 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM))
    freqs = torch.outer(torch.arange(num_positions, dtype=torch.float32), inv_freq).cuda()  # [P, D/2]
    return freqs.cos(), freqs.sin()


def with_window(pages, window_rows):
    """Keep the pages `window_rows` maps ({page: row}) in FP16 as well, as the KV pool does."""
    shape = (len(window_rows), *pages.k.shape[1:3], pages.head_dim)
    pages.window_k = torch.zeros(shape, dtype=torch.float16, device="cuda")
    pages.window_v = torch.zeros(shape, dtype=torch.float16, device="cuda")
    pages.window_row = torch.full((pages.num_blocks,), -1, dtype=torch.int32)
    for page, row in window_rows.items():
        pages.window_row[page] = row
    pages.window_row = pages.window_row.cuda()
    return pages


def filled_pages(precision, context_lens, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, num_window_pages=0, seed=0):
    """Pages holding random K/V of each sequence, through a shuffled block table (-1 past a
    sequence's pages): (pages, block_tables, context_lens)."""
    generator = torch.Generator().manual_seed(seed)
    seq_blocks = [math.ceil(n / BLOCK_SIZE) for n in context_lens]
    num_blocks = sum(seq_blocks) + 2
    pages = allocate_pages(num_blocks, BLOCK_SIZE, num_kv_heads, head_dim, precision, device="cuda")
    order = torch.randperm(num_blocks, generator=generator)
    if num_window_pages:
        with_window(pages, {int(page): row for row, page in enumerate(order[:num_window_pages:2])})
    block_tables = torch.full((len(context_lens), max(seq_blocks)), -1, dtype=torch.int32)
    for seq, (num_tokens, start) in enumerate(zip(context_lens, [0, *torch.tensor(seq_blocks).cumsum(0).tolist()])):
        block_tables[seq, : seq_blocks[seq]] = order[start : start + seq_blocks[seq]].int()
        positions = torch.arange(num_tokens)
        slots = block_tables[seq, positions // BLOCK_SIZE].long() * BLOCK_SIZE + positions % BLOCK_SIZE
        k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator) * 1.5
        v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator)
        write_kv_ref(k.cuda().half(), v.cuda().half(), slots.cuda(), pages)
    return pages, block_tables.cuda(), torch.tensor(context_lens, dtype=torch.int32, device="cuda")


# ---------------------------------------------------------------- norm, activation, RoPE


@pytest.mark.parametrize("num_rows", [1, 8, 300])
def test_rms_norm(card, num_rows):
    x, residual = randn(num_rows, HIDDEN, seed=1, scale=20), randn(num_rows, HIDDEN, seed=2, scale=20)
    weight = randn(HIDDEN, seed=3).abs() + 0.5
    normed, total = rms_norm(x, weight, EPS, residual)
    expected, expected_total = rms_norm_ref(x, weight, EPS, residual)
    check(card, f"rms_norm {num_rows} x {HIDDEN}", normed, expected, FP16_TOLERANCE)
    assert torch.equal(total, expected_total)


@pytest.mark.parametrize("num_rows", [1, 8])
def test_silu_and_mul(card, num_rows):
    gate_up = randn(num_rows, 2 * INTERMEDIATE, seed=4, scale=4)
    check(
        card,
        f"silu_and_mul {num_rows} x {INTERMEDIATE}",
        silu_and_mul(gate_up),
        silu_and_mul_ref(gate_up),
        FP16_TOLERANCE,
    )


def test_apply_rotary(card):
    q, k = randn(8, NUM_HEADS, HEAD_DIM, seed=5), randn(8, NUM_KV_HEADS, HEAD_DIM, seed=6)
    positions = torch.randint(0, 4096, (8,), generator=torch.Generator().manual_seed(7)).cuda()
    cos, sin = rope_tables()
    expected_q, expected_k = apply_rotary_ref(q, positions, cos, sin), apply_rotary_ref(k, positions, cos, sin)
    apply_rotary(q, k, positions, cos, sin)
    check(card, "apply_rotary 8 tokens", torch.cat((q, k), 1), torch.cat((expected_q, expected_k), 1), FP16_TOLERANCE)


# ---------------------------------------------------------------- KV store


def _slots(num_tokens, num_blocks, seed):
    slots = torch.randperm(num_blocks * BLOCK_SIZE, generator=torch.Generator().manual_seed(seed))[:num_tokens]
    slots[::7] = -1  # padding rows are skipped
    return slots.cuda()


@pytest.mark.parametrize("precision,has_window", [(p, False) for p in PRECISIONS] + [("int8", True), ("int4", True)])
def test_write_kv(card, precision, has_window):
    k, v = randn(300, NUM_KV_HEADS, HEAD_DIM, seed=8, scale=3), randn(300, NUM_KV_HEADS, HEAD_DIM, seed=9)
    slots = _slots(300, 24, seed=10)
    by_kernel, by_reference = (
        allocate_pages(24, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, precision, device="cuda") for _ in range(2)
    )
    if has_window:
        by_kernel, by_reference = (with_window(pages, {3: 1, 10: 0}) for pages in (by_kernel, by_reference))
    write_kv(k, v, slots, by_kernel)
    write_kv_ref(k, v, slots, by_reference)
    check_equal_pages(
        card, f"write_kv {precision}{' window' if has_window else ''} 300 tokens", by_kernel, by_reference
    )


@pytest.mark.parametrize("precision", PRECISIONS)
def test_rotary_write_kv(card, precision):
    qkv = randn(8, QKV_OUTPUTS, seed=11, scale=3)
    q, k, v = (t.view(8, -1, HEAD_DIM) for t in qkv.split((NUM_HEADS * HEAD_DIM, *(NUM_KV_HEADS * HEAD_DIM,) * 2), -1))
    positions = torch.randint(0, 4096, (8,), generator=torch.Generator().manual_seed(12)).cuda()
    slots, cos, sin = _slots(8, 4, seed=13), *rope_tables()
    expected_qk = torch.cat((apply_rotary_ref(q, positions, cos, sin), apply_rotary_ref(k, positions, cos, sin)), 1)
    pages, expected_pages = (
        allocate_pages(4, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, precision, device="cuda") for _ in range(2)
    )
    rotary_write_kv(q, k, v, positions, cos, sin, slots, pages)
    check(card, f"rotary_write_kv {precision} q, k", torch.cat((q, k), 1), expected_qk, FP16_TOLERANCE)
    # the rows stored are the rotated k the kernel wrote back, and v
    write_kv_ref(k, v, slots, expected_pages)
    check_equal_pages(card, f"rotary_write_kv {precision}", pages, expected_pages)


# ---------------------------------------------------------------- attention

DECODE_BATCHES = {"batch 1": [300], "batch 8": [1, 17, 128, 255, 300, 301, 400, 513]}


@pytest.mark.parametrize("batch", list(DECODE_BATCHES))
@pytest.mark.parametrize("precision", PRECISIONS)
def test_paged_decode_attention(card, precision, batch):
    context_lens = DECODE_BATCHES[batch]
    pages, block_tables, lens = filled_pages(precision, context_lens, num_window_pages=6 if precision == "int8" else 0)
    q = randn(len(context_lens), NUM_HEADS, HEAD_DIM, seed=14)
    args = (pages, block_tables, lens, HEAD_DIM**-0.5)
    got = paged_decode_attention(q, *args)
    tolerance = FP16_TOLERANCE if precision == "fp16" else DOT_TOLERANCE
    label = f"decode {precision} {batch}{' window' if pages.has_window else ''}"
    check(card, label, got, paged_decode_attention_ref(q.float(), *args), tolerance)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_paged_prefill_attention(card, precision):
    # the second sequence continues after a cached prefix of 300 tokens
    context_lens, num_new = [300, 400, 37], [300, 100, 37]
    pages, block_tables, lens = filled_pages(precision, context_lens, seed=1)
    cu_seqlens = torch.tensor([0, *torch.tensor(num_new).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q = randn(sum(num_new), NUM_HEADS, HEAD_DIM, seed=15)
    args = (pages, block_tables, cu_seqlens, lens, HEAD_DIM**-0.5)
    got = paged_prefill_attention(q, *args)
    tolerance = FP16_TOLERANCE if precision == "fp16" else DOT_TOLERANCE
    check(
        card, f"prefill {precision} {num_new} new tokens", got, paged_prefill_attention_ref(q.float(), *args), tolerance
    )


@pytest.mark.parametrize("precision", PRECISIONS)
def test_latent_attention(card, precision):
    # DeepSeek-V2-Lite: 16 heads over one KV head of 512 latent + 64 RoPE values, V aliased to K
    pages, block_tables, lens = filled_pages(precision, [17, 400], num_kv_heads=1, head_dim=576, seed=2)
    pages.v, pages.v_scale, pages.v_zero = pages.k, pages.k_scale, pages.k_zero
    scale = 576**-0.5
    tolerance = FP16_TOLERANCE if precision == "fp16" else DOT_TOLERANCE
    q = randn(2, 16, 576, seed=16)
    got = paged_decode_attention(q, pages, block_tables, lens, scale)
    expected = paged_decode_attention_ref(q.float(), pages, block_tables, lens, scale)
    check(card, f"latent decode {precision}", got, expected, tolerance)
    cu_seqlens = torch.tensor([0, 17, 117], dtype=torch.int32, device="cuda")
    q = randn(117, 16, 576, seed=17)
    got = paged_prefill_attention(q, pages, block_tables, cu_seqlens, lens, scale)
    expected = paged_prefill_attention_ref(q.float(), pages, block_tables, cu_seqlens, lens, scale)
    check(card, f"latent prefill {precision}", got, expected, tolerance)


# ---------------------------------------------------------------- linear layers

AWQ_CASES = [
    # (layer, rows, compensation rank, batch invariant): one row takes the lane or the
    # K-in-thread form, 8 rows the tl.dot decode form, 64 the GEMM, 512 dequantize + cuBLAS
    ("qkv", 1, 0, False),
    ("o", 1, 0, False),
    ("gate_up", 1, 0, False),
    ("down", 1, 0, False),
    ("qkv", 8, 0, False),
    ("down", 8, 0, False),
    ("gate_up", 64, 0, False),
    ("down", 512, 0, False),
    ("qkv", 1, 32, False),
    ("gate_up", 1, 32, False),
    ("o", 8, 32, False),
    ("o", 8, 0, True),
]


@pytest.mark.parametrize("layer,num_rows,rank,batch_invariant", AWQ_CASES)
def test_awq_linear(card, layer, num_rows, rank, batch_invariant):
    num_inputs, num_outputs = LAYERS[layer]
    weights = random_awq(num_inputs, num_outputs, seed=num_outputs)
    qweight, qzeros, scales, bias = weights
    x = randn(num_rows, num_inputs, seed=num_rows)
    # compensation factors whose term is about a tenth of y: leaving it out fails the tolerance
    lora = {}
    if rank:
        lora = {
            "lora_a": randn(rank, num_inputs, seed=18, scale=0.05),
            "lora_bt": randn(rank, num_outputs, seed=19, scale=0.05),
        }
    got = awq_linear(x, *weights[:3], GROUP_SIZE, bias, batch_invariant=batch_invariant, **lora)
    expected = awq_linear_ref(x, qweight, qzeros, scales, GROUP_SIZE, bias, **lora)
    label = f"awq_linear {layer} {num_inputs}x{num_outputs} M={num_rows}{f' rank {rank}' if rank else ''}"
    check(card, label + (" batch-invariant" if batch_invariant else ""), got, expected, DOT_TOLERANCE)


def test_awq_one_row_with_norm(card):
    # the gate/up projection with the post-attention norm (and the residual add) in its prologue
    weights = random_awq(*LAYERS["gate_up"], seed=20)
    x, residual = randn(1, HIDDEN, seed=21, scale=4), randn(1, HIDDEN, seed=22, scale=4)
    norm = InputNorm(randn(HIDDEN, seed=23).abs() + 0.5, EPS, residual, torch.empty_like(x))
    got = awq_linear_one_row(x, *weights[:3], GROUP_SIZE, weights[3], norm=norm)
    normed, total = rms_norm_ref(x, norm.weight, EPS, residual)
    check(
        card,
        "awq_linear_one_row gate_up + rms_norm",
        got,
        awq_linear_ref(normed, *weights[:3], GROUP_SIZE, weights[3]),
        DOT_TOLERANCE,
    )
    assert torch.equal(norm.sum_out, total)


def test_awq_one_row_gated(card):
    # the down projection with silu(gate) * up in its prologue
    weights = random_awq(*LAYERS["down"], seed=24)
    gate_up = randn(1, 2 * INTERMEDIATE, seed=25, scale=3)
    got = awq_linear_one_row(gate_up, *weights[:3], GROUP_SIZE, weights[3], is_gated=True)
    expected = awq_linear_ref(silu_and_mul_ref(gate_up), *weights[:3], GROUP_SIZE, weights[3])
    check(card, "awq_linear_one_row down + silu_and_mul", got, expected, DOT_TOLERANCE)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_awq_one_row_with_rope_and_kv_store(card, precision):
    # the fused q/k/v projection of one decode token: norm, matmul, RoPE, then the KV store
    weights = random_awq(*LAYERS["qkv"], seed=26)
    x, position, slot = (
        randn(1, HIDDEN, seed=27, scale=4),
        torch.tensor([300], device="cuda"),
        torch.tensor([77], device="cuda"),
    )
    norm_weight = randn(HIDDEN, seed=28).abs() + 0.5
    cos, sin = rope_tables()
    pages, expected_pages = (
        allocate_pages(8, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, precision, device="cuda") for _ in range(2)
    )
    rope_kv = RopeKVWrite(NUM_HEADS, position, cos, sin, slot, pages)
    got = awq_linear_one_row(x, *weights[:3], GROUP_SIZE, weights[3], norm=InputNorm(norm_weight, EPS), rope_kv=rope_kv)
    expected = awq_linear_ref(rms_norm_ref(x, norm_weight, EPS)[0], *weights[:3], GROUP_SIZE, weights[3])
    heads = (NUM_HEADS + NUM_KV_HEADS) * HEAD_DIM
    expected[:, :heads] = apply_rotary_ref(expected[:, :heads].view(1, -1, HEAD_DIM), position, cos, sin).view(1, -1)
    check(card, f"awq_linear_one_row qkv + rms_norm + rope + {precision} store", got, expected, DOT_TOLERANCE)
    k, v = got[:, NUM_HEADS * HEAD_DIM :].view(1, 2 * NUM_KV_HEADS, HEAD_DIM).split(NUM_KV_HEADS, 1)
    write_kv_ref(k, v, slot, expected_pages)
    check_equal_pages(card, f"awq_linear_one_row {precision} store", pages, expected_pages)


@pytest.mark.parametrize("num_rows", [1, 8])
def test_invariant_linear(card, num_rows):
    weight, bias = randn(HIDDEN, HIDDEN, seed=29, scale=0.03), randn(HIDDEN, seed=30)
    x = randn(num_rows, HIDDEN, seed=31)
    got = invariant_linear(x, weight, bias)
    check(
        card,
        f"invariant_linear {HIDDEN}x{HIDDEN} M={num_rows}",
        got,
        invariant_linear_ref(x, weight, bias),
        FP16_TOLERANCE,
    )


def test_every_kernel_ran(card):
    """Runs after the cases of its card: every kernel of lowvram.kernels ran as the card's code."""
    kernels = {fn.fn.__name__ for fn in jit_functions() if fn.fn.__name__.endswith("_kernel")}
    if not card.kernels_run:
        pytest.skip("run with the cases of this module")
    print(f"{card.card.name}: ran {sorted(card.kernels_run)}")
    assert kernels <= card.kernels_run, f"never launched on the {card.card.name}: {sorted(kernels - card.kernels_run)}"
