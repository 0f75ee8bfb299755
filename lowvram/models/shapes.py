"""The real DeepSeek model shapes, and random-weight checkpoints of them.

Benchmarks measure speed and memory at the shapes users run without needing the
real weights (which cannot be downloaded everywhere): `write_random_checkpoint`
writes a complete Hugging Face directory (config.json from the published config's
shape fields, BF16 safetensors of the tensors the model declares, a small tokenizer and a
chat template). Weights are drawn directly (N(0, 0.02), norms at 1), on the GPU when
there is one, so a 1.5B checkpoint takes seconds, not the minutes a transformers init would.
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

SHAPES: dict[str, dict] = {
    "r1-distill-qwen-1.5b": dict(
        architectures=["Qwen2ForCausalLM"],
        model_type="qwen2",
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        vocab_size=151936,
        max_position_embeddings=131072,
        rope_theta=10000.0,
    ),
    "r1-distill-qwen-7b": dict(
        architectures=["Qwen2ForCausalLM"],
        model_type="qwen2",
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
        max_position_embeddings=131072,
        rope_theta=10000.0,
    ),
    "deepseek-coder-1.3b": dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        hidden_size=2048,
        intermediate_size=5504,
        num_hidden_layers=24,
        num_attention_heads=16,
        num_key_value_heads=16,
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


def write_random_checkpoint(
    out_dir: str | Path, shape: str, *, num_layers: int | None = None, seed: int = 0, max_shard_bytes: int = 2 * 2**30
) -> Path:
    """A complete checkpoint of a named shape with random BF16 weights; returns its directory."""
    from safetensors.torch import save_file

    from lowvram.testing import train_tiny_tokenizer

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = shape_config(shape, num_layers)
    extra = ("<|endoftext|>",) if config["model_type"] == "qwen2" else ()
    train_tiny_tokenizer(out_dir, extra_special_tokens=extra)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    (out_dir / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 1}))
    with torch.device("meta"):
        model = CausalLM(model_config_from_dict(config))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=device).manual_seed(seed)
    shards: list[dict[str, torch.Tensor]] = [{}]
    shard_bytes = 0
    for name, dims in ((name, p.shape) for name, p in model.named_parameters()):
        if name.endswith("norm.weight"):
            tensor = torch.ones(dims, dtype=torch.bfloat16)
        else:
            tensor = (
                (torch.randn(dims, generator=gen, device=device, dtype=torch.float32) * 0.02).to(torch.bfloat16).cpu()
            )
        if shard_bytes + tensor.numel() * 2 > max_shard_bytes and shards[-1]:
            shards.append({})
            shard_bytes = 0
        shards[-1][name] = tensor
        shard_bytes += tensor.numel() * 2
    weight_map = {}
    for n, tensors in enumerate(shards):
        file = f"model-{n + 1:05d}-of-{len(shards):05d}.safetensors" if len(shards) > 1 else "model.safetensors"
        save_file(tensors, str(out_dir / file), metadata={"format": "pt"})
        weight_map.update({name: file for name in tensors})
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(t.numel() * 2 for s in shards for t in s.values())},
            "weight_map": weight_map,
        }
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return out_dir


# A folder where benchmarks keep the random checkpoints they make, so that several
# benchmarks in one session write and quantize each shape once (scripts/test_gpu.sh sets it).
BENCH_CACHE_ENV = "LOWVRAM_BENCH_CACHE"
_COMPLETE = ".complete"


def cached_checkpoint(key: str, make: Callable[[Path], object], work_dir: str | Path) -> Path:
    """The directory `make(path)` fills, made once per `key` where $LOWVRAM_BENCH_CACHE names
    a folder (reused by every later call with the same key), else made under `work_dir`.

    `key` must name everything the contents depend on (shape, seed, quantizer settings).
    `make` gets a directory that does not exist yet; a cached entry counts only once `make`
    has returned, so an interrupted run leaves nothing a later one would trust.
    """
    cache = os.environ.get(BENCH_CACHE_ENV)
    if not cache:
        Path(work_dir).mkdir(parents=True, exist_ok=True)
        target = Path(work_dir) / key
        make(target)
        return target
    target = Path(cache) / key
    if (target / _COMPLETE).is_file():
        return target
    shutil.rmtree(target, ignore_errors=True)
    partial = Path(cache) / f"{key}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    partial.parent.mkdir(parents=True, exist_ok=True)
    make(partial)
    (partial / _COMPLETE).write_text("")
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
    """Random weights of `shape` and their AWQ INT4 version (`num_samples` calibration
    blocks; FP16-kept layers, compensation and an INT4 lm_head as given, none by default):
    (source directory, AWQ directory), cached as `cached_checkpoint` says."""
    from lowvram.quant.quantize import quantize_model

    source = cached_checkpoint(f"{shape}-bf16", lambda d: write_random_checkpoint(d, shape), work_dir)
    key = f"{shape}-awq-n{num_samples}-g{group_size}-f{fp16_budget_mib:g}-r{rank}" + ("-head" if quantize_head else "")
    awq = cached_checkpoint(
        key,
        lambda d: quantize_model(
            source,
            d,
            group_size=group_size,
            fp16_budget_mib=fp16_budget_mib,
            rank=rank,
            num_samples=num_samples,
            device=device,
            emulate_vram_gib=emulate_vram_gib,
            quantize_head=quantize_head,
        ),
        work_dir,
    )
    return source, awq
