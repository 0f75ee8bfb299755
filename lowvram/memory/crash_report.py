"""Crash reports: what a run knew about memory when it failed, as one JSON file (format:
CrashReport.to_json, docs/doctor.md) that `lowvram doctor --oom FILE` explains."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import shlex
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from lowvram.errors import ConfigError, LowvramError
from lowvram.paths import user_data_dir

CRASH_REPORT_FORMAT = "lowvram-crash-report"
CRASH_REPORT_VERSION = 1
# Exit status of a command that stopped on a CUDA out-of-memory error.
EXIT_OUT_OF_MEMORY = 3
MAX_LARGEST_BLOCKS = 16


@dataclass
class CrashReport:
    exception_text: str
    profile: dict = field(default_factory=dict)
    model: dict = field(default_factory=dict)
    memory: dict = field(default_factory=dict)
    controller_events: list[dict] = field(default_factory=list)
    command: str | None = None
    created_utc: str = ""
    lowvram_version: str = ""
    torch_version: str | None = None

    def to_json(self) -> dict:
        return {"format": CRASH_REPORT_FORMAT, "version": CRASH_REPORT_VERSION} | dataclasses.asdict(self)


def default_crash_report_dir() -> Path:
    return user_data_dir("crash-reports")


def write_crash_report(
    path: str | os.PathLike | None,
    *,
    profile: Any,
    model: Any,
    memory: dict,
    controller_events: list[dict] | tuple = (),
    exception_text: str,
    command: str | None = None,
) -> Path:
    """Write a crash report and return its path. path: a file, a directory, or None for
    default_crash_report_dir(). profile: a Profile, its dict or a profile name. model: a
    model directory (its config.json is copied in), a {"path", "config"} dict, or None for
    the bundled demo model. memory: sizes (keys ending in `_bytes`) and short facts."""
    import torch

    import lowvram
    from lowvram.config import load_profile
    from lowvram.demo import DEMO_MODEL_DIR
    from lowvram.models.checkpoint import read_raw_config

    if dataclasses.is_dataclass(profile):
        profile = dataclasses.asdict(profile)
    elif profile is not None and not isinstance(profile, dict):
        try:
            profile = dataclasses.asdict(load_profile(str(profile)))
        except LowvramError:
            profile = {"name": str(profile)}
    if model is None and (DEMO_MODEL_DIR / "config.json").is_file():
        model = DEMO_MODEL_DIR
    if model is not None and not isinstance(model, dict):
        model = {"path": str(model), "config": read_raw_config(Path(str(model)).expanduser())}
    now = datetime.now(timezone.utc)
    report = CrashReport(
        exception_text=str(exception_text),
        profile=dict(profile or {}),
        model=dict(model or {"path": None, "config": None}),
        memory=dict(memory),
        controller_events=list(controller_events),
        command=command,
        created_utc=now.strftime("%Y-%m-%dT%H:%M:%SZ"),
        lowvram_version=lowvram.__version__,
        torch_version=torch.__version__,
    )
    target = Path(path).expanduser() if path is not None else default_crash_report_dir()
    if path is None or target.is_dir():
        target = target / f"crash-{now.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.json"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(report.to_json(), indent=2, default=str) + "\n")
    return target


def crash_report_from_dict(data: Any, source: str = "crash report") -> CrashReport:
    """Validate a parsed crash report; ConfigError names what is wrong."""
    if not isinstance(data, dict) or data.get("format") != CRASH_REPORT_FORMAT:
        raise ConfigError(f'{source} is not a lowvram crash report (no "format": "{CRASH_REPORT_FORMAT}")')
    version = data.get("version")
    if not isinstance(version, int) or version > CRASH_REPORT_VERSION:
        raise ConfigError(
            f"{source} has crash-report version {version!r}; this lowvram reads up to "
            f"{CRASH_REPORT_VERSION}: update lowvram"
        )
    kinds = {"profile": dict, "model": dict, "memory": dict, "controller_events": list, "exception_text": str}
    for key, kind in kinds.items():
        if not isinstance(data.get(key), kind):
            got = type(data.get(key)).__name__
            raise ConfigError(f"{source}: field {key!r} must be a JSON {kind.__name__}, got {got}")
    return CrashReport(
        **{key: data[key] for key in kinds},
        command=data.get("command"),
        created_utc=str(data.get("created_utc", "")),
        lowvram_version=str(data.get("lowvram_version", "")),
        torch_version=data.get("torch_version"),
    )


_CUDA_STATS = {
    "allocated_bytes.all.current": "allocated_bytes",
    "allocated_bytes.all.peak": "peak_allocated_bytes",
    "reserved_bytes.all.current": "reserved_bytes",
    "reserved_bytes.all.peak": "peak_reserved_bytes",
    "num_ooms": "num_ooms",
    "num_alloc_retries": "num_alloc_retries",
}


def is_cuda_oom(exc: BaseException) -> bool:
    """A device out-of-memory from torch, the CUDA runtime or cuBLAS."""
    import torch

    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return True
    markers = ("out of memory", "CUBLAS_STATUS_ALLOC_FAILED", "cudaErrorMemoryAllocation")
    return isinstance(exc, RuntimeError) and any(marker in str(exc) for marker in markers)


def write_oom_crash_report(
    exc: BaseException,
    *,
    profile: Any = None,
    model: Any = None,
    engine: Any = None,
    controller_events: list[dict] | tuple = (),
    command: str | None = None,
    path: str | os.PathLike | None = None,
) -> Path:
    """Write a crash report for an out-of-memory exception that was just caught: torch's
    view of device memory (totals, peaks, the largest live blocks) and what the engine,
    if any, planned and had in use."""
    import torch

    memory: dict[str, Any] = {}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        device = torch.cuda.current_device()
        memory["device_name"] = torch.cuda.get_device_name(device)
        stats = torch.cuda.memory_stats(device)
        memory |= {name: int(stats[key]) for key, name in _CUDA_STATS.items() if key in stats}
        try:  # the card may be too full even to answer these; the report is written without them
            free, total = torch.cuda.mem_get_info(device)
            memory.update(device_free_bytes=int(free), device_total_bytes=int(total))
            blocks = [
                block["size"]
                for segment in torch.cuda.memory_snapshot()
                for block in segment.get("blocks", [])
                if block.get("state") == "active_allocated"
            ]
            memory["largest_live_blocks_bytes"] = sorted(blocks, reverse=True)[:MAX_LARGEST_BLOCKS]
        except Exception:
            pass
    if engine is not None:
        plan = engine.kv_plan
        memory.update(
            weight_bytes=engine.model.weight_bytes,
            kv_pool_bytes=plan.kv_bytes,
            kv_num_blocks=plan.num_blocks,
            kv_block_size=plan.block_size,
            kv_bytes_per_token=plan.bytes_per_token,
            workspace_reserve_bytes=plan.activation_bytes,
            budget_bytes=plan.budget_bytes,
            max_model_len=engine.max_model_len,
            kv_precision=engine.kv_precision,
            device_type=engine.device.type,
        )
        if hasattr(engine, "block_manager"):  # an out-of-memory while the pool was allocated leaves none
            # Pages cached for reuse (prefix caching) are reclaimable: evicted on demand, not "used".
            memory.update(
                kv_bytes_in_use=engine.kv_bytes_in_use(),
                kv_blocks_in_use=engine.block_manager.num_used_blocks,
                kv_blocks_cached_reclaimable=engine.block_manager.num_cached_blocks,
            )
        profile, model = engine.profile, engine.model_dir
    if command is None and sys.argv:
        command = "lowvram " + shlex.join(sys.argv[1:])
    exception_text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    return write_crash_report(
        path,
        profile=profile,
        model=model,
        memory=memory,
        controller_events=controller_events,
        exception_text=exception_text,
        command=command,
    )


def format_doctor_hint(path: str | os.PathLike) -> str:
    """The lines a run prints after writing a crash report."""
    return (
        f"lowvram: out of device memory; crash report written to {path}\n"
        f"lowvram: to see what held the memory and what to change, run:\n"
        f"    lowvram doctor --oom {shlex.quote(str(path))}"
    )


def report_cuda_oom(command: Callable[[Any], int]) -> Callable[[Any], int]:
    """Decorate a CLI command: a CUDA out-of-memory error becomes a crash report, the doctor
    command on stderr and exit status 3 instead of a traceback. The engine is found among
    the traceback's locals (an engine, or an object holding one as `.engine`); the argparse
    namespace supplies `profile` and `model` when the engine was not built yet."""

    @functools.wraps(command)
    def run(args) -> int:
        from lowvram.config import load_profile

        try:
            return command(args)
        except Exception as exc:
            if not is_cuda_oom(exc):
                raise
            overrides = {
                name: getattr(args, name, None) for name in ("device", "dtype", "emulate_vram_gib", "max_model_len")
            }
            try:
                profile = load_profile(getattr(args, "profile", None)).replace(**overrides)
            except LowvramError:
                profile = getattr(args, "profile", None)
            candidates = (
                candidate
                for frame, _ in traceback.walk_tb(exc.__traceback__)
                for value in list(frame.f_locals.values())
                for candidate in (value, getattr(value, "engine", None))
            )
            engine = next((c for c in candidates if hasattr(c, "kv_plan") and hasattr(c, "model_dir")), None)
            path = write_oom_crash_report(exc, profile=profile, model=getattr(args, "model", None), engine=engine)
            print(format_doctor_hint(path), file=sys.stderr)
            return EXIT_OUT_OF_MEMORY

    return run
