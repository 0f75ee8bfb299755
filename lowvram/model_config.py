"""The model's shape, read from a Hugging Face config.json.

Only what the runtime needs, normalised across transformers 4.x and 5.x spellings
(5.x keeps RoPE settings in `rope_parameters`; older files use `rope_theta` and
`rope_scaling`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from lowvram.errors import ModelLoadError, UnsupportedModelError

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "deepseek-coder, deepseek-llm",
    "Qwen2ForCausalLM": "DeepSeek-R1-Distill-Qwen",
}
SUPPORTED_ROPE_TYPES = ("default", "linear")


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
    checkpoint_dtype: str
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

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


def _rope_settings(raw: dict, source: str) -> tuple[float, str, float]:
    params = raw.get("rope_parameters") or {}
    legacy = raw.get("rope_scaling") or {}
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type") or params.get("type") or legacy.get("rope_type") or legacy.get("type") or "default"
    factor = params.get("factor", legacy.get("factor", 1.0))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"{source}: RoPE scaling {rope_type!r} is not supported yet; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    return float(theta), rope_type, float(factor or 1.0)


def model_config_from_dict(raw: dict, source: str = "config.json") -> ModelConfig:
    archs = raw.get("architectures") or []
    arch = archs[0] if archs else raw.get("model_type", "?")
    if arch not in SUPPORTED_ARCHITECTURES:
        supported = "; ".join(f"{a} ({m})" for a, m in SUPPORTED_ARCHITECTURES.items())
        raise UnsupportedModelError(f"{source}: architecture {arch!r} is not supported. Supported: {supported}")
    try:
        num_heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        theta, rope_type, factor = _rope_settings(raw, source)
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
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
            rope_theta=theta,
            rope_type=rope_type,
            rope_factor=factor,
            has_qkv_bias=arch == "Qwen2ForCausalLM" or bool(raw.get("attention_bias", False)),
            is_tied_head=bool(raw.get("tie_word_embeddings", False)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            checkpoint_dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "float32"),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )
    except KeyError as exc:
        raise ModelLoadError(f"{source}: required field {exc.args[0]!r} is missing") from None
    except (TypeError, ValueError) as exc:
        raise ModelLoadError(f"{source}: a field has a bad value ({exc})") from None


def load_model_config(model_dir: Path) -> tuple[ModelConfig, dict]:
    """Read `config.json`; returns the normalised config and the raw dict."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ModelLoadError(
            f"{model_dir} has no config.json; pass a Hugging Face model directory (config.json, *.safetensors, tokenizer files)"
        )
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{path} is not valid JSON ({exc}); re-download the checkpoint") from None
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{path} must hold a JSON object")
    return model_config_from_dict(raw, str(path)), raw
