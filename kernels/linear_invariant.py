"""Batch-invariant dense linear: y = x @ W^T + bias, each row's bits independent of the row count.

cuBLAS picks its kernel (tile shape, split-K) from the matrix sizes, so a row computed alone
and the same row inside an eight-row batch are summed in different orders and can differ in
their last bits. Greedy decoding turns such a difference into a different token sooner or
later, so a request batched with others would not give the text it gives alone.

This kernel uses one tiling for every row count: 16-row tiles through tl.dot (a row's
products never meet another row's), K walked in BLOCK_K steps in order, and a split-K chosen
from N and K only, whose partial sums the last program of a column block adds in split order
(`awq_gemv_store`, shared with the W4A16 decode kernel). Rows go through in launches of at
most INVARIANT_MAX_ROWS, which bounds the float32 partials ([SPLIT_K, rows, N]) of a long
prefill chunk without changing any row's arithmetic.

`invariant_linear` checks its inputs and runs the kernel on CUDA (or on CPU tensors under
TRITON_INTERPRET=1); elsewhere it computes one row at a time with torch, which is invariant
for the same reason. `invariant_linear_ref` is the float64 reference.
"""

from __future__ import annotations

import torch

from lowvram.errors import KernelError
from lowvram.kernels.dispatch import use_triton

# The W4A16 path's SM count, so both kinds of layer split alike (a small count under the
# interpreter, so CPU tests cover the split reduction).
from lowvram.kernels.w4a16 import num_sms

try:
    import triton
    import triton.language as tl

    from lowvram.kernels.w4a16_gemv import DOT_MIN_M, INVARIANT_MAX_ROWS, SPLIT_COUNTERS, awq_gemv_store

    HAS_TRITON = True
except ImportError:  # Windows and macOS wheels of torch ship without Triton
    HAS_TRITON = False

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
    if not HAS_TRITON or not use_triton(name, x.device, use_reference):
        rows = [torch.nn.functional.linear(x2d[i : i + 1], weight, bias) for i in range(x2d.shape[0])]
        return torch.cat(rows).reshape(out_shape)
    if x.dtype != weight.dtype:
        raise KernelError(f"{name}: x is {x.dtype} but the weight is {weight.dtype}; the kernel takes one dtype")
    y = torch.empty((x2d.shape[0], num_outputs), dtype=x.dtype, device=x.device)
    split_k = invariant_split_k(num_outputs, num_inputs, num_sms(x.device))
    for start in range(0, x2d.shape[0], INVARIANT_MAX_ROWS):
        stop = min(start + INVARIANT_MAX_ROWS, x2d.shape[0])
        _launch(x2d[start:stop], weight, bias, y[start:stop], split_k)
    return y.reshape(out_shape)


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor, split_k: int) -> None:
    num_rows, num_inputs = x.shape
    num_outputs = weight.shape[0]
    num_k_blocks = triton.cdiv(num_inputs, BLOCK_K)
    k_blocks_per_split = triton.cdiv(num_k_blocks, split_k)
    split_k = triton.cdiv(num_k_blocks, k_blocks_per_split)
    num_column_blocks = triton.cdiv(num_outputs, BLOCK_N)
    num_row_tiles = triton.cdiv(num_rows, DOT_MIN_M)
    is_partial = split_k > 1
    if is_partial:
        # partials: [SPLIT_K, M, N] float32
        partials = x.new_empty((split_k, num_rows, num_outputs), dtype=torch.float32)
        counters = SPLIT_COUNTERS.get(y.device, num_column_blocks * num_row_tiles)
    else:
        partials = counters = y  # not read
    _linear_rows_kernel[(num_column_blocks, split_k, num_row_tiles)](
        x,
        weight,
        bias if bias is not None else weight,
        y,
        partials,
        counters,
        num_rows,
        num_outputs,
        num_inputs,
        x.stride(0),
        x.stride(1),
        weight.stride(0),
        weight.stride(1),
        y.stride(0),
        k_blocks_per_split,
        num_k_blocks,
        BLOCK_M=DOT_MIN_M,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        HAS_BIAS=bias is not None,
        IS_PARTIAL=is_partial,
        num_warps=4,
    )


if HAS_TRITON:

    @triton.jit
    def _linear_rows_kernel(
        x_ptr,
        w_ptr,
        bias_ptr,
        y_ptr,
        partial_ptr,
        counter_ptr,
        M,
        N,
        K,
        stride_xm,
        stride_xk,
        stride_wn,
        stride_wk,
        stride_ym,
        K_BLOCKS_PER_SPLIT,
        NUM_K_BLOCKS,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        IS_PARTIAL: tl.constexpr,
    ):
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        pid_m = tl.program_id(2)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_m = offs_m < M
        mask_n = offs_n < N
        counter_ptr += pid_m * tl.num_programs(0)  # each row tile has its own column-block counters
        kb_start = pid_k * K_BLOCKS_PER_SPLIT
        kb_end = tl.minimum(kb_start + K_BLOCKS_PER_SPLIT, NUM_K_BLOCKS)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kb in range(kb_start, kb_end):
            offs_k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
            mask_k = offs_k < K
            # x: [BLOCK_M, BLOCK_K]; w^T: [BLOCK_K, BLOCK_N]
            x = tl.load(
                x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                mask=mask_m[:, None] & mask_k[None, :],
                other=0.0,
            )
            w = tl.load(
                w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk,
                mask=mask_n[None, :] & mask_k[:, None],
                other=0.0,
            )
            acc += tl.dot(x, w)
        awq_gemv_store(
            acc,
            offs_m[:, None],
            offs_n[None, :],
            mask_m[:, None] & mask_n[None, :],
            y_ptr,
            stride_ym,
            bias_ptr,
            partial_ptr,
            counter_ptr,
            M,
            N,
            HAS_BIAS,
            IS_PARTIAL,
        )
