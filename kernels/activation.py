"""SwiGLU's activation in one kernel: silu(gate) * up of a fused gate/up output [T, 2I] -> [T, I]."""

import torch
import triton
import triton.language as tl

from lowvram.errors import KernelError
from lowvram.kernels.dispatch import use_triton


@triton.jit
def silu_mul(gate, up):
    """silu(gate) * up in float32, silu rounded to gate's dtype first as torch does (also the GEMV's prologue)."""
    gate_f = gate.to(tl.float32)
    activated = (gate_f / (1.0 + tl.exp(-gate_f))).to(gate.dtype)
    return activated.to(tl.float32) * up.to(tl.float32)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, num_cols, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < num_cols
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + num_cols + offs, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_o + offs, silu_mul(gate, up).to(gate.dtype), mask=mask)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def silu_and_mul(x: torch.Tensor, *, use_reference: bool = False) -> torch.Tensor:
    """x [T, 2I] (gate then up) -> silu(gate) * up [T, I]."""
    if x.dim() != 2 or x.shape[1] % 2 or x.stride(1) != 1:
        raise KernelError(
            f"silu_and_mul: x is {tuple(x.shape)}, strides {x.stride()}; expected [T, 2I], last dim contiguous"
        )
    if x.dtype == torch.bfloat16 or not use_triton("silu_and_mul", x.device, use_reference) or x.shape[0] == 0:
        return silu_and_mul_ref(x)
    num_rows, num_cols = x.shape[0], x.shape[1] // 2
    out = torch.empty((num_rows, num_cols), dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(num_cols))
    grid = (num_rows, triton.cdiv(num_cols, block))
    _silu_and_mul_kernel[grid](x, out, num_cols, x.stride(0), out.stride(0), BLOCK=block, num_warps=4)
    return out
