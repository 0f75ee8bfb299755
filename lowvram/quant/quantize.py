"""`lowvram quantize MODEL OUT`: AWQ INT4 in the AutoAWQ GEMM layout, one layer at a time.

Per decoder layer, with calibration activations (default 128 samples x 512 tokens):
1. run the layer in full precision and keep its block outputs (attention, MLP, layer);
2. AWQ: search and fold the input-channel scales of each scale group (`lowvram.quant.awq`),
   then search per-group clipping for every Linear but q/k (skipped with --method rtn);
3. quantize every Linear to INT4 (group size 128 by default) in the exact packed form;
4. with --fp16-budget-mib: score each fused group (q/k/v, o, gate/up, down) by the error
   quantizing it alone adds to the layer's output, relative to that output per token;
5. with --rank (and --bias-correction): fit the residual compensation of each Linear
   (`lowvram.quant.compensation`);
6. pass the full-precision output on as the next layer's input (as AutoAWQ does, so every
   layer sees the activations of the original model).
Only the current layer's weights and activations are on the device: the checkpoint is read
tensor by tensor from its safetensors files, so the model itself stays on the host (mapped
from disk). Activations that do not fit the device budget are kept in pinned host memory.

After the last layer the most sensitive groups that fit --fp16-budget-mib stay in FP16
(re-read from the checkpoint with their AWQ scales applied) and are listed in
`modules_to_not_convert`, together with the fused names vLLM gives them (`qkv_proj`,
`gate_up_proj`), so vLLM keeps the whole fused layer in FP16 as well.

The output directory is the AutoAWQ GEMM layout exactly (`model.safetensors` with
`*.qweight` int32 [K, N/8], `*.qzeros` int32 [K/G, N/8], `*.scales` float16 [K/G, N], FP16
everything else; `quantization_config` in config.json), plus the tokenizer files, the
compensation tensors in `lowvram_compensation.st` (a file vLLM and transformers never
read) and `lowvram_quantize.json` (what was chosen and why). It is written into
OUT.partial-XXXX and renamed into place at the end; on any error that directory is removed.
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import math
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from lowvram.errors import ConfigError, ModelLoadError, OutOfMemoryError, UnsupportedModelError
from lowvram.kernels.awq_format import PACK_FACTOR, SUPPORTED_GROUP_SIZES, AwqTensors, quantize_rtn
from lowvram.models.checkpoint import COMPENSATION_FILE, weight_files
from lowvram.models.config import AwqConfig, ModelConfig, load_model_config
from lowvram.models.dense import Rotary
from lowvram.models.loader import QUANTIZABLE_LINEARS
from lowvram.quant.awq import (
    MAX_CLIP_TOKENS,
    NO_CLIP_LINEARS,
    ScaleGroup,
    clip_weight,
    fake_quantize,
    fold_scales,
    layer_scale_groups,
    sample_tokens,
    search_clip,
    search_scales,
)
from lowvram.quant.awq_linear import BIAS_CORRECTION, LORA_A, LORA_B
from lowvram.quant.calibration import calibration_blocks, load_calibration_records
from lowvram.quant.compensation import Compensation, InputStats, fit_compensation

log = logging.getLogger("lowvram")

MIB = 2**20
GIB = 2**30
WEIGHTS_FILE = "model.safetensors"
REPORT_FILE = "lowvram_quantize.json"
METHODS = ("awq", "rtn")
CHUNK_TOKENS = {"cuda": 8192, "cpu": 2048}
# Share of the device's (or emulated card's) memory that cached activations may fill.
MAX_RESIDENT_SHARE = 0.6
MAX_HEAD_TOKENS = 2048
HEAD_CHUNK_TOKENS = 256
# Files of the input directory that are not copied: weights, and configs that are rewritten.
SKIPPED_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".st")
SKIPPED_FILES = ("config.json", "quant_config.json", "model.safetensors.index.json", REPORT_FILE)

# Linears that vLLM fuses into one module must share a precision: one INT4/FP16 decision
# covers the whole group. Named as vLLM names the module -> its checkpoint Linears.
FUSED_GROUPS = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
}
INPUT_OF = {
    "self_attn.q_proj": "attn_in",
    "self_attn.k_proj": "attn_in",
    "self_attn.v_proj": "attn_in",
    "self_attn.o_proj": "o_in",
    "mlp.gate_proj": "mlp_in",
    "mlp.up_proj": "mlp_in",
    "mlp.down_proj": "down_in",
}


# -- report ------------------------------------------------------------------------------------


@dataclass
class QuantizeReport:
    """What `quantize_model` did; also written to OUT/lowvram_quantize.json."""

    model_dir: str
    out_dir: str
    method: str
    group_size: int
    device: str
    num_samples: int
    seq_len: int
    rank: int
    has_bias_correction: bool
    fp16_budget_mib: float
    is_head_quantized: bool
    num_int4_linears: int = 0
    fp16_groups: list[dict] = field(default_factory=list)  # {"name", "score", "extra_mib"}, most sensitive first
    sensitivity: dict[str, float] = field(default_factory=dict)  # fused group -> relative error it adds to h
    compensation: dict[str, dict] = field(
        default_factory=dict
    )  # linear -> {"rank", "scale", "bias", "error_reduction"}
    awq_alphas: dict[str, float | None] = field(default_factory=dict)  # scale group -> alpha (None: RTN won)
    int4_bytes: int = 0
    fp16_layer_bytes: int = 0
    compensation_bytes: int = 0
    other_bytes: int = 0
    seconds: float = 0.0
    peak_device_bytes: int | None = None
    peak_host_bytes: int | None = None

    @property
    def total_bytes(self) -> int:
        return self.int4_bytes + self.fp16_layer_bytes + self.compensation_bytes + self.other_bytes

    def to_json(self) -> dict:
        return {**asdict(self), "total_bytes": self.total_bytes}

    def summary(self) -> str:
        lines = [
            f"quantized {self.model_dir} -> {self.out_dir} ({self.method.upper()} INT4, group size "
            f"{self.group_size}, {self.num_samples} x {self.seq_len} calibration tokens, on {self.device})"
        ]
        lines.append(
            f"  weights {self.total_bytes / MIB:.1f} MiB: INT4 {self.int4_bytes / MIB:.1f} "
            f"({self.num_int4_linears} linears), FP16 layers {self.fp16_layer_bytes / MIB:.1f}, "
            f"compensation {self.compensation_bytes / MIB:.1f}, embeddings/head/norms "
            f"{self.other_bytes / MIB:.1f}"
        )
        if self.fp16_budget_mib > 0:
            if self.fp16_groups:
                lines.append(f"  kept in FP16 (most sensitive first, within {self.fp16_budget_mib:g} MiB):")
                lines += [
                    f"    {g['name']:<40} score {g['score']:.3e}  +{g['extra_mib']:.2f} MiB" for g in self.fp16_groups
                ]
            else:
                lines.append(f"  no layer fits the FP16 budget of {self.fp16_budget_mib:g} MiB")
        if self.compensation:
            ranks = [c["rank"] for c in self.compensation.values()]
            reductions = [c["error_reduction"] for c in self.compensation.values()]
            lines.append(
                f"  compensation on {len(ranks)} linears: mean rank {sum(ranks) / len(ranks):.1f}, "
                f"held-out INT4 error reduced by {100 * sum(reductions) / len(reductions):.0f}% on average"
            )
        peak = (
            f"peak device memory {self.peak_device_bytes / GIB:.2f} GiB" if self.peak_device_bytes is not None else ""
        )
        host = f"peak host memory {self.peak_host_bytes / GIB:.2f} GiB" if self.peak_host_bytes else ""
        lines.append(f"  time {self.seconds:.1f} s" + "".join(f", {p}" for p in (peak, host) if p))
        return "\n".join(lines)


# -- reading the input checkpoint --------------------------------------------------------------


class SourceCheckpoint:
    """The input checkpoint's tensors, read one at a time from its (memory-mapped) shards."""

    def __init__(self, model_dir: Path):
        from safetensors import safe_open

        self._where = {}
        for path in weight_files(model_dir):
            try:
                handle = safe_open(str(path), framework="pt", device="cpu")
            except Exception as exc:  # safetensors raises its own error types and OSError
                raise ModelLoadError(f"{path} is corrupt or unreadable ({exc}); re-download this shard") from None
            for name in handle.keys():
                self._where[name] = handle

    def has(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise ModelLoadError(f"the checkpoint lacks {name}; it is incomplete or does not match config.json")
        return self._where[name].get_tensor(name)


def _layer_weights(source: SourceCheckpoint, config: ModelConfig, index: int, device: torch.device) -> dict:
    """Float32 weights of one decoder layer on the device, keyed by name within the layer."""
    names = ["input_layernorm.weight", "post_attention_layernorm.weight"]
    names += [f"{linear}.weight" for linear in QUANTIZABLE_LINEARS]
    if config.has_qkv_bias:
        names += [f"self_attn.{p}_proj.bias" for p in "qkv"]
    return {name: source.get(f"model.layers.{index}.{name}").to(device=device, dtype=torch.float32) for name in names}


# -- the layer, run densely over whole calibration samples ---------------------------------------


class LayerRunner:
    """One decoder layer's forward over calibration samples [b, L, hidden], without a KV cache.

    Weights come in as a dict (name within the layer -> tensor in the compute dtype), so a
    search can swap in trial weights without touching the model.
    """

    def __init__(self, config: ModelConfig, seq_len: int, device: torch.device):
        self.config = config
        self.rotary = Rotary(config)
        self.positions = torch.arange(seq_len, device=device)

    @staticmethod
    def linear(weights: dict, name: str, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, weights[f"{name}.weight"], weights.get(f"{name}.bias"))

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps)
        return weight * xf.to(x.dtype)

    def attention_context(self, weights: dict, x: torch.Tensor) -> torch.Tensor:
        """x [b, L, hidden] (normed) -> context before o_proj [b, L, heads * head_dim]."""
        config = self.config
        batch, length, _ = x.shape
        num_heads, num_kv_heads, head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        q = self.linear(weights, "self_attn.q_proj", x).reshape(batch * length, num_heads, head_dim)
        k = self.linear(weights, "self_attn.k_proj", x).reshape(batch * length, num_kv_heads, head_dim)
        v = self.linear(weights, "self_attn.v_proj", x)
        q, k = self.rotary(self.positions[:length].repeat(batch), q, k)
        group = num_heads // num_kv_heads
        # q: [b, H, L, D]; k, v: [b, Hkv, L, D] repeated to [b, H, L, D]
        q = q.reshape(batch, length, num_heads, head_dim).transpose(1, 2)
        k = k.reshape(batch, length, num_kv_heads, head_dim).transpose(1, 2).repeat_interleave(group, dim=1)
        v = v.reshape(batch, length, num_kv_heads, head_dim).transpose(1, 2).repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=head_dim**-0.5)
        return out.transpose(1, 2).reshape(batch, length, num_heads * head_dim)  # [b, H, L, D] -> [b, L, H*D]

    def attention(self, weights: dict, x: torch.Tensor) -> torch.Tensor:
        return self.linear(weights, "self_attn.o_proj", self.attention_context(weights, x))

    def mlp_hidden(self, weights: dict, x: torch.Tensor) -> torch.Tensor:
        return F.silu(self.linear(weights, "mlp.gate_proj", x)) * self.linear(weights, "mlp.up_proj", x)

    def mlp(self, weights: dict, x: torch.Tensor) -> torch.Tensor:
        return self.linear(weights, "mlp.down_proj", self.mlp_hidden(weights, x))

    def layer(self, weights: dict, h: torch.Tensor) -> torch.Tensor:
        h = h + self.attention(weights, self.rms_norm(h, weights["input_layernorm.weight"]))
        return h + self.mlp(weights, self.rms_norm(h, weights["post_attention_layernorm.weight"]))

    def block(self, target: str, weights: dict, x: torch.Tensor) -> torch.Tensor:
        """The output a scale group is scored on, from that group's cached input x."""
        if target == "attn":
            return self.attention(weights, x)
        if target == "o":
            return self.linear(weights, "self_attn.o_proj", x)
        if target == "mlp":
            return self.mlp(weights, x)
        return self.linear(weights, "mlp.down_proj", x)


# -- where cached activations live ---------------------------------------------------------------


class ActivationStore:
    """Keeps per-chunk activations on the device while under budget, in pinned host memory beyond it."""

    def __init__(self, device: torch.device, max_resident_bytes: int | None):
        self.device = device
        self.max_resident_bytes = max_resident_bytes

    def keep(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.device.type != "cuda" or torch.cuda.memory_allocated(self.device) <= self.max_resident_bytes:
            return tensor
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        host.copy_(tensor)
        return host

    def load(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(self.device, non_blocking=True)


# -- per-layer result -------------------------------------------------------------------------------


@dataclass
class LinearResult:
    packed: AwqTensors | None  # on the host
    bias: torch.Tensor | None  # float16, folded
    input_scales: torch.Tensor | None  # [K] AWQ scale applied to the weight's columns
    output_scales: torch.Tensor | None  # [N] divisor folded into the weight's rows (prev of a later group)
    compensation: Compensation | None = None


@dataclass
class LayerResult:
    norms: dict[str, torch.Tensor]  # folded, float16
    linears: dict[str, LinearResult]
    scores: dict[str, float]  # fused group -> sensitivity


def _float16(tensor: torch.Tensor, name: str) -> torch.Tensor:
    half = tensor.detach().to(device="cpu", dtype=torch.float16).contiguous()
    if not torch.isfinite(half).all() and torch.isfinite(tensor).all():
        raise UnsupportedModelError(
            f"{name} has values beyond float16's range (max |x| {tensor.abs().max().item():.3g}); AWQ checkpoints "
            "are float16, so this model cannot be written in the AutoAWQ layout"
        )
    return half


class Quantizer:
    """Runs the per-layer pipeline over the calibration activations; see the module docstring."""

    def __init__(
        self,
        config: ModelConfig,
        source: SourceCheckpoint,
        device: torch.device,
        *,
        method: str,
        group_size: int,
        rank: int,
        use_bias_correction: bool,
        is_sensitivity_needed: bool,
        seq_len: int,
        max_resident_bytes: int | None,
    ):
        self.config, self.source, self.device = config, source, device
        self.method, self.group_size = method, group_size
        self.rank, self.use_bias_correction = rank, use_bias_correction
        self.is_sensitivity_needed = is_sensitivity_needed
        self.dtype = torch.float16 if device.type == "cuda" else torch.float32
        self.runner = LayerRunner(config, seq_len, device)
        self.store = ActivationStore(device, max_resident_bytes)
        self.groups = layer_scale_groups(config.num_heads, config.num_kv_heads)
        self.alphas: dict[str, float | None] = {}

    @property
    def is_compensated(self) -> bool:
        return self.rank > 0 or self.use_bias_correction

    def _cast(self, weights: dict) -> dict:
        return {name: tensor.to(self.dtype) for name, tensor in weights.items()}

    def embed(self, ids: torch.Tensor, samples_per_chunk: int) -> list[torch.Tensor]:
        """Layer-0 inputs, one tensor [b, L, hidden] per chunk of samples."""
        table = self.source.get("model.embed_tokens.weight")
        return [
            self.store.keep(F.embedding(ids[i : i + samples_per_chunk], table).to(self.device, self.dtype))
            for i in range(0, ids.shape[0], samples_per_chunk)
        ]

    def quantize_layer(self, index: int, hs: list[torch.Tensor]) -> tuple[LayerResult, list[torch.Tensor]]:
        """Quantize layer `index` given its inputs; returns its result and the next layer's inputs."""
        weights = _layer_weights(self.source, self.config, index, self.device)
        compute = self._cast(weights)
        attn_ref, mlp_ref, next_hs = self._reference_pass(index, compute, hs)
        refs = {"attn": attn_ref, "o": attn_ref, "mlp": mlp_ref, "down": mlp_ref}

        input_scales: dict[str, torch.Tensor] = {}
        output_scales: dict[str, torch.Tensor] = {}
        if self.method == "awq":
            for group in self.groups:
                inputs = self._group_inputs(group, compute, hs, attn_ref)
                scales = self._search_group(index, group, weights, compute, inputs, refs[group.target])
                del inputs
                fold_scales(weights, group, scales)
                compute = self._cast(weights)
                input_scales.update(dict.fromkeys(group.linears, scales))
                if not group.is_prev_norm:
                    output_scales[group.prev] = scales

        samples, stats = self._input_statistics(compute, hs, attn_ref)
        dequantized, packed = self._quantize_linears(weights, samples)
        scores = self._sensitivity(compute, dequantized, hs, next_hs) if self.is_sensitivity_needed else {}
        linears = {}
        for name in QUANTIZABLE_LINEARS:
            bias = weights.get(f"{name}.bias")
            linears[name] = LinearResult(
                packed=packed[name],
                bias=None if bias is None else _float16(bias, f"model.layers.{index}.{name}.bias"),
                input_scales=input_scales[name].cpu() if name in input_scales else None,
                output_scales=output_scales[name].cpu() if name in output_scales else None,
            )
            if self.is_compensated:
                error = weights[f"{name}.weight"] - dequantized[name]
                linears[name].compensation = _to_host(
                    fit_compensation(error, stats[INPUT_OF[name]], self.rank, self.use_bias_correction)
                )
        norms = {
            name: _float16(weights[name], f"model.layers.{index}.{name}")
            for name in ("input_layernorm.weight", "post_attention_layernorm.weight")
        }
        return LayerResult(norms, linears, scores), next_hs

    def _reference_pass(self, index: int, compute: dict, hs: list) -> tuple[list, list, list]:
        """The full-precision layer's attention and MLP outputs and its output, per chunk."""
        runner, store = self.runner, self.store
        attn_ref, mlp_ref, next_hs = [], [], []
        for chunk in hs:
            h = store.load(chunk)
            attn = runner.attention(compute, runner.rms_norm(h, compute["input_layernorm.weight"]))
            mid = h + attn
            mlp = runner.mlp(compute, runner.rms_norm(mid, compute["post_attention_layernorm.weight"]))
            out = mid + mlp
            if not torch.isfinite(out).all():
                raise UnsupportedModelError(
                    f"layer {index} overflows {self.dtype} on the calibration text; quantize with --device cpu "
                    "(float32), or check the checkpoint"
                )
            attn_ref.append(store.keep(attn))
            mlp_ref.append(store.keep(mlp))
            next_hs.append(store.keep(out))
        return attn_ref, mlp_ref, next_hs

    def _quantize_linears(self, weights: dict, samples: dict) -> tuple[dict, dict]:
        """Clip (AWQ) and quantize every Linear: (dequantized float32 weights on the device, packed on the host)."""
        dequantized, packed = {}, {}
        for name in QUANTIZABLE_LINEARS:
            weight = weights[f"{name}.weight"]
            if self.method == "awq" and name not in NO_CLIP_LINEARS:
                max_abs = search_clip(weight, samples[INPUT_OF[name]], self.group_size)
                weight = clip_weight(weight, self.group_size, max_abs)
            dequantized[name] = fake_quantize(weight, self.group_size)
            tensors = quantize_rtn(weight, self.group_size)
            packed[name] = AwqTensors(
                tensors.qweight.cpu(), tensors.qzeros.cpu(), tensors.scales.cpu(), self.group_size
            )
        return dequantized, packed

    def _group_inputs(self, group: ScaleGroup, compute: dict, hs: list, attn_ref: list) -> list[torch.Tensor]:
        """The group's input activations, one tensor per chunk, from the layer as folded so far."""
        runner, store = self.runner, self.store
        inputs = []
        for chunk, attn in zip(hs, attn_ref):
            h = store.load(chunk)
            x = runner.rms_norm(h, compute["input_layernorm.weight"])
            if group.inputs == "o_in":
                x = runner.attention_context(compute, x)
            elif group.inputs in ("mlp_in", "down_in"):
                x = runner.rms_norm(h + store.load(attn), compute["post_attention_layernorm.weight"])
                if group.inputs == "down_in":
                    x = runner.mlp_hidden(compute, x)
            inputs.append(store.keep(x))
        return inputs

    def _search_group(
        self, index: int, group: ScaleGroup, weights: dict, compute: dict, inputs: list, refs: list
    ) -> torch.Tensor:
        store = self.store
        num_tokens = 0
        x_sum = torch.zeros(inputs[0].shape[-1], dtype=torch.float32, device=self.device)
        for x in inputs:
            x = store.load(x)
            x_sum += x.abs().float().sum(dim=(0, 1))
            num_tokens += x.shape[0] * x.shape[1]

        def loss_fn(trial: list[torch.Tensor]) -> float:
            swapped = dict(compute)
            for name, weight in zip(group.linears, trial):
                swapped[f"{name}.weight"] = weight.to(self.dtype)
            total, count = 0.0, 0
            for x, ref in zip(inputs, refs):
                out = self.runner.block(group.target, swapped, store.load(x))
                total += float((out.float() - store.load(ref).float()).pow(2).sum())
                count += out.numel()
            return total / count

        found = search_scales(
            x_sum / num_tokens, [weights[f"{n}.weight"] for n in group.linears], self.group_size, loss_fn
        )
        self.alphas[f"model.layers.{index}.{group.prev}->{','.join(group.linears)}"] = found.alpha
        return found.scales

    def _input_statistics(self, compute: dict, hs: list, attn_ref: list) -> tuple[dict, dict]:
        """Clipping samples (AWQ) and fit/eval moments (compensation) of every input kind."""
        if self.method != "awq" and not self.is_compensated:
            return {}, {}
        runner, store = self.runner, self.store
        config = self.config
        widths = {
            "attn_in": config.hidden_size,
            "o_in": config.q_size,
            "mlp_in": config.hidden_size,
            "down_in": config.intermediate_size,
        }
        stats = {kind: InputStats(width, self.device) for kind, width in widths.items()} if self.is_compensated else {}
        samples = {kind: [] for kind in widths}
        per_chunk = math.ceil(MAX_CLIP_TOKENS / len(hs))
        first_sample = 0
        for chunk, attn in zip(hs, attn_ref):
            h = store.load(chunk)
            batch, length = h.shape[:2]
            x_attn = runner.rms_norm(h, compute["input_layernorm.weight"])
            x_mlp = runner.rms_norm(h + store.load(attn), compute["post_attention_layernorm.weight"])
            inputs = {
                "attn_in": x_attn,
                "o_in": runner.attention_context(compute, x_attn),
                "mlp_in": x_mlp,
                "down_in": runner.mlp_hidden(compute, x_mlp),
            }
            # even samples fit the compensation, odd ones judge it
            is_fit = torch.arange(first_sample, first_sample + batch, device=self.device) % 2 == 0
            for kind, x in inputs.items():
                samples[kind].append(sample_tokens(x.reshape(batch * length, -1), per_chunk))
                if stats:
                    stats[kind].add(x[is_fit].reshape(-1, x.shape[-1]), is_fit=True)
                    stats[kind].add(x[~is_fit].reshape(-1, x.shape[-1]), is_fit=False)
            first_sample += batch
        return {kind: torch.cat(parts)[:MAX_CLIP_TOKENS] for kind, parts in samples.items()}, stats

    def _sensitivity(self, compute: dict, dequantized: dict, hs: list, outs: list) -> dict[str, float]:
        """Per fused group, with only that group in INT4: mean over tokens of |error of h|^2 / |h|^2.

        Per token, because the next layer reads h through an RMSNorm: what it sees of an
        error is the error relative to that token's h.
        """
        scores = {}
        for group_name, members in FUSED_GROUPS.items():
            swapped = dict(compute)
            for name in members:
                swapped[f"{name}.weight"] = dequantized[name].to(self.dtype)
            total, num_tokens = 0.0, 0
            for chunk, ref in zip(hs, outs):
                ref = self.store.load(ref).float()
                out = self.runner.layer(swapped, self.store.load(chunk)).float()
                per_token = (out - ref).pow(2).sum(-1) / ref.pow(2).sum(-1).clamp(min=1e-30)
                total += float(per_token.sum())
                num_tokens += per_token.numel()
            scores[group_name] = total / num_tokens
        return scores

    def quantize_head(self, hs: list[torch.Tensor]) -> tuple[AwqTensors, torch.Tensor]:
        """AWQ for lm_head, its scales folded into the final norm; returns (packed head, folded norm weight).

        The search holds the head in float32 several times over ([vocab, hidden]: 0.9 GiB each
        for a 152K vocabulary), more than a 4 GB card has beside the calibration data; where
        the device runs out, the head is quantized in host memory instead (slower, same method).
        """
        try:
            return self._quantize_head(hs, self.device)
        except torch.cuda.OutOfMemoryError:
            if self.device.type != "cuda":
                raise
            log.info("lm_head's scale search does not fit the device; quantizing the head on the CPU")
            torch.cuda.empty_cache()
            return self._quantize_head(hs, torch.device("cpu"))

    def _quantize_head(self, hs: list[torch.Tensor], device: torch.device) -> tuple[AwqTensors, torch.Tensor]:
        on_device = device == self.device
        dtype = self.dtype if device.type == "cuda" else torch.float32
        keep = self.store.keep if on_device else (lambda t: t)
        load = self.store.load if on_device else (lambda t: t.to(device))
        norm = self.source.get("model.norm.weight").to(device, torch.float32)
        weight = self.source.get("lm_head.weight").to(device, torch.float32)
        per_chunk = math.ceil(MAX_HEAD_TOKENS / len(hs))
        x = torch.cat(
            [
                sample_tokens(
                    self.runner.rms_norm(load(h).to(dtype), norm.to(dtype)).reshape(-1, norm.shape[0]), per_chunk
                )
                for h in hs
            ]
        )[:MAX_HEAD_TOKENS]
        pieces = list(torch.split(x, HEAD_CHUNK_TOKENS))
        compute_weight = weight.to(dtype)
        refs = [keep(F.linear(piece, compute_weight)) for piece in pieces]
        del compute_weight
        if self.method == "awq":

            def loss_fn(trial):
                trial_weight = trial[0].to(dtype)
                total, count = 0.0, 0
                for piece, ref in zip(pieces, refs):
                    out = F.linear(piece, trial_weight)
                    total += float((out.float() - load(ref).float()).pow(2).sum())
                    count += out.numel()
                return total / count

            found = search_scales(x.abs().float().mean(dim=0), [weight], self.group_size, loss_fn)
            self.alphas["model.norm->lm_head"] = found.alpha
            norm, weight = norm / found.scales, weight * found.scales
            max_abs = search_clip(weight, sample_tokens(x / found.scales.to(x.dtype)), self.group_size)
            weight = clip_weight(weight, self.group_size, max_abs)
        tensors = quantize_rtn(weight, self.group_size)
        packed = AwqTensors(tensors.qweight.cpu(), tensors.qzeros.cpu(), tensors.scales.cpu(), self.group_size)
        return packed, _float16(norm, "model.norm.weight")


def _to_host(compensation: Compensation | None) -> Compensation | None:
    if compensation is None:
        return None
    for name in ("lora_a", "lora_b", "bias_correction"):
        tensor = getattr(compensation, name)
        if tensor is not None:
            half = tensor.to(device="cpu", dtype=torch.float16).contiguous()
            if not torch.isfinite(half).all():
                log.warning("a compensation term overflows float16; that layer is left uncompensated")
                return None
            setattr(compensation, name, half)
    return compensation


# -- choosing the FP16 groups -----------------------------------------------------------------


def _group_bytes(config: ModelConfig, group_size: int, members: tuple[str, ...]) -> tuple[int, int]:
    """(FP16 bytes, INT4 bytes) of a fused group's weights."""
    shapes = {
        "self_attn.q_proj": (config.q_size, config.hidden_size),
        "self_attn.k_proj": (config.kv_size, config.hidden_size),
        "self_attn.v_proj": (config.kv_size, config.hidden_size),
        "self_attn.o_proj": (config.hidden_size, config.q_size),
        "mlp.gate_proj": (config.intermediate_size, config.hidden_size),
        "mlp.up_proj": (config.intermediate_size, config.hidden_size),
        "mlp.down_proj": (config.hidden_size, config.intermediate_size),
    }
    fp16 = int4 = 0
    for name in members:
        num_outputs, num_inputs = shapes[name]
        fp16 += num_outputs * num_inputs * 2
        num_groups = num_inputs // group_size
        int4 += num_inputs * num_outputs // 2 + num_groups * num_outputs // 2 + num_groups * num_outputs * 2
    return fp16, int4


def choose_fp16_groups(
    scores: dict[tuple[int, str], float], config: ModelConfig, group_size: int, budget_bytes: int
) -> list[tuple[int, str, float, int]]:
    """The most sensitive fused groups whose extra bytes (FP16 minus INT4) fit the budget.

    Greedy by score: a group that does not fit is skipped and smaller ones are still tried.
    Returns (layer, group, score, extra_bytes), most sensitive first.
    """
    chosen, used = [], 0
    for (layer, group), score in sorted(scores.items(), key=lambda item: -item[1]):
        fp16, int4 = _group_bytes(config, group_size, FUSED_GROUPS[group])
        extra = fp16 - int4
        if used + extra <= budget_bytes:
            chosen.append((layer, group, score, extra))
            used += extra
    return chosen


def modules_to_not_convert(chosen: list[tuple[int, str, float, int]]) -> list[str]:
    """The kept Linears' checkpoint names, plus the fused names vLLM matches against."""
    names = []
    for layer, group, _, _ in sorted(chosen, key=lambda c: (c[0], list(FUSED_GROUPS).index(c[1]))):
        members = FUSED_GROUPS[group]
        names += [f"model.layers.{layer}.{name}" for name in members]
        if group not in members:
            names.append(f"model.layers.{layer}.{group}")
    return names


# -- validation ---------------------------------------------------------------------------------


def check_quantizable(config: ModelConfig, group_size: int, is_head_quantized: bool) -> None:
    """Raise before any work when the model cannot be written as AWQ with this group size."""
    if config.quantization is not None:
        raise UnsupportedModelError(
            "the model is already quantized (config.json has quantization_config); "
            "quantize its FP16/BF16 original instead"
        )
    if group_size not in SUPPORTED_GROUP_SIZES:
        raise ConfigError(f"--group-size {group_size} is not supported; allowed: {list(SUPPORTED_GROUP_SIZES)}")
    dims = {
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_attention_heads * head_dim": config.q_size,
    }
    for name, value in dims.items():
        if value % group_size:
            fitting = [g for g in SUPPORTED_GROUP_SIZES if all(v % g == 0 for v in dims.values())]
            hint = f"; use --group-size {fitting[-1]}" if fitting else "; no supported group size divides all of them"
            raise ConfigError(
                f"--group-size {group_size} does not divide the model's {name} ({value}), which is "
                f"the input size (K) of some of its Linears{hint}"
            )
    outputs = {
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_attention_heads * head_dim": config.q_size,
        "num_key_value_heads * head_dim": config.kv_size,
    }
    if is_head_quantized:
        outputs["vocab_size"] = config.vocab_size
    for name, value in outputs.items():
        if value % PACK_FACTOR:
            raise UnsupportedModelError(
                f"the model's {name} ({value}) is not a multiple of 8, which the AWQ "
                "layout needs (eight 4-bit outputs per int32)"
            )
    if is_head_quantized and config.is_tied_head:
        raise ConfigError(
            "--quantize-head: this model's lm_head is tied to its embeddings, which stay FP16; drop --quantize-head"
        )


def _check_output(model_dir: Path, out_dir: Path, is_forced: bool) -> None:
    if out_dir.resolve() == model_dir.resolve():
        raise ConfigError(f"OUT {out_dir} is the input model directory; choose a new directory")
    if not out_dir.parent.is_dir():
        raise ConfigError(f"the parent of OUT ({out_dir.parent}) does not exist; create it first")
    if out_dir.exists():
        if not out_dir.is_dir():
            raise ConfigError(f"OUT {out_dir} exists and is not a directory")
        if any(out_dir.iterdir()) and not is_forced:
            raise ConfigError(f"OUT {out_dir} already exists and is not empty; pass --force to replace it")


def _estimate_output_bytes(config: ModelConfig, group_size: int, fp16_budget_bytes: int) -> int:
    linear_int4 = sum(_group_bytes(config, group_size, members)[1] for members in FUSED_GROUPS.values())
    embeddings = config.vocab_size * config.hidden_size * 2 * (1 if config.is_tied_head else 2)
    return config.num_layers * linear_int4 + embeddings + fp16_budget_bytes


# -- writing ----------------------------------------------------------------------------------


def write_tensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """Write one safetensors file (the metadata transformers expects included)."""
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata={"format": "pt"})


def _copy_side_files(model_dir: Path, staging: Path) -> None:
    for path in sorted(model_dir.iterdir()):
        is_skipped = path.name in SKIPPED_FILES or path.suffix in SKIPPED_SUFFIXES or path.name.startswith("lowvram_")
        if path.is_file() and not is_skipped:
            shutil.copy2(path, staging / path.name)


def _fp16_linear(source: SourceCheckpoint, prefix: str, result: LinearResult) -> torch.Tensor:
    """The FP16 weight of a layer kept unquantized: the original with its AWQ scales folded in."""
    weight = source.get(f"{prefix}.weight").to(torch.float32)
    if result.input_scales is not None:
        weight = weight * result.input_scales
    if result.output_scales is not None:
        weight = weight / result.output_scales[:, None]
    return _float16(weight, f"{prefix}.weight")


def _assemble(
    source: SourceCheckpoint,
    config: ModelConfig,
    layers: list[LayerResult],
    fp16_names: set[str],
    head: tuple[AwqTensors, torch.Tensor] | None,
    report: QuantizeReport,
) -> tuple[dict, dict]:
    """The output tensors (AutoAWQ names) and the compensation tensors; fills the report's byte counts."""
    tensors, extras = {}, {}

    def add(name: str, tensor: torch.Tensor, kind: str) -> None:
        tensors[name] = tensor
        setattr(report, kind, getattr(report, kind) + tensor.numel() * tensor.element_size())

    add(
        "model.embed_tokens.weight",
        _float16(source.get("model.embed_tokens.weight"), "model.embed_tokens.weight"),
        "other_bytes",
    )
    for index, layer in enumerate(layers):
        for name, tensor in layer.norms.items():
            add(f"model.layers.{index}.{name}", tensor, "other_bytes")
        for name, result in layer.linears.items():
            prefix = f"model.layers.{index}.{name}"
            if prefix in fp16_names:
                add(f"{prefix}.weight", _fp16_linear(source, prefix, result), "fp16_layer_bytes")
                if result.bias is not None:
                    add(f"{prefix}.bias", result.bias, "fp16_layer_bytes")
                continue
            report.num_int4_linears += 1
            for attr in ("qweight", "qzeros", "scales"):
                add(f"{prefix}.{attr}", getattr(result.packed, attr), "int4_bytes")
            if result.bias is not None:
                add(f"{prefix}.bias", result.bias, "int4_bytes")
            comp = result.compensation
            if comp is not None:
                for attr, tensor in (
                    (LORA_A, comp.lora_a),
                    (LORA_B, comp.lora_b),
                    (BIAS_CORRECTION, comp.bias_correction),
                ):
                    if tensor is not None:
                        extras[f"{prefix}.{attr}"] = tensor
                        report.compensation_bytes += tensor.numel() * tensor.element_size()
                report.compensation[prefix] = {
                    "rank": comp.rank,
                    "scale": comp.scale,
                    "bias": comp.bias_correction is not None,
                    "error_reduction": round(comp.error_reduction, 4),
                }
    if head is not None:
        packed, norm = head
        add("model.norm.weight", norm, "other_bytes")
        for attr in ("qweight", "qzeros", "scales"):
            add(f"lm_head.{attr}", getattr(packed, attr), "int4_bytes")
    else:
        add("model.norm.weight", _float16(source.get("model.norm.weight"), "model.norm.weight"), "other_bytes")
        if not config.is_tied_head:
            add("lm_head.weight", _float16(source.get("lm_head.weight"), "lm_head.weight"), "other_bytes")
    return tensors, extras


def _write_output(
    model_dir: Path,
    out_dir: Path,
    raw_config: dict,
    quant: AwqConfig,
    tensors: dict,
    extras: dict,
    report: QuantizeReport,
) -> None:
    """Write everything into OUT.partial-XXXX, then rename it to OUT; remove it on any failure."""
    staging = Path(tempfile.mkdtemp(prefix=f"{out_dir.name}.partial-", dir=out_dir.parent))
    try:
        config = {key: value for key, value in raw_config.items() if key != "quantization_config"}
        config["quantization_config"] = quant.to_config_dict()
        config["torch_dtype"] = "float16"
        config["dtype"] = "float16"
        (staging / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        write_tensors(tensors, staging / WEIGHTS_FILE)
        if extras:
            write_tensors(extras, staging / COMPENSATION_FILE)
        _copy_side_files(model_dir, staging)
        (staging / REPORT_FILE).write_text(json.dumps(report.to_json(), indent=2) + "\n", encoding="utf-8")
        _move_into_place(staging, out_dir)
    except BaseException as exc:
        shutil.rmtree(staging, ignore_errors=True)
        if isinstance(exc, OSError):
            if exc.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)):
                raise ConfigError(
                    f"no space left on the disk holding {out_dir.parent} while writing the checkpoint "
                    f"(about {report.total_bytes / MIB:.0f} MiB); free some space or choose another "
                    "OUT. Nothing was written."
                ) from None
            raise ConfigError(
                f"cannot write the checkpoint under {out_dir.parent}: {exc}. Nothing was written."
            ) from None
        raise


def _move_into_place(staging: Path, out_dir: Path) -> None:
    if not out_dir.exists():
        os.replace(staging, out_dir)
        return
    old = Path(tempfile.mkdtemp(prefix=f"{out_dir.name}.old-", dir=out_dir.parent))
    os.replace(out_dir, old / out_dir.name)
    try:
        os.replace(staging, out_dir)
    except BaseException:
        os.replace(old / out_dir.name, out_dir)
        raise
    finally:
        shutil.rmtree(old, ignore_errors=True)


# -- the entry point ------------------------------------------------------------------------------


def _pick_device(requested: str) -> torch.device:
    from lowvram.memory.device import pick_device

    device = pick_device(requested)
    if device.type == "cuda" and device.index is None:
        # some torch.cuda calls (set_per_process_memory_fraction) insist on an explicit index
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _device_cap_bytes(device: torch.device, emulate_vram_gib: float | None) -> int | None:
    if device.type != "cuda":
        return None
    total = torch.cuda.get_device_properties(device).total_memory
    if emulate_vram_gib is None:
        return total
    fraction = emulate_vram_gib * GIB / total
    if not 0 < fraction <= 1:
        raise ConfigError(
            f"--emulate-vram-gib {emulate_vram_gib} must be positive and at most this card's {total / GIB:.1f} GiB"
        )
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    return int(emulate_vram_gib * GIB)


def _peak_host_bytes() -> int | None:
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def quantize_model(
    model_dir: str | Path,
    out_dir: str | Path,
    *,
    method: str = "awq",
    group_size: int = 128,
    fp16_budget_mib: float = 0.0,
    rank: int = 0,
    bias_correction: bool = False,
    quantize_head: bool = False,
    calib_texts: list[str] | None = None,
    calib_path: str | Path | None = None,
    num_samples: int = 128,
    seq_len: int = 512,
    device: str = "auto",
    emulate_vram_gib: float | None = None,
    force: bool = False,
    show_progress: bool = False,
    on_layer: Callable[[int, int], None] | None = None,
) -> QuantizeReport:
    """Quantize an FP16/BF16 checkpoint to AWQ INT4 (AutoAWQ GEMM layout) in `out_dir`.

    Args:
        method: "awq" (scale and clipping search) or "rtn" (plain round-to-nearest).
        group_size: inputs per scale and zero point: 32, 64 or 128; must divide the model's
            hidden, intermediate and attention sizes.
        fp16_budget_mib: extra MiB (over INT4) that the most quantization-sensitive layers
            may take to stay FP16; 0 keeps every decoder Linear in INT4.
        rank: the largest rank of the low-rank error correction per Linear; 0 turns it off.
        bias_correction: also offer each Linear a bias correction (the INT4 error's mean
            output on the calibration set), kept where it helps there. Off by default: on the
            demo model it raised held-out perplexity, since the calibration mix's mean input is
            not the mean of every text.
        quantize_head: quantize lm_head too (other loaders, vLLM included, then cannot load
            the checkpoint: they keep lm_head in FP16). Embeddings always stay FP16.
        calib_texts / calib_path: calibration text (a list of strings, or a .jsonl/.txt file);
            neither means the corpus shipped with lowvram.
        num_samples, seq_len: calibration blocks and their length in tokens.
        device: where the computation runs ("auto", "cuda", "cpu"); the model stays on the host.
        emulate_vram_gib: cap this process's CUDA allocator to behave like a card this size.
        force: replace a non-empty `out_dir`.
        show_progress: draw a progress bar per layer on stderr.
        on_layer: called with (layers done, number of layers) after each layer, for UIs.
    Raises ConfigError, ModelLoadError, UnsupportedModelError with what to do; on any error
    no output directory is left behind.
    """
    start = time.perf_counter()
    model_dir, out_dir = Path(model_dir).expanduser(), Path(out_dir).expanduser()
    if method not in METHODS:
        raise ConfigError(f"--method {method!r} is not supported; use one of {list(METHODS)}")
    if rank < 0 or fp16_budget_mib < 0:
        raise ConfigError(f"--rank ({rank}) and --fp16-budget-mib ({fp16_budget_mib}) must not be negative")
    if not model_dir.is_dir():
        raise ModelLoadError(
            f"MODEL {model_dir} is not a directory; pass a Hugging Face model directory "
            "(config.json, *.safetensors, tokenizer files)"
        )
    config, raw_config = load_model_config(model_dir)
    check_quantizable(config, group_size, quantize_head)
    _check_output(model_dir, out_dir, force)
    budget_bytes = int(fp16_budget_mib * MIB)
    free_bytes = shutil.disk_usage(out_dir.parent).free
    needed_bytes = _estimate_output_bytes(config, group_size, budget_bytes)
    if free_bytes < needed_bytes:
        raise ConfigError(
            f"the disk holding {out_dir.parent} has {free_bytes / MIB:.0f} MiB free but the checkpoint "
            f"needs about {needed_bytes / MIB:.0f} MiB; free some space or choose another OUT"
        )
    use_bias = bool(bias_correction)

    compute_device = _pick_device(device)
    cap_bytes = _device_cap_bytes(compute_device, emulate_vram_gib)
    if compute_device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(compute_device)

    from lowvram.engine.tokenizer import Tokenizer

    tokenizer = Tokenizer(model_dir).hf
    records = (
        [{"text": text} for text in calib_texts] if calib_texts is not None else load_calibration_records(calib_path)
    )
    ids = calibration_blocks(tokenizer, records, num_samples, seq_len)
    if int(ids.max()) >= config.vocab_size:
        raise ModelLoadError(
            f"the tokenizer gives token id {int(ids.max())} but the model has {config.vocab_size} "
            "embeddings; the tokenizer does not belong to this model"
        )
    num_samples, seq_len = ids.shape
    report = QuantizeReport(
        model_dir=str(model_dir),
        out_dir=str(out_dir),
        method=method,
        group_size=group_size,
        device=str(compute_device),
        num_samples=num_samples,
        seq_len=seq_len,
        rank=rank,
        has_bias_correction=use_bias,
        fp16_budget_mib=fp16_budget_mib,
        is_head_quantized=quantize_head,
    )

    source = SourceCheckpoint(model_dir)
    quantizer = Quantizer(
        config,
        source,
        compute_device,
        method=method,
        group_size=group_size,
        rank=rank,
        use_bias_correction=use_bias,
        is_sensitivity_needed=budget_bytes > 0,
        seq_len=seq_len,
        max_resident_bytes=int(MAX_RESIDENT_SHARE * cap_bytes) if cap_bytes else None,
    )
    samples_per_chunk = max(1, CHUNK_TOKENS[compute_device.type] // seq_len)
    layers: list[LayerResult] = []
    scores: dict[tuple[int, str], float] = {}
    try:
        with torch.inference_mode(), LayerProgress(show_progress, config.num_layers) as advance:
            hs = quantizer.embed(ids, samples_per_chunk)
            for index in range(config.num_layers):
                result, hs = quantizer.quantize_layer(index, hs)
                layers.append(result)
                scores.update({(index, group): score for group, score in result.scores.items()})
                advance(index)
                if on_layer is not None:
                    on_layer(index + 1, config.num_layers)
            head = quantizer.quantize_head(hs) if quantize_head else None
            del hs
    except torch.cuda.OutOfMemoryError:
        cap = f"{cap_bytes / GIB:.1f} GiB" if cap_bytes else "the card"
        raise OutOfMemoryError(
            f"quantizing layer {len(layers)} ran out of device memory ({cap}) with {num_samples} x {seq_len} "
            "calibration tokens; lower --num-samples or --seq-len, or use --device cpu"
        ) from None

    chosen = choose_fp16_groups(scores, config, group_size, budget_bytes) if budget_bytes else []
    skipped = modules_to_not_convert(chosen)
    report.sensitivity = {f"model.layers.{layer}.{group}": score for (layer, group), score in scores.items()}
    report.fp16_groups = [
        {"name": f"model.layers.{layer}.{group}", "score": score, "extra_mib": extra / MIB}
        for layer, group, score, extra in chosen
    ]
    report.awq_alphas = quantizer.alphas
    tensors, extras = _assemble(source, config, layers, set(skipped), head, report)
    report.seconds = time.perf_counter() - start
    if compute_device.type == "cuda":
        report.peak_device_bytes = torch.cuda.max_memory_allocated(compute_device)
    report.peak_host_bytes = _peak_host_bytes()
    quant = AwqConfig(group_size=group_size, modules_to_not_convert=tuple(skipped))
    _write_output(model_dir, out_dir, raw_config, quant, tensors, extras, report)
    return report


class LayerProgress:
    """A per-layer progress bar on stderr (rich), or nothing."""

    def __init__(self, is_shown: bool, num_layers: int):
        self.is_shown, self.num_layers = is_shown, num_layers
        self._bar = None

    def __enter__(self):
        if not self.is_shown:
            return lambda index: None
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self._bar = Progress(
            TextColumn("quantizing"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("layers"),
            TimeElapsedColumn(),
            console=Console(stderr=True),
        )
        self._bar.__enter__()
        task = self._bar.add_task("layers", total=self.num_layers)
        return lambda index: self._bar.update(task, completed=index + 1)

    def __exit__(self, *exc_info):
        if self._bar is not None:
            self._bar.__exit__(*exc_info)
        return False


# -- command line -----------------------------------------------------------------------------


def add_quantize_parser(subparsers) -> argparse.ArgumentParser:
    """Register `lowvram quantize MODEL OUT` on an argparse subparsers object."""
    parser = subparsers.add_parser(
        "quantize",
        help="quantize a model to AWQ INT4 (AutoAWQ GEMM layout, loads in vLLM and transformers)",
        description="Quantize an FP16/BF16 Hugging Face checkpoint to AWQ INT4, layer by layer, optionally keeping "
        "the most sensitive layers in FP16 and adding a low-rank correction of the INT4 error.",
    )
    parser.add_argument("model", metavar="MODEL", help="input model directory (config.json, *.safetensors, tokenizer)")
    parser.add_argument("out", metavar="OUT", help="output directory (must not exist, or be empty, unless --force)")
    parser.add_argument("--method", choices=METHODS, default="awq", help="awq (default) or rtn (round-to-nearest)")
    parser.add_argument(
        "--group-size",
        type=int,
        default=128,
        choices=SUPPORTED_GROUP_SIZES,
        help="inputs sharing one scale and zero point (default 128)",
    )
    parser.add_argument(
        "--calib",
        metavar="FILE",
        default=None,
        help="calibration text: .jsonl ({'text'} or {'messages'} records) or plain text; "
        "default: the corpus shipped with lowvram",
    )
    parser.add_argument("--num-samples", type=int, default=128, help="calibration blocks (default 128)")
    parser.add_argument("--seq-len", type=int, default=512, help="tokens per calibration block (default 512)")
    parser.add_argument(
        "--fp16-budget-mib",
        type=float,
        default=0.0,
        help="extra MiB the most sensitive layers may use to stay FP16 (default 0: none)",
    )
    head = parser.add_mutually_exclusive_group()
    head.add_argument(
        "--keep-head",
        dest="quantize_head",
        action="store_false",
        default=False,
        help="keep lm_head in FP16 (default; what vLLM and transformers expect)",
    )
    head.add_argument(
        "--quantize-head",
        dest="quantize_head",
        action="store_true",
        help="quantize lm_head too (smaller, but only lowvram loads the result)",
    )
    parser.add_argument(
        "--rank",
        type=int,
        default=0,
        help="largest rank of the per-layer low-rank INT4 error correction (default 0: off)",
    )
    parser.add_argument(
        "--bias-correction",
        action="store_true",
        help="also correct each layer's mean INT4 error with a bias (off by default: it fits the "
        "calibration text's mean input, which other text may not share)",
    )
    parser.add_argument(
        "--device",
        choices=["auto", "cuda", "cpu"],
        default="auto",
        help="where to compute (the model itself stays in host memory)",
    )
    parser.add_argument("--emulate-vram-gib", type=float, default=None, help="behave like a card with this much memory")
    parser.add_argument("--force", action="store_true", help="replace OUT if it exists")
    parser.set_defaults(func=cmd_quantize)
    return parser


def cmd_quantize(args) -> int:
    if args.quantize_head:
        print(
            "lowvram: --quantize-head: vLLM and transformers keep lm_head in FP16 and will not load this "
            "checkpoint; lowvram will",
            file=sys.stderr,
        )
    report = quantize_model(
        args.model,
        args.out,
        method=args.method,
        group_size=args.group_size,
        fp16_budget_mib=args.fp16_budget_mib,
        rank=args.rank,
        bias_correction=args.bias_correction,
        quantize_head=args.quantize_head,
        calib_path=args.calib,
        num_samples=args.num_samples,
        seq_len=args.seq_len,
        device=args.device,
        emulate_vram_gib=args.emulate_vram_gib,
        force=args.force,
        show_progress=True,
    )
    print(report.summary())
    return 0
