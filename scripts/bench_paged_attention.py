"""Decode attention bandwidth on paged FP16/INT8/INT4 KV caches, against the GPU's copy bandwidth.

Decode attention reads every K/V byte of the context once, so the figure of
merit is achieved GB/s (bytes of pages plus scales read, over the median kernel
time from `triton.testing.do_bench`) as a fraction of a plain device-to-device copy. One layer of the
R1-Distill-Qwen-1.5B shape (12 query heads, 2 KV heads, head_dim 128).

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
    import triton.testing

    generator = torch.Generator(device="cuda").manual_seed(0)
    blocks_per_seq = math.ceil(context_len / BLOCK_SIZE)
    num_blocks = batch_size * blocks_per_seq
    pages = random_pages(precision, num_blocks, generator)
    # Scattered blocks, as a long-running pool hands them out.
    order = torch.randperm(num_blocks, device="cuda", generator=generator)
    block_tables = order.view(batch_size, blocks_per_seq).to(torch.int32)  # [S, max_blocks]
    context_lens = torch.full((batch_size,), context_len, dtype=torch.int32, device="cuda")
    q = torch.randn(batch_size, NUM_HEADS, HEAD_DIM, device="cuda", dtype=torch.float16, generator=generator)
    scale = HEAD_DIM**-0.5

    def run():
        return paged_decode_attention(q, pages, block_tables, context_lens, scale, max_context_len=context_len)

    run()
    torch.cuda.synchronize()
    # do_bench flushes L2 before each call: at 8K and batch 1 the pages (8 MB) would
    # otherwise stay in the H200's 50 MB L2, which a 28-layer model never sees.
    time_ms = _median_ms(triton.testing.do_bench, run)
    bytes_read = batch_size * context_len * pages.bytes_per_token()
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
    }
    del pages, order, block_tables
    torch.cuda.empty_cache()
    return row


def _median_ms(bench_fn, fn) -> float:
    try:
        return bench_fn(fn, return_mode="median")
    except TypeError:  # a Triton without return_mode: mean instead
        return bench_fn(fn)


def fits_in_memory(precision: str, context_len: int, batch_size: int) -> bool:
    free_bytes, _ = torch.cuda.mem_get_info()
    bytes_per_token = NUM_KV_HEADS * 2 * (HEAD_DIM * 2 if precision == "fp16" else HEAD_DIM + 4)
    return batch_size * context_len * bytes_per_token * 2 < free_bytes * 0.5


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
            "rows": rows,
        }
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
