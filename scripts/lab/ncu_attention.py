"""Launches the paged decode attention kernel once per page precision, for Nsight Compute.

One layer of the 1.5B shape (12 query heads, 2 KV heads, head size 128) with pages for
`--batch` sequences of `--context` tokens each, scattered as a long-running pool hands them
out; each precision's call runs twice (the first compiles and warms up) with the default
configuration. Run it under ncu, e.g.

    ncu --clock-control none --kernel-name regex:"_decode_kernel" \\
        --section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats \\
        --section InstructionStats python scripts/lab/ncu_attention.py

ncu flushes the caches before each profiled launch, so the pages come from memory as in a
decode step; the second launch of each precision is the one to read.
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/, for bench_paged_attention


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--precisions", default="fp16,int8,int4")
    parser.add_argument("--context", type=int, default=131072)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    from bench_paged_attention import HEAD_DIM, Setup

    from lowvram.kernels.paged_attention import paged_decode_attention

    for precision in args.precisions.split(","):
        setup = Setup.make(precision, args.context, args.batch)
        for _ in range(2):
            paged_decode_attention(
                setup.q, setup.pages, setup.tables[0], setup.context_lens, HEAD_DIM**-0.5, max_context_len=args.context
            )
        torch.cuda.synchronize()
        print(
            precision,
            args.context,
            args.batch,
            f"{setup.bytes_read / 2**20:.0f} MiB of pages read per call",
            flush=True,
        )
        del setup
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
