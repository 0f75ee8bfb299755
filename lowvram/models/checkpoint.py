"""What a checkpoint holds: its files and tensor names and, once loaded, its weights' bytes by kind
(below the loader, the memory plan and DeepSeek-V2, which all read them).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from torch import nn

from lowvram.errors import ModelLoadError
from lowvram.quant.awq_linear import LORA_NAMES, AwqLinear

# The low-rank compensation and bias corrections, beside the AWQ tensors; other loaders ignore it.
COMPENSATION_FILE = "lowvram_compensation.st"


def read_raw_config(model_dir: str | Path) -> dict | None:
    """config.json as a dict, or None when there is no readable file."""
    try:
        raw = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return raw if isinstance(raw, dict) else None


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors shards named by the index, or every *.safetensors file."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ModelLoadError(f"{index} is malformed ({exc}); re-download the checkpoint") from None
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(
                f"{model_dir} is incomplete: shard {missing[0]} named in {index.name} is missing "
                f"({len(missing)} of {len(files)} missing); re-download the checkpoint"
            )
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        has_bin = any(model_dir.glob("*.bin"))
        hint = " (it has PyTorch .bin files; convert them to safetensors)" if has_bin else ""
        raise ModelLoadError(f"{model_dir} has no *.safetensors weights{hint}")
    return files


def tensor_names(files: list[Path]) -> set[str]:
    """Names of every tensor in the shards, read from their headers only."""
    from safetensors import SafetensorError, safe_open

    names: set[str] = set()
    for path in files:
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                names.update(f.keys())
        except (SafetensorError, OSError, RuntimeError, ValueError) as exc:
            raise ModelLoadError(f"{path} is corrupt or unreadable ({exc}); re-download this shard") from None
    return names


@dataclass
class WeightReport:
    """Bytes the loaded weights occupy, by kind (as held in memory, after any dtype conversion)."""

    int4_layer_bytes: int = 0
    fp16_layer_bytes: int = 0
    compensation_bytes: int = 0
    embedding_bytes: int = 0
    head_bytes: int = 0
    other_bytes: int = 0
    num_int4_layers: int = 0
    num_fp16_layers: int = 0

    @property
    def total_bytes(self) -> int:
        return sum(value for name, value in asdict(self).items() if name.endswith("_bytes"))

    def as_dict(self) -> dict:
        return {**asdict(self), "total_bytes": self.total_bytes}

    def summary(self) -> str:
        mib = 2**20
        return (
            f"{self.total_bytes / mib:.1f} MiB: INT4 layers {self.int4_layer_bytes / mib:.1f} "
            f"({self.num_int4_layers}), FP16 layers {self.fp16_layer_bytes / mib:.1f} ({self.num_fp16_layers}), "
            f"compensation {self.compensation_bytes / mib:.1f}, embeddings {self.embedding_bytes / mib:.1f}, "
            f"head {self.head_bytes / mib:.1f}, norms {self.other_bytes / mib:.1f}"
        )


def weight_report(model: nn.Module) -> WeightReport:
    """Count every weight tensor once, by what it is; a tied head counts with the embeddings."""
    report = WeightReport()
    seen: set[int] = set()

    def fresh(tensors) -> int:
        kept = [t for t in tensors if t is not None and id(t) not in seen]
        seen.update(id(t) for t in kept)
        return sum(t.nbytes for t in kept)

    report.embedding_bytes = fresh([model.model.embed_tokens.weight])
    for name, module in model.named_modules():
        if isinstance(module, AwqLinear):
            # a bias correction was added into the bias; a bias made of the correction alone is compensation
            bias = [module.bias]
            awq = [module.qweight, module.qzeros, module.scales] + (bias if module.has_own_bias else [])
            extras = [getattr(module, n) for n in LORA_NAMES] + ([] if module.has_own_bias else bias)
            if name == "lm_head":
                report.head_bytes += fresh(awq + extras)
                continue
            report.int4_layer_bytes += fresh(awq)
            report.compensation_bytes += fresh(extras)
            report.num_int4_layers += 1
        elif isinstance(module, nn.Linear):
            num_bytes = fresh([module.weight, module.bias])
            if name == "lm_head":
                report.head_bytes += num_bytes
            else:
                report.fp16_layer_bytes += num_bytes
                report.num_fp16_layers += 1
    report.other_bytes = fresh(model.parameters())
    return report
