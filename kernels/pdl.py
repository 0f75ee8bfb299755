"""Programmatic dependent launch for the decode kernels (sm_90 and later).

A batch-1 decode step is a chain of about 150 small kernels, each reading the output of the
one before it. Launched plainly, each waits for the previous one to finish before its first
program starts, and its first weight loads then wait on DRAM: in a CUDA-graph step on an H200 the
launch gaps alone came to 97 µs of 1.51 ms, and the one-row GEMVs reached a quarter of the
copy bandwidth, most of the rest being memory latency at the start of each kernel.

With programmatic dependent launch (CUDA 12.3+, compute capability 9.0+), a kernel launched
with the attribute may start once every program of the kernel before it has signalled
(`griddepcontrol.launch_dependents`). Each decode kernel here signals as soon as its own
wait is over, so the next one is resident while it computes. The next one's programs first
ask L2 to fetch their share of the layer's weights, which no kernel of the step writes, then
block in `griddepcontrol.wait` until the previous kernel has finished and its writes are
visible. Only then do they read activations or write anything.

That order is what keeps it exact: the signal comes after the wait, so at most two kernels
overlap and everything before the previous one has finished when a kernel starts. Before its
wait a kernel issues L2 prefetches (a hint: it changes no value, even of memory written
meanwhile) and reads only what was written before the previous kernel ran: decode attention
reads its sequence's context length and block table there, to prefetch its first K/V tile.
Kernels launched without the attribute (torch's, cuBLAS's) order as before. GPUs before
sm_90 and the interpreter never use it.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

try:  # Triton 3.4+
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    HAS_GDC = True
except ImportError:
    HAS_GDC = False

MIN_CAPABILITY = (9, 0)
LINE_BYTES = 128  # one L2 prefetch brings one line
# Prefetch a layer's weights only while they take at most this share of L2: more would evict
# what the running kernel is reading (an INT4 head of 117 MB is read straight from DRAM).
MAX_L2_SHARE = 0.4


@functools.cache
def _device_has_pdl(device_index: int) -> bool:
    # ROCm builds report the gfx version as the capability (MI300: 9.4); HIP has no such launch
    return torch.version.hip is None and torch.cuda.get_device_capability(device_index) >= MIN_CAPABILITY


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def uses_pdl(device: torch.device) -> bool:
    """Whether decode kernels on `device` launch with programmatic dependent launch: an NVIDIA
    GPU of compute capability 9.0 or later (not a ROCm device), compiled (not interpreted)
    Triton with the grid-dependency instructions."""
    if device.type != "cuda" or not HAS_GDC or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return _device_has_pdl(_index(device))


@functools.cache
def _l2_bytes(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).L2_cache_size


def prefetch_lines(num_bytes: int, num_programs: int, l2_bytes: int) -> int:
    """L2 lines each of `num_programs` programs prefetches so that together they cover
    `num_bytes` (a power of two, as tl.arange needs; programs past the end repeat the last
    line), or 0 when the buffer is empty or over MAX_L2_SHARE of an L2 of `l2_bytes`."""
    if num_bytes <= 0 or num_bytes > MAX_L2_SHARE * l2_bytes:
        return 0
    return triton.next_power_of_2(triton.cdiv(triton.cdiv(num_bytes, LINE_BYTES), num_programs))


def dependent_launch(device: torch.device) -> dict:
    """Launch keywords of a kernel that calls await_inputs: the PDL flag, and launch_pdl with it."""
    return {"PDL": True, "launch_pdl": True} if uses_pdl(device) else {"PDL": False}


def launch_prefetch(device: torch.device, tensors: tuple[torch.Tensor, ...], num_programs: int) -> dict:
    """dependent_launch's keywords plus one PREFETCH_<i> count per tensor for prefetch_l2: the
    lines each of `num_programs` programs asks of L2 (prefetch_lines), 0 without PDL or when
    the tensors together exceed MAX_L2_SHARE of L2."""
    options = dependent_launch(device)
    names = [f"PREFETCH_{i}" for i in range(len(tensors))]
    if not options["PDL"]:
        return {**options, **dict.fromkeys(names, 0)}
    l2_bytes = _l2_bytes(_index(device))
    sizes = [t.numel() * t.element_size() for t in tensors]
    fits = sum(sizes) <= MAX_L2_SHARE * l2_bytes
    return {
        **options,
        **{name: prefetch_lines(size, num_programs, l2_bytes) if fits else 0 for name, size in zip(names, sizes)},
    }


@triton.jit
def prefetch_l2(base_ptr, num_bytes, LINES: tl.constexpr):
    """Ask L2 for this program's LINES lines of the buffer at base_ptr (num_bytes long): the
    programs of the grid, in launch order, take consecutive runs of lines."""
    if LINES > 0:
        program = tl.program_id(0) + tl.num_programs(0) * (tl.program_id(1) + tl.num_programs(1) * tl.program_id(2))
        offsets = (program.to(tl.int64) * LINES + tl.arange(0, LINES)) * 128
        prefetch_l2_lines(base_ptr.to(tl.pointer_type(tl.int8)) + tl.minimum(offsets, num_bytes - 1))


@triton.jit
def prefetch_l2_lines(addresses):
    """Ask L2 for the line holding each of `addresses` (a tensor of pointers, any shape)."""
    # is_pure=False: its result is unused, and a pure op would be dropped
    tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1]; mov.b32 $0, 0;", "=r,l", [addresses], dtype=tl.int32, is_pure=False, pack=1
    )


@triton.jit
def await_inputs(PDL: tl.constexpr):
    """Under PDL: block until the kernel before has finished (its writes visible), then let the
    next kernel start. Every program calls it before it writes anything and before it reads
    anything the kernel before may write; only L2 prefetches (w4a16_gemv.await_inputs_prefetching),
    and reads of what was written before that kernel ran (a step's block tables and context
    lengths), come before it."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
