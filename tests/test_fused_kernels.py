"""The fused RMSNorm, RoPE and SiLU-and-multiply kernels against their plain-torch references.

Without CUDA they run in the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1).
"""

import pytest
import torch

from lowvram.errors import KernelError
from lowvram.kernels import dispatch
from lowvram.kernels.activation import silu_and_mul, silu_and_mul_ref
from lowvram.kernels.rms_norm import rms_norm, rms_norm_ref
from lowvram.kernels.rotary import apply_rotary, apply_rotary_ref

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPE = torch.float16 if DEVICE.type == "cuda" else torch.float32
# FP16 results may differ from the reference by one rounding of the output.
TOLERANCE = 1e-3 if DTYPE == torch.float16 else 1e-5


def test_kernel_path_is_exercised():
    assert dispatch.use_triton("test", DEVICE, use_reference=False)


def _largest_relative(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got.float() - expected.float()).abs().max() / expected.float().abs().max()).item()


@pytest.mark.parametrize("num_cols", [64, 96, 1536])
@pytest.mark.parametrize("has_residual", [False, True])
def test_rms_norm_matches_the_reference(num_cols, has_residual):
    generator = torch.Generator().manual_seed(num_cols)
    x = (torch.randn(5, num_cols, generator=generator) * 30).to(DEVICE, DTYPE)
    residual = (torch.randn(5, num_cols, generator=generator) * 30).to(DEVICE, DTYPE) if has_residual else None
    weight = torch.rand(num_cols, generator=generator).to(DEVICE, DTYPE) + 0.5
    got, got_sum = rms_norm(x, weight, 1e-6, residual)
    expected, expected_sum = rms_norm_ref(x, weight, 1e-6, residual)
    worst = _largest_relative(got, expected)
    print(f"rms_norm {num_cols} residual={has_residual}: largest relative difference {worst:.2e}")
    assert worst <= TOLERANCE
    if has_residual:
        assert torch.equal(got_sum, expected_sum)
    else:
        assert got_sum is None


@pytest.mark.parametrize("num_cols", [16, 1536])  # 16: a row shorter than the threads, which then share elements
def test_rms_norm_in_place_over_its_inputs_equals_the_out_of_place_result(num_cols):
    # A decoder layer has the norm written over x and the sum over the residual.
    generator = torch.Generator().manual_seed(num_cols)
    x = (torch.randn(6, num_cols, generator=generator) * 30).to(DEVICE, DTYPE)
    residual = (torch.randn(6, num_cols, generator=generator) * 30).to(DEVICE, DTYPE)
    weight = (torch.rand(num_cols, generator=generator) + 0.5).to(DEVICE, DTYPE)
    for use_reference in (False, True):
        expected, expected_sum = rms_norm(x, weight, 1e-6, residual, use_reference=use_reference)
        x_in_place, residual_in_place = x.clone(), residual.clone()
        got, got_sum = rms_norm(
            x_in_place,
            weight,
            1e-6,
            residual_in_place,
            out=x_in_place,
            sum_out=residual_in_place,
            use_reference=use_reference,
        )
        assert got.data_ptr() == x_in_place.data_ptr() and got_sum.data_ptr() == residual_in_place.data_ptr()
        assert torch.equal(got, expected) and torch.equal(got_sum, expected_sum)


def test_rms_norm_rejects_outputs_of_the_wrong_dtype():
    x = torch.zeros(2, 8, device=DEVICE, dtype=torch.float16)
    with pytest.raises(KernelError, match="out is"):
        rms_norm(x, torch.ones(8, device=DEVICE, dtype=torch.float32), 1e-6, out=x)
    with pytest.raises(KernelError, match="sum_out"):
        rms_norm(x, torch.ones(8, device=DEVICE, dtype=torch.float16), 1e-6, sum_out=x)


def test_rms_norm_reads_strided_rows():
    x = torch.randn(4, 128).to(DEVICE, DTYPE)[:, :64]
    weight = torch.ones(64, device=DEVICE, dtype=DTYPE)
    assert _largest_relative(rms_norm(x, weight, 1e-6)[0], rms_norm_ref(x, weight, 1e-6)[0]) <= TOLERANCE


def test_rms_norm_rejects_a_mismatched_weight():
    with pytest.raises(KernelError, match="weight"):
        rms_norm(torch.zeros(2, 8, device=DEVICE), torch.ones(4, device=DEVICE), 1e-6)


@pytest.mark.parametrize("head_dim", [16, 64])
def test_rotary_in_place_on_a_fused_qkv_output(head_dim):
    """q and k are views into one [T, (H + 2 Hkv) * D] buffer; v must stay untouched."""
    num_tokens, num_heads, num_kv_heads = 7, 4, 2
    generator = torch.Generator().manual_seed(head_dim)
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=generator).to(DEVICE, DTYPE)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q, k, v = qkv.split((q_size, kv_size, kv_size), dim=-1)
    q = q.view(num_tokens, num_heads, head_dim)
    k = k.view(num_tokens, num_kv_heads, head_dim)
    positions = torch.tensor([0, 1, 5, 17, 3, 200, 63], device=DEVICE)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = torch.outer(torch.arange(256, dtype=torch.float32), inv_freq).to(DEVICE)
    cos, sin = freqs.cos(), freqs.sin()
    expected_q = apply_rotary_ref(q, positions, cos, sin)
    expected_k = apply_rotary_ref(k, positions, cos, sin)
    v_before = v.clone()
    apply_rotary(q, k, positions, cos, sin)
    worst = max(_largest_relative(q, expected_q), _largest_relative(k, expected_k))
    print(f"rotary D={head_dim}: largest relative difference {worst:.2e}")
    assert worst <= TOLERANCE
    assert torch.equal(v, v_before)


def test_rotary_rejects_tables_of_the_wrong_width():
    q = torch.zeros(2, 2, 16, device=DEVICE)
    with pytest.raises(KernelError, match="cos/sin"):
        apply_rotary(
            q,
            q.clone(),
            torch.zeros(2, dtype=torch.long, device=DEVICE),
            torch.zeros(8, 4, device=DEVICE),
            torch.zeros(8, 4, device=DEVICE),
        )


@pytest.mark.parametrize("num_cols", [24, 1408])
def test_silu_and_mul_matches_the_reference(num_cols):
    generator = torch.Generator().manual_seed(num_cols)
    x = (torch.randn(3, 2 * num_cols, generator=generator) * 4).to(DEVICE, DTYPE)
    worst = _largest_relative(silu_and_mul(x), silu_and_mul_ref(x))
    print(f"silu_and_mul {num_cols}: largest relative difference {worst:.2e}")
    assert worst <= TOLERANCE


def test_silu_and_mul_needs_an_even_width():
    with pytest.raises(KernelError, match="2I"):
        silu_and_mul(torch.zeros(2, 7, device=DEVICE))


@pytest.mark.gpu
def test_fused_kernels_at_the_real_shapes_in_fp16():
    """R1-Distill-Qwen-1.5B: hidden 1536, 12 heads and 2 KV heads of 128, intermediate 8960."""
    generator = torch.Generator().manual_seed(1)
    x = (torch.randn(8, 1536, generator=generator) * 20).cuda().half()
    residual = (torch.randn(8, 1536, generator=generator) * 20).cuda().half()
    weight = (torch.rand(1536, generator=generator) + 0.5).cuda().half()
    worst_norm = _largest_relative(rms_norm(x, weight, 1e-6, residual)[0], rms_norm_ref(x, weight, 1e-6, residual)[0])
    qkv = torch.randn(8, (12 + 4) * 128, generator=generator).cuda().half()
    q, k, _ = qkv.split((12 * 128, 256, 256), dim=-1)
    q, k = q.view(8, 12, 128), k.view(8, 2, 128)
    positions = torch.randint(0, 16384, (8,), generator=generator).cuda()
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 128, 2, dtype=torch.float32) / 128))
    freqs = torch.outer(torch.arange(16384, dtype=torch.float32), inv_freq).cuda()
    expected_q = apply_rotary_ref(q, positions, freqs.cos(), freqs.sin())
    apply_rotary(q, k, positions, freqs.cos(), freqs.sin())
    worst_rotary = _largest_relative(q, expected_q)
    gate_up = (torch.randn(8, 2 * 8960, generator=generator) * 4).cuda().half()
    worst_silu = _largest_relative(silu_and_mul(gate_up), silu_and_mul_ref(gate_up))
    print(
        f"fp16 at real shapes, largest relative differences: rms_norm {worst_norm:.2e}, "
        f"rotary {worst_rotary:.2e}, silu_and_mul {worst_silu:.2e}"
    )
    assert max(worst_norm, worst_rotary, worst_silu) <= 1e-3
