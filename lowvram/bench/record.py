"""What every benchmark record carries: the commit, the machine, the date, the versions,
and the card's own copy bandwidth.

An achieved GB/s figure means little without the ceiling of the card it ran on, so the
copy bandwidth is measured on the spot (one large device-to-device copy, bytes read plus
bytes written over its median time) rather than taken from a datasheet. Measure it
before a memory cap is applied: the copy needs two buffers of `num_bytes`.
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

DEFAULT_COPY_BYTES = 2 * 2**30
NUM_COPY_WARMUPS = 2
NUM_COPY_REPEATS = 10
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


def gpu_name(device: torch.device | str | int | None = None) -> str | None:
    """The CUDA card's name, or None without CUDA."""
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_name(device)


def utc_now() -> str:
    """The current time in UTC, ISO 8601 to the second."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _package_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def versions() -> dict[str, str | None]:
    """Versions of what decides speed: Python, torch and its CUDA, Triton, transformers."""
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": _package_version("triton"),
        "transformers": _package_version("transformers"),
    }


def hold_stream() -> None:
    """Keep the current CUDA stream busy for HOLD_CYCLES, so that a start event recorded after it
    is reached only once the host has submitted the work that follows: the time between the
    events is then the GPU's alone, without the host's submission of a kernel or a CUDA graph
    (several microseconds, which a graph of one call would count in full)."""
    torch.cuda._sleep(HOLD_CYCLES)


def measure_copy_bandwidth_gbps(
    num_bytes: int = DEFAULT_COPY_BYTES, device: torch.device | str | None = None, num_repeats: int = NUM_COPY_REPEATS
) -> float:
    """Bytes read plus bytes written per second (in GB/s, 1e9) by one copy of `num_bytes`.

    device: "cuda" (default when there is a GPU) or "cpu". On CUDA each copy is timed with
    events; the median of `num_repeats` is taken so one slow copy on a shared card does not
    decide it. Buffers much larger than the caches make this the memory's own bandwidth.
    """
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(NUM_COPY_WARMUPS):
        dst.copy_(src)
    times_s = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(num_repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            hold_stream()
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            times_s.append(start.elapsed_time(end) / 1000)
    else:
        for _ in range(num_repeats):
            start_s = time.perf_counter()
            dst.copy_(src)
            times_s.append(time.perf_counter() - start_s)
    del src, dst
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return 2 * num_bytes / statistics.median(times_s) / 1e9


def run_metadata(command: str) -> dict:
    """The fields every record starts with: command, date, commit, GPU (None on the CPU), versions."""
    return {
        "command": command,
        "date": utc_now(),
        "git_commit": git_commit(),
        "gpu": gpu_name(),
        "machine": f"{platform.machine()} {platform.system()}",
        "versions": versions(),
    }
