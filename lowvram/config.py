"""Profiles: the card lowvram plans for (memory and token budgets, KV layout, controller
thresholds), a validated dataclass fed from `profiles/*.yaml` or a user's YAML file."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from lowvram.errors import ConfigError


@dataclass
class ControllerConfig:
    """Thresholds of the feedback controller (memory as fractions of the budget)."""

    memory_high_water: float = 0.90
    memory_low_water: float = 0.75
    latency_high_ms: float = 120.0
    latency_low_ms: float = 60.0
    patience_tokens: int = 3
    cooldown_steps: int = 32
    is_enabled: bool = True


@dataclass
class Profile:
    """Everything lowvram needs to know about the card it plans for."""

    name: str = "custom"
    description: str = ""
    device: str = "auto"
    dtype: str = "auto"
    memory_budget_gib: float = 4.0
    memory_utilization: float = 0.90
    emulate_vram_gib: float | None = None
    max_model_len: int = 4096
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 2048
    kv_block_size: int = 16
    kv_precision: str = "auto"
    kv_recent_fp16_tokens: int = 64
    kv_backend: str = "auto"
    host_spill_gib: float = 8.0
    allow_oversubscription: bool = False
    enable_prefix_caching: bool = True
    enable_cuda_graphs: bool = True
    enable_prefill_graphs: bool = False
    pipelined_decode: bool = True
    embeddings_on_host: bool = False
    batch_invariant: bool = False
    weight_format: str = "auto"
    fp16_budget_mib: int = 64
    compensation_rank: int = 16
    weight_offload: str = "auto"
    max_resident_layers: int | None = None
    controller: ControllerConfig = field(default_factory=ControllerConfig)

    @property
    def memory_budget_bytes(self) -> int:
        return int(self.memory_budget_gib * self.memory_utilization * 2**30)

    def replace(self, **changes: Any) -> Profile:
        """A validated copy with some fields changed (e.g. from CLI flags)."""
        data = dataclasses.asdict(self)
        for key, value in changes.items():
            if value is not None:
                data[key] = dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value
        return profile_from_dict(data, source=f"profile '{self.name}'")


FIELD_DOCS: dict[str, str] = {
    "name": "Profile name shown in logs and the UI.",
    "description": "One line on the card this profile is for.",
    "device": "Where to run: auto (CUDA if present, else CPU), cuda or cpu.",
    "dtype": "Compute dtype: auto (float16 on CUDA, float32 on CPU), float16, bfloat16 or float32.",
    "memory_budget_gib": "Device memory lowvram may plan for, in GiB (the card's size on a dedicated card).",
    "memory_utilization": "Fraction of the budget used for weights, KV and workspace (0.3-1.0); the rest is headroom.",
    "emulate_vram_gib": "Make a larger card behave like one of this size: caps torch's allocator and the KV pool (null = off).",
    "max_model_len": "Longest context (prompt + output) a request may have, in tokens.",
    "max_num_seqs": "Most sequences decoded together in one step.",
    "max_num_batched_tokens": "Most tokens processed in one step (bounds prefill activation memory).",
    "kv_block_size": "Tokens per KV page (8, 16, 32 or 64).",
    "kv_precision": "KV page precision: fp16, int8, int4, or auto (start at fp16; the controller compresses under pressure).",
    "kv_recent_fp16_tokens": "Tokens at the end of each sequence whose KV stays FP16 under INT8/INT4 (0 = off).",
    "kv_backend": "Where KV pages live: um (CUDA unified memory), pinned (device + pinned host tier), device, or auto.",
    "host_spill_gib": "Host RAM the KV pool may spill pages to, in GiB.",
    "allow_oversubscription": "Allow unified-memory pages beyond the free device memory (true only on a dedicated card).",
    "enable_prefix_caching": "Reuse the KV pages of a shared prompt prefix (earlier chat turns) instead of recomputing them.",
    "enable_cuda_graphs": "Replay decode steps from CUDA graphs on CUDA devices (false = eager launches, for debugging).",
    "enable_prefill_graphs": "Also replay one-prompt prefills up to 512 tokens from CUDA graphs (sooner first token).",
    "pipelined_decode": "On CUDA, queue each decode step before the host has read the previous one's tokens, so "
    "the host's work overlaps the GPU's (steps with penalties, prefills and admissions run alone).",
    "embeddings_on_host": "Untied token embeddings in pinned host memory, read over the bus (frees 0.43 GiB at 1.5B).",
    "batch_invariant": "Same logits to the bit alone or batched (output ignores the load); slower, KV stays FP16.",
    "weight_format": "Weight format: awq (INT4), fp16, or auto (as the checkpoint is stored).",
    "fp16_budget_mib": "Device memory for layers kept in FP16 when quantizing, in MiB.",
    "compensation_rank": "Rank of the low-rank residual that corrects INT4 error (0 = off).",
    "weight_offload": "Decoder layers in host memory: auto (on CUDA when the weights do not fit), off, stream "
    "(the layers that do not fit are copied in every step), or cpu (their MLPs run on the CPU).",
    "max_resident_layers": "With weight offload: most layers kept on the device (null = as many as fit).",
    "controller": "Feedback controller thresholds (see the controller.* fields).",
    "controller.memory_high_water": "Fraction of the budget above which the controller starts relieving memory.",
    "controller.memory_low_water": "Fraction of the budget below which the controller relaxes again.",
    "controller.latency_high_ms": "Per-token decode latency (ms) above which the controller shrinks the batch.",
    "controller.latency_low_ms": "Per-token decode latency (ms) below which the controller relaxes again.",
    "controller.patience_tokens": "Consecutive tokens over a threshold before the controller acts.",
    "controller.cooldown_steps": "Steps below the low-water marks before the controller relaxes one level.",
    "controller.is_enabled": "Turn the controller on or off.",
}


# Allowed values: choices, or an inclusive (low, high) range (integers for `int` fields; `| None` admits null).
CHOICES: dict[str, tuple] = {
    "device": ("auto", "cuda", "cpu"),
    "dtype": ("auto", "float16", "bfloat16", "float32"),
    "kv_block_size": (8, 16, 32, 64),
    "kv_precision": ("fp16", "int8", "int4", "auto"),
    "kv_backend": ("um", "pinned", "device", "auto"),
    "weight_format": ("awq", "fp16", "auto"),
    "weight_offload": ("auto", "off", "stream", "cpu"),
}
RANGES: dict[str, tuple[float, float]] = {
    "memory_budget_gib": (0.25, 4096),
    "memory_utilization": (0.3, 1.0),
    "emulate_vram_gib": (0.25, 4096),
    "max_model_len": (16, 1 << 22),
    "max_num_seqs": (1, 1024),
    "max_num_batched_tokens": (16, 1 << 20),
    "kv_recent_fp16_tokens": (0, 1 << 20),
    "host_spill_gib": (0, 4096),
    "fp16_budget_mib": (0, 1 << 20),
    "compensation_rank": (0, 1024),
    "max_resident_layers": (0, 1 << 16),
    "controller.memory_high_water": (0.05, 1.0),
    "controller.memory_low_water": (0.05, 1.0),
    "controller.latency_high_ms": (0.01, 1e6),
    "controller.latency_low_ms": (0.01, 1e6),
    "controller.patience_tokens": (1, 10_000),
    "controller.cooldown_steps": (0, 1_000_000),
}


def _check_fields(obj, source: str, prefix: str = "") -> None:
    """Check every field of a Profile or ControllerConfig against its type, CHOICES and RANGES."""
    for f in dataclasses.fields(obj):
        name, value, kind = prefix + f.name, getattr(obj, f.name), f.type
        if value is None and kind.endswith("| None"):
            continue
        if name in CHOICES and value not in CHOICES[name]:
            allowed = ", ".join(str(c) for c in CHOICES[name])
            raise ConfigError(f"{source}: {name} = {value!r} is not allowed; use one of: {allowed}")
        if kind == "bool" and not isinstance(value, bool):
            raise ConfigError(f"{source}: {name} = {value!r} must be true or false")
        if kind == "str" and not isinstance(value, str):
            raise ConfigError(f"{source}: {name} must be a string")
        if name in RANGES:
            low, high = RANGES[name]
            is_int = kind.startswith("int")
            is_number = isinstance(value, int) if is_int else isinstance(value, (int, float))
            if isinstance(value, bool) or not is_number or (not is_int and not math.isfinite(value)):
                raise ConfigError(
                    f"{source}: {name} = {value!r} must be {'an integer' if is_int else 'a number'} "
                    f"between {low} and {high}"
                )
            if not low <= value <= high:
                raise ConfigError(f"{source}: {name} = {value!r} is out of range; allowed: {low} to {high}")


def _build(cls, data: dict, source: str, prefix: str = ""):
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: {prefix.rstrip('.') or 'the profile'} must be a mapping of field: value")
    known = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ConfigError(
            f"{source}: unknown field {prefix}{unknown[0]!r}; known fields: {', '.join(prefix + k for k in known)}"
        )
    if cls is Profile and "controller" in data:
        data = {**data, "controller": _build(ControllerConfig, data["controller"] or {}, source, "controller.")}
    return cls(**data)


def profile_from_dict(data: dict, source: str = "profile") -> Profile:
    """A Profile from YAML data; ConfigError names the first bad field, its value and what is allowed."""
    p = _build(Profile, data, source)
    if p.weight_offload is False:  # YAML reads a bare `off` as false
        p.weight_offload = "off"
    if not isinstance(p.name, str) or not p.name:
        raise ConfigError(f"{source}: name = {p.name!r} must be a non-empty string")
    _check_fields(p, source)
    _check_fields(p.controller, source, "controller.")
    if p.max_num_batched_tokens < p.max_num_seqs:
        raise ConfigError(
            f"{source}: max_num_batched_tokens = {p.max_num_batched_tokens} is smaller than "
            f"max_num_seqs = {p.max_num_seqs}; it must be at least max_num_seqs so every sequence can decode"
        )
    c = p.controller
    for low, high in (("memory_low_water", "memory_high_water"), ("latency_low_ms", "latency_high_ms")):
        if getattr(c, low) >= getattr(c, high):
            raise ConfigError(
                f"{source}: controller.{low} = {getattr(c, low)} must be below "
                f"controller.{high} = {getattr(c, high)} (the gap is the hysteresis band)"
            )
    return p


def builtin_profile_names() -> list[str]:
    files = resources.files("lowvram.profiles")
    return sorted(p.name[: -len(".yaml")] for p in files.iterdir() if p.name.endswith(".yaml"))


def profiles_markdown() -> str:
    """docs/profiles.md: every field of a profile, what it means, and its value in each built-in
    profile (`lowvram profiles --markdown` writes it; a test keeps the file current)."""
    profiles = [load_profile(name) for name in builtin_profile_names()]
    rows = [dataclasses.asdict(profile) for profile in profiles]

    def value(row: dict, field_name: str) -> str:
        for part in field_name.split("."):
            row = row[part]
        return "" if isinstance(row, dict) else f"`{row}`".replace("|", "\\|")

    lines = [
        "# Profiles",
        "",
        "A profile describes the card lowvram plans for. Pick a built-in one with `--profile NAME`",
        "or pass a YAML file with the same fields (unset fields keep the defaults of `Profile`);",
        "`lowvram profiles --show NAME` prints one in full. This page is generated by",
        "`lowvram profiles --markdown > docs/profiles.md`.",
        "",
        "| profile | for |",
        "|---|---|",
        *(f"| `{profile.name}` | {profile.description} |" for profile in profiles),
        "",
        "| field | meaning | " + " | ".join(f"`{profile.name}`" for profile in profiles) + " |",
        "|---|---|" + "---|" * len(profiles),
    ]
    for field_name, doc in FIELD_DOCS.items():
        if field_name in ("name", "description"):
            continue
        values = " | ".join(value(row, field_name) for row in rows)
        lines.append(f"| `{field_name}` | {doc.replace('|', chr(92) + '|')} | {values} |")
    return "\n".join(lines) + "\n"


def load_profile(name_or_path: str | Path | None = None) -> Profile:
    """A built-in profile by name ('4gb') or a YAML file by path; None: `4gb` with CUDA, `cpu` without."""
    if name_or_path is None:
        import torch

        name_or_path = "4gb" if torch.cuda.is_available() else "cpu"
    text_name = str(name_or_path)
    builtin = builtin_profile_names()
    if text_name in builtin:
        text = resources.files("lowvram.profiles").joinpath(f"{text_name}.yaml").read_text()
        source = f"profile '{text_name}'"
    else:
        path = Path(text_name).expanduser()
        if not (path.suffix in (".yaml", ".yml") or path.exists() or "/" in text_name):
            raise ConfigError(
                f"unknown profile {text_name!r}; built-in profiles: {', '.join(builtin)} (or pass a path to a YAML file)"
            )
        if not path.is_file():
            raise ConfigError(f"profile file {str(path)!r} does not exist; built-in profiles: {', '.join(builtin)}")
        text = path.read_text()
        source = f"profile file {str(path)!r}"
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source} is not valid YAML: {exc}") from None
    if isinstance(data, dict) and "name" not in data:
        data["name"] = Path(text_name).stem
    return profile_from_dict(data, source)
