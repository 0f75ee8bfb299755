"""cuda-bindings feature detection, without a GPU: both API generations, the missing
package, and errors turned into lowvram's own exceptions."""

import sys

import pytest

from lowvram.errors import ConfigError, KernelError
from lowvram.kv import managed_memory


def test_missing_cuda_bindings_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "cuda", None)
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)
    with pytest.raises(ConfigError, match="pip install cuda-bindings"):
        managed_memory.load_runtime()


def test_the_two_api_generations_are_told_apart_by_signature():
    def prefetch_12(devPtr, count, dstDevice, stream):  # cuda-bindings 12.x
        pass

    def prefetch_13(devPtr, count, location, flags, stream):  # cuda-bindings 13
        pass

    assert managed_memory.uses_mem_location(prefetch_13)
    assert not managed_memory.uses_mem_location(prefetch_12)


def test_locations_take_the_installed_form():
    rt = pytest.importorskip("cuda.bindings.runtime")
    host = managed_memory._location_args(rt, managed_memory.HOST)
    gpu = managed_memory._location_args(rt, 3)
    if managed_memory.uses_mem_location(rt.cudaMemPrefetchAsync):
        assert host.type == rt.cudaMemLocationType.cudaMemLocationTypeHost
        assert (gpu.type, gpu.id) == (rt.cudaMemLocationType.cudaMemLocationTypeDevice, 3)
    else:
        assert (host, gpu) == (rt.cudaCpuDeviceId, 3)


def test_a_failed_call_is_a_kernel_error_naming_it():
    rt = pytest.importorskip("cuda.bindings.runtime")
    assert managed_memory.check((rt.cudaError_t.cudaSuccess, 7), "x") == 7
    with pytest.raises(KernelError, match="cudaMemGetInfo failed: cudaErrorMemoryAllocation"):
        managed_memory.check((rt.cudaError_t.cudaErrorMemoryAllocation, None, None), "cudaMemGetInfo")
