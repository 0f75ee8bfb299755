"""The real DeepSeek model shapes, and random-weight checkpoints of them, so benchmarks measure
speed and memory at the shapes users run without the real weights. Weights are drawn directly
(N(0, 0.02), norms at 1), on the GPU when there is one: seconds for a 1.5B checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from lowvram.errors import ConfigError
from lowvram.models.config import model_config_from_dict
from lowvram.models.dense import CausalLM

_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")
_QWEN2 = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", max_position_embeddings=131072, rope_theta=1e4)
SHAPES: dict[str, dict] = {
    "r1-distill-qwen-1.5b": dict(_QWEN2, **dict(zip(_FIELDS, (1536, 8960, 28, 12, 2))), vocab_size=151936),
    "r1-distill-qwen-7b": dict(_QWEN2, **dict(zip(_FIELDS, (3584, 18944, 28, 28, 4))), vocab_size=152064),
    "deepseek-coder-1.3b": dict(
        dict(zip(_FIELDS, (2048, 5504, 24, 16, 16))),
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        vocab_size=32256,
        max_position_embeddings=16384,
        rope_theta=100000.0,
        rope_scaling={"type": "linear", "factor": 4.0},
    ),
}


def shape_config(name: str, num_layers: int | None = None) -> dict:
    if name not in SHAPES:
        raise ConfigError(f"unknown shape {name!r}; known shapes: {', '.join(SHAPES)}")
    config = dict(
        SHAPES[name],
        torch_dtype="bfloat16",
        bos_token_id=0,
        eos_token_id=1,
        hidden_act="silu",
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    if num_layers is not None:
        config["num_hidden_layers"] = num_layers
    return config


def write_random_checkpoint(out_dir: str | Path, shape: str, *, num_layers: int | None = None, seed: int = 0) -> Path:
    """A complete Hugging Face directory (BF16, small tokenizer) of `shape` with random weights."""
    from lowvram.testing import save_weights, train_tiny_tokenizer

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = shape_config(shape, num_layers)
    train_tiny_tokenizer(out_dir, extra_special_tokens=("<|endoftext|>",) if config["model_type"] == "qwen2" else ())
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    (out_dir / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 1}))
    with torch.device("meta"):
        model = CausalLM(model_config_from_dict(config))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=device).manual_seed(seed)
    weights = {}
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            weights[name] = torch.ones(p.shape, dtype=torch.bfloat16)
        else:
            noise = torch.randn(p.shape, generator=gen, device=device, dtype=torch.float32)
            weights[name] = (noise * 0.02).to(torch.bfloat16).cpu()
    save_weights(out_dir, weights, sharded=True)
    return out_dir


# A folder where benchmarks keep the random checkpoints they make, so that several benchmarks
# in one session write and quantize each shape once (scripts/test_gpu.sh sets it).
BENCH_CACHE_ENV = "LOWVRAM_BENCH_CACHE"


def cached_checkpoint(key: str, make: Callable[[Path], object], work_dir: str | Path) -> Path:
    """The directory `make(path)` fills, under `work_dir` or once per `key` (naming all it depends on)
    in $LOWVRAM_BENCH_CACHE; an entry counts once `make` has returned."""
    cache = os.environ.get(BENCH_CACHE_ENV)
    if not cache:
        Path(work_dir).mkdir(parents=True, exist_ok=True)
        make(Path(work_dir) / key)
        return Path(work_dir) / key
    target = Path(cache) / key
    if (target / ".complete").is_file():
        return target
    shutil.rmtree(target, ignore_errors=True)
    partial = Path(cache) / f"{key}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    partial.parent.mkdir(parents=True, exist_ok=True)
    make(partial)
    (partial / ".complete").write_text("")
    partial.rename(target)
    return target


def random_awq_checkpoint(
    shape: str,
    work_dir: str | Path,
    *,
    num_samples: int = 8,
    group_size: int = 128,
    fp16_budget_mib: float = 0.0,
    rank: int = 0,
    device: str = "auto",
    emulate_vram_gib: float | None = None,
    quantize_head: bool = False,
) -> tuple[Path, Path]:
    """(source, AWQ INT4) directories of random weights of `shape`, cached; options as quantize_model's."""
    from lowvram.quant.quantize import quantize_model

    source = cached_checkpoint(f"{shape}-bf16", lambda d: write_random_checkpoint(d, shape), work_dir)
    key = f"{shape}-awq-n{num_samples}-g{group_size}-f{fp16_budget_mib:g}-r{rank}" + ("-head" if quantize_head else "")
    options = dict(group_size=group_size, fp16_budget_mib=fp16_budget_mib, rank=rank, num_samples=num_samples)
    options.update(device=device, emulate_vram_gib=emulate_vram_gib, quantize_head=quantize_head)
    awq = cached_checkpoint(key, lambda d: quantize_model(source, d, **options), work_dir)
    return source, awq
