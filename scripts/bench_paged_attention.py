"""Decode attention bandwidth on paged FP16/INT8/INT4 KV caches, against the GPU's copy bandwidth.

Decode attention reads every K/V byte of the context once, so the figure of
merit is achieved GB/s (bytes of pages plus scales read, over the median time of one call
replayed from a CUDA graph, as the decode step runs it, with pages cold in L2) as a fraction
of a plain device-to-device copy. One layer of the R1-Distill-Qwen-1.5B shape (12 query
heads, 2 KV heads, head_dim 128).

    python scripts/bench_paged_attention.py [--json results.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import sys

import torch

from lowvram.bench_record import git_commit, measure_copy_bandwidth_gbps
from lowvram.kernels.paged_attention import paged_decode_attention, plan_decode_partitions
from lowvram.kv_quant import allocate_pages

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 12, 2, 128, 16
CONTEXT_LENS = (8192, 32768, 131072)
BATCH_SIZES = (1, 8)
PRECISIONS = ("fp16", "int8", "int4")
TARGET_FRACTION = 0.60
MAX_COPIES = 16  # calls per timed graph
REPLAYS = 20


def copy_bandwidth_gbs(num_bytes: int = 2 << 30) -> float:
    """Device-to-device copy: bytes read plus bytes written per second."""
    return measure_copy_bandwidth_gbps(num_bytes, "cuda")


def random_pages(precision: str, num_blocks: int, generator: torch.Generator):
    pages = allocate_pages(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, precision, device="cuda")
    if precision == "fp16":
        pages.k.normal_(generator=generator)
        pages.v.normal_(generator=generator)
        return pages
    for codes in (pages.k, pages.v):
        codes.random_(0, 256, generator=generator)
    for scale, zero in ((pages.k_scale, pages.k_zero), (pages.v_scale, pages.v_zero)):
        scale.uniform_(0.005, 0.02, generator=generator)
        zero.uniform_(0.0, 255.0 if precision == "int8" else 15.0, generator=generator)
    return pages


def bench_decode(precision: str, context_len: int, batch_size: int, copy_gbs: float) -> dict:
    """Median time of one decode-attention call (kernel plus partition merge), replayed from a
    CUDA graph as the model's decode step runs it, so Python's launch cost is not counted.

    The graph holds `copies` calls over distinct pages, together at least four times the L2
    cache, so each call reads its pages from device memory as a 28-layer model would.
    """
    generator = torch.Generator(device="cuda").manual_seed(0)
    blocks_per_seq = math.ceil(context_len / BLOCK_SIZE)
    bytes_read = batch_size * context_len * _bytes_per_token(precision)
    copies = min(MAX_COPIES, max(1, math.ceil(4 * _l2_bytes() / bytes_read)))
    num_blocks = copies * batch_size * blocks_per_seq
    pages = random_pages(precision, num_blocks, generator)
    # Scattered blocks, as a long-running pool hands them out.
    order = torch.randperm(num_blocks, device="cuda", generator=generator).to(torch.int32)
    tables = [t.contiguous() for t in order.view(copies, batch_size, blocks_per_seq)]  # [S, max_blocks] each
    context_lens = torch.full((batch_size,), context_len, dtype=torch.int32, device="cuda")
    q = torch.randn(batch_size, NUM_HEADS, HEAD_DIM, device="cuda", dtype=torch.float16, generator=generator)
    scale = HEAD_DIM**-0.5

    def run_all():
        for table in tables:
            paged_decode_attention(q, pages, table, context_lens, scale, max_context_len=context_len)

    run_all()  # compiles the kernels outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run_all()
    graph.replay()
    torch.cuda.synchronize()
    times_ms = []
    for _ in range(REPLAYS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times_ms.append(start.elapsed_time(end) / copies)
    time_ms = sorted(times_ms)[len(times_ms) // 2]
    achieved_gbs = bytes_read / (time_ms * 1e-3) / 1e9
    num_splits, partition_tokens = plan_decode_partitions(batch_size, NUM_KV_HEADS, context_len, q.device)
    row = {
        "precision": precision,
        "context_len": context_len,
        "batch_size": batch_size,
        "num_splits": num_splits,
        "partition_tokens": partition_tokens,
        "time_us": round(time_ms * 1e3, 2),
        "kv_bytes_read": bytes_read,
        "achieved_gbs": round(achieved_gbs, 1),
        "fraction_of_copy": round(achieved_gbs / copy_gbs, 3),
        "calls_per_graph": copies,
    }
    return row


def _bytes_per_token(precision: str) -> int:
    """K and V bytes of one token in one layer, scales and zeros included."""
    per_head = {"fp16": 2 * HEAD_DIM, "int8": HEAD_DIM + 4, "int4": HEAD_DIM // 2 + 4}[precision]
    return 2 * NUM_KV_HEADS * per_head


def _l2_bytes() -> int:
    return getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 0) or 64 << 20


def fits_in_memory(precision: str, context_len: int, batch_size: int) -> bool:
    free_bytes, _ = torch.cuda.mem_get_info()
    per_call = batch_size * context_len * _bytes_per_token(precision)
    copies = min(MAX_COPIES, max(1, math.ceil(4 * _l2_bytes() / per_call)))
    return copies * per_call * 2 < free_bytes * 0.5


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON to PATH")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_paged_attention needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton

    gpu_name = torch.cuda.get_device_name(0)
    copy_gbs = copy_bandwidth_gbs()
    print(f"{gpu_name}: copy bandwidth {copy_gbs:.0f} GB/s (read + write)")
    print(f"decode, H={NUM_HEADS} Hkv={NUM_KV_HEADS} D={HEAD_DIM} B={BLOCK_SIZE}, one layer; target >= "
          f"{TARGET_FRACTION:.0%} of copy at 8K+")
    header = (
        f"{'precision':>9} {'context':>8} {'batch':>5} {'splits':>6} {'time_us':>9} {'GB/s':>8} {'of copy':>8}"
    )
    print(header)
    rows = []
    for precision in PRECISIONS:
        for context_len in CONTEXT_LENS:
            for batch_size in BATCH_SIZES:
                if not fits_in_memory(precision, context_len, batch_size):
                    print(f"{precision:>9} {context_len:>8} {batch_size:>5}  skipped: not enough free memory")
                    continue
                row = bench_decode(precision, context_len, batch_size, copy_gbs)
                torch.cuda.empty_cache()  # the pages and the graph went with the call
                rows.append(row)
                mark = "" if row["fraction_of_copy"] >= TARGET_FRACTION else "  below target"
                print(
                    f"{precision:>9} {context_len:>8} {batch_size:>5} {row['num_splits']:>6} {row['time_us']:>9.1f} "
                    f"{row['achieved_gbs']:>8.0f} {row['fraction_of_copy']:>8.1%}{mark}"
                )
    if args.json:
        result = {
            "command": " ".join([sys.executable, *sys.argv]),
            "gpu": gpu_name,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "git_commit": git_commit(),
            "versions": {
                "python": platform.python_version(),
                "torch": torch.__version__,
                "triton": triton.__version__,
                "cuda": torch.version.cuda,
            },
            "copy_bandwidth_gbs": round(copy_gbs, 1),
            "timing": "median of CUDA-graph replays; each graph holds calls over distinct pages (L2 cold)",
            "rows": rows,
        }
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
