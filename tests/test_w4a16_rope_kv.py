"""The one-row fused q/k/v GEMV that finishes with RoPE and the KV store (rope_kv), against the
same GEMV followed by rotary_write_kv: y (q and k rotated, v as computed) and every page tensor
must come out bit for bit alike, for FP16, INT8 and INT4 pages, with and without FP16 window
pages, with one split or several, with the norm prologue and the compensation.

Without CUDA both run in the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1);
with CUDA the same tests run on the GPU, at the 1.5B shape's heads too.
"""

import pytest
import torch
from test_rotary_kv_write import PAGE_NAMES, _pages, _split, _tables

from lowvram.kernels import w4a16
from lowvram.kernels.kv_write import rotary_write_kv
from lowvram.kernels.w4a16 import InputNorm, RopeKVWrite
from tests.test_w4a16 import DEVICE, needs_triton, random_awq, random_lora, random_x

DTYPE = torch.float16 if DEVICE == "cuda" else torch.float32


def row_config(split_k, **extra):
    return {"block_n": 64, "block_k": 32, "split_k": split_k, "num_warps": 4, "reduce_at_end": True, **extra}


def run_both(
    num_heads,
    num_kv_heads,
    head_dim,
    precision,
    *,
    has_window=False,
    split_k=1,
    position=37,
    slot=11,
    group_size=32,
    with_norm=False,
    rank=0,
    config_extra=None,
    seed=0,
):
    """(y, pages) of the fused launch and of the GEMV then rotary_write_kv, from the same inputs."""
    num_inputs = 4 * group_size
    num_outputs = (num_heads + 2 * num_kv_heads) * head_dim
    qweight, qzeros, scales, bias = random_awq(num_inputs, num_outputs, group_size, seed=seed)
    x = random_x(1, num_inputs, seed=seed + 1, dtype=DTYPE)
    lora = random_lora(rank, num_inputs, num_outputs, seed=seed + 2) if rank else (None, None)
    cos, sin = _tables(64, head_dim)
    positions = torch.tensor([position], device=DEVICE)
    slots = torch.tensor([slot], dtype=torch.int64, device=DEVICE)
    # one column block per head in both (the fused launch takes that block width itself), so
    # the GEMV sums alike on a GPU too
    config = row_config(split_k, **{"block_n": head_dim, **(config_extra or {})})
    results = []
    for fused in (True, False):
        pages = _pages(precision, 8, 4, num_kv_heads, head_dim, DTYPE, has_window)
        norm = None
        if with_norm:
            weight = (torch.rand(num_inputs, generator=torch.Generator().manual_seed(seed + 3)) + 0.5).to(DTYPE)
            norm = InputNorm(weight.to(DEVICE), 1e-6)
        y = torch.full((1, num_outputs), float("nan"), dtype=DTYPE, device=DEVICE)
        rope_kv = RopeKVWrite(num_heads, positions, cos, sin, slots, pages) if fused else None
        w4a16.w4a16_gemv.launch_row(
            x, qweight, qzeros, scales, group_size, bias, y, config, *lora, norm=norm, rope_kv=rope_kv
        )
        if not fused:
            q, k, v = _split(y, num_heads, num_kv_heads, head_dim)
            rotary_write_kv(q, k, v, positions, cos, sin, slots, pages)
        results.append((y, pages))
    return results


def assert_same(fused, separate):
    (y, pages), (y_ref, pages_ref) = fused, separate
    assert torch.equal(y, y_ref)
    for name in PAGE_NAMES:
        got, expected = getattr(pages, name), getattr(pages_ref, name)
        if expected is not None:
            assert torch.equal(got, expected), f"pages.{name} differs"


@needs_triton
@pytest.mark.parametrize("precision", ["fp16", "int8", "int4"])
@pytest.mark.parametrize("split_k", [1, 3])
def test_rope_and_kv_store_in_the_projection_equal_the_separate_kernel(precision, split_k):
    assert_same(*run_both(4, 2, 32, precision, split_k=split_k))


@needs_triton
def test_heads_of_sixteen():
    # the tiny test models' head size: two packed words per head
    assert_same(*run_both(4, 2, 16, "int4", split_k=2))


@needs_triton
@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_window_pages_get_the_fp16_row_too(precision):
    # slot 5 is in page 1, which the fixture keeps in FP16 as well
    assert_same(*run_both(2, 1, 32, precision, has_window=True, slot=5))


@needs_triton
def test_with_the_norm_prologue_and_the_compensation():
    assert_same(*run_both(4, 2, 32, "fp16", with_norm=True, rank=8, split_k=2))
    # x A^T computed once per launch (reducing every K block): the other place the last program finishes
    assert_same(*run_both(4, 2, 32, "int8", rank=8, split_k=2, config_extra={"reduce_at_end": False}))


@needs_triton
def test_the_projection_refuses_rope_for_several_rows():
    qweight, qzeros, scales, _ = random_awq(64, 128, 32, seed=5)
    x = random_x(2, 64, seed=6, dtype=DTYPE)
    cos, sin = _tables(8, 32)
    pages = _pages("fp16", 4, 4, 1, 32, DTYPE, False)
    rope_kv = RopeKVWrite(2, torch.tensor([1], device=DEVICE), cos, sin, torch.tensor([0], device=DEVICE), pages)
    y = torch.empty(2, 128, dtype=DTYPE, device=DEVICE)
    with pytest.raises(ValueError, match="one row"):
        w4a16.w4a16_gemv.launch_row(x, qweight, qzeros, scales, 32, None, y, row_config(1), rope_kv=rope_kv)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("precision", ["fp16", "int8", "int4"])
def test_at_the_real_heads(precision):
    # the 1.5B shape's attention: 12 query heads, 2 KV heads of 128, group 128
    assert_same(
        *run_both(
            12,
            2,
            128,
            precision,
            group_size=128,
            split_k=9,
            position=60,
            with_norm=True,
            rank=16,
            config_extra={"block_k": 128},
        )
    )
