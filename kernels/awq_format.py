"""The AutoAWQ "GEMM" INT4 layout in torch: packing, unpacking, RTN quantization, dequantization.

For K inputs, N outputs and group size G: qweight int32 [K, N/8] (input-major, eight 4-bit
columns per int32), qzeros int32 [K/G, N/8] packed alike, scales float16 [K/G, N], and
w[k, n] = (q[k, n] - z[k // G, n]) * s[k // G, n] with z stored as is (no GPTQ +1). Nibble i of
packed column c holds column 8c + AWQ_ORDER[i], the interleaving vLLM and Hugging Face expect.
"""

from dataclasses import dataclass

import torch

from lowvram.errors import ConfigError, KernelError

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)
SUPPORTED_GROUP_SIZES = (32, 64, 128)
NUM_BITS = 4
MAX_QUANT_VALUE = 2**NUM_BITS - 1
PACK_FACTOR = 32 // NUM_BITS

_INT_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


@dataclass
class AwqTensors:
    """One Linear in AutoAWQ GEMM form (shapes above)."""

    qweight: torch.Tensor
    qzeros: torch.Tensor
    scales: torch.Tensor
    group_size: int


def check_group_size(group_size: int, num_inputs: int) -> None:
    if group_size not in SUPPORTED_GROUP_SIZES:
        raise ConfigError(f"AWQ group_size {group_size} is not supported; allowed: {list(SUPPORTED_GROUP_SIZES)}")
    if num_inputs % group_size != 0:
        raise ConfigError(
            f"AWQ group_size {group_size} does not divide the layer's {num_inputs} inputs (K); "
            f"pick a group size in {list(SUPPORTED_GROUP_SIZES)} that divides K"
        )


def check_awq_shapes(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int
) -> tuple[int, int]:
    """(K, N) of one packed Linear; KernelError for a bad dtype or shape, ConfigError for the group size."""
    if qweight.dtype != torch.int32 or qweight.dim() != 2:
        raise KernelError(f"qweight must be a 2-D int32 tensor [K, N/8], got {qweight.dtype} {list(qweight.shape)}")
    num_inputs, num_packed_cols = qweight.shape
    num_outputs = num_packed_cols * PACK_FACTOR
    check_group_size(group_size, num_inputs)
    num_groups = num_inputs // group_size
    if qzeros.dtype != torch.int32 or list(qzeros.shape) != [num_groups, num_packed_cols]:
        raise KernelError(
            f"qzeros must be int32 [K/G, N/8] = [{num_groups}, {num_packed_cols}] for qweight "
            f"{list(qweight.shape)} and group_size {group_size}, got {qzeros.dtype} {list(qzeros.shape)}"
        )
    if scales.dtype != torch.float16 or list(scales.shape) != [num_groups, num_outputs]:
        raise KernelError(
            f"scales must be float16 [K/G, N] = [{num_groups}, {num_outputs}] for qweight "
            f"{list(qweight.shape)} and group_size {group_size}, got {scales.dtype} {list(scales.shape)}"
        )
    return num_inputs, num_outputs


def pack_awq(q: torch.Tensor) -> torch.Tensor:
    """Pack 4-bit integers q [K, N] (values 0..15) into AWQ int32 [K, N/8]."""
    if q.dtype not in _INT_DTYPES or q.dim() != 2:
        raise KernelError(f"q must be a 2-D integer tensor [K, N], got {q.dtype} {list(q.shape)}")
    num_rows, num_cols = q.shape
    if num_cols % PACK_FACTOR != 0:
        raise KernelError(f"q has {num_cols} columns (shape {list(q.shape)}); N must be divisible by 8")
    if q.numel() > 0 and (int(q.min()) < 0 or int(q.max()) > MAX_QUANT_VALUE):
        raise KernelError(f"q values must lie in 0..15, got {int(q.min())}..{int(q.max())}")
    # grouped: [K, N/8, 8], last dim = column within the packed int32
    grouped = q.to(torch.int64).reshape(num_rows, num_cols // PACK_FACTOR, PACK_FACTOR)
    packed = torch.zeros(num_rows, num_cols // PACK_FACTOR, dtype=torch.int64, device=q.device)
    for nibble, column in enumerate(AWQ_ORDER):
        packed |= grouped[:, :, column] << (NUM_BITS * nibble)
    # int64 -> int32 with two's-complement wrap, not relying on casting overflow
    packed = torch.where(packed >= 2**31, packed - 2**32, packed)
    return packed.to(torch.int32)


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """Unpack AWQ int32 [K, N/8] into uint8 [K, N] with values 0..15."""
    if packed.dtype != torch.int32 or packed.dim() != 2:
        raise KernelError(f"packed must be a 2-D int32 tensor [K, N/8], got {packed.dtype} {list(packed.shape)}")
    num_rows, num_packed_cols = packed.shape
    # widening to int64 and masking makes the shift logical, so negative int32 words unpack right
    words = packed.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.tensor([NUM_BITS * n for n in AWQ_REVERSE_ORDER], dtype=torch.int64, device=packed.device)
    # nibbles: [K, N/8, 8], last dim = column within the packed int32
    nibbles = (words.unsqueeze(-1) >> shifts) & MAX_QUANT_VALUE
    return nibbles.reshape(num_rows, num_packed_cols * PACK_FACTOR).to(torch.uint8)


def dequantize_awq(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    dtype: torch.dtype = torch.float16,
) -> torch.Tensor:
    """Return W [K, N] (input-major) = (q - z) * s, computed in float32 and cast to dtype."""
    check_awq_shapes(qweight, qzeros, scales, group_size)
    q = unpack_awq(qweight).to(torch.float32)
    zeros = unpack_awq(qzeros).to(torch.float32).repeat_interleave(group_size, dim=0)
    group_scales = scales.to(torch.float32).repeat_interleave(group_size, dim=0)
    return ((q - zeros) * group_scales).to(dtype)


def quantize_rtn(weight: torch.Tensor, group_size: int = 128, zero_point: bool = True) -> AwqTensors:
    """Round-to-nearest INT4 quantization of an nn.Linear weight [N, K] into AWQ GEMM tensors.

    Per group and output column, zero_point=True maps [min(w, 0), max(w, 0)] onto 0..15
    (scale = range / 15, z = round(-min / scale)): including 0 keeps z in 0..15, so nothing is
    clamped, unlike AutoAWQ's raw min/max. zero_point=False: scale = max|w| / 7, z = 8. Scales
    round up to the next float16, so rounding never shrinks the range.
    """
    if weight.dim() != 2 or not weight.is_floating_point():
        raise KernelError(
            f"weight must be a 2-D float tensor [N, K] (nn.Linear layout), got {weight.dtype} {list(weight.shape)}"
        )
    num_outputs, num_inputs = weight.shape
    if num_outputs % PACK_FACTOR != 0:
        raise KernelError(f"weight [N, K] = {list(weight.shape)} has {num_outputs} outputs; N must be divisible by 8")
    check_group_size(group_size, num_inputs)
    num_groups = num_inputs // group_size
    # grouped: [K/G, G, N], input-major like the packed tensors
    grouped = weight.detach().to(torch.float32).t().reshape(num_groups, group_size, num_outputs)
    if zero_point:
        max_val = grouped.amax(dim=1).clamp(min=0)
        min_val = grouped.amin(dim=1).clamp(max=0)
        scales = (max_val - min_val).clamp(min=1e-5) / MAX_QUANT_VALUE
    else:
        scales = grouped.abs().amax(dim=1).clamp(min=1e-5) / (2 ** (NUM_BITS - 1) - 1)
    scales = _round_up_to_float16(scales)
    if not torch.isfinite(scales).all():
        raise KernelError(
            "weight values are too large for float16 AWQ scales (a group spans more than "
            f"{65504 * MAX_QUANT_VALUE:.0f}); check the checkpoint for corrupt values"
        )
    scales_fp32 = scales.to(torch.float32)
    if zero_point:
        zeros = torch.round(-min_val / scales_fp32).clamp(0, MAX_QUANT_VALUE)
    else:
        zeros = torch.full_like(scales_fp32, 2 ** (NUM_BITS - 1))
    # q: [K/G, G, N]
    q = (torch.round(grouped / scales_fp32[:, None, :]) + zeros[:, None, :]).clamp(0, MAX_QUANT_VALUE)
    q = q.reshape(num_inputs, num_outputs).to(torch.int32)
    return AwqTensors(
        qweight=pack_awq(q),
        qzeros=pack_awq(zeros.to(torch.int32)),
        scales=scales,
        group_size=group_size,
    )


def _round_up_to_float16(values: torch.Tensor) -> torch.Tensor:
    rounded = values.to(torch.float16)
    is_low = rounded.to(torch.float32) < values
    bumped = torch.nextafter(rounded, torch.full_like(rounded, float("inf")))
    return torch.where(is_low, bumped, rounded)
