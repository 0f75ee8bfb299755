"""Batch-invariant dense linear: y = x @ W^T + bias, each row's bits independent of the row count.

cuBLAS picks its kernel (tile shape, split-K) from the matrix sizes, so a row computed alone
and the same row inside an eight-row batch are summed in different orders and can differ in
their last bits. Greedy decoding turns such a difference into a different token sooner or
later, so a request batched with others would not give the text it gives alone.

This runs the W4A16 tiled kernel over the dense weight (w4a16_gemv._tiled_kernel): 16-row
tiles through tl.dot (a row's products never meet another row's), K walked in order, and a
split-K chosen from N and K only whose partials are added in split order. Elsewhere it computes
one row at a time with torch, which is invariant for the same reason.
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
    """x [..., K] @ weight [N, K]^T + bias in float64, returned as float32."""
    y = x.to(torch.float64) @ weight.to(torch.float64).t()
    if bias is not None:
        y = y + bias.to(torch.float64)
    return y.to(torch.float32)


def invariant_split_k(num_outputs: int, num_inputs: int, num_sms: int) -> int:
    """K splits: enough programs for about two per SM on a one-row product, from N and K only."""
    num_column_blocks = -(-num_outputs // BLOCK_N)
    num_k_blocks = -(-num_inputs // BLOCK_K)
    return max(1, min(num_k_blocks, -(-2 * num_sms // num_column_blocks)))


def invariant_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, use_reference: bool = False
) -> torch.Tensor:
    """y [..., N] = x [..., K] @ weight [N, K]^T + bias [N], in x's dtype; each row of y has the
    same bits however many rows x has.

    weight and bias are nn.Linear's (weight may have any strides); x any strides. Raises
    KernelError naming the tensor for bad shapes, dtypes or devices.
    """
    name = "invariant_linear"
    if x.dim() < 1 or weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise KernelError(
            f"{name}: x {list(x.shape)} and weight {list(weight.shape)} do not multiply (x [..., K], weight [N, K])"
        )
    if weight.device != x.device or (bias is not None and bias.device != x.device):
        raise KernelError(
            f"{name}: x is on {x.device} but the weight or bias is not; move the layer and its input to one device"
        )
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
    for start in range(0, x2d.shape[0], INVARIANT_MAX_ROWS):
        stop = start + INVARIANT_MAX_ROWS
        launch_tiled(x2d[start:stop], weight, bias, y[start:stop], config)
    return y.reshape(out_shape)
