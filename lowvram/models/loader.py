"""Find a checkpoint (local directory or hub id) and load it into a CausalLM.

Weights are read tensor by tensor from safetensors and assigned into a model built
on the meta device, so host memory never holds two copies of the model.

AWQ checkpoints (AutoAWQ GEMM layout): before loading, every Linear that the checkpoint
quantizes is swapped for an AwqLinear, whose packed int32/float16 tensors are kept exactly
as read (only moved to the device). `lm_head` is quantized only when the checkpoint holds
`lm_head.qweight`, since AutoAWQ and vLLM always keep it in FP16. Residual-compensation
tensors written by `lowvram quantize` live in a side file (COMPENSATION_FILE) that other
loaders never open.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
from torch import nn

from lowvram.config import Profile
from lowvram.demo import demo_model_path
from lowvram.errors import ModelLoadError
from lowvram.memory.plan import plan_expert_cache
from lowvram.models.batch_invariance import make_batch_invariant
from lowvram.models.checkpoint import COMPENSATION_FILE, read_raw_config, tensor_names, weight_files, weight_report
from lowvram.models.config import ModelConfig, load_model_config
from lowvram.models.deepseek_v2 import DeepseekV2Config, is_deepseek_v2, load_deepseek_v2
from lowvram.models.dense import CausalLM
from lowvram.models.fusion import fuse_projections
from lowvram.quant.awq_linear import AWQ_NAMES, COMPENSATION_NAMES, AwqLinear, swap_awq_linears

log = logging.getLogger("lowvram")

# Not "*.safetensors": vLLM reads every *.safetensors file of a directory without an index
# and fails on tensor names it does not know, so the extras go in a file it never globs.
HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "tokenizer*", COMPENSATION_FILE]
QUANTIZABLE_LINEARS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)


def resolve_model_path(model: str | os.PathLike | None) -> Path:
    """A local directory as is; otherwise a hub id fetched through huggingface_hub.

    None means the small demo model that ships inside the package.
    """
    if model is None:
        return demo_model_path()
    text = str(model)
    path = Path(text).expanduser()
    if path.is_dir():
        return path
    looks_like_path = (
        path.exists() or text.startswith((".", "/", "~")) or text.count("/") != 1 or os.sep == "\\" and "\\" in text
    )
    if looks_like_path:
        raise ModelLoadError(f"model directory {text!r} does not exist; pass a local Hugging Face model directory")
    return _download(text)


def _download(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download
    except ImportError:  # pragma: no cover - a declared dependency
        raise ModelLoadError(
            "huggingface_hub is not installed; pip install huggingface_hub, or pass a local directory"
        ) from None
    try:
        return Path(snapshot_download(repo_id, allow_patterns=HUB_PATTERNS))
    except Exception as exc:  # the hub raises many types (offline, 404, gated, HTTP)
        reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        raise ModelLoadError(
            f"could not fetch {repo_id!r} from the Hugging Face hub ({reason}). If this machine is offline, "
            f"download the model elsewhere (huggingface-cli download {repo_id} --local-dir DIR), copy DIR here "
            f"and pass --model DIR"
        ) from None


def _target_dtype(config: ModelConfig, device: torch.device, dtype: torch.dtype | None) -> torch.dtype:
    if dtype is not None:
        return dtype
    # Turing (the 4 GB cards we target) has no BF16: compute in FP16 on CUDA.
    return torch.float16 if device.type == "cuda" else torch.float32


def _target(model: nn.Module, name: str) -> tuple[nn.Module, str] | None:
    """The module and attribute a checkpoint tensor belongs to, or None for tensors the model has no slot for."""
    module_name, _, attr = name.rpartition(".")
    try:
        module = model.get_submodule(module_name)
    except AttributeError:
        return None
    if isinstance(module, AwqLinear) and attr in COMPENSATION_NAMES:
        return module, attr
    if isinstance(getattr(module, attr, None), nn.Parameter) or getattr(module, "_buffers", {}).get(attr) is not None:
        return module, attr
    return None


def _assign(module: nn.Module, attr: str, name: str, tensor: torch.Tensor) -> None:
    if isinstance(module, AwqLinear) and attr in COMPENSATION_NAMES:
        try:
            module.set_compensation(attr, tensor)
        except ValueError as exc:
            raise ModelLoadError(f"tensor {name}: {exc}; the compensation file does not match the model") from None
        return
    expected = getattr(module, attr).shape
    if tuple(expected) != tuple(tensor.shape):
        raise ModelLoadError(f"tensor {name} has shape {tuple(tensor.shape)} but config.json implies {tuple(expected)}")
    if attr in module._buffers:
        module._buffers[attr] = tensor
    else:
        setattr(module, attr, nn.Parameter(tensor, requires_grad=False))


def _convert(
    module: nn.Module, attr: str, tensor: torch.Tensor, device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    # Packed AWQ tensors stay bit-for-bit as on disk: int32 words and float16 scales.
    if isinstance(module, AwqLinear) and attr in AWQ_NAMES:
        return tensor.to(device=device)
    return tensor.to(device=device, dtype=dtype)


def load_weights(model: CausalLM, files: list[Path], device: torch.device, dtype: torch.dtype) -> int:
    """Assign every tensor from the shards; returns the bytes loaded.

    Compensation tensors are attached last, once every bias holds its checkpoint value: a bias
    correction is added to the bias as it attaches (and gives a bias-free layer one).
    """
    from safetensors import SafetensorError, safe_open

    loaded: set[str] = set()
    names_on_disk: set[str] = set()
    compensation: list[tuple[nn.Module, str, str, torch.Tensor]] = []
    num_bytes = 0
    for path in files:
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():
                    names_on_disk.add(name)
                    target = _target(model, name)
                    if target is None:
                        continue
                    tensor = _convert(*target, f.get_tensor(name), device, dtype)
                    if isinstance(target[0], AwqLinear) and target[1] in COMPENSATION_NAMES:
                        compensation.append((*target, name, tensor))
                    else:
                        _assign(*target, name, tensor)
                    loaded.add(name)
                    num_bytes += tensor.numel() * tensor.element_size()
        except (SafetensorError, OSError, RuntimeError, ValueError) as exc:
            raise ModelLoadError(f"{path} is corrupt or unreadable ({exc}); re-download this shard") from None
    if model.config.is_tied_head and "lm_head.weight" not in loaded:
        model.lm_head.weight = model.model.embed_tokens.weight
        loaded.add("lm_head.weight")
    expected = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    expected |= {n for n, _ in model.named_buffers(remove_duplicate=False)}
    missing = sorted(expected - loaded)
    if missing:
        raise ModelLoadError(
            f"the checkpoint lacks {len(missing)} tensors the config needs, e.g. {missing[0]}; it is incomplete or "
            f"does not match config.json{_quantization_hint(missing, names_on_disk)}"
        )
    for module, attr, name, tensor in compensation:
        _assign(module, attr, name, tensor)
    return num_bytes


def _quantization_hint(missing: list[str], names_on_disk: set[str]) -> str:
    for name in missing:
        stem, _, attr = name.rpartition(".")
        if attr == "qweight" and f"{stem}.weight" in names_on_disk:
            return (
                f" ({stem} is listed as INT4 but the checkpoint holds it in FP16; is it missing from "
                "quantization_config.modules_to_not_convert?)"
            )
        if attr == "weight" and f"{stem}.qweight" in names_on_disk:
            return (
                f" ({stem} is listed in quantization_config.modules_to_not_convert but the checkpoint holds "
                "it quantized)"
            )
    return ""


def load_model(
    model_dir: Path,
    device: torch.device,
    dtype: torch.dtype | None = None,
    *,
    profile: Profile | None = None,
    held_bytes: int = 0,
    fuse: bool = False,
    batch_invariant: bool = False,
) -> tuple[CausalLM, ModelConfig]:
    """Build the model on the meta device and assign the checkpoint's tensors.

    fuse: q/k/v and gate/up of each dense layer as one projection each (lowvram.models.fusion).
    batch_invariant: every matmul and attention in its batch-invariant form
        (lowvram.models.batch_invariance); dense models only.

    Sets `model.weight_report` (a WeightReport: bytes by kind) and `model.weight_bytes` (its total).
    DeepseekV2ForCausalLM checkpoints load through lowvram.models.deepseek_v2 and return a
    DeepseekV2Config; on CUDA, `profile` sizes their device cache of routed experts (less
    `held_bytes`, device memory the process already holds: memory_plan.memory_budget_bytes).
    """
    model_dir = Path(model_dir)
    raw = read_raw_config(model_dir)
    if raw is not None and is_deepseek_v2(raw):
        model, config = _load_deepseek_v2(model_dir, raw, device, dtype, profile, held_bytes)
        cached = model.num_cached_experts
        where = f"{cached} of {config.num_routed_experts} routed experts per layer" if cached else "every routed expert"
        _log_loaded(model, config, model_dir, device, _target_dtype(config, device, dtype), f", {where} on the device")
        return model, config
    config, _ = load_model_config(model_dir)
    files = weight_files(model_dir)
    dtype = _target_dtype(config, device, dtype)
    with torch.device("meta"):
        model = CausalLM(config)
    if config.quantization is not None:
        is_head_quantized = "lm_head.qweight" in tensor_names(files)
        swap_awq_linears(model, config.quantization, is_head_quantized)
        compensation = model_dir / COMPENSATION_FILE
        if compensation.is_file():
            files = files + [compensation]
    load_weights(model, files, device, dtype)
    if fuse:
        fuse_projections(model)
    if batch_invariant:
        num_layers = make_batch_invariant(model)
        log.info("batch-invariant kernels in %d layers: every request decodes as it would alone", num_layers)
    model.weight_report = weight_report(model)
    model.weight_bytes = model.weight_report.total_bytes
    model.dtype = dtype
    model.eval()
    _log_loaded(model, config, model_dir, device, dtype)
    return model, config


def _log_loaded(model, config, model_dir: Path, device: torch.device, dtype: torch.dtype, detail: str = "") -> None:
    kind = f"AWQ INT4 g{config.quantization.group_size}" if config.quantization else str(dtype)
    summary = model.weight_report.summary()
    log.info(
        "loaded %s (%s, %s) on %s in %s%s: %s", model_dir, config.architecture, kind, device, dtype, detail, summary
    )


def is_deepseek_v2_checkpoint(model_dir: str | os.PathLike) -> bool:
    """Whether the directory's config.json names DeepseekV2ForCausalLM (or model_type deepseek_v2)."""
    raw = read_raw_config(model_dir)
    return raw is not None and is_deepseek_v2(raw)


def _load_deepseek_v2(
    model_dir: Path,
    raw: dict,
    device: torch.device,
    dtype: torch.dtype | None,
    profile: Profile | None,
    held_bytes: int,
) -> tuple[CausalLM, ModelConfig]:
    # Experts move only between host and a GPU: on the CPU they all stay where they are.
    config = DeepseekV2Config.from_dict(raw, str(model_dir / "config.json"))
    dtype = _target_dtype(config, device, dtype)
    max_cached_experts = None
    if profile is not None and device.type == "cuda" and config.num_routed_experts:
        max_model_len = min(profile.max_model_len, config.max_position_embeddings)
        max_cached_experts = plan_expert_cache(
            config,
            profile,
            torch.finfo(dtype).bits // 8,
            max_model_len,
            device_type=device.type,
            model_dir=model_dir,
            held_bytes=held_bytes,
        )
    model, _ = load_deepseek_v2(model_dir, device, dtype, max_cached_experts=max_cached_experts)
    return model, config
