"""Arrival counters of the W4A16 split-K: the last program of a column block to count in adds
the partials and resets the counter, so counters are zero between launches and one buffer per
device serves every layer and graph replay (one such kernel in flight per device: the engine
runs on one stream). Buffers are made outside CUDA-graph capture only (the eager warm-up makes
them); a replaced buffer stays alive, as graphs captured with it still point at it.
"""

from __future__ import annotations

import torch

from lowvram.errors import KernelError


class ArrivalCounters:
    """Per-device zeroed int32 counters; `user` names the kernel in errors, requests above
    `min_size` round up to a power of two."""

    def __init__(self, user: str, min_size: int):
        self.user = user
        self.min_size = min_size
        self.by_device: dict[torch.device, torch.Tensor] = {}
        self.replaced: list[torch.Tensor] = []

    def get(self, device: torch.device, num_counters: int) -> torch.Tensor:
        """At least `num_counters` counters; KernelError if they must be made during capture."""
        counters = self.by_device.get(device)
        if counters is not None and counters.numel() >= num_counters:
            return counters
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise KernelError(
                f"{self.user} needs {num_counters} arrival counters on {device} but has "
                f"{0 if counters is None else counters.numel()}, and they cannot be made during CUDA-graph "
                f"capture; run the step once eagerly before capturing it"
            )
        if counters is not None:
            self.replaced.append(counters)
        size = max(self.min_size, 1 << max(0, num_counters - 1).bit_length())
        counters = torch.zeros(size, dtype=torch.int32, device=device)
        self.by_device[device] = counters
        return counters
