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
