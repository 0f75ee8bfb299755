"""What the decode GEMV's memory access alone costs: the floor under each kernel form.

For each projection of a shape, a kernel with the decode GEMV's grid and tiles reads the
packed INT4 words exactly as the kernel does and only adds them up (no unpacking, no
scales, no compensation, one store per program); the copy of a tensor of the same size
and a plain elementwise read give the GPU's own figures. Everything is timed from memory,
over enough copies of the weights to leave L2 (as profile_decode.py's sweep does).

    python scripts/probe_gemv_floor.py [--shape r1-distill-qwen-1.5b] [--json out.json]
"""

import argparse
import json
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch
import triton
import triton.language as tl

COLD_BYTES = 256 * 2**20


@triton.jit
def _read_tiles_kernel(qweight_ptr, out_ptr, num_packed_cols, K_BLOCKS_PER_SPLIT, NUM_K_BLOCKS,
                       BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_c = pid_n * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_c = offs_c < num_packed_cols
    total = tl.zeros((BLOCK_C,), dtype=tl.int32)
    kb_start = pid_k * K_BLOCKS_PER_SPLIT
    for kb in range(kb_start, tl.minimum(kb_start + K_BLOCKS_PER_SPLIT, NUM_K_BLOCKS)):
        offs_k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        packed = tl.load(qweight_ptr + offs_k[:, None] * num_packed_cols + offs_c[None, :], mask=mask_c[None, :],
                         other=0)
        total += tl.sum(packed, axis=0)
    tl.store(out_ptr + (pid_k * tl.num_programs(0) + pid_n) * BLOCK_C + tl.arange(0, BLOCK_C), total)


def time_cold(fn_over_copies, num_copies: int) -> float:
    """Microseconds per call of one graph that calls once per weight copy."""
    from triton.testing import do_bench_cudagraph

    return do_bench_cudagraph(fn_over_copies, rep=20) / num_copies * 1000


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="r1-distill-qwen-1.5b")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    from lowvram.shapes import projection_shapes

    shapes = projection_shapes(args.shape)
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    tilings = [  # (block_n, block_k, num_warps, split rule)
        (64, 128, 4, "lanes"), (64, 128, 4, "k/128"), (256, 16, 1, "k/128"), (256, 32, 1, "k/128"),
        (512, 16, 2, "k/128"), (512, 32, 2, "k/256"), (1024, 16, 4, "k/128"), (1024, 32, 4, "k/256"),
        (256, 64, 1, "k/256"), (512, 64, 4, "k/128"),
    ]
    results = []
    for name, (k, n) in shapes.items():
        nbytes = k * n // 2
        num_copies = max(1, min(64, COLD_BYTES // nbytes))
        copies = [torch.randint(-2**31, 2**31 - 1, (k, n // 8), dtype=torch.int32, device="cuda")
                  for _ in range(num_copies)]
        row = {"shape": name, "k": k, "n": n, "weight_bytes": nbytes, "num_copies": num_copies, "tilings": []}
        dst = torch.empty_like(copies[0])
        us = time_cold(lambda: [dst.copy_(w) for w in copies], num_copies)
        row["copy_us"] = round(us, 2)
        row["copy_gbps"] = round(2 * nbytes / us / 1e3, 1)
        sink = torch.empty((), dtype=torch.int64, device="cuda")
        us = time_cold(lambda: [torch.sum(w, dim=(0, 1), dtype=torch.int64, out=sink) for w in copies], num_copies)
        row["torch_sum_us"] = round(us, 2)
        row["torch_sum_gbps"] = round(nbytes / us / 1e3, 1)
        for block_n, block_k, warps, rule in tilings:
            num_k_blocks = k // block_k
            num_n_blocks = triton.cdiv(n, block_n)
            if rule == "lanes":
                split = max(1, min(num_k_blocks, max(4, triton.cdiv(4 * num_sms, num_n_blocks))))
            else:
                split = max(1, min(num_k_blocks, k // int(rule.split("/")[1])))
            per_split = triton.cdiv(num_k_blocks, split)
            split = triton.cdiv(num_k_blocks, per_split)
            out = torch.empty(split * num_n_blocks * block_n // 8, dtype=torch.int32, device="cuda")
            grid = (num_n_blocks, split)

            def calls(block_n=block_n, block_k=block_k, warps=warps, per_split=per_split, out=out, grid=grid,
                      num_k_blocks=num_k_blocks):
                for w in copies:
                    _read_tiles_kernel[grid](w, out, n // 8, per_split, num_k_blocks, BLOCK_C=block_n // 8,
                                             BLOCK_K=block_k, num_warps=warps)

            us = time_cold(calls, num_copies)
            row["tilings"].append({"block_n": block_n, "block_k": block_k, "num_warps": warps, "split_k": split,
                                   "programs": num_n_blocks * split, "us": round(us, 2),
                                   "gbps": round(nbytes / us / 1e3, 1)})
        results.append(row)
        best = min(row["tilings"], key=lambda t: t["us"])
        print(json.dumps({k2: v for k2, v in row.items() if k2 != "tilings"} | {"best_tiling": best}))
        for t in row["tilings"]:
            print("   ", json.dumps(t))
    record = {"command": " ".join(["probe_gemv_floor.py", *sys.argv[1:]]), "gpu": torch.cuda.get_device_name(),
              "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "shape": args.shape,
              "results": results}
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
