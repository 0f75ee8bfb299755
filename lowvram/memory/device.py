"""Choosing the device and compute dtype, and emulating a smaller card."""

from __future__ import annotations

import logging

import torch

from lowvram.config import Profile
from lowvram.errors import ConfigError

log = logging.getLogger("lowvram")
GIB = 2**30
_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def pick_device(requested: str) -> torch.device:
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if requested == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            "device = 'cuda' but no CUDA GPU is visible to torch; use --device cpu or install a CUDA build of torch"
        )
    if requested not in ("cuda", "cpu"):
        raise ConfigError(f"device = {requested!r} is not allowed; use auto, cuda or cpu")
    return torch.device(requested)


def pick_dtype(requested: str, device: torch.device) -> torch.dtype:
    if requested == "auto":
        return torch.float16 if device.type == "cuda" else torch.float32
    if requested not in _DTYPES:
        raise ConfigError(f"dtype = {requested!r} is not allowed; use auto, float16, bfloat16 or float32")
    if requested == "float16" and device.type == "cpu":
        raise ConfigError("dtype = 'float16' is slow and inexact on the CPU; use float32 or bfloat16 there")
    return _DTYPES[requested]


def apply_emulation(profile: Profile, device: torch.device) -> None:
    """Cap torch's allocator so a large card runs out of memory where the profile's card would."""
    if profile.emulate_vram_gib is None:
        return
    if device.type != "cuda":
        log.warning(
            "--emulate-vram-gib %g is ignored: it shrinks a CUDA GPU, and this runs on the CPU",
            profile.emulate_vram_gib,
        )
        return
    if device.index is None:  # set_per_process_memory_fraction needs an indexed device
        device = torch.device("cuda", torch.cuda.current_device())
    total = torch.cuda.get_device_properties(device).total_memory
    fraction = profile.emulate_vram_gib * GIB / total
    if fraction > 1.0:
        raise ConfigError(
            f"emulate_vram_gib = {profile.emulate_vram_gib} is larger than this card ({total / GIB:.1f} GiB); "
            "emulation can only make a card smaller"
        )
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    cap = (profile.emulate_vram_gib, fraction, total / GIB)
    log.info("emulating a %.1f GiB card: torch allocator capped at %.3f of %.1f GiB", *cap)


SMALL_MODEL_PARAMS = 50_000_000


def tune_cpu_threads(device: torch.device, num_params: int) -> None:
    """Run small models on one CPU thread: waking other threads costs far more than a small
    matrix's work (64x160 linear: 0.25 ms on 2 threads, 0.012 ms on one)."""
    if device.type == "cpu" and num_params < SMALL_MODEL_PARAMS and torch.get_num_threads() != 1:
        log.info("small model on the CPU: using one thread")
        torch.set_num_threads(1)
