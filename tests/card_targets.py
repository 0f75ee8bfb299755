"""Run lowvram's Triton kernels as the 4 GB cards would, on whatever GPU the tests have.

A cubin built for sm_75 does not load on an sm_90 GPU, but its PTX does: the driver's JIT
(cuModuleLoadData) compiles PTX for the GPU it runs on. Inside `emulate(card)`:

- Triton's current target is the card's (`GPUTarget("cuda", 75, 32)` for the GTX 1650), so
  every kernel is compiled for that architecture: its instruction selection, layouts,
  pipelining and shared-memory size are the card's. The target is part of Triton's cache
  key, so nothing compiled for the real GPU is reused; each kernel of `lowvram.kernels` starts
  with an empty in-memory cache, put back on exit.
- Each compiled kernel is loaded from its PTX rather than its cubin.
- `torch.cuda.get_device_capability` and the SM count and L2 size of
  `torch.cuda.get_device_properties` are the card's, and the kernel modules' cached answers
  are dropped, so the wrappers pick the configuration, or the plain-torch fallback, that they
  pick on the card.

`Emulation.ran()` names the kernels launched since `Emulation.new_case()`, after checking that
each was compiled for the card, was loaded from PTX and fits the card's shared memory.
"""

from __future__ import annotations

import contextlib
import importlib
import pkgutil
from collections import defaultdict
from dataclasses import dataclass, field

import pytest
import torch
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import CompiledKernel
from triton.runtime import driver
from triton.runtime.jit import JITFunction

import lowvram.kernels


@dataclass(frozen=True)
class Card:
    name: str
    capability: tuple[int, int]
    num_sms: int
    l2_bytes: int
    max_shared_bytes: int  # per block, with the opt-in above 48 KiB

    @property
    def arch(self) -> int:
        return self.capability[0] * 10 + self.capability[1]


CARDS = {
    "sm75": Card("GTX 1650 (Turing)", (7, 5), num_sms=14, l2_bytes=1 << 20, max_shared_bytes=64 << 10),
    "sm86": Card("RTX 3050 Laptop (Ampere)", (8, 6), num_sms=16, l2_bytes=2 << 20, max_shared_bytes=99 << 10),
}


@dataclass
class Emulation:
    card: Card
    launches: list[tuple[str, CompiledKernel]] = field(default_factory=list)
    ptx_loaded: list[CompiledKernel] = field(default_factory=list)
    case_kernels: set[str] = field(default_factory=set)  # launched since new_case()
    kernels_run: set[str] = field(default_factory=set)  # launched under this card

    def new_case(self) -> None:
        self.ran()
        self.case_kernels.clear()

    def ran(self) -> list[str]:
        """The kernels launched since `new_case` (none: the wrappers took their plain-torch
        paths), each checked to be the card's code."""
        for name, kernel in self.launches:
            assert kernel.metadata.target.arch == self.card.arch, f"{name} was compiled for {kernel.metadata.target}"
            assert f".target sm_{self.card.arch}" in kernel.asm["ptx"], f"{name}: PTX for another target"
            assert any(kernel is loaded for loaded in self.ptx_loaded), f"{name} was not loaded from its PTX"
            assert kernel.metadata.shared <= self.card.max_shared_bytes, (
                f"{name} needs {kernel.metadata.shared} bytes of shared memory; "
                f"the {self.card.name} has {self.card.max_shared_bytes}"
            )
            self.case_kernels.add(name)
        self.launches.clear()
        self.kernels_run |= self.case_kernels
        return sorted(self.case_kernels)


def kernel_modules() -> list:
    """Every module of lowvram.kernels, imported."""
    return [
        importlib.import_module(f"lowvram.kernels.{m.name}") for m in pkgutil.iter_modules(lowvram.kernels.__path__)
    ]


def jit_functions() -> list[JITFunction]:
    """Every @triton.jit function of lowvram.kernels, kernels and the helpers they call."""
    found = {id(v): v for m in kernel_modules() for v in vars(m).values() if isinstance(v, JITFunction)}
    return list(found.values())


def _drop_cached_answers() -> None:
    """Forget what the kernel modules cached about the device (capability, SM count, backend)."""
    for module in kernel_modules():
        for value in vars(module).values():
            if callable(getattr(value, "cache_clear", None)):
                value.cache_clear()


class _CardProperties:
    """The real device's properties with the card's capability, SM count and L2 size."""

    def __init__(self, real, card: Card):
        self._real = real
        self.major, self.minor = card.capability
        self.multi_processor_count = card.num_sms
        self.L2_cache_size = card.l2_bytes

    def __getattr__(self, name):
        return getattr(self._real, name)


@contextlib.contextmanager
def emulate(card: Card):
    """Compile, load and dispatch every lowvram kernel as on `card` (see the module docstring)."""
    emulation = Emulation(card)
    active = driver.active
    load_binary, init_handles, run = active.utils.load_binary, CompiledKernel._init_handles, JITFunction.run
    get_properties = torch.cuda.get_device_properties
    loading: list[CompiledKernel] = []

    def init_handles_from_ptx(kernel):
        loading.append(kernel)
        try:
            init_handles(kernel)
        finally:
            loading.pop()

    def load_ptx(name, binary, shared, device):
        kernel = loading[-1]
        emulation.ptx_loaded.append(kernel)
        return load_binary(name, kernel.asm["ptx"].encode() + b"\0", shared, device)  # cuModuleLoadData: NUL-ended

    def recorded_run(fn, *args, **kwargs):
        kernel = run(fn, *args, **kwargs)
        if kernel is not None:
            emulation.launches.append((fn.fn.__name__, kernel))
        return kernel

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(active, "get_current_target", lambda: GPUTarget("cuda", card.arch, 32))
        patch.setattr(active.utils, "load_binary", load_ptx)
        patch.setattr(CompiledKernel, "_init_handles", init_handles_from_ptx)
        patch.setattr(JITFunction, "run", recorded_run)
        patch.setattr(torch.cuda, "get_device_capability", lambda device=None: card.capability)
        patch.setattr(
            torch.cuda, "get_device_properties", lambda device=None: _CardProperties(get_properties(device), card)
        )
        for fn in jit_functions():
            patch.setattr(fn, "device_caches", defaultdict(fn.create_binder))
        _drop_cached_answers()
        try:
            yield emulation
        finally:
            _drop_cached_answers()
