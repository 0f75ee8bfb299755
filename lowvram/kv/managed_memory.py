"""CUDA Unified Memory through cuda-bindings (optional): allocate, view as a tensor, advise,
migrate on a stream. Calls return (error code, values...). cuda-bindings 13 takes a
`cudaMemLocation` where 12.x takes an int device (-1: host), read from the signatures.
`torch.as_tensor` accepts managed memory through `__cuda_array_interface__` (from_dlpack does
not) and keeps the owner alive. Without concurrentManagedAccess (Windows, WSL2) there is no
oversubscription nor host access while kernels run: the pool uses pinned pages there.
"""

from __future__ import annotations

import functools
import inspect
import mmap

import torch

from lowvram.errors import ConfigError, KernelError, OutOfMemoryError

GIB = 2**30
HOST = None  # a location: the host, or a GPU's index

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


@functools.cache
def uses_mem_location(function) -> bool:
    """Whether `function` takes a cudaMemLocation (cuda-bindings 13) rather than an int device (12.x)."""
    try:
        return "location" in inspect.signature(function).parameters
    except (TypeError, ValueError):  # no signature: 13.x documents the location form first
        return "cudaMemLocation" in (function.__doc__ or "").split("\n", 1)[0]


def check(result, what: str):
    """Raise KernelError for a failed call; return the values after the error code."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != load_runtime().cudaError_t.cudaSuccess:
        raise KernelError(f"{what} failed: {getattr(err, 'name', err)}")
    return tuple(values) if len(values) > 1 else next(iter(values), None)


def _location_args(rt, device_index: int | None):
    """A location (a GPU's index, or HOST) in the form this cuda-bindings takes it."""
    if not uses_mem_location(rt.cudaMemPrefetchAsync):
        return rt.cudaCpuDeviceId if device_index is HOST else device_index
    loc = rt.cudaMemLocation()
    if device_index is HOST:
        loc.type, loc.id = rt.cudaMemLocationType.cudaMemLocationTypeHost, 0
    else:
        loc.type, loc.id = rt.cudaMemLocationType.cudaMemLocationTypeDevice, device_index
    return loc


class ManagedBuffer:
    """One cudaMallocManaged allocation, freed when the last tensor viewing it dies (exposed
    as a flat uint8 `__cuda_array_interface__`)."""

    def __init__(self, num_bytes: int, device_index: int):
        rt = load_runtime()
        check(rt.cudaSetDevice(device_index), "cudaSetDevice")
        self.ptr = 0
        result = rt.cudaMallocManaged(max(1, num_bytes), rt.cudaMemAttachGlobal)
        self.ptr = int(check(result, f"cudaMallocManaged({num_bytes} bytes)"))
        self.__cuda_array_interface__ = dict(
            shape=(num_bytes,), typestr="|u1", data=(self.ptr, False), strides=None, version=2
        )

    def __del__(self):
        ptr, self.ptr = getattr(self, "ptr", 0), 0
        if ptr:
            try:
                load_runtime().cudaFree(ptr)  # synchronizes the device, so no kernel still reads the range
            except Exception:  # interpreter shutdown: the CUDA context may already be gone
                pass


class ManagedMemory:
    """Managed allocations and their placement on one GPU; the pool talks only to this, so
    CPU tests can stand in a recorder."""

    def __init__(self, device: torch.device):
        self.rt = load_runtime()
        self.device_index = device.index if device.index is not None else torch.cuda.current_device()
        self.device = torch.device("cuda", self.device_index)
        self.page_bytes = mmap.PAGESIZE  # migration and advice work on whole OS pages

    def free_bytes(self) -> int:
        """Free device bytes as the driver reports them (resident managed pages count as used)."""
        check(self.rt.cudaSetDevice(self.device_index), "cudaSetDevice")
        return int(check(self.rt.cudaMemGetInfo(), "cudaMemGetInfo")[0])

    def is_concurrent(self) -> bool:
        """Whether GPU and host may touch managed memory at once (0 on Windows and WSL2)."""
        attr = self.rt.cudaDeviceAttr.cudaDevAttrConcurrentManagedAccess
        return bool(check(self.rt.cudaDeviceGetAttribute(attr, self.device_index), "cudaDeviceGetAttribute"))

    def allocate(self, num_bytes: int) -> torch.Tensor:
        """A flat uint8 CUDA tensor over a new managed allocation. The GPU maps every page
        (accessed-by), so a page on the host is read over the bus instead of faulting."""
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
        self._advise(buffer.ptr, num_bytes, "cudaMemAdviseSetAccessedBy", self.device_index)
        return flat

    def place(
        self, tensor: torch.Tensor, start_bytes: int, num_bytes: int, *, on_host: bool, stream: torch.cuda.Stream
    ) -> None:
        """Advise a byte range of `tensor` to live on the host or the GPU and migrate it there on `stream`."""
        if num_bytes <= 0:
            return
        self.advise_preferred(tensor, start_bytes, num_bytes, on_host=on_host)
        where = _location_args(self.rt, HOST if on_host else self.device_index)
        flags = (0,) if uses_mem_location(self.rt.cudaMemPrefetchAsync) else ()  # 13.x takes flags
        ptr = tensor.data_ptr() + start_bytes
        result = self.rt.cudaMemPrefetchAsync(ptr, num_bytes, where, *flags, stream.cuda_stream)
        check(result, f"cudaMemPrefetchAsync({num_bytes} bytes to {'host' if on_host else 'GPU'})")

    def advise_preferred(self, tensor: torch.Tensor, start_bytes: int, num_bytes: int, *, on_host: bool) -> None:
        """Set where a range should live without migrating it (for pages never touched yet)."""
        if num_bytes > 0:
            location = HOST if on_host else self.device_index
            self._advise(tensor.data_ptr() + start_bytes, num_bytes, "cudaMemAdviseSetPreferredLocation", location)

    def _advise(self, ptr: int, num_bytes: int, advice_name: str, location: int | None) -> None:
        advice = getattr(self.rt.cudaMemoryAdvise, advice_name)
        result = self.rt.cudaMemAdvise(ptr, num_bytes, advice, _location_args(self.rt, location))
        check(result, f"cudaMemAdvise({advice_name})")


def check_managed_size(managed_bytes: int, free_bytes: int, budget_bytes: int, allow_oversubscription: bool) -> None:
    """Refuse a managed pool larger than the profile's budget (device KV share plus host spill)
    or, without oversubscription, than the free device memory: on a shared GPU asking the
    driver for more managed memory than is free can stall every process on the card."""
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
