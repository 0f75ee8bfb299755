"""Work confined to a slice of the GPU's SMs (a CUDA green context), to measure kernels the
way a card with that many SMs runs them.

lowvram's users have cards of 14 to 20 SMs (a GTX 1650 has 14, an RTX 3050 laptop GPU 16);
the GPU the project is measured on has 132. A decode-attention call over an 8K context is a
few microseconds there, so short that its launch and the time its loads take to ramp up
weigh as much as its reads; on a card of 16 SMs the same call runs ten times longer and the
reads dominate. `sm_slice(16)` opens a green context holding 16 of the GPU's SMs, makes a
stream of it the current one (kernels launched on it run on those SMs only; memory and
compiled kernels are shared with the rest of the process) and has lowvram's kernels size
their grids for 16 SMs (`lowvram.kernels.dispatch.sm_limits`). The memory is still the
big card's: each SM has more bandwidth to draw on than a small card's, so what a slice
shows is what the kernels do with few SMs, not a small card's absolute speed.

Green contexts need CUDA 12.4 or newer and cuda-bindings (an optional dependency); the
driver grants SMs in groups (8 on Hopper), so the slice can be larger than asked
(`SmSlice.num_sms` says what was granted). Synchronize the slice's stream
(`torch.cuda.current_stream().synchronize()`), not the device: the device's synchronize
covers the primary context's streams.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from lowvram.errors import ConfigError
from lowvram.kernels import dispatch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False


def _driver():
    """cuda-bindings' driver module, or ConfigError saying how to get it."""
    try:
        from cuda.bindings import driver
    except ImportError:
        try:
            from cuda import cuda as driver
        except ImportError as exc:
            raise ConfigError(
                "running on a slice of the GPU's SMs needs the cuda-bindings package "
                "(pip install cuda-bindings, the version matching your CUDA driver)"
            ) from exc
    return driver


GREEN_CONTEXT_HINT = "a slice of the GPU's SMs needs a CUDA 12.4+ driver that supports green contexts"


def _checked(driver, what: str, result, hint: str = GREEN_CONTEXT_HINT):
    """`result` of a cuda-bindings call (error code first) without the code, or ConfigError
    naming the call, the error and `hint`."""
    error, *values = result
    if error != driver.CUresult.CUDA_SUCCESS:
        _, name = driver.cuGetErrorName(error)
        raise ConfigError(f"{what} failed: {name.decode() if isinstance(name, bytes) else name}; {hint}")
    return values[0] if len(values) == 1 else tuple(values)


@dataclass
class SmSlice:
    """A green context of `num_sms` SMs of CUDA device `device_index`, and a stream that runs on them."""

    device_index: int
    num_sms: int
    stream: torch.cuda.ExternalStream
    _green_ctx: object
    _raw_stream: object

    def close(self) -> None:
        """Destroy the stream and the green context, both even if the first fails. The driver
        made them, so a failure here is not a missing feature: the error names what failed."""
        driver = _driver()
        self.stream.synchronize()
        hint = "the slice's work finished; the driver may hold its resources until the process exits"
        try:
            _checked(driver, "closing the slice: cuStreamDestroy", driver.cuStreamDestroy(self._raw_stream), hint)
        finally:
            _checked(driver, "closing the slice: cuGreenCtxDestroy", driver.cuGreenCtxDestroy(self._green_ctx), hint)


def open_sm_slice(num_sms: int, device_index: int = 0) -> SmSlice:
    """A slice of at least `num_sms` SMs of CUDA device `device_index` (see the module's note)."""
    if not torch.cuda.is_available():
        raise ConfigError("a slice of the GPU's SMs needs a CUDA GPU, and torch sees none")
    total = torch.cuda.get_device_properties(device_index).multi_processor_count
    if not isinstance(num_sms, int) or not 1 <= num_sms <= total:
        raise ConfigError(f"asked for a slice of {num_sms!r} SMs; this GPU has {total}: pick 1 to {total}")
    driver = _driver()
    torch.cuda.init()  # the primary context, which the green context shares memory and modules with
    _checked(driver, "cuInit", driver.cuInit(0))
    device = _checked(driver, "cuDeviceGet", driver.cuDeviceGet(device_index))
    sms = _checked(
        driver,
        "cuDeviceGetDevResource",
        driver.cuDeviceGetDevResource(device, driver.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM),
    )
    groups, num_groups, _ = _checked(
        driver, "cuDevSmResourceSplitByCount", driver.cuDevSmResourceSplitByCount(1, sms, 0, num_sms)
    )
    if num_groups < 1:
        raise ConfigError(f"the driver cannot make a group of {num_sms} SMs on this GPU ({total} SMs)")
    group = groups[0]
    description = _checked(driver, "cuDevResourceGenerateDesc", driver.cuDevResourceGenerateDesc([group], 1))
    green_ctx = _checked(
        driver,
        "cuGreenCtxCreate",
        driver.cuGreenCtxCreate(description, device, driver.CUgreenCtxCreate_flags.CU_GREEN_CTX_DEFAULT_STREAM),
    )
    raw_stream = _checked(
        driver,
        "cuGreenCtxStreamCreate",
        driver.cuGreenCtxStreamCreate(green_ctx, driver.CUstream_flags.CU_STREAM_NON_BLOCKING, 0),
    )
    stream = torch.cuda.ExternalStream(int(raw_stream), device=torch.device("cuda", device_index))
    return SmSlice(device_index, int(group.sm.smCount), stream, green_ctx, raw_stream)


@contextlib.contextmanager
def sm_slice(num_sms: int, device_index: int = 0) -> Iterator[SmSlice]:
    """Run what the block launches on a slice of `num_sms` SMs (open_sm_slice), its stream the
    current one and lowvram's kernels sized for the SMs granted; all restored after it. The
    slice's stream starts after the work queued before the block, and that stream waits for
    the block's work."""
    piece = open_sm_slice(num_sms, device_index)
    caller = torch.cuda.current_stream(device_index)
    dispatch.sm_limits[device_index] = piece.num_sms
    try:
        piece.stream.wait_stream(caller)
        with torch.cuda.stream(piece.stream):
            yield piece
        caller.wait_stream(piece.stream)
    finally:
        dispatch.sm_limits.pop(device_index, None)
        piece.close()


if HAS_TRITON:

    @triton.jit
    def _sm_id_kernel(out_ptr):
        sm_id = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
        tl.store(out_ptr + tl.program_id(0), sm_id)


def sm_ids(num_programs: int, device_index: int = 0) -> torch.Tensor:
    """The SM each of `num_programs` programs of a kernel launched on the current stream ran
    on (int32 [num_programs]): how a test or a benchmark sees which SMs its work can reach."""
    if not HAS_TRITON or not torch.cuda.is_available():
        raise ConfigError("reading SM ids needs a CUDA GPU and Triton")
    out = torch.full((num_programs,), -1, dtype=torch.int32, device=torch.device("cuda", device_index))
    _sm_id_kernel[(num_programs,)](out)
    return out
