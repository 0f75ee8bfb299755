"""Prefill kernels for W4A16: a tiled tl.dot GEMM that dequantizes AWQ tiles in registers,
and a dequantize-to-float16 kernel for the "dequantize once, then cuBLAS" path.

The GEMM walks K in blocks that lie inside one quantization group, multiplies the
activations by the exact integers (q - z) on tensor cores, and scales the float32 tile
product by the group's scales afterwards, so no float16 rounding of W happens at all.
Programs that share a weight tile are launched next to each other (M is the fastest grid
axis), so the tile is read from DRAM once and from L2 after that.

Above some M the cuBLAS matmul of a dequantized float16 W beats any in-register dequant;
it needs a temporary K * N * 2 bytes, which is why the caller picks it only for large M.
"""

import torch
import triton
import triton.language as tl

from lowvram.kernels.w4a16_gemv import awq_load_block


@triton.jit
def _awq_gemm_kernel(
    x_ptr,
    qweight_ptr,
    qzeros_ptr,
    scales_ptr,
    bias_ptr,
    y_ptr,
    M,
    N,
    K,
    num_packed_cols,
    stride_xm,
    stride_xk,
    stride_ym,
    GROUP_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_N: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, K // BLOCK_K):
        k_start = kb * BLOCK_K
        offs_k = k_start + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk, mask=mask_m[:, None], other=0.0)
        # centered: [BLOCK_K, BLOCK_N], integers -15..15
        centered, scales = awq_load_block(
            qweight_ptr,
            qzeros_ptr,
            scales_ptr,
            k_start,
            pid_n,
            N,
            num_packed_cols,
            GROUP_SIZE,
            BLOCK_K,
            BLOCK_N,
            EVEN_N,
        )
        acc += tl.dot(x, centered.to(x.dtype)) * scales[None, :]

    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(
        y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :],
        acc.to(y_ptr.dtype.element_ty),
        mask=mask_m[:, None] & mask_n[None, :],
    )


@triton.jit
def _awq_dequant_kernel(
    qweight_ptr,
    qzeros_ptr,
    scales_ptr,
    w_ptr,
    N,
    num_packed_cols,
    GROUP_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_N: tl.constexpr,
):
    pid_k = tl.program_id(0)
    pid_n = tl.program_id(1)
    k_start = pid_k * BLOCK_K
    centered, scales = awq_load_block(
        qweight_ptr, qzeros_ptr, scales_ptr, k_start, pid_n, N, num_packed_cols, GROUP_SIZE, BLOCK_K, BLOCK_N, EVEN_N
    )
    w = centered.to(tl.float32) * scales[None, :]
    offs_k = k_start + tl.arange(0, BLOCK_K)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(w_ptr + offs_k[:, None] * N + offs_n[None, :], w.to(w_ptr.dtype.element_ty), mask=(offs_n < N)[None, :])


def choose_gemm_config(num_rows: int, group_size: int) -> dict:
    """Tile sizes for the prefill GEMM: 64x128 tiles, K blocks inside one group."""
    block_m = 32 if num_rows <= 32 else 64
    return {"block_m": block_m, "block_n": 128, "block_k": min(group_size, 64), "num_warps": 4, "num_stages": 3}


def launch_awq_gemm(x, qweight, qzeros, scales, group_size, bias, y, config):
    """Run the prefill GEMM into y [M, N]; inputs already checked by the caller."""
    num_rows, num_inputs = x.shape
    num_outputs = y.shape[1]
    block_m, block_n, block_k = config["block_m"], config["block_n"], config["block_k"]
    if group_size % block_k != 0 or block_n % 8 != 0 or min(block_m, block_n, block_k) < 16:
        raise ValueError(f"bad GEMM tiles {config} for group size {group_size}")
    has_bias = bias is not None
    grid = (triton.cdiv(num_rows, block_m), triton.cdiv(num_outputs, block_n))
    _awq_gemm_kernel[grid](
        x,
        qweight,
        qzeros,
        scales,
        bias if has_bias else scales,
        y,
        num_rows,
        num_outputs,
        num_inputs,
        num_outputs // 8,
        x.stride(0),
        x.stride(1),
        y.stride(0),
        GROUP_SIZE=group_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        EVEN_N=num_outputs % block_n == 0,
        HAS_BIAS=has_bias,
        num_warps=config["num_warps"],
        num_stages=config["num_stages"],
    )
    return y


def launch_awq_dequant(qweight, qzeros, scales, group_size, dtype=torch.float16):
    """Dequantize a checked AWQ Linear into a new contiguous W [K, N] of `dtype`."""
    num_inputs = qweight.shape[0]
    num_outputs = scales.shape[1]
    weight = torch.empty((num_inputs, num_outputs), dtype=dtype, device=qweight.device)
    block_k = min(group_size, 32)
    block_n = 128
    grid = (num_inputs // block_k, triton.cdiv(num_outputs, block_n))
    _awq_dequant_kernel[grid](
        qweight,
        qzeros,
        scales,
        weight,
        num_outputs,
        num_outputs // 8,
        GROUP_SIZE=group_size,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        EVEN_N=num_outputs % block_n == 0,
        num_warps=4,
    )
    return weight
