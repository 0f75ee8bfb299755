"""What `lowvram quantize` writes: the AutoAWQ GEMM checkpoint exactly (`model.safetensors`,
`quantization_config`), the tokenizer files, the compensation in `lowvram_compensation.st` (a
file vLLM and transformers never read) and `lowvram_quantize.json`; staged in OUT.partial-XXXX
and renamed into place, so an error leaves nothing.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from lowvram.errors import ConfigError, UnsupportedModelError
from lowvram.models.checkpoint import COMPENSATION_FILE
from lowvram.models.config import AwqConfig, ModelConfig
from lowvram.quant.awq_linear import BIAS_CORRECTION, LORA_A, LORA_B
from lowvram.quant.compensation import Compensation

MIB = 2**20
GIB = 2**30
WEIGHTS_FILE = "model.safetensors"
REPORT_FILE = "lowvram_quantize.json"
# Files of the input directory that are not copied: weights, and configs that are rewritten.
SKIPPED_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".st")
SKIPPED_FILES = ("config.json", "quant_config.json", "model.safetensors.index.json")  # and lowvram_* files

# Linears that vLLM fuses into one module share one INT4/FP16 decision: vLLM's name -> ours.
FUSED_GROUPS = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
}


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
    compensation: dict[str, dict] = field(default_factory=dict)  # linear -> {"rank", "scale", "bias", ...}
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

    def summary(self) -> str:
        lines = [
            f"quantized {self.model_dir} -> {self.out_dir} ({self.method.upper()} INT4, group size "
            f"{self.group_size}, {self.num_samples} x {self.seq_len} calibration tokens, on {self.device})",
            f"  weights {self.total_bytes / MIB:.1f} MiB: INT4 {self.int4_bytes / MIB:.1f} "
            f"({self.num_int4_linears} linears), FP16 layers {self.fp16_layer_bytes / MIB:.1f}, "
            f"compensation {self.compensation_bytes / MIB:.1f}, embeddings/head/norms {self.other_bytes / MIB:.1f}",
        ]
        if self.fp16_groups:
            lines.append(f"  kept in FP16 (most sensitive first, within {self.fp16_budget_mib:g} MiB):")
            lines += [
                f"    {g['name']:<40} score {g['score']:.3e}  +{g['extra_mib']:.2f} MiB" for g in self.fp16_groups
            ]
        elif self.fp16_budget_mib > 0:
            lines.append(f"  no layer fits the FP16 budget of {self.fp16_budget_mib:g} MiB")
        if self.compensation:
            ranks, reductions = zip(*((c["rank"], c["error_reduction"]) for c in self.compensation.values()))
            lines.append(
                f"  compensation on {len(ranks)} linears: mean rank {sum(ranks) / len(ranks):.1f}, "
                f"held-out INT4 error reduced by {100 * sum(reductions) / len(reductions):.0f}% on average"
            )
        time = f"  time {self.seconds:.1f} s"
        if self.peak_device_bytes is not None:
            time += f", peak device memory {self.peak_device_bytes / GIB:.2f} GiB"
        if self.peak_host_bytes:
            time += f", peak host memory {self.peak_host_bytes / GIB:.2f} GiB"
        return "\n".join([*lines, time])


def group_bytes(config: ModelConfig, group_size: int, members: tuple[str, ...]) -> tuple[int, int]:
    """(FP16 bytes, INT4 bytes) of a fused group's weights."""
    c = config
    shapes = {  # [N, K]
        "self_attn.q_proj": (c.q_size, c.hidden_size),
        "self_attn.k_proj": (c.kv_size, c.hidden_size),
        "self_attn.v_proj": (c.kv_size, c.hidden_size),
        "self_attn.o_proj": (c.hidden_size, c.q_size),
        "mlp.gate_proj": (c.intermediate_size, c.hidden_size),
        "mlp.up_proj": (c.intermediate_size, c.hidden_size),
        "mlp.down_proj": (c.hidden_size, c.intermediate_size),
    }
    fp16 = int4 = 0
    for num_outputs, num_inputs in (shapes[name] for name in members):
        num_groups = num_inputs // group_size
        fp16 += num_outputs * num_inputs * 2
        # packed codes, packed zeros, float16 scales
        int4 += num_inputs * num_outputs // 2 + num_groups * num_outputs // 2 + num_groups * num_outputs * 2
    return fp16, int4


def choose_fp16_groups(report: QuantizeReport, config: ModelConfig) -> list[str]:
    """Fill report.fp16_groups with the most sensitive fused groups whose extra bytes (FP16
    minus INT4) fit the budget, greedily by score (a group that does not fit is skipped);
    returns modules_to_not_convert: their Linears' names plus the fused names vLLM matches."""
    chosen, used = [], 0
    for name, score in sorted(report.sensitivity.items(), key=lambda item: -item[1]):
        layer, group = name.split(".", 3)[2:]
        fp16, int4 = group_bytes(config, report.group_size, FUSED_GROUPS[group])
        if used + fp16 - int4 <= int(report.fp16_budget_mib * MIB):
            report.fp16_groups.append({"name": name, "score": score, "extra_mib": (fp16 - int4) / MIB})
            chosen.append((int(layer), list(FUSED_GROUPS).index(group), group))
            used += fp16 - int4
    names = []
    for layer, _, group in sorted(chosen):
        names += [f"model.layers.{layer}.{name}" for name in FUSED_GROUPS[group]]
        if group not in FUSED_GROUPS[group]:
            names.append(f"model.layers.{layer}.{group}")
    return names


@dataclass
class LinearResult:
    packed: dict[str, torch.Tensor]  # qweight, qzeros, scales on the host
    bias: torch.Tensor | None  # float16, folded
    input_scales: torch.Tensor | None  # [K] AWQ scale applied to the weight's columns
    output_scales: torch.Tensor | None  # [N] divisor folded into the weight's rows (prev of a later group)
    compensation: Compensation | None = None


def float16(tensor: torch.Tensor, name: str) -> torch.Tensor:
    """The tensor as float16 on the host; UnsupportedModelError where float16 cannot hold it."""
    half = tensor.detach().to(device="cpu", dtype=torch.float16).contiguous()
    if not torch.isfinite(half).all() and torch.isfinite(tensor).all():
        raise UnsupportedModelError(
            f"{name} has values beyond float16's range (max |x| {tensor.abs().max().item():.3g}); AWQ checkpoints "
            "are float16, so this model cannot be written in the AutoAWQ layout"
        )
    return half


def assemble(source, config: ModelConfig, layers: list, fp16_names: set[str], head, report: QuantizeReport):
    """(tensors under AutoAWQ names, compensation tensors), counting bytes in the report, from
    (norms, {linear: LinearResult}) per layer and `head` (packed lm_head, folded norm) or None;
    a Linear in `fp16_names` is re-read from `source` with its AWQ scales folded in."""
    tensors, extras = {}, {}

    def add(name: str, tensor: torch.Tensor, kind: str) -> None:
        tensors[name] = tensor
        setattr(report, kind, getattr(report, kind) + tensor.numel() * tensor.element_size())

    def original(name: str) -> torch.Tensor:
        return float16(source.get(name), name)

    add("model.embed_tokens.weight", original("model.embed_tokens.weight"), "other_bytes")
    for index, (norms, linears) in enumerate(layers):
        for name, tensor in norms.items():
            add(f"model.layers.{index}.{name}", tensor, "other_bytes")
        for name, result in linears.items():
            prefix = f"model.layers.{index}.{name}"
            kind = "fp16_layer_bytes" if prefix in fp16_names else "int4_bytes"
            if prefix in fp16_names:
                weight = source.get(f"{prefix}.weight").to(torch.float32)
                if result.input_scales is not None:
                    weight = weight * result.input_scales
                if result.output_scales is not None:
                    weight = weight / result.output_scales[:, None]
                add(f"{prefix}.weight", float16(weight, f"{prefix}.weight"), kind)
            else:
                report.num_int4_linears += 1
                for attr, tensor in result.packed.items():
                    add(f"{prefix}.{attr}", tensor, kind)
            if result.bias is not None:
                add(f"{prefix}.bias", result.bias, kind)
            comp = result.compensation
            if comp is None or prefix in fp16_names:
                continue
            for attr, tensor in ((LORA_A, comp.lora_a), (LORA_B, comp.lora_b), (BIAS_CORRECTION, comp.bias_correction)):
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
        add("model.norm.weight", head[1], "other_bytes")
        for attr, tensor in head[0].items():
            add(f"lm_head.{attr}", tensor, "int4_bytes")
    else:
        add("model.norm.weight", original("model.norm.weight"), "other_bytes")
        if not config.is_tied_head:
            add("lm_head.weight", original("lm_head.weight"), "other_bytes")
    return tensors, extras


def write_tensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """Write one safetensors file (the metadata transformers expects included)."""
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata={"format": "pt"})


def write_output(model_dir: Path, out_dir: Path, raw_config: dict, skipped: list, tensors: dict, extras: dict, report):
    """Write everything into OUT.partial-XXXX, then rename it to OUT; remove it on any failure.
    `skipped`: the FP16-kept modules (quantization_config.modules_to_not_convert)."""
    staging = Path(tempfile.mkdtemp(prefix=f"{out_dir.name}.partial-", dir=out_dir.parent))
    try:
        config = {key: value for key, value in raw_config.items() if key != "quantization_config"}
        quant = AwqConfig(group_size=report.group_size, modules_to_not_convert=tuple(skipped))
        config.update(quantization_config=quant.to_config_dict(), torch_dtype="float16", dtype="float16")
        (staging / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        write_tensors(tensors, staging / WEIGHTS_FILE)
        if extras:
            write_tensors(extras, staging / COMPENSATION_FILE)
        for path in sorted(model_dir.iterdir()):
            is_skipped = path.name in SKIPPED_FILES or path.suffix in SKIPPED_SUFFIXES
            if path.is_file() and not is_skipped and not path.name.startswith("lowvram_"):
                shutil.copy2(path, staging / path.name)
        report_json = {**asdict(report), "total_bytes": report.total_bytes}
        (staging / REPORT_FILE).write_text(json.dumps(report_json, indent=2) + "\n", encoding="utf-8")
        if out_dir.exists():  # swapped in, the old one put back if the rename fails
            old = Path(tempfile.mkdtemp(prefix=f"{out_dir.name}.old-", dir=out_dir.parent))
            os.replace(out_dir, old / out_dir.name)
            try:
                os.replace(staging, out_dir)
            except BaseException:
                os.replace(old / out_dir.name, out_dir)
                raise
            finally:
                shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(staging, out_dir)
    except BaseException as exc:
        shutil.rmtree(staging, ignore_errors=True)
        if not isinstance(exc, OSError):
            raise
        if exc.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)):
            raise ConfigError(
                f"no space left on the disk holding {out_dir.parent} while writing the checkpoint (about "
                f"{report.total_bytes / MIB:.0f} MiB); free some space or choose another OUT. Nothing was written."
            ) from None
        raise ConfigError(f"cannot write the checkpoint under {out_dir.parent}: {exc}. Nothing was written.") from None
