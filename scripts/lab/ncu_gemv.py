"""Launches the one-row decode GEMV once per projection of a shape, for Nsight Compute.

Each projection's kernel runs twice (the first launch compiles and warms up), with the
default configuration and the rank-R compensation the profile's quantization adds, then
probe_gemv_floor.py's kernel on the same tiling in each of its modes (read, f32, half2).
Run it under ncu, e.g.

    ncu --clock-control none --kernel-name regex:"_awq_gemv_row_kernel|_read_tiles_kernel" \
        --section SpeedOfLight --section Occupancy --section WarpStateStats \
        --section SchedulerStats --section LaunchStats python scripts/lab/ncu_gemv.py

ncu flushes the caches before each profiled launch by default, so the weights come from
memory as in a decode step.
"""

import argparse
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="r1-distill-qwen-1.5b")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=128)
    args = parser.parse_args()
    from lab_shapes import projection_shapes, random_awq_tensors
    from probe_gemv_floor import MODES, _read_tiles_kernel

    from lowvram.kernels.w4a16_gemv import choose_gemv_config, launch_awq_gemv

    shapes = projection_shapes(args.shape)
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    g = args.group_size
    for name, (k, n) in shapes.items():
        qweight, qzeros, scales = random_awq_tensors(k, n, g, device="cuda")
        lora = (
            (
                torch.randn(args.rank, k, dtype=torch.float16, device="cuda") * 0.01,
                torch.randn(args.rank, n, dtype=torch.float16, device="cuda") * 0.01,
            )
            if args.rank
            else (None, None)
        )
        x = torch.randn(1, k, dtype=torch.float16, device="cuda")
        y = torch.empty(1, n, dtype=torch.float16, device="cuda")
        config = choose_gemv_config(1, n, k, g, num_sms)
        print(name, k, n, config, flush=True)
        for _ in range(2):
            launch_awq_gemv(x, qweight, qzeros, scales, g, None, y, config, *lora)
        block_n, block_k = config["block_n"], config["block_k"]
        num_k_blocks = k // block_k
        per_split = triton.cdiv(num_k_blocks, config["split_k"])
        split = triton.cdiv(num_k_blocks, per_split)
        out = torch.empty(split * triton.cdiv(n, block_n) * block_n // 8, dtype=torch.int32, device="cuda")
        for mode in MODES.values():
            _read_tiles_kernel[(triton.cdiv(n, block_n), split)](
                qweight,
                x,
                out,
                n // 8,
                per_split,
                num_k_blocks,
                BLOCK_C=block_n // 8,
                BLOCK_K=block_k,
                MODE=mode,
                num_warps=config["num_warps"],
            )
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
