"""Which path a kernel wrapper runs: the Triton kernel or its plain-torch reference.

Triton runs on CUDA tensors, and on CPU tensors under TRITON_INTERPRET=1 (how CI
checks the kernels). The choice is logged once per kernel and path.
"""

import logging
import os

import torch

try:
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:  # Windows and macOS wheels of torch ship without Triton
    HAS_TRITON = False

logger = logging.getLogger("lowvram.kernels")
_logged_paths: set[str] = set()
# SMs the kernels size their grids for, by CUDA device index, where work runs on a slice of
# the GPU's SMs (lowvram.sm_slice); a device not here sizes them for all of its own.
_sm_limits: dict[int, int] = {}


def set_sm_limit(device_index: int, num_sms: int | None) -> None:
    """Size the kernels' grids on CUDA device `device_index` for `num_sms` SMs (None: the GPU's own count)."""
    if num_sms is None:
        _sm_limits.pop(device_index, None)
    else:
        _sm_limits[device_index] = num_sms


def sm_limit(device: torch.device) -> int | None:
    """The SM count set by `set_sm_limit` for `device`, None where there is none."""
    if device.type != "cuda" or not _sm_limits:
        return None
    return _sm_limits.get(device.index if device.index is not None else torch.cuda.current_device())


def use_triton(kernel_name: str, device: torch.device, use_reference: bool) -> bool:
    if use_reference or not HAS_TRITON:
        path = "reference"
    elif device.type == "cuda" or (device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"):
        path = "triton"
    else:
        path = "reference"
    key = f"{kernel_name}:{path}"
    if key not in _logged_paths:
        _logged_paths.add(key)
        logger.info("%s: using the %s path (%s tensors)", kernel_name, path, device.type)
    return path == "triton"
