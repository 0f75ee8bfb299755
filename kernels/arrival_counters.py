"""Arrival counters for kernels whose last program to finish a unit of work adds up the
others' partial results: the W4A16 decode GEMV's split-K (one counter per column block) and
decode attention's merge inside the kernel (one per sequence and KV head).

Each program counts itself in with an acq_rel atomic; the one that sees the count reach the
number of programs does the sum and resets the counter. Counters are therefore zero between
launches, so one buffer per device serves every layer and every replay of a CUDA graph. That
assumes one such kernel in flight per device at a time, as the engine runs its steps on one
stream; two at once on different streams would count into the same slots.

A buffer is made, or grown, outside CUDA-graph capture only: one made during a capture would
live in that graph's private pool. The engine's eager warm-up before each capture makes it.
A buffer replaced by a larger one stays alive: graphs captured with it still point at it.
"""

from __future__ import annotations

import torch

from lowvram.errors import KernelError


class ArrivalCounters:
    """Per-device zeroed int32 counters for one kind of kernel.

    Args:
        user: the kernel, as error messages name it.
        min_size: the smallest buffer made; larger requests round up to a power of two.
    """

    def __init__(self, user: str, min_size: int):
        self.user = user
        self.min_size = min_size
        self.by_device: dict[torch.device, torch.Tensor] = {}
        self.replaced: list[torch.Tensor] = []

    def get(self, device: torch.device, num_counters: int) -> torch.Tensor:
        """The device's counters, at least `num_counters` of them; raises KernelError when they
        would have to be made during a CUDA-graph capture."""
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
