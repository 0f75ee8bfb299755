"""Which path a kernel wrapper runs: Triton on CUDA GPUs from Turing (7.5) on and on CPU tensors
under TRITON_INTERPRET=1 (the tests), else the plain-torch reference; logged once per kernel and path.
"""

import functools
import logging
import os

import torch

try:
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:  # Windows and macOS wheels of torch ship without Triton
    HAS_TRITON = False

logger = logging.getLogger("lowvram.kernels")
IS_INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"
MIN_COMPUTE_CAPABILITY = (7, 5)
# Few enough that CPU tests still split K and the context and so cover the reductions after.
INTERPRETER_NUM_SMS = 4
_logged_paths: set[str] = set()
# SMs to size grids for by CUDA device index, where scripts/lab/sm_slice.py runs on a slice of them.
sm_limits: dict[int, int] = {}


def num_sms(device: torch.device) -> int:
    """The SMs the kernels size their grids for on `device` (INTERPRETER_NUM_SMS off CUDA)."""
    if device.type != "cuda":
        return INTERPRETER_NUM_SMS
    index = device.index if device.index is not None else torch.cuda.current_device()
    return sm_limits.get(index) or _device_sms(index)


@functools.cache
def _device_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.cache
def triton_path(device_type: str, device_index) -> tuple[bool, str]:
    """(whether the Triton kernels run on this device, why) for the log and for error messages."""
    if not HAS_TRITON:
        return False, "triton is not installed"
    if device_type == "cpu":
        return IS_INTERPRETER, "TRITON_INTERPRET=1" if IS_INTERPRETER else "CPU tensors"
    if device_type != "cuda":
        return False, f"no Triton kernels for {device_type} devices"
    if IS_INTERPRETER:
        return False, "TRITON_INTERPRET=1 would run the kernels on the host"
    capability = torch.cuda.get_device_capability(device_index)
    return capability >= MIN_COMPUTE_CAPABILITY, f"compute capability {capability[0]}.{capability[1]} (7.5 or newer)"


def use_triton(kernel_name: str, device: torch.device, use_reference: bool) -> bool:
    """Whether `kernel_name` runs its Triton kernel on `device` (never with use_reference)."""
    is_triton, reason = (False, "reference asked for") if use_reference else triton_path(device.type, device.index)
    key = f"{kernel_name}:{is_triton}:{device}"
    if key not in _logged_paths:
        _logged_paths.add(key)
        logger.info("%s on %s: %s (%s)", kernel_name, device, "Triton kernel" if is_triton else "plain torch", reason)
    return is_triton
