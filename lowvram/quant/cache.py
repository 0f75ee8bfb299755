"""AWQ INT4 copies made on demand (`lowvram chat --quantize`, `lowvram pull --quantize`): each is made once
and kept under the user's data dir, named '<model>-awq-g<group>-f<fp16 MiB>-r<rank>-<source fingerprint>',
so the profile's settings and the exact source weights pick the copy, and `lowvram list` can tell which
cached model a copy came from by the fingerprint at the end of its name."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from lowvram.paths import model_identity, user_data_dir


def quantized_copy(
    model: str | None,
    profile: str | None = None,
    *,
    device: str = "auto",
    num_samples: int = 128,
    label: str | None = None,
    on_stage: Callable[[str], None] = lambda text: None,
) -> Path:
    """An AWQ INT4 copy of `model` (directory, GGUF file or hub id), made now unless made before; an AWQ
    checkpoint is returned as it is. The profile's fp16_budget_mib and compensation_rank choose the FP16
    layers and the residual's rank."""
    from lowvram.config import load_profile
    from lowvram.models.config import load_model_config
    from lowvram.models.loader import resolve_model_path
    from lowvram.quant.quantize import default_group_size, quantize_model

    label = label or model or "the bundled demo model"
    model_dir = resolve_model_path(model)
    config, _ = load_model_config(model_dir)
    if config.quantization is not None:
        on_stage(f"{label} is already AWQ INT4")
        return model_dir
    profile = load_profile(profile)
    group_size = default_group_size(config)
    settings = f"awq-g{group_size}-f{profile.fp16_budget_mib}-r{profile.compensation_rank}"
    # a hub snapshot's folder is its commit hash: name the copy after the repository instead
    is_snapshot = model_dir.parent.name == "snapshots"
    name = model_dir.parent.parent.name.removeprefix("models--") if is_snapshot else model_dir.name
    root = user_data_dir("quantized")
    identity = model_identity(model_dir)[:12]
    made = sorted(root.glob(f"*-{settings}-{identity}")) if root.is_dir() else []
    if made and (made[0] / "config.json").is_file():
        on_stage(f"using the AWQ INT4 copy made earlier: {made[0]}")
        return made[0]
    out = root / f"{name}-{settings}-{identity}"
    root.mkdir(parents=True, exist_ok=True)
    on_stage(f"quantizing {label} to AWQ INT4 (once; kept in {out}): {quantize_time_text(config, num_samples, device)}")
    quantize_model(
        model_dir,
        out,
        group_size=group_size,
        fp16_budget_mib=profile.fp16_budget_mib,
        rank=profile.compensation_rank,
        num_samples=num_samples,
        device=device,
        on_layer=lambda done, total: on_stage(f"quantizing: layer {done} of {total}"),
    )
    return out


def quantize_time_text(config, num_samples: int, device: str) -> str:
    """'roughly N min on the CPU' (or on a small GPU): what quantizing will take, said before it starts."""
    import torch

    on_cpu = device == "cpu" or (device == "auto" and not torch.cuda.is_available())
    # Rough rates (parameters x calibration blocks per second): 2 CPU cores, a GTX 1650-class card
    minutes = config.num_params() * num_samples / (2e7 if on_cpu else 5e7) / 60
    return f"roughly {max(1, round(minutes))} min {'on the CPU' if on_cpu else 'on a small GPU'}"
