"""Benchmark the W4A16 AWQ kernels on a CUDA GPU.

Decode (M = 1 and 8) is bandwidth-bound, so it is reported as achieved GB/s over the bytes
it must move (qweight + qzeros + scales + x + y) and as a fraction of the measured
device-to-device copy bandwidth; a float16 cuBLAS matmul of the same shape is shown beside
it. Prefill (M = 512) is compute-bound and reported in TFLOP/s for the tl.dot GEMM, for
dequantize-then-cuBLAS, and for a cuBLAS float16 matmul of an already dequantized weight.

    python scripts/lab/bench_w4a16.py [--json PATH] [--sweep]

--sweep also times a few alternative block configurations per shape (takes longer).
"""

import argparse
import datetime
import json
import sys

import torch
import triton
from lab_shapes import random_awq_tensors
from triton.testing import do_bench

from lowvram.bench.record import git_commit, measure_copy_bandwidth_gbps
from lowvram.kernels import w4a16
from lowvram.kernels.w4a16_gemm import choose_gemm_config, launch_awq_dequant, launch_awq_gemm
from lowvram.kernels.w4a16_gemv import choose_gemv_config, launch_awq_gemv

GROUP_SIZE = 128
# (K, N): R1-Distill-Qwen-1.5B q/o, gate/up, down, k/v; deepseek-coder-1.3b gate/up
SHAPES = [(1536, 1536), (1536, 8960), (8960, 1536), (1536, 256), (2048, 5504)]
DECODE_ROWS = (1, 8)
PREFILL_ROWS = 512
COPY_BYTES = 2 * 2**30
WARMUP_MS = 10
REP_MS = 50
GEMV_SWEEP = [
    {"block_n": block_n, "block_k": block_k, "split_k_scale": split_k_scale, "num_warps": 4}
    for block_n in (64, 128, 256)
    for block_k in (64, 128)
    for split_k_scale in (0.5, 1, 2)
]
GEMM_SWEEP = [
    {"block_m": 64, "block_n": 128, "block_k": 64, "num_warps": 4, "num_stages": 3},
    {"block_m": 128, "block_n": 128, "block_k": 64, "num_warps": 8, "num_stages": 3},
    {"block_m": 128, "block_n": 64, "block_k": 64, "num_warps": 4, "num_stages": 4},
    {"block_m": 64, "block_n": 64, "block_k": 128, "num_warps": 4, "num_stages": 3},
    {"block_m": 128, "block_n": 256, "block_k": 64, "num_warps": 8, "num_stages": 3},
]


def median_ms(fn) -> float:
    return do_bench(fn, warmup=WARMUP_MS, rep=REP_MS, return_mode="median")


def measure_copy_gbps() -> float:
    return measure_copy_bandwidth_gbps(COPY_BYTES, "cuda")  # read + write


def random_layer(num_inputs, num_outputs, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return random_awq_tensors(num_inputs, num_outputs, GROUP_SIZE, device="cuda", generator=gen)


def relative_error(y, ref) -> float:
    return ((y.float() - ref).abs().max() / ref.abs().max()).item()


def bench_decode(num_inputs, num_outputs, num_rows, copy_gbps, num_sms, is_sweep):
    qweight, qzeros, scales = random_layer(num_inputs, num_outputs, seed=num_inputs + num_outputs)
    x = torch.randn(num_rows, num_inputs, device="cuda").half()
    y = torch.empty(num_rows, num_outputs, dtype=torch.float16, device="cuda")
    config = choose_gemv_config(num_rows, num_outputs, num_inputs, GROUP_SIZE, num_sms)
    elapsed_ms = median_ms(lambda: launch_awq_gemv(x, qweight, qzeros, scales, GROUP_SIZE, None, y, config))
    ref = w4a16.awq_linear_ref(x, qweight, qzeros, scales, GROUP_SIZE)
    error = relative_error(y, ref)
    weight_fp16 = launch_awq_dequant(qweight, qzeros, scales, GROUP_SIZE)
    fp16_ms = median_ms(lambda: x @ weight_fp16)
    num_bytes = sum(t.numel() * t.element_size() for t in (qweight, qzeros, scales, x, y))
    gbps = num_bytes / elapsed_ms / 1e6
    row = {
        "kind": "decode",
        "K": num_inputs,
        "N": num_outputs,
        "M": num_rows,
        "config": config,
        "ms": elapsed_ms,
        "bytes": num_bytes,
        "gbps": gbps,
        "copy_fraction": gbps / copy_gbps,
        "fp16_matmul_ms": fp16_ms,
        "rel_err": error,
    }
    if is_sweep:
        best_ms, best_config = elapsed_ms, config
        for candidate in GEMV_SWEEP:
            if GROUP_SIZE % candidate["block_k"] != 0:
                continue
            trial = dict(candidate)
            scale = trial.pop("split_k_scale")
            trial["split_k"] = max(1, round(config["split_k"] * scale))
            trial_ms = median_ms(lambda: launch_awq_gemv(x, qweight, qzeros, scales, GROUP_SIZE, None, y, trial))
            if trial_ms < best_ms:
                best_ms, best_config = trial_ms, trial
        row["best_ms"], row["best_config"] = best_ms, best_config
    return row


def bench_prefill(num_inputs, num_outputs, is_sweep):
    qweight, qzeros, scales = random_layer(num_inputs, num_outputs, seed=num_inputs * 3 + num_outputs)
    x = torch.randn(PREFILL_ROWS, num_inputs, device="cuda").half()
    y = torch.empty(PREFILL_ROWS, num_outputs, dtype=torch.float16, device="cuda")
    config = choose_gemm_config(PREFILL_ROWS, GROUP_SIZE)
    gemm_ms = median_ms(lambda: launch_awq_gemm(x, qweight, qzeros, scales, GROUP_SIZE, None, y, config))
    error = relative_error(y, w4a16.awq_linear_ref(x, qweight, qzeros, scales, GROUP_SIZE))
    dequant_matmul_ms = median_ms(lambda: x @ launch_awq_dequant(qweight, qzeros, scales, GROUP_SIZE))
    weight_fp16 = launch_awq_dequant(qweight, qzeros, scales, GROUP_SIZE)
    fp16_ms = median_ms(lambda: x @ weight_fp16)
    flops = 2 * PREFILL_ROWS * num_inputs * num_outputs
    row = {
        "kind": "prefill",
        "K": num_inputs,
        "N": num_outputs,
        "M": PREFILL_ROWS,
        "config": config,
        "ms": gemm_ms,
        "tflops": flops / gemm_ms / 1e9,
        "dequant_matmul_ms": dequant_matmul_ms,
        "dequant_matmul_tflops": flops / dequant_matmul_ms / 1e9,
        "fp16_matmul_ms": fp16_ms,
        "fp16_matmul_tflops": flops / fp16_ms / 1e9,
        "rel_err": error,
    }
    if is_sweep:
        best_ms, best_config = gemm_ms, config
        for trial in GEMM_SWEEP:
            trial_ms = median_ms(lambda: launch_awq_gemm(x, qweight, qzeros, scales, GROUP_SIZE, None, y, trial))
            if trial_ms < best_ms:
                best_ms, best_config = trial_ms, trial
        row["best_ms"], row["best_config"] = best_ms, best_config
    return row


def print_tables(copy_gbps, rows):
    print(f"device-to-device copy: {copy_gbps:,.0f} GB/s (read + write)\n")
    print(
        f"{'decode':8} {'K':>5} {'N':>5} {'M':>3} {'us':>8} {'GB/s':>8} {'of copy':>8} "
        f"{'fp16 us':>8} {'rel err':>8}  config"
    )
    for row in rows:
        if row["kind"] != "decode":
            continue
        best = f"  best {row['best_ms'] * 1e3:.1f} us {row['best_config']}" if "best_ms" in row else ""
        print(
            f"{'':8} {row['K']:>5} {row['N']:>5} {row['M']:>3} {row['ms'] * 1e3:>8.1f} "
            f"{row['gbps']:>8.0f} {row['copy_fraction']:>8.1%} {row['fp16_matmul_ms'] * 1e3:>8.1f} "
            f"{row['rel_err']:>8.1e}  {row['config']}{best}"
        )
    print(
        f"\n{'prefill':8} {'K':>5} {'N':>5} {'M':>3} {'us':>8} {'TFLOP/s':>8} "
        f"{'dq+mm':>8} {'fp16 mm':>8} {'rel err':>8}  (TFLOP/s)"
    )
    for row in rows:
        if row["kind"] != "prefill":
            continue
        best = f"  best {row['best_ms'] * 1e3:.1f} us {row['best_config']}" if "best_ms" in row else ""
        print(
            f"{'':8} {row['K']:>5} {row['N']:>5} {row['M']:>3} {row['ms'] * 1e3:>8.1f} "
            f"{row['tflops']:>8.1f} {row['dequant_matmul_tflops']:>8.1f} "
            f"{row['fp16_matmul_tflops']:>8.1f} {row['rel_err']:>8.1e}{best}"
        )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    parser.add_argument("--sweep", action="store_true", help="time alternative block configurations")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_w4a16 needs a CUDA GPU", file=sys.stderr)
        return 2

    torch.manual_seed(0)
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    copy_gbps = measure_copy_gbps()
    rows = []
    for num_inputs, num_outputs in SHAPES:
        for num_rows in DECODE_ROWS:
            rows.append(bench_decode(num_inputs, num_outputs, num_rows, copy_gbps, num_sms, args.sweep))
    for num_inputs, num_outputs in SHAPES:
        rows.append(bench_prefill(num_inputs, num_outputs, args.sweep))
    print_tables(copy_gbps, rows)

    if args.json:
        record = {
            "command": " ".join([sys.executable, *sys.argv]),
            "gpu": torch.cuda.get_device_name(0),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "git_commit": git_commit(),
            "torch": torch.__version__,
            "triton": triton.__version__,
            "group_size": GROUP_SIZE,
            "copy_gbps": copy_gbps,
            "rows": rows,
        }
        with open(args.json, "w") as handle:
            json.dump(record, handle, indent=2)
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
