"""What summing a GEMV's products in float16 would cost in accuracy, measured on the CPU.

The decode GEMV's arithmetic per weight is what bounds it on an H200 (docs/performance.md);
float16 pairs would halve it, but a float16 running sum rounds at every add. This emulates
that form exactly in torch: products x[k] * (q - z) rounded to float16, summed in float16
over `span` consecutive rows, the spans summed in float32 and scaled per group, against the
float64 reference and against the float32 sums the kernels use now. Random AWQ codes at a
real projection shape; x at three magnitudes.

    python scripts/lab/half_accumulation_error.py [--shape r1-distill-qwen-1.5b] [--json out.json]
"""

import argparse
import json
import sys
from pathlib import Path

import torch
from lab_shapes import projection_shapes, random_awq_tensors

from lowvram.bench.record import run_metadata
from lowvram.kernels.awq_format import dequantize_awq

GROUP_SIZE = 128
SPANS = (4, 8, 16, 32)
X_SCALES = (1.0, 4.0, 7.0)


def max_relative_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.double() - ref).abs().max() / ref.abs().max()).item()


def half_span_sums(x: torch.Tensor, centered: torch.Tensor, scales: torch.Tensor, span: int) -> torch.Tensor:
    """float32 y [N]: float16 sums over `span` rows of float16 products, float32 beyond."""
    num_inputs, num_outputs = centered.shape
    products = x.half()[:, None] * centered.half()  # [K, N], each rounded to float16
    y = torch.zeros(num_outputs, dtype=torch.float32)
    for group in range(num_inputs // GROUP_SIZE):
        group_sum = torch.zeros(num_outputs, dtype=torch.float32)
        for start in range(group * GROUP_SIZE, (group + 1) * GROUP_SIZE, span):
            running = torch.zeros(num_outputs, dtype=torch.float16)
            for k in range(start, start + span):
                running = running + products[k]  # float16 + float16, rounded to float16
            group_sum += running.float()
        y += group_sum * scales[group].float()
    return y


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="r1-distill-qwen-1.5b")
    parser.add_argument("--projections", default="qkv,down", help="comma-separated projections")
    parser.add_argument("--json", help="write the record here")
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(0)
    results = []
    for name, (k, n) in projection_shapes(args.shape).items():
        if name not in args.projections.split(","):
            continue
        qweight, qzeros, scales = random_awq_tensors(k, n, GROUP_SIZE, generator=generator)
        centered = dequantize_awq(qweight, qzeros, torch.ones_like(scales), GROUP_SIZE, dtype=torch.float64)
        per_row_scales = scales.double().repeat_interleave(GROUP_SIZE, 0)
        for x_scale in X_SCALES:
            x = (torch.randn(k, generator=generator) * x_scale).half()
            ref = (x.double()[:, None] * centered * per_row_scales).sum(0)
            float32 = (
                (x.float()[:, None] * centered.float()).reshape(k // GROUP_SIZE, GROUP_SIZE, n).sum(1) * scales.float()
            ).sum(0)
            row = {
                "projection": name,
                "k": k,
                "n": n,
                "x_std": x_scale,
                "float32_sums": max_relative_error(float32, ref),
                "float16_output_rounding": max_relative_error(ref.half().float(), ref),
                "float16_spans": {
                    str(span): max_relative_error(half_span_sums(x, centered, scales, span), ref) for span in SPANS
                },
            }
            results.append(row)
            print(json.dumps(row), flush=True)
    if args.json:
        record = {
            **run_metadata(" ".join(["half_accumulation_error.py", *sys.argv[1:]])),
            "shape": args.shape,
            "group_size": GROUP_SIZE,
            "metric": "max |y - ref| / max |ref|, ref in float64",
            "results": results,
        }
        Path(args.json).write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
