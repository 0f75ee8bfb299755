"""Find a checkpoint (local directory or hub id) and load it into a CausalLM.

Weights are read tensor by tensor from safetensors and assigned into a model built
on the meta device, so host memory never holds two copies of the model.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch
from torch import nn

from lowvram.errors import ModelLoadError
from lowvram.model import CausalLM
from lowvram.model_config import ModelConfig, load_model_config

log = logging.getLogger("lowvram")

HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "tokenizer*"]
BUNDLED_MODEL_DIR = Path(__file__).parent / "demo_model"


def resolve_model_path(model: str | os.PathLike | None) -> Path:
    """A local directory as is; otherwise a hub id fetched through huggingface_hub.

    None means the small demo model that ships inside the package.
    """
    if model is None:
        if not (BUNDLED_MODEL_DIR / "config.json").is_file():
            raise ModelLoadError("the bundled demo model is missing from this install; pass --model PATH")
        return BUNDLED_MODEL_DIR
    text = str(model)
    path = Path(text).expanduser()
    if path.is_dir():
        return path
    looks_like_path = path.exists() or text.startswith((".", "/", "~")) or text.count("/") != 1 or os.sep == "\\" and "\\" in text
    if looks_like_path:
        raise ModelLoadError(f"model directory {text!r} does not exist; pass a local Hugging Face model directory")
    return _download(text)


def _download(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download
    except ImportError:  # pragma: no cover - a declared dependency
        raise ModelLoadError("huggingface_hub is not installed; pip install huggingface_hub, or pass a local directory") from None
    try:
        return Path(snapshot_download(repo_id, allow_patterns=HUB_PATTERNS))
    except Exception as exc:  # the hub raises many types (offline, 404, gated, HTTP)
        reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        raise ModelLoadError(
            f"could not fetch {repo_id!r} from the Hugging Face hub ({reason}). If this machine is offline, "
            f"download the model elsewhere (huggingface-cli download {repo_id} --local-dir DIR), copy DIR here "
            f"and pass --model DIR"
        ) from None


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


def _target_dtype(config: ModelConfig, device: torch.device, dtype: torch.dtype | None) -> torch.dtype:
    if dtype is not None:
        return dtype
    # Turing (the 4 GB cards we target) has no BF16: compute in FP16 on CUDA.
    return torch.float16 if device.type == "cuda" else torch.float32


def _assign(model: nn.Module, name: str, tensor: torch.Tensor) -> bool:
    module_name, _, param_name = name.rpartition(".")
    try:
        module = model.get_submodule(module_name)
    except AttributeError:
        return False
    if not isinstance(getattr(module, param_name, None), nn.Parameter):
        return False
    expected = getattr(module, param_name).shape
    if tuple(expected) != tuple(tensor.shape):
        raise ModelLoadError(f"tensor {name} has shape {tuple(tensor.shape)} but config.json implies {tuple(expected)}")
    setattr(module, param_name, nn.Parameter(tensor, requires_grad=False))
    return True


def load_weights(model: CausalLM, files: list[Path], device: torch.device, dtype: torch.dtype) -> int:
    """Assign every tensor from the shards; returns the bytes loaded."""
    from safetensors import SafetensorError, safe_open

    loaded: set[str] = set()
    num_bytes = 0
    for path in files:
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():
                    tensor = f.get_tensor(name).to(device=device, dtype=dtype)
                    if _assign(model, name, tensor):
                        loaded.add(name)
                        num_bytes += tensor.numel() * tensor.element_size()
        except (SafetensorError, OSError, RuntimeError, ValueError) as exc:
            raise ModelLoadError(f"{path} is corrupt or unreadable ({exc}); re-download this shard") from None
    if model.config.is_tied_head and "lm_head.weight" not in loaded:
        model.lm_head.weight = model.model.embed_tokens.weight
        loaded.add("lm_head.weight")
    expected = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    missing = sorted(expected - loaded)
    if missing:
        raise ModelLoadError(
            f"the checkpoint lacks {len(missing)} tensors the config needs, e.g. {missing[0]}; it is incomplete or "
            "does not match config.json"
        )
    return num_bytes


def load_model(model_dir: Path, device: torch.device, dtype: torch.dtype | None = None) -> tuple[CausalLM, ModelConfig]:
    config, _ = load_model_config(model_dir)
    files = weight_files(model_dir)
    dtype = _target_dtype(config, device, dtype)
    with torch.device("meta"):
        model = CausalLM(config)
    model.weight_bytes = load_weights(model, files, device, dtype)
    model.dtype = dtype
    model.eval()
    log.info("loaded %s (%s) on %s in %s: %.1f MiB", model_dir, config.architecture, device, dtype, model.weight_bytes / 2**20)
    return model, config
