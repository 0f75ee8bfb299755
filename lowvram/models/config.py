"""The model's shape from a Hugging Face config.json, across transformers 4.x and 5.x spellings
(5.x keeps RoPE settings in `rope_parameters`). AWQ settings come from `quantization_config` or
an older AutoAWQ's quant_config.json (w_bit, q_group_size); anything but the GEMM layout with 4
bits, zero points and group size 32/64/128 is refused before any weight is read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from lowvram.errors import ModelLoadError, UnsupportedModelError
from lowvram.kernels.awq_format import SUPPORTED_GROUP_SIZES

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "deepseek-coder, deepseek-llm",
    "Qwen2ForCausalLM": "DeepSeek-R1-Distill-Qwen",
}
SUPPORTED_ROPE_TYPES = ("default", "linear")
# Loaded by lowvram.models.deepseek_v2, which reads its own config
DEEPSEEK_V2 = "DeepseekV2ForCausalLM (DeepSeek-V2-Lite, DeepSeek-Coder-V2-Lite)"
_INT_FIELDS = (
    "vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads num_key_value_heads head_dim"
)
_NUMBER_FIELDS = [(name, int) for name in _INT_FIELDS.split()] + [("rms_norm_eps", float), ("rope_theta", float)]
LEGACY_QUANT_CONFIG = "quant_config.json"
_SUPPORTED_QUANT = (
    "AWQ INT4 in the AutoAWQ GEMM layout (quant_method 'awq', version 'gemm', bits 4, zero_point true, "
    f"group_size {'/'.join(map(str, SUPPORTED_GROUP_SIZES))}), or unquantized FP16/BF16/FP32 weights"
)


@dataclass(frozen=True)
class AwqConfig:
    """An AutoAWQ GEMM checkpoint's settings. Every Linear whose name contains a fragment of
    `modules_to_not_convert` keeps an FP16 `weight` (as AutoAWQ, transformers and vLLM match)."""

    group_size: int
    modules_to_not_convert: tuple[str, ...] = ()

    def is_skipped(self, module_name: str) -> bool:
        return any(fragment in module_name for fragment in self.modules_to_not_convert)

    def to_config_dict(self) -> dict:
        """The `quantization_config` entry of config.json, as AutoAWQ writes it."""
        return {
            "quant_method": "awq",
            "bits": 4,
            "group_size": self.group_size,
            "zero_point": True,
            "version": "gemm",
            "modules_to_not_convert": list(self.modules_to_not_convert),
        }


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_type: str
    rope_factor: float
    has_qkv_bias: bool
    is_tied_head: bool
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]
    quantization: AwqConfig | None = None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def num_params(self) -> int:
        """Parameter count (embedding and head counted separately when untied)."""
        h, i = self.hidden_size, self.intermediate_size
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        if self.has_qkv_bias:
            attn += self.q_size + 2 * self.kv_size
        per_layer = attn + 3 * h * i + 2 * h
        head = 0 if self.is_tied_head else self.vocab_size * h
        return self.vocab_size * h + self.num_layers * per_layer + h + head


def eos_token_ids(raw: dict) -> tuple[int, ...]:
    eos = raw.get("eos_token_id")
    return tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())


def awq_config_from_dict(raw: dict, source: str) -> AwqConfig:
    """A `quantization_config` dict (or legacy quant_config.json) as an AwqConfig."""
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{source}: quantization_config must be a JSON object, got {type(raw).__name__}")
    method = str(raw.get("quant_method", "awq")).lower()
    version = str(raw.get("version", "gemm")).lower()
    bits = raw.get("bits", raw.get("w_bit", 4))
    group_size = raw.get("group_size", raw.get("q_group_size", 128))
    gemv = " (GEMV packs along K for batch-1 kernels; re-quantize with version 'gemm', e.g. `lowvram quantize`)"
    for is_supported, problem in (
        (method == "awq", f"quant_method {method!r} is not supported"),
        (version == "gemm", f"AWQ version {version!r} is not supported{gemv if version.startswith('gemv') else ''}"),
        (bits == 4, f"AWQ with {bits} bits is not supported"),
        (group_size in SUPPORTED_GROUP_SIZES, f"AWQ group_size {group_size} is not supported"),
        (raw.get("zero_point", True) is True, "AWQ without zero points (zero_point false) is not supported"),
    ):
        if not is_supported:
            raise UnsupportedModelError(f"{source}: {problem}. Supported: {_SUPPORTED_QUANT}")
    skipped = raw.get("modules_to_not_convert") or []
    if not isinstance(skipped, list) or not all(isinstance(name, str) for name in skipped):
        raise ModelLoadError(f"{source}: modules_to_not_convert must be a list of module names, got {skipped!r}")
    return AwqConfig(group_size=int(group_size), modules_to_not_convert=tuple(skipped))


def model_config_from_dict(raw: dict, source: str = "config.json", legacy_quant: dict | None = None) -> ModelConfig:
    """Normalise a config.json dict; `legacy_quant` is the content of a quant_config.json beside it."""
    archs = raw.get("architectures") or []
    arch = archs[0] if archs else raw.get("model_type", "?")
    if arch not in SUPPORTED_ARCHITECTURES:
        supported = "; ".join([*(f"{a} ({m})" for a, m in SUPPORTED_ARCHITECTURES.items()), DEEPSEEK_V2])
        raise UnsupportedModelError(f"{source}: architecture {arch!r} is not supported. Supported: {supported}")
    for name, kind in _NUMBER_FIELDS:
        value = raw.get(name)
        try:
            if value is not None:
                kind(value)
        except (TypeError, ValueError):
            raise ModelLoadError(f"{source}: field {name!r} is {value!r}, not a number; fix config.json") from None
    try:
        num_heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        params = raw.get("rope_parameters") or {}
        legacy = raw.get("rope_scaling") or {}
        rope_type = (
            params.get("rope_type") or params.get("type") or legacy.get("rope_type") or legacy.get("type") or "default"
        )
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(
                f"{source}: RoPE scaling {rope_type!r} is not supported yet; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        quantization = None
        if raw.get("quantization_config") is not None:
            quantization = awq_config_from_dict(raw["quantization_config"], f"{source} quantization_config")
        elif legacy_quant is not None:
            quantization = awq_config_from_dict(legacy_quant, LEGACY_QUANT_CONFIG)
        return ModelConfig(
            architecture=arch,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=int(raw.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(params.get("rope_theta", raw.get("rope_theta", 10000.0))),
            rope_type=rope_type,
            rope_factor=float(params.get("factor", legacy.get("factor", 1.0)) or 1.0),
            has_qkv_bias=arch == "Qwen2ForCausalLM" or bool(raw.get("attention_bias", False)),
            is_tied_head=bool(raw.get("tie_word_embeddings", False)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            eos_token_ids=eos_token_ids(raw),
            quantization=quantization,
        )
    except KeyError as exc:
        raise ModelLoadError(f"{source}: required field {exc.args[0]!r} is missing") from None
    except (TypeError, ValueError) as exc:
        raise ModelLoadError(f"{source}: a field has a bad value ({exc})") from None


def load_model_config(model_dir: Path) -> tuple[ModelConfig, dict]:
    """The normalised config of `config.json` (and a legacy quant_config.json beside it), and the raw dict."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ModelLoadError(
            f"{model_dir} has no config.json; pass a Hugging Face model directory (config.json, *.safetensors, tokenizer files)"
        )
    legacy_path = Path(model_dir) / LEGACY_QUANT_CONFIG
    raw = _read_json(path)
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{path} must hold a JSON object")
    legacy_quant = _read_json(legacy_path) if legacy_path.is_file() and raw.get("quantization_config") is None else None
    return model_config_from_dict(raw, str(path), legacy_quant), raw


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{path} is not valid JSON ({exc}); re-download the checkpoint") from None
