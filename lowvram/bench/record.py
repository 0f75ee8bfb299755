"""What every benchmark record carries: the commit, the machine, the date, the versions, and
the card's copy bandwidth, measured on the spot (a GB/s figure means little without the ceiling
of the card it ran on); measure it before a memory cap: the copy needs two buffers.
"""

from __future__ import annotations

import platform
import statistics
import subprocess
import time
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

import torch

# GPU clock cycles (25-100 µs) a stream is kept busy before a timed launch (hold_stream).
HOLD_CYCLES = 100_000


def git_commit(short: bool = False) -> str:
    """The commit of the checkout lowvram runs from, or "unknown" outside a git checkout."""
    command = ["git", "rev-parse", "--short", "HEAD"] if short else ["git", "rev-parse", "HEAD"]
    try:
        # Asked from the package's own folder: the caller's working directory may be any repository.
        result = subprocess.run(
            command, capture_output=True, text=True, timeout=10, check=False, cwd=Path(__file__).resolve().parent
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return result.stdout.strip() if result.returncode == 0 and result.stdout.strip() else "unknown"


def hold_stream() -> None:
    """Keep the current CUDA stream busy for HOLD_CYCLES, so that a start event recorded next is
    reached only once the host has submitted what follows: the events then time the GPU alone."""
    torch.cuda._sleep(HOLD_CYCLES)


def measure_copy_bandwidth_gbps(
    num_bytes: int = 2 * 2**30, device: torch.device | str | None = None, num_repeats: int = 10
) -> float:
    """Bytes read plus written per second (GB/s, 1e9) by one copy of `num_bytes` on `device`
    (default: CUDA when there is a GPU): the median of `num_repeats` copies, timed with events
    on CUDA, so one slow copy on a shared card does not decide it."""
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(2):  # warm-up
        dst.copy_(src)
    times_s = []
    for _ in range(num_repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            hold_stream()
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            times_s.append(start.elapsed_time(end) / 1000)
        else:
            start_s = time.perf_counter()
            dst.copy_(src)
            times_s.append(time.perf_counter() - start_s)
    del src, dst
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return 2 * num_bytes / statistics.median(times_s) / 1e9


def run_metadata(command: str) -> dict:
    """The fields every record starts with: command, date (UTC), commit, GPU (None on the CPU),
    and the versions of what decides speed."""
    versions = {}
    for name in ("triton", "transformers"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return {
        "command": command,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "git_commit": git_commit(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "machine": f"{platform.machine()} {platform.system()}",
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            **versions,
        },
    }
