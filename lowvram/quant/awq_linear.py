"""AwqLinear: an nn.Linear whose weight stays packed as AutoAWQ GEMM INT4 tensors (the
checkpoint's `qweight`, `qzeros`, `scales`, `bias`), run by `lowvram.kernels.w4a16.awq_linear`.

Compensation from `lowvram quantize`, under names other loaders ignore: `lowvram_lora_a` [r, K]
and `lowvram_lora_b` [N, r] add (x A^T) B^T inside the INT4 kernel (B held as a view of a
contiguous [r, N], `lora_bt`); `lowvram_bias_correction` [N] is folded into the bias.
"""

from __future__ import annotations

import torch
from torch import nn

from lowvram.errors import ModelLoadError
from lowvram.kernels.awq_format import PACK_FACTOR, dequantize_awq
from lowvram.kernels.w4a16 import InputNorm, awq_linear, awq_linear_one_row, can_fuse_one_row

LORA_A = "lowvram_lora_a"
LORA_B = "lowvram_lora_b"
BIAS_CORRECTION = "lowvram_bias_correction"
COMPENSATION_NAMES = (LORA_A, LORA_B, BIAS_CORRECTION)  # names in the checkpoint
LORA_NAMES = (LORA_A, LORA_B)  # the ones a module keeps as buffers
AWQ_NAMES = ("qweight", "qzeros", "scales")


class AwqLinear(nn.Module):
    """y = x W^T + bias with W = (q - z) * s held as packed INT4 (K % group_size == 0, N % 8 == 0);
    the buffers start empty for the loader to fill."""

    def __init__(self, in_features: int, out_features: int, group_size: int, has_bias: bool = False):
        super().__init__()
        if out_features % PACK_FACTOR or in_features % group_size:
            raise ValueError(
                f"AWQ needs out_features % 8 == 0 and in_features % group_size == 0, got "
                f"[{out_features}, {in_features}] with group_size {group_size}"
            )
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        num_groups = in_features // group_size
        self.register_buffer("qweight", torch.empty(in_features, out_features // PACK_FACTOR, dtype=torch.int32))
        self.register_buffer("qzeros", torch.empty(num_groups, out_features // PACK_FACTOR, dtype=torch.int32))
        self.register_buffer("scales", torch.empty(num_groups, out_features, dtype=torch.float16))
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if has_bias else None
        for name in LORA_NAMES:
            self.register_buffer(name, None)
        self.has_own_bias = has_bias
        self.is_bias_corrected = False  # the bias already holds lowvram_bias_correction
        self.is_batch_invariant = False  # set by lowvram.models.batch_invariance
        # W (+ A^T B^T) [K, N] in float32, made at the first CPU call, and what it was made from
        self.cpu_weight: torch.Tensor | None = None
        self.cpu_weight_key: tuple = ()

    @property
    def has_compensation(self) -> bool:
        return self.is_bias_corrected or self.lowvram_lora_a is not None or self.lowvram_lora_b is not None

    @property
    def lora_rank(self) -> int:
        return 0 if self.lowvram_lora_a is None else self.lowvram_lora_a.shape[0]

    @property
    def lora_bt(self) -> torch.Tensor | None:
        """B^T [r, N], contiguous as set_compensation stores it."""
        return None if self.lowvram_lora_b is None else self.lowvram_lora_b.t()

    def set_compensation(self, name: str, tensor: torch.Tensor) -> None:
        """Attach one compensation tensor, checking its shape; a bias correction is added to
        the bias, which must already be loaded."""
        num_inputs, num_outputs = self.in_features, self.out_features
        expected = {LORA_A: (None, num_inputs), LORA_B: (num_outputs, None), BIAS_CORRECTION: (num_outputs,)}[name]
        shape = tuple(tensor.shape)
        if len(shape) != len(expected) or any(e is not None and e != s for e, s in zip(expected, shape)):
            readable = ["r" if e is None else e for e in expected]
            raise ValueError(f"{name} has shape {list(shape)}, expected {readable}")
        if name == LORA_B:
            self.register_buffer(name, tensor.t().contiguous().t())  # [N, r] over a contiguous [r, N]
        elif name == LORA_A:
            self.register_buffer(name, tensor.contiguous())
        elif self.bias is None:
            self.bias = nn.Parameter(tensor.clone(), requires_grad=False)
            self.is_bias_corrected = True
        elif self.bias.is_meta:
            raise ValueError(f"{BIAS_CORRECTION} was attached before the bias was loaded; attach it after")
        else:
            # one rounding to the bias dtype instead of one per add in the forward pass
            folded = (self.bias.float() + tensor.to(self.bias.device).float()).to(self.bias.dtype)
            self.bias = nn.Parameter(folded, requires_grad=False)
            self.is_bias_corrected = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            return awq_linear(x, *self._packed(), **self._lora(), batch_invariant=self.is_batch_invariant)
        # On the CPU (Triton there is only the interpreter) W is unpacked once, the compensation folded
        # into it, where the float32 copy fits in free memory; else it is unpacked on every call. The
        # copy is remade when a tensor it came from changes (an expert cache's slot is refilled in place).
        tensors = (self.qweight, self.qzeros, self.scales, self.lowvram_lora_a, self.lowvram_lora_b)
        key = tuple((id(t), t._version) for t in tensors if t is not None)
        if key != self.cpu_weight_key:
            self.cpu_weight, self.cpu_weight_key = None, key
            if self._cpu_weight_fits():
                weight = dequantize_awq(self.qweight, self.qzeros, self.scales, self.group_size, dtype=torch.float32)
                if self.lowvram_lora_a is not None:
                    weight.addmm_(self.lowvram_lora_a.t().float(), self.lora_bt.float())
                self.cpu_weight = weight
        if self.cpu_weight is None:
            return awq_linear(
                x, *self._packed(), **self._lora(), use_reference=True, batch_invariant=self.is_batch_invariant
            )
        x32 = x.float()
        bias = None if self.bias is None else self.bias.float()
        if self.is_batch_invariant:  # BLAS picks its blocking (so a row's summation order) from the row count
            rows = [torch.nn.functional.linear(row, self.cpu_weight.t(), bias) for row in x32.split(1, dim=-2)]
            return torch.cat(rows, dim=-2).to(x.dtype)
        return torch.nn.functional.linear(x32, self.cpu_weight.t(), bias).to(x.dtype)

    def _cpu_weight_fits(self) -> bool:
        import psutil

        return 4 * self.in_features * self.out_features < psutil.virtual_memory().available - (1 << 30)

    def can_fuse_input(self, x: torch.Tensor) -> bool:
        """Whether forward_normed / forward_gated serve x: one float16 row on the GPU, outside the
        batch-invariant mode (one kernel form for every row count)."""
        return not self.is_batch_invariant and x.is_cuda and can_fuse_one_row(x)

    def forward_normed(
        self, h: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float, rope_kv=None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(self(RMSNorm(h + residual)), h + residual) in one kernel (no residual: h itself);
        `rope_kv`: a fused q/k/v output also rotated and its k, v stored (w4a16.RopeKVWrite)."""
        total = None if residual is None else torch.empty_like(h)
        norm = InputNorm(norm_weight, eps, residual, total)
        y = awq_linear_one_row(h, *self._packed(), **self._lora(), norm=norm, rope_kv=rope_kv)
        return y, (h if total is None else total)

    def forward_gated(self, gate_up: torch.Tensor) -> torch.Tensor:
        """self(silu(gate) * up) of a fused gate/up output [1, 2K], in one kernel."""
        return awq_linear_one_row(gate_up, *self._packed(), **self._lora(), is_gated=True)

    def _packed(self) -> tuple:
        return self.qweight, self.qzeros, self.scales, self.group_size, self.bias

    def _lora(self) -> dict:
        if self.lowvram_lora_a is None or self.lowvram_lora_b is None:
            return {}
        return {"lora_a": self.lowvram_lora_a, "lora_bt": self.lora_bt}

    def extra_repr(self) -> str:
        extras = f", lora_rank={self.lora_rank}" if self.lora_rank else ""
        extras += ", bias_correction=True" if self.is_bias_corrected else ""
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"group_size={self.group_size}, bias={self.bias is not None}{extras}"
        )


def swap_awq_linears(model: nn.Module, quant, is_head_quantized: bool = False) -> None:
    """Replace every Linear of the decoder layers that `quant` (models.config.AwqConfig) does
    not skip, and lm_head when quantized, by an empty AwqLinear; the model is on the meta device."""
    names = [
        name
        for name, module in model.model.layers.named_modules(prefix="model.layers")
        if isinstance(module, nn.Linear) and not quant.is_skipped(name)
    ]
    for name in names + (["lm_head"] if is_head_quantized else []):
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        linear = getattr(parent, child)
        try:
            with torch.device("meta"):
                awq = AwqLinear(linear.in_features, linear.out_features, quant.group_size, linear.bias is not None)
        except ValueError as exc:
            raise ModelLoadError(
                f"{name} cannot be AWQ INT4 with quantization_config group_size {quant.group_size}: {exc}; the "
                "checkpoint does not match its config.json (or misses the layer in modules_to_not_convert)"
            ) from None
        setattr(parent, child, awq)
