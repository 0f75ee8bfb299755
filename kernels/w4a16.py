"""W4A16 linear layer over AutoAWQ GEMM tensors: y = x @ W + bias, W stored as INT4.

`awq_linear` checks its inputs, then picks one of three ways to compute:
- M <= MAX_DECODE_M rows: the split-K decode kernel (w4a16_gemv), bandwidth-bound;
- MAX_DECODE_M < M < DEQUANT_MATMUL_MIN_M: the tiled tl.dot GEMM (w4a16_gemm);
- M >= DEQUANT_MATMUL_MIN_M: dequantize W to float16 once, then cuBLAS, which wins once the
  matmul is long enough to hide the extra K * N * 2 bytes written and read.
The Triton kernels run on CUDA devices of compute capability 7.5 or newer with a working
Triton, and on CPU tensors under TRITON_INTERPRET=1 (how CI tests them). Everything else uses
the plain-torch path: dequantize, then matmul. The choice is logged once per device on the
`lowvram.kernels` logger.

Residual compensation, y += (x A^T) Bt with A [R, K] and Bt [R, N], is computed inside the
decode kernel (w4a16_gemv explains how); the larger paths add it with one more matmul pair
(tl.dot GEMM) or fold it into the dequantized W (cuBLAS path), where it costs little.

`awq_linear_ref` is the high-precision reference the kernels are tested against.
"""

import functools
import logging
import os
from dataclasses import dataclass

import torch

from lowvram.errors import ConfigError, KernelError
from lowvram.kernels.awq_format import check_awq_shapes, dequantize_awq
from lowvram.kernels.dispatch import num_sms
from lowvram.kernels.kv_quant import KVPages

logger = logging.getLogger("lowvram.kernels")

MAX_DECODE_M = 16
# Measured on an H200 (docs/performance.md): at 512 rows dequantize-then-cuBLAS beat the
# tl.dot GEMM on 4 of the 5 real shapes (e.g. 1536x8960: 350 vs 148 TFLOP/s).
DEQUANT_MATMUL_MIN_M = 512
MIN_COMPUTE_CAPABILITY = (7, 5)
IS_INTERPRETER = os.environ.get("TRITON_INTERPRET", "0") == "1"

try:
    from lowvram.kernels import w4a16_gemm, w4a16_gemv

    _TRITON_IMPORT_ERROR = None
except Exception as exc:  # no triton, or a triton that cannot initialise on this machine
    w4a16_gemm = w4a16_gemv = None
    _TRITON_IMPORT_ERROR = exc

_logged_choices: set[str] = set()


def awq_linear_ref(x, qweight, qzeros, scales, group_size, bias=None, *, lora_a=None, lora_bt=None):
    """Reference: x [..., K] @ dequantized W [K, N] (+ bias) (+ (x A^T) Bt), returned as float32.

    The matmuls run in float64 so a global TF32 setting on the GPU cannot loosen them.
    """
    check_awq_shapes(qweight, qzeros, scales, group_size)
    weight = dequantize_awq(qweight, qzeros, scales, group_size, dtype=torch.float64)
    x64 = x.to(torch.float64)
    y = x64 @ weight.to(x.device)
    if bias is not None:
        y = y + bias.to(torch.float64)
    if lora_a is not None:
        y = y + (x64 @ lora_a.to(torch.float64).t()) @ lora_bt.to(torch.float64)
    return y.to(torch.float32)


def awq_linear(
    x,
    qweight,
    qzeros,
    scales,
    group_size,
    bias=None,
    *,
    lora_a=None,
    lora_bt=None,
    use_reference: bool = False,
    batch_invariant: bool = False,
):
    """y [..., N] = x [..., K] @ W [K, N] + bias + (x A^T) Bt, W given as AutoAWQ GEMM tensors.

    x: float16 [..., K] (float32 and bfloat16 are accepted on the plain-torch path, and
    float32 under the Triton interpreter), any strides; qweight int32 [K, N/8], qzeros int32
    [K/G, N/8], scales float16 [K/G, N], bias [N] or None, all contiguous and on x's device;
    group_size in 32/64/128 and dividing K. lora_a [R, K] (contiguous) and lora_bt [R, N]
    (any strides, contiguous is fastest), both or neither, float, on x's device: the residual
    compensation, added in the same decode launch. Returns y in x's dtype. Raises KernelError,
    naming the tensor, for bad shapes, dtypes, strides, devices or group size. use_reference
    forces the plain-torch path (the engine does this on the CPU, where the interpreter is for
    tests only). batch_invariant gives each row of y the same bits however many rows x has:
    one kernel tiling for every M on the Triton path (w4a16_gemv.invariant_gemv_config), one
    row at a time on the plain-torch path.
    """
    num_inputs, num_outputs = _check_inputs(x, qweight, qzeros, scales, group_size, bias)
    _check_lora(x, lora_a, lora_bt, num_inputs, num_outputs)
    use_triton = not use_reference and _select_backend(x.device)
    if use_triton:
        allowed = (torch.float16, torch.float32) if x.device.type == "cpu" else (torch.float16,)
        if x.dtype not in allowed:
            raise KernelError(
                f"x is {x.dtype}; the Triton AWQ kernels take {[str(d) for d in allowed]} "
                f"activations (convert activations to float16 before AWQ layers)"
            )
    # x2d: [M, K]
    x2d = x.reshape(-1, num_inputs)
    num_rows = x2d.shape[0]
    out_shape = (*x.shape[:-1], num_outputs)
    if num_rows == 0:
        return x.new_empty(out_shape)
    if not use_triton:
        return _awq_linear_torch(
            x2d, qweight, qzeros, scales, group_size, bias, lora_a, lora_bt, batch_invariant
        ).reshape(out_shape)

    has_lora = lora_a is not None
    if batch_invariant:
        y = torch.empty((num_rows, num_outputs), dtype=x.dtype, device=x.device)
        config = w4a16_gemv.invariant_gemv_config(num_outputs, num_inputs, group_size, num_sms(x.device))
        for start in range(0, num_rows, w4a16_gemv.INVARIANT_MAX_ROWS):
            stop = min(start + w4a16_gemv.INVARIANT_MAX_ROWS, num_rows)
            w4a16_gemv.launch_awq_gemv(
                x2d[start:stop], qweight, qzeros, scales, group_size, bias, y[start:stop], config, lora_a, lora_bt
            )
        return y.reshape(out_shape)
    if num_rows >= DEQUANT_MATMUL_MIN_M:
        weight = w4a16_gemm.launch_awq_dequant(qweight, qzeros, scales, group_size, x.dtype)  # [K, N], ours
        if has_lora:
            # W += A^T Bt: K * N * R multiply-adds however many rows, one op, then one matmul
            weight.addmm_(lora_a.t().to(x.dtype), lora_bt.to(x.dtype))
        if bias is None:
            y = x2d @ weight
        else:
            y = torch.addmm(bias.to(x.dtype), x2d, weight)
        return y.reshape(out_shape)

    y = torch.empty((num_rows, num_outputs), dtype=x.dtype, device=x.device)
    if num_rows <= MAX_DECODE_M:
        config = w4a16_gemv.decode_gemv_config(
            num_rows, num_outputs, num_inputs, group_size, num_sms(x.device), has_lora
        )
        w4a16_gemv.launch_awq_gemv(x2d, qweight, qzeros, scales, group_size, bias, y, config, lora_a, lora_bt)
    else:
        config = w4a16_gemm.choose_gemm_config(num_rows, group_size)
        w4a16_gemm.launch_awq_gemm(x2d, qweight, qzeros, scales, group_size, bias, y, config)
        if has_lora:
            y.addmm_(x2d @ lora_a.t().to(x.dtype), lora_bt.to(x.dtype))
    return y.reshape(out_shape)


@dataclass
class InputNorm:
    """The one-row kernel's RMSNorm prologue: it multiplies W by weight * normalise(x + residual)
    (kernels/rms_norm.py's arithmetic) instead of x, and stores x + residual to sum_out.

    weight: [K] in x's dtype; residual, sum_out: [1, K] contiguous, both or neither (the
    first layer's norm has no residual yet). sum_out must not be x or residual: the other
    programs of the launch still read them.
    """

    weight: torch.Tensor
    eps: float
    residual: torch.Tensor | None = None
    sum_out: torch.Tensor | None = None


@dataclass
class RopeKVWrite:
    """What the one-row fused q/k/v projection needs to finish as rotary_write_kv does: the
    query heads' count, the token's position [1] and the float32 cos/sin tables [P, D/2]
    (attention.Rope), its slot [1] and the layer's KV pages. y then holds q and k rotated,
    and k and v are in the pages."""

    num_heads: int
    positions: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    slot_mapping: torch.Tensor
    pages: KVPages


def can_fuse_one_row(x: torch.Tensor) -> bool:
    """Whether awq_linear_one_row serves x: one float16 row on a device with the Triton kernels."""
    return (
        x.dim() == 2
        and x.shape[0] == 1
        and x.dtype == torch.float16
        and x.is_contiguous()
        and _select_backend(x.device)
    )


def awq_linear_one_row(
    x,
    qweight,
    qzeros,
    scales,
    group_size,
    bias=None,
    *,
    lora_a=None,
    lora_bt=None,
    norm=None,
    is_gated: bool = False,
    rope_kv: RopeKVWrite | None = None,
):
    """awq_linear of one row with the input's last step fused into the decode kernel:
    norm (InputNorm) multiplies W by weight * normalise(x + residual) and stores the
    sum to norm.sum_out; is_gated takes x [1, 2K] (gate then up) and multiplies by
    silu(gate) * up. x: [1, K] (or [1, 2K]) contiguous, float16 (float32 too under the
    interpreter); can_fuse_one_row says when this runs. Returns y [1, N]. `rope_kv` (with
    the norm, on a fused q/k/v layer) also rotates q and k in y and stores k and v in its
    pages, in the lane kernel with one column block per head.
    """
    if (norm is None) == (not is_gated):
        raise KernelError("awq_linear_one_row fuses one prologue: give norm or is_gated, not both or neither")
    width = qweight.shape[0] * (2 if is_gated else 1)
    if x.dim() != 2 or x.shape[0] != 1 or x.shape[1] != width or not x.is_contiguous():
        raise KernelError(
            f"awq_linear_one_row: x is {list(x.shape)} with strides {x.stride()}; expected one "
            f"contiguous row of {width} ({'gate then up, ' if is_gated else ''}K = {qweight.shape[0]})"
        )
    num_inputs, num_outputs = _check_inputs(x[:, : qweight.shape[0]], qweight, qzeros, scales, group_size, bias)
    _check_lora(x, lora_a, lora_bt, num_inputs, num_outputs)
    if not _select_backend(x.device):
        raise KernelError(f"awq_linear_one_row needs the Triton kernels, which {x.device} does not have")
    if norm is not None:
        expected = (num_inputs,)
        if norm.weight.shape != expected or norm.weight.dtype != x.dtype or not norm.weight.is_contiguous():
            raise KernelError(
                f"the norm weight is {norm.weight.dtype} {list(norm.weight.shape)}; expected a "
                f"contiguous {x.dtype} [{num_inputs}]"
            )
        if (norm.residual is None) != (norm.sum_out is None):
            raise KernelError("the norm's residual and sum_out come together: pass both or neither")
        for name in ("residual", "sum_out"):
            tensor = getattr(norm, name)
            if tensor is not None and (
                tensor.shape != x.shape
                or tensor.dtype != x.dtype
                or not tensor.is_contiguous()
                or tensor.device != x.device
            ):
                raise KernelError(
                    f"the norm's {name} is {tensor.dtype} {list(tensor.shape)} on {tensor.device}; "
                    f"expected a contiguous {x.dtype} {list(x.shape)} on {x.device}"
                )
        if norm.sum_out is not None and norm.sum_out.data_ptr() in (x.data_ptr(), norm.residual.data_ptr()):
            raise KernelError("the norm's sum_out must be a new tensor: other programs still read x and residual")
    if rope_kv is not None:
        pages = rope_kv.pages
        expected = (rope_kv.num_heads + 2 * pages.num_kv_heads) * pages.head_dim
        if norm is None or num_outputs != expected or pages.head_dim % 16:
            raise KernelError(
                f"awq_linear_one_row: RoPE and the KV store need the norm prologue and a fused q/k/v "
                f"layer of {rope_kv.num_heads} + 2 x {pages.num_kv_heads} heads of {pages.head_dim} "
                f"({expected} outputs); got {num_outputs} outputs"
            )
        # one column block per head, in the lane kernel
        config = w4a16_gemv.choose_gemv_config(
            1, num_outputs, num_inputs, group_size, num_sms(x.device), block_n=pages.head_dim
        )
    else:
        config = w4a16_gemv.decode_gemv_config(
            1, num_outputs, num_inputs, group_size, num_sms(x.device), lora_a is not None
        )
    y = torch.empty((1, num_outputs), dtype=x.dtype, device=x.device)
    return w4a16_gemv.launch_awq_gemv(
        x,
        qweight,
        qzeros,
        scales,
        group_size,
        bias,
        y,
        config,
        lora_a,
        lora_bt,
        norm=norm,
        is_gated=is_gated,
        rope_kv=rope_kv,
    )


def _awq_linear_torch(x2d, qweight, qzeros, scales, group_size, bias, lora_a=None, lora_bt=None, batch_invariant=False):
    # CPU matmuls are fastest and most accurate in float32; GPUs keep the activation dtype.
    compute_dtype = x2d.dtype if x2d.is_cuda else torch.float32
    weight = dequantize_awq(qweight, qzeros, scales, group_size, dtype=compute_dtype)
    x = x2d.to(compute_dtype)

    def rows_times_weight(rows: torch.Tensor) -> torch.Tensor:
        y = rows @ weight
        if bias is not None:
            y = y + bias.to(compute_dtype)
        if lora_a is not None:
            y = torch.addmm(y, rows @ lora_a.t().to(compute_dtype), lora_bt.to(compute_dtype))
        return y

    if batch_invariant:
        # BLAS picks its blocking (and so a row's summation order) from the row count
        y = torch.cat([rows_times_weight(x[i : i + 1]) for i in range(x.shape[0])])
    else:
        y = rows_times_weight(x)
    return y.to(x2d.dtype)


def _check_inputs(x, qweight, qzeros, scales, group_size, bias):
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() < 1:
        raise KernelError(
            f"x must be a floating-point tensor [..., K], got "
            f"{getattr(x, 'dtype', type(x).__name__)} {list(getattr(x, 'shape', []))}"
        )
    try:
        num_inputs, num_outputs = check_awq_shapes(qweight, qzeros, scales, group_size)
    except ConfigError as exc:
        raise KernelError(str(exc)) from exc
    if x.shape[-1] != num_inputs:
        raise KernelError(
            f"x has {x.shape[-1]} features (shape {list(x.shape)}) but qweight "
            f"{list(qweight.shape)} expects K = {num_inputs}"
        )
    for name, tensor in (("qweight", qweight), ("qzeros", qzeros), ("scales", scales)):
        if not tensor.is_contiguous():
            raise KernelError(
                f"{name} {list(tensor.shape)} must be contiguous, got strides "
                f"{tensor.stride()}; call .contiguous() when loading"
            )
        if tensor.device != x.device:
            raise KernelError(
                f"{name} is on {tensor.device} but x is on {x.device}; move the layer and its input to one device"
            )
    if bias is not None:
        if not bias.is_floating_point() or list(bias.shape) != [num_outputs]:
            raise KernelError(f"bias must be a float tensor [N] = [{num_outputs}], got {bias.dtype} {list(bias.shape)}")
        if not bias.is_contiguous() or bias.device != x.device:
            raise KernelError(
                f"bias must be contiguous and on {x.device}, got strides {bias.stride()} on {bias.device}"
            )
    return num_inputs, num_outputs


def _check_lora(x, lora_a, lora_bt, num_inputs, num_outputs):
    if lora_a is None and lora_bt is None:
        return
    if lora_a is None or lora_bt is None:
        raise KernelError("lora_a and lora_bt come together: pass both or neither")
    for name, tensor, width in (("lora_a", lora_a, num_inputs), ("lora_bt", lora_bt, num_outputs)):
        if not tensor.is_floating_point() or tensor.dim() != 2 or tensor.shape[1] != width:
            readable = "[R, K] = [R, %d]" if name == "lora_a" else "[R, N] = [R, %d]"
            raise KernelError(
                f"{name} must be a float tensor {readable % width}, got {tensor.dtype} {list(tensor.shape)}"
            )
        if tensor.device != x.device:
            raise KernelError(
                f"{name} is on {tensor.device} but x is on {x.device}; move the layer and its input to one device"
            )
    if lora_a.shape[0] != lora_bt.shape[0]:
        raise KernelError(f"lora_a has rank {lora_a.shape[0]} but lora_bt has rank {lora_bt.shape[0]}")
    if lora_a.stride(1) != 1:
        raise KernelError(
            f"lora_a {list(lora_a.shape)} must have unit stride along K, got strides "
            f"{lora_a.stride()}; call .contiguous() when loading"
        )


def _select_backend(device: torch.device) -> bool:
    """True for the Triton kernels, False for the plain-torch path; logs the choice once."""
    use_triton, reason = _backend_for(device.type, device.index)
    message = f"AWQ linear on {device}: {'Triton kernels' if use_triton else 'plain torch'} ({reason})"
    if message not in _logged_choices:
        _logged_choices.add(message)
        logger.info(message)
    return use_triton


@functools.cache
def _backend_for(device_type: str, device_index) -> tuple[bool, str]:
    if _TRITON_IMPORT_ERROR is not None:
        return False, f"triton is unavailable: {_TRITON_IMPORT_ERROR}"
    if device_type == "cpu":
        if IS_INTERPRETER:
            return True, "TRITON_INTERPRET=1"
        return False, "CPU tensors"
    if device_type != "cuda":
        return False, f"no Triton kernels for {device_type} devices"
    if IS_INTERPRETER:
        return False, "TRITON_INTERPRET=1 would run the kernels on the host"
    capability = torch.cuda.get_device_capability(device_index)
    if capability < MIN_COMPUTE_CAPABILITY:
        return False, f"compute capability {capability[0]}.{capability[1]} is below 7.5"
    return True, f"compute capability {capability[0]}.{capability[1]}"
