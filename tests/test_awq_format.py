"""AutoAWQ GEMM layout: checked against the unpacker in awq_layout.py, written from the documented layout."""

import pytest
import torch
from awq_layout import reference_dequantize, reference_unpack

from lowvram.errors import ConfigError, KernelError
from lowvram.kernels.awq_format import (
    AwqTensors,
    dequantize_awq,
    pack_awq,
    quantize_rtn,
    unpack_awq,
)


def random_awq(num_inputs, num_outputs, group_size, seed=0):
    gen = torch.Generator().manual_seed(seed)
    qweight = torch.randint(-(2**31), 2**31 - 1, (num_inputs, num_outputs // 8), dtype=torch.int32, generator=gen)
    qzeros = torch.randint(
        -(2**31), 2**31 - 1, (num_inputs // group_size, num_outputs // 8), dtype=torch.int32, generator=gen
    )
    scales = (torch.rand(num_inputs // group_size, num_outputs, generator=gen) * 0.02 + 1e-3).half()
    return qweight, qzeros, scales


def test_unpack_matches_documented_layout_bit_for_bit():
    qweight, _, _ = random_awq(64, 48, 32)
    assert torch.equal(unpack_awq(qweight).to(torch.int64), reference_unpack(qweight))


def test_known_word_unpacks_to_documented_columns():
    # nibble i holds column [0, 2, 4, 6, 1, 3, 5, 7][i]; the top nibble makes the word negative
    word = 0
    for nibble, value in enumerate([0x1, 0x2, 0x3, 0x4, 0x5, 0x6, 0x7, 0xF]):
        word |= value << (4 * nibble)
    packed = torch.tensor([[word - 2**32]], dtype=torch.int32)
    assert unpack_awq(packed).tolist() == [[0x1, 0x5, 0x2, 0x6, 0x3, 0x7, 0x4, 0xF]]


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_dequantize_matches_documented_layout_bit_for_bit(group_size):
    qweight, qzeros, scales = random_awq(256, 40, group_size, seed=group_size)
    expected = reference_dequantize(qweight, qzeros, scales, group_size)
    got = dequantize_awq(qweight, qzeros, scales, group_size, dtype=torch.float32)
    assert torch.equal(got, expected)
    assert dequantize_awq(qweight, qzeros, scales, group_size).dtype == torch.float16


def test_pack_unpack_round_trip():
    q = torch.randint(0, 16, (33, 64), dtype=torch.int32, generator=torch.Generator().manual_seed(1))
    packed = pack_awq(q)
    assert packed.dtype == torch.int32 and packed.shape == (33, 8)
    assert torch.equal(unpack_awq(packed).to(torch.int32), q)
    assert torch.equal(reference_unpack(packed), q.to(torch.int64))


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("zero_point", [True, False])
def test_rtn_error_is_within_half_a_scale(group_size, zero_point):
    gen = torch.Generator().manual_seed(group_size)
    weight = torch.randn(48, 256, generator=gen) * 0.03  # nn.Linear layout [N, K]
    weight[:, :group_size] += 0.2  # groups that do not straddle zero
    tensors = quantize_rtn(weight, group_size=group_size, zero_point=zero_point)
    assert isinstance(tensors, AwqTensors)
    assert tensors.qweight.shape == (256, 6) and tensors.qweight.dtype == torch.int32
    assert tensors.qzeros.shape == (256 // group_size, 6) and tensors.qzeros.dtype == torch.int32
    assert tensors.scales.shape == (256 // group_size, 48) and tensors.scales.dtype == torch.float16
    dequant = reference_dequantize(tensors.qweight, tensors.qzeros, tensors.scales, group_size)
    error = (weight.t() - dequant).abs()
    half_scale = tensors.scales.to(torch.float32).repeat_interleave(group_size, dim=0) / 2
    worst = (error / half_scale).max().item()
    print(f"group {group_size} zero_point {zero_point}: worst |w - dq| = {worst:.4f} * scale/2")
    assert (error <= half_scale * (1 + 1e-5) + 1e-7).all()
    zeros = reference_unpack(tensors.qzeros)
    assert zeros.min() >= 0 and zeros.max() <= 15
    if not zero_point:
        assert (zeros == 8).all()


def test_rtn_uses_the_full_code_range():
    weight = torch.linspace(-1.0, 2.0, 128).repeat(8, 1)  # [8, 128]
    tensors = quantize_rtn(weight, group_size=128)
    q = reference_unpack(tensors.qweight)
    assert q.min() == 0 and q.max() == 15


@pytest.mark.parametrize("group_size", [16, 100, 256])
def test_unsupported_group_size_is_a_config_error(group_size):
    with pytest.raises(ConfigError, match=f"group_size {group_size}.*32, 64, 128"):
        quantize_rtn(torch.randn(16, 256), group_size=group_size)


def test_group_size_must_divide_inputs():
    with pytest.raises(ConfigError, match="does not divide the layer's 96 inputs"):
        quantize_rtn(torch.randn(16, 96), group_size=64)


def test_outputs_not_divisible_by_8_is_a_kernel_error():
    with pytest.raises(KernelError, match=r"\[12, 128\].*divisible by 8"):
        quantize_rtn(torch.randn(12, 128), group_size=128)
    with pytest.raises(KernelError, match="divisible by 8"):
        pack_awq(torch.zeros(4, 12, dtype=torch.int32))


def test_pack_rejects_out_of_range_values():
    with pytest.raises(KernelError, match="0..15"):
        pack_awq(torch.full((2, 8), 16, dtype=torch.int32))


def test_mismatched_tensors_name_the_tensor_and_shape():
    qweight, qzeros, scales = random_awq(128, 16, 64)
    with pytest.raises(KernelError, match=r"qzeros must be int32 \[K/G, N/8\] = \[2, 2\].*\[1, 2\]"):
        dequantize_awq(qweight, qzeros[:1], scales, 64)
    with pytest.raises(KernelError, match=r"scales must be float16 \[K/G, N\] = \[2, 16\].*float32"):
        dequantize_awq(qweight, qzeros, scales.float(), 64)
    with pytest.raises(KernelError, match=r"qweight must be a 2-D int32.*int64"):
        dequantize_awq(qweight.long(), qzeros, scales, 64)
