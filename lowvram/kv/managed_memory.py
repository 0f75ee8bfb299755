"""CUDA Unified Memory from Python through cuda-bindings (an optional dependency).

What the KV pool needs from the CUDA runtime, and nothing more: allocate and free
managed memory, see it as a torch tensor, advise where a range should live, migrate
it (prefetch) on a stream, and ask whether the card can oversubscribe.

Facts this module is built on:
- Every cuda-bindings call returns a tuple whose first item is the error code.
- cuda-bindings 13 passes a `cudaMemLocation` (type + id) to `cudaMemAdvise` and
  `cudaMemPrefetchAsync` (prefetch also takes flags); 12.x passes an int device, with
  `cudaCpuDeviceId` (-1) for the host. Which one is in use is read from the
  functions' signatures, once.
- `torch.from_dlpack` rejects managed memory; `torch.as_tensor` on an object that
  exposes `__cuda_array_interface__` accepts it and holds a reference to that object
  until the last view dies, so the object owns the allocation.
- `cudaDevAttrConcurrentManagedAccess` is 0 on Windows and WSL2: no oversubscription,
  no prefetch to the GPU, and the host must not touch managed memory while kernels
  run. The pool uses pinned host pages there instead.
"""

from __future__ import annotations

import functools
import inspect
import logging
import mmap
from dataclasses import dataclass

import torch

from lowvram.errors import ConfigError, KernelError, OutOfMemoryError

log = logging.getLogger("lowvram")
GIB = 2**30

INSTALL_HINT = (
    "kv_backend 'um' needs the cuda-bindings package (pip install cuda-bindings, the version matching "
    "your CUDA driver); or set kv_backend to 'pinned' or 'device' in the profile"
)


def load_runtime():
    """The cuda-bindings runtime module, or ConfigError saying how to get it."""
    try:
        from cuda.bindings import runtime
    except ImportError:
        try:  # cuda-python before 12.6 shipped the same module under another name
            from cuda import cudart as runtime
        except ImportError:
            raise ConfigError(INSTALL_HINT) from None
    return runtime


def has_runtime() -> bool:
    try:
        load_runtime()
    except ConfigError:
        return False
    return True


@functools.cache
def uses_mem_location(function) -> bool:
    """True when `function` (cudaMemAdvise / cudaMemPrefetchAsync) takes a cudaMemLocation
    (cuda-bindings 13), False when it takes an int device (12.x)."""
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):
        # No signature to read: 13.x documents the location form first in its docstring.
        return "cudaMemLocation" in (function.__doc__ or "").split("\n", 1)[0]
    return "location" in parameters


def check(result, what: str):
    """Raise KernelError for a failed call; return the values after the error code."""
    rt = load_runtime()
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != rt.cudaError_t.cudaSuccess:
        name = getattr(err, "name", str(err))
        raise KernelError(f"{what} failed: {name}")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def concurrent_managed_access(device_index: int) -> bool:
    """Whether the GPU and the host may touch managed memory at once (and pages can
    oversubscribe and be prefetched to the GPU): 0 on Windows and WSL2."""
    rt = load_runtime()
    attr = rt.cudaDeviceAttr.cudaDevAttrConcurrentManagedAccess
    return bool(check(rt.cudaDeviceGetAttribute(attr, device_index), "cudaDeviceGetAttribute"))


def mem_get_info(device_index: int) -> tuple[int, int]:
    """(free, total) device bytes as the driver reports them; managed pages resident
    on the GPU count as used, unlike in torch's allocator statistics."""
    rt = load_runtime()
    check(rt.cudaSetDevice(device_index), "cudaSetDevice")
    free_bytes, total_bytes = check(rt.cudaMemGetInfo(), "cudaMemGetInfo")
    return int(free_bytes), int(total_bytes)


@dataclass(frozen=True)
class Location:
    """Where a managed range should live: the GPU `device_index`, or the host (None)."""

    device_index: int | None

    @property
    def is_host(self) -> bool:
        return self.device_index is None


HOST = Location(None)


def _location_args(rt, location: Location):
    """The location argument in the form this cuda-bindings takes it."""
    if not uses_mem_location(rt.cudaMemPrefetchAsync):
        return rt.cudaCpuDeviceId if location.is_host else location.device_index
    loc = rt.cudaMemLocation()
    if location.is_host:
        loc.type = rt.cudaMemLocationType.cudaMemLocationTypeHost
        loc.id = 0
    else:
        loc.type = rt.cudaMemLocationType.cudaMemLocationTypeDevice
        loc.id = location.device_index
    return loc


class ManagedBuffer:
    """One cudaMallocManaged allocation, freed when the last tensor viewing it dies.

    Exposes `__cuda_array_interface__` as a flat uint8 array so `torch.as_tensor`
    can view it; torch keeps this object alive for as long as that tensor lives.
    """

    def __init__(self, num_bytes: int, device_index: int):
        rt = load_runtime()
        check(rt.cudaSetDevice(device_index), "cudaSetDevice")
        self.num_bytes = num_bytes
        self.device_index = device_index
        self.ptr = int(
            check(
                rt.cudaMallocManaged(max(1, num_bytes), rt.cudaMemAttachGlobal), f"cudaMallocManaged({num_bytes} bytes)"
            )
        )
        self.__cuda_array_interface__ = {
            "shape": (num_bytes,),
            "typestr": "|u1",
            "data": (self.ptr, False),
            "strides": None,
            "version": 2,
        }

    def __del__(self):
        ptr, self.ptr = getattr(self, "ptr", 0), 0
        if not ptr:
            return
        try:
            rt = load_runtime()
            rt.cudaFree(ptr)  # synchronizes the device, so no kernel still reads the range
        except Exception:  # interpreter shutdown: the CUDA context may already be gone
            pass


class ManagedMemory:
    """Managed allocations and their placement on one GPU.

    The KV pool talks to this interface only, so its bookkeeping can be tested on
    the CPU with a stand-in that records calls.
    """

    def __init__(self, device: torch.device):
        self.rt = load_runtime()
        self.device_index = device.index if device.index is not None else torch.cuda.current_device()
        self.device = torch.device("cuda", self.device_index)
        self.page_bytes = mmap.PAGESIZE  # migration and advice work on whole OS pages
        self._gpu = Location(self.device_index)

    def free_bytes(self) -> int:
        return mem_get_info(self.device_index)[0]

    def is_concurrent(self) -> bool:
        return concurrent_managed_access(self.device_index)

    def allocate(self, num_bytes: int) -> torch.Tensor:
        """A flat uint8 CUDA tensor over a new managed allocation. The GPU keeps a
        mapping to every page (accessed-by), so a page living on the host is read over
        the bus instead of faulting."""
        buffer = ManagedBuffer(num_bytes, self.device_index)
        try:
            flat = torch.as_tensor(buffer, device=self.device)
        except (RuntimeError, TypeError) as exc:
            raise KernelError(
                f"could not view managed memory as a torch tensor ({exc}); torch needs numpy for "
                "__cuda_array_interface__: pip install numpy"
            ) from None
        if flat.data_ptr() != buffer.ptr:  # a silent copy would leave the pool outside managed memory
            raise KernelError("torch copied the managed allocation instead of viewing it")
        self._advise(buffer.ptr, num_bytes, "cudaMemAdviseSetAccessedBy", self._gpu)
        return flat

    def place(
        self, tensor: torch.Tensor, start_bytes: int, num_bytes: int, *, on_host: bool, stream: torch.cuda.Stream
    ) -> None:
        """Advise `num_bytes` of `tensor` from `start_bytes` to live on the host or the GPU
        and migrate them there, enqueued on `stream`."""
        if num_bytes <= 0:
            return
        ptr = tensor.data_ptr() + start_bytes
        location = HOST if on_host else self._gpu
        self._advise(ptr, num_bytes, "cudaMemAdviseSetPreferredLocation", location)
        rt = self.rt
        where = _location_args(rt, location)
        if uses_mem_location(rt.cudaMemPrefetchAsync):
            result = rt.cudaMemPrefetchAsync(ptr, num_bytes, where, 0, stream.cuda_stream)
        else:
            result = rt.cudaMemPrefetchAsync(ptr, num_bytes, where, stream.cuda_stream)
        check(result, f"cudaMemPrefetchAsync({num_bytes} bytes to {'host' if on_host else 'GPU'})")

    def advise_preferred(self, tensor: torch.Tensor, start_bytes: int, num_bytes: int, *, on_host: bool) -> None:
        """Set where a range should live without migrating it (for pages never touched yet)."""
        if num_bytes > 0:
            self._advise(
                tensor.data_ptr() + start_bytes,
                num_bytes,
                "cudaMemAdviseSetPreferredLocation",
                HOST if on_host else self._gpu,
            )

    def last_prefetch_is_host(self, tensor: torch.Tensor, start_bytes: int, num_bytes: int) -> bool:
        """Whether the range was last prefetched to the host (for tests and diagnostics)."""
        rt = self.rt
        attr = rt.cudaMemRangeAttribute.cudaMemRangeAttributeLastPrefetchLocation
        value = check(
            rt.cudaMemRangeGetAttribute(4, attr, tensor.data_ptr() + start_bytes, num_bytes), "cudaMemRangeGetAttribute"
        )
        return int(value) == int(rt.cudaCpuDeviceId)

    def _advise(self, ptr: int, num_bytes: int, advice_name: str, location: Location) -> None:
        rt = self.rt
        advice = getattr(rt.cudaMemoryAdvise, advice_name)
        check(rt.cudaMemAdvise(ptr, num_bytes, advice, _location_args(rt, location)), f"cudaMemAdvise({advice_name})")


def check_managed_size(managed_bytes: int, free_bytes: int, budget_bytes: int, *, allow_oversubscription: bool) -> None:
    """Refuse a managed pool larger than the profile's budgets (device KV share plus host
    spill) or, unless the profile allows oversubscription, than the free device memory.

    On a shared GPU, asking the driver for more managed memory than is free can stall
    every process on the card, so the refusal comes before any allocation.
    """
    if managed_bytes > budget_bytes:
        raise OutOfMemoryError(
            f"the unified-memory KV pool would need {managed_bytes / GIB:.2f} GiB but the profile allows "
            f"{budget_bytes / GIB:.2f} GiB (device KV share plus host_spill_gib); lower host_spill_gib or max_model_len"
        )
    if managed_bytes > free_bytes and not allow_oversubscription:
        raise OutOfMemoryError(
            f"the unified-memory KV pool would need {managed_bytes / GIB:.2f} GiB of managed memory but the GPU "
            f"has {free_bytes / GIB:.2f} GiB free; lower host_spill_gib, use kv_backend 'pinned', or set "
            "allow_oversubscription: true on a card no other process uses"
        )
