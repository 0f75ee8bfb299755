"""Batch-invariant dense linear: y = x @ W^T + bias, each row's bits independent of the row count.

cuBLAS picks its summation order from the matrix sizes, so a row alone and in a batch can differ
in its last bits, and greedy decoding in its tokens. This runs the tiled W4A16 kernel over the
dense weight: 16-row tl.dot tiles, K in order, a split-K from N and K only, partials added in
split order. Without Triton it computes one row at a time in torch.
"""

from __future__ import annotations

import torch

from lowvram.errors import KernelError
from lowvram.kernels.dispatch import HAS_TRITON, num_sms, use_triton

if HAS_TRITON:
    from lowvram.kernels.w4a16_gemv import DOT_MIN_M, INVARIANT_MAX_ROWS, launch_tiled

BLOCK_N = 64
BLOCK_K = 64


def invariant_linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """In float64, returned as float32."""
    y = x.to(torch.float64) @ weight.to(torch.float64).t()
    if bias is not None:
        y = y + bias.to(torch.float64)
    return y.to(torch.float32)


def invariant_split_k(num_outputs: int, num_inputs: int, num_sms: int) -> int:
    """K splits for about two programs per SM on one row, from N and K only."""
    num_column_blocks = -(-num_outputs // BLOCK_N)
    num_k_blocks = -(-num_inputs // BLOCK_K)
    return max(1, min(num_k_blocks, -(-2 * num_sms // num_column_blocks)))


def invariant_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, use_reference: bool = False
) -> torch.Tensor:
    """y [..., N] = x [..., K] @ weight [N, K]^T + bias [N] in x's dtype (nn.Linear's weight and bias,
    any strides), each row the same bits however many rows x has."""
    name = "invariant_linear"
    if x.dim() < 1 or weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise KernelError(
            f"{name}: x {list(x.shape)} and weight {list(weight.shape)} do not multiply ([..., K], [N, K])"
        )
    if weight.device != x.device or (bias is not None and bias.device != x.device):
        raise KernelError(f"{name}: x is on {x.device} but the weight or bias is not; move them to one device")
    if bias is not None and list(bias.shape) != [weight.shape[0]]:
        raise KernelError(f"{name}: bias must be [N] = [{weight.shape[0]}], got {list(bias.shape)}")
    num_outputs, num_inputs = weight.shape
    x2d = x.reshape(-1, num_inputs)  # [M, K]
    out_shape = (*x.shape[:-1], num_outputs)
    if x2d.shape[0] == 0:
        return x.new_empty(out_shape)
    if not use_triton(name, x.device, use_reference):
        rows = [torch.nn.functional.linear(x2d[i : i + 1], weight, bias) for i in range(x2d.shape[0])]
        return torch.cat(rows).reshape(out_shape)
    if x.dtype != weight.dtype:
        raise KernelError(f"{name}: x is {x.dtype} but the weight is {weight.dtype}; the kernel takes one dtype")
    y = torch.empty((x2d.shape[0], num_outputs), dtype=x.dtype, device=x.device)
    split_k = invariant_split_k(num_outputs, num_inputs, num_sms(x.device))
    config = {"block_m": DOT_MIN_M, "block_n": BLOCK_N, "block_k": BLOCK_K, "split_k": split_k, "num_warps": 4}
    for rows in range(0, x2d.shape[0], INVARIANT_MAX_ROWS):
        launch_tiled(x2d[rows : rows + INVARIANT_MAX_ROWS], weight, bias, y[rows : rows + INVARIANT_MAX_ROWS], config)
    return y.reshape(out_shape)
