"""Find a checkpoint (local directory or hub id) and load it, tensor by tensor, into a model built
on the meta device. AWQ (AutoAWQ GEMM): every Linear the checkpoint quantizes becomes an
AwqLinear holding the packed tensors as read; `lm_head` only where the checkpoint holds
`lm_head.qweight`. `lowvram quantize`'s compensation tensors live in COMPENSATION_FILE.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
from torch import nn

from lowvram.config import Profile
from lowvram.demo import demo_model_path
from lowvram.errors import ModelLoadError, UnsupportedModelError
from lowvram.kernels.awq_format import dequantize_awq
from lowvram.memory.plan import plan_expert_cache
from lowvram.models.batch_invariance import make_batch_invariant
from lowvram.models.checkpoint import COMPENSATION_FILE, read_raw_config, tensor_names, weight_files
from lowvram.models.config import ModelConfig, load_model_config
from lowvram.models.deepseek_v2 import DeepseekV2Config, DeepseekV2ForCausalLM, is_deepseek_v2
from lowvram.models.dense import CausalLM
from lowvram.models.fusion import fuse_projections
from lowvram.quant.awq_linear import AWQ_NAMES, COMPENSATION_NAMES, AwqLinear, swap_awq_linears

log = logging.getLogger("lowvram")

QUANTIZABLE_LINEARS = (*(f"self_attn.{n}_proj" for n in "qkvo"), "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def resolve_model_path(model: str | os.PathLike | None) -> Path:
    """A local directory as is, a GGUF file converted once (models/gguf.py), a copy lowvram made by the
    name `lowvram list` shows, a hub id (from the cache, else fetched: models/hub.py), or (None) the demo model."""
    if model is None:
        return demo_model_path()
    text = str(model)
    path = Path(text).expanduser()
    if path.is_dir():
        return path
    if path.suffix.lower() == ".gguf":
        from lowvram.models.gguf import convert_gguf

        return convert_gguf(path)
    from lowvram.models.hub import looks_like_hub_id, resolve_hub_model, resolve_local_copy

    if copy := resolve_local_copy(text):
        return copy
    if os.sep == "\\" and "\\" in text or not looks_like_hub_id(text):
        raise ModelLoadError(
            f"model directory {text!r} does not exist (nor is it a name `lowvram list` shows); pass a local "
            "Hugging Face model directory, a .gguf file or a hub id (ORG/NAME)"
        )
    return resolve_hub_model(text)


def load_weights(
    model: CausalLM, files: list[Path], device: torch.device, dtype: torch.dtype, expert_device=None
) -> None:
    """Assign every tensor of the shards the model has a place for. DeepSeek-V2's routed experts go
    to `expert_device`; its router stays float32 (rounded scores flip near-tied experts).
    Compensation attaches last, once every bias it may add a correction to is loaded."""
    from safetensors import SafetensorError, safe_open

    loaded: set[str] = set()
    names_on_disk: set[str] = set()
    compensation: list[tuple[nn.Module, str, str, torch.Tensor]] = []
    for path in files:
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():
                    names_on_disk.add(name)
                    module_name, _, attr = name.rpartition(".")
                    try:
                        module = model.get_submodule(module_name)
                    except AttributeError:
                        continue
                    is_compensation = isinstance(module, AwqLinear) and attr in COMPENSATION_NAMES
                    if not is_compensation and not isinstance(getattr(module, attr, None), torch.Tensor):
                        continue  # no slot in the model for it
                    target = expert_device if expert_device is not None and ".mlp.experts." in name else device
                    tensor = f.get_tensor(name)
                    if isinstance(module, AwqLinear) and attr in AWQ_NAMES:
                        tensor = tensor.to(target)  # packed int32 words and float16 scales stay as stored
                    else:
                        tensor = tensor.to(target, torch.float32 if name.endswith("mlp.gate.weight") else dtype)
                    loaded.add(name)
                    if is_compensation:
                        compensation.append((module, attr, name, tensor))
                        continue
                    expected = tuple(getattr(module, attr).shape)
                    if expected != tuple(tensor.shape):
                        shape = tuple(tensor.shape)
                        raise ModelLoadError(f"tensor {name} has shape {shape} but config.json implies {expected}")
                    if attr in module._buffers:
                        module._buffers[attr] = tensor
                    else:
                        setattr(module, attr, nn.Parameter(tensor, requires_grad=False))
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
        try:
            module.set_compensation(attr, tensor)
        except ValueError as exc:
            raise ModelLoadError(f"tensor {name}: {exc}; the compensation file does not match the model") from None


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


def _build_and_load(model_cls, config, model_dir: Path, device, dtype, expert_device=None) -> CausalLM:
    files = weight_files(model_dir)
    with torch.device("meta"):
        model = model_cls(config)
    if config.quantization is not None:
        swap_awq_linears(model, config.quantization, "lm_head.qweight" in tensor_names(files))
        if (model_dir / COMPENSATION_FILE).is_file():
            files.append(model_dir / COMPENSATION_FILE)
    load_weights(model, files, device, dtype, expert_device)
    model.dtype = dtype
    model.eval()
    return model


def _log_loaded(model, config, model_dir: Path, device: torch.device, dtype: torch.dtype, detail: str = "") -> None:
    kind = f"AWQ INT4 g{config.quantization.group_size}" if config.quantization else str(dtype)
    summary = model.weight_report.summary()
    log.info(
        "loaded %s (%s, %s) on %s in %s%s: %s", model_dir, config.architecture, kind, device, dtype, detail, summary
    )


def load_model(
    model_dir: Path, device: torch.device, dtype: torch.dtype | None = None, *, fuse=False, batch_invariant=False
) -> tuple[CausalLM, ModelConfig]:
    """The checkpoint's model and config, `weight_report` and `weight_bytes` set; `fuse` q/k/v and
    gate/up into one projection each, `batch_invariant` kernels (dense models only)."""
    model_dir = Path(model_dir)
    raw = read_raw_config(model_dir)
    if raw is not None and is_deepseek_v2(raw):
        return load_deepseek_v2(model_dir, device, dtype)
    config, _ = load_model_config(model_dir)
    # Turing (the 4 GB cards we target) has no BF16: compute in FP16 on CUDA.
    dtype = dtype or (torch.float16 if device.type == "cuda" else torch.float32)
    model = _build_and_load(CausalLM, config, model_dir, device, dtype)
    if fuse:
        fuse_projections(model)
    if batch_invariant:
        num_layers = make_batch_invariant(model)
        log.info("batch-invariant kernels in %d layers: every request decodes as it would alone", num_layers)
    model.count_weights()
    _log_loaded(model, config, model_dir, device, dtype)
    return model, config


def load_deepseek_v2(
    model_dir: str | Path,
    device: torch.device | str,
    dtype: torch.dtype | None = None,
    *,
    max_cached_experts: int | None = None,
    profile: Profile | None = None,
    held_bytes: int = 0,
) -> tuple[DeepseekV2ForCausalLM, DeepseekV2Config]:
    """A DeepSeek-V2 checkpoint. `max_cached_experts`: routed experts per MoE layer kept on the
    device, the rest read straight into host memory (None: all on the device); on CUDA `profile`
    sizes it when not given, less `held_bytes` the process already holds."""
    model_dir, device = Path(model_dir), torch.device(device)
    raw = read_raw_config(model_dir)
    if raw is None:
        raise ModelLoadError(f"cannot read {model_dir / 'config.json'}; pass a Hugging Face model directory")
    config = DeepseekV2Config.from_dict(raw, str(model_dir / "config.json"))
    dtype = dtype or (torch.float16 if device.type == "cuda" else torch.float32)
    if max_cached_experts is None and profile is not None and device.type == "cuda" and config.num_routed_experts:
        sizes = (torch.finfo(dtype).bits // 8, min(profile.max_model_len, config.max_position_embeddings))
        max_cached_experts = plan_expert_cache(
            config, profile, *sizes, device_type="cuda", model_dir=model_dir, held_bytes=held_bytes
        )
    is_offloaded = max_cached_experts is not None and max_cached_experts < config.num_routed_experts
    model = _build_and_load(
        DeepseekV2ForCausalLM, config, model_dir, device, dtype, torch.device("cpu") if is_offloaded else None
    )
    # Absorption multiplies by kv_b_proj's weight as a matrix: INT4 ones are dequantized once.
    for layer in model.model.layers:
        linear = layer.self_attn.kv_b_proj
        if isinstance(linear, AwqLinear):
            if linear.has_compensation:
                raise UnsupportedModelError("residual compensation on kv_b_proj is not supported for DeepSeek-V2")
            weight = dequantize_awq(linear.qweight, linear.qzeros, linear.scales, linear.group_size, dtype)  # [K, N]
            dense = nn.Linear(linear.in_features, linear.out_features, bias=False, device="meta")
            dense.weight = nn.Parameter(weight.t().contiguous(), requires_grad=False)  # [N, K]
            layer.self_attn.kv_b_proj = dense
    if is_offloaded:
        model.offload_experts(max_cached_experts)  # counts the weights too
    else:
        model.count_weights()
    cached = model.num_cached_experts
    where = f"{cached} of {config.num_routed_experts} routed experts per layer" if cached else "every routed expert"
    _log_loaded(model, config, model_dir, device, dtype, f", {where} on the device")
    return model, config
