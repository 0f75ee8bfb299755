"""What the decode GEMV's memory access alone costs: the floor under each kernel form.

For each projection of a shape, a kernel with the decode GEMV's grid and tiles reads the
packed INT4 words exactly as the kernel does and only adds them up (mode "read": no
unpacking, no scales, no compensation, one store per program); the copy of a tensor of the
same size and a plain elementwise read give the GPU's own figures. Two more modes add the
arithmetic of dequantizing and multiplying every nibble, without the GEMV's sums across
threads, scales, compensation or split-K epilogue: "f32" as the lane kernel does it, one
nibble per instruction in float32; "half2" two nibbles per instruction in float16 pairs
(inline PTX: lop3, sub.f16x2, fma.rn.f16x2). Everything is timed from memory, over enough
copies of the weights to leave L2 (as profile_decode.py's sweep does).

    python scripts/lab/probe_gemv_floor.py [--shape r1-distill-qwen-1.5b] [--json out.json]
"""

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

from lowvram.bench.record import run_metadata

COLD_BYTES = 256 * 2**20


# What a probe kernel does with each tile of packed words besides reading it.
MODE_READ = 0  # add the words up: the memory floor
MODE_F32 = 1  # the lane kernel's per-nibble float work: shift, mask, bit-trick float, subtract, FMA
MODE_HALF2 = 2  # two nibbles per instruction: lop3 into float16 pairs, sub.f16x2, fma.rn.f16x2
MODES = {"read": MODE_READ, "f32": MODE_F32, "half2": MODE_HALF2}
FLOAT32_ZERO = tl.constexpr(8388616.0)  # 2**23 + 8: the bit-trick float of a zero of 8
HALF2_ZERO = tl.constexpr(0x64086408)  # two float16 1032.0: 1024 + a zero of 8, in each half


@triton.jit
def _half2_dequant_fma(acc0, acc1, acc2, acc3, words, zero2, x2):
    """acc_i (float16 pairs as int32) += x * (q - z) for the nibble pairs (i, i + 4) of each
    word: AWQ's order puts adjacent columns in them, and one lop3 makes both float16s."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 t, s;
        lop3.b32 t, $8, 0x000F000F, 0x64006400, 0xEA;
        sub.f16x2 t, t, $9;
        fma.rn.f16x2 $0, t, $10, $4;
        shr.b32 s, $8, 4;
        lop3.b32 t, s, 0x000F000F, 0x64006400, 0xEA;
        sub.f16x2 t, t, $9;
        fma.rn.f16x2 $1, t, $10, $5;
        shr.b32 s, $8, 8;
        lop3.b32 t, s, 0x000F000F, 0x64006400, 0xEA;
        sub.f16x2 t, t, $9;
        fma.rn.f16x2 $2, t, $10, $6;
        shr.b32 s, $8, 12;
        lop3.b32 t, s, 0x000F000F, 0x64006400, 0xEA;
        sub.f16x2 t, t, $9;
        fma.rn.f16x2 $3, t, $10, $7;
        }""",
        constraints="=r,=r,=r,=r,r,r,r,r,r,r,r",
        args=[acc0, acc1, acc2, acc3, words, zero2, x2],
        dtype=(tl.int32, tl.int32, tl.int32, tl.int32),
        is_pure=True,
        pack=1,
    )


@triton.jit
def _read_tiles_kernel(
    qweight_ptr,
    x_ptr,
    out_ptr,
    num_packed_cols,
    K_BLOCKS_PER_SPLIT,
    NUM_K_BLOCKS,
    BLOCK_C: tl.constexpr,
    BLOCK_K: tl.constexpr,
    MODE: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_c = pid_n * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_c = offs_c < num_packed_cols
    total = tl.zeros((BLOCK_C,), dtype=tl.int32)
    acc = tl.zeros((BLOCK_K, BLOCK_C), dtype=tl.float32)
    acc0 = tl.zeros((BLOCK_K, BLOCK_C), dtype=tl.int32)
    acc1 = tl.zeros_like(acc0)
    acc2 = tl.zeros_like(acc0)
    acc3 = tl.zeros_like(acc0)
    kb_start = pid_k * K_BLOCKS_PER_SPLIT
    for kb in range(kb_start, tl.minimum(kb_start + K_BLOCKS_PER_SPLIT, NUM_K_BLOCKS)):
        offs_k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        packed = tl.load(
            qweight_ptr + offs_k[:, None] * num_packed_cols + offs_c[None, :], mask=mask_c[None, :], other=0
        )
        if MODE == 0:
            total += tl.sum(packed, axis=0)
        elif MODE == 1:
            x = tl.load(x_ptr + offs_k).to(tl.float32)[:, None]
            for j in tl.static_range(8):
                codes = (((packed >> (4 * j)) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True)
                acc += x * (codes - FLOAT32_ZERO)
        else:
            x_bits = tl.load(x_ptr + offs_k).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
            x2 = tl.broadcast_to((x_bits | (x_bits << 16))[:, None], (BLOCK_K, BLOCK_C))
            zero2 = tl.full((BLOCK_K, BLOCK_C), HALF2_ZERO, tl.int32)
            acc0, acc1, acc2, acc3 = _half2_dequant_fma(acc0, acc1, acc2, acc3, packed, zero2, x2)
    if MODE == 1:
        total = tl.sum(acc, axis=0).to(tl.int32, bitcast=True)
    elif MODE == 2:
        total = tl.sum(acc0 ^ acc1 ^ acc2 ^ acc3, axis=0)
    tl.store(out_ptr + (pid_k * tl.num_programs(0) + pid_n) * BLOCK_C + tl.arange(0, BLOCK_C), total)


def time_cold(fn_over_copies, num_copies: int) -> float:
    """Microseconds per call of one graph that calls once per weight copy."""
    from triton.testing import do_bench_cudagraph

    return do_bench_cudagraph(fn_over_copies, rep=20) / num_copies * 1000


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="r1-distill-qwen-1.5b")
    parser.add_argument(
        "--modes",
        default="read,f32,half2",
        help="what the probe does with the words: read (the floor), f32, half2 (see MODES)",
    )
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    from lab_shapes import projection_shapes

    shapes = projection_shapes(args.shape)
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    tilings = [  # (block_n, block_k, num_warps, split rule); "lanes": the one-row GEMV's own
        (64, 128, 4, "lanes"),
        (64, 128, 4, "k/128"),
        (256, 32, 1, "k/128"),
        (256, 64, 1, "k/256"),
        (512, 64, 4, "k/128"),
        (1024, 16, 4, "k/128"),
    ]
    modes = args.modes.split(",")
    results = []
    for name, (k, n) in shapes.items():
        nbytes = k * n // 2
        num_copies = max(1, min(64, COLD_BYTES // nbytes))
        copies = [
            torch.randint(-(2**31), 2**31 - 1, (k, n // 8), dtype=torch.int32, device="cuda") for _ in range(num_copies)
        ]
        x = torch.randn(k, dtype=torch.float16, device="cuda")
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

            for mode in modes:

                def calls(
                    block_n=block_n,
                    block_k=block_k,
                    warps=warps,
                    per_split=per_split,
                    out=out,
                    grid=grid,
                    num_k_blocks=num_k_blocks,
                    mode=mode,
                ):
                    for w in copies:
                        _read_tiles_kernel[grid](
                            w,
                            x,
                            out,
                            n // 8,
                            per_split,
                            num_k_blocks,
                            BLOCK_C=block_n // 8,
                            BLOCK_K=block_k,
                            MODE=MODES[mode],
                            num_warps=warps,
                        )

                timing = {
                    "mode": mode,
                    "block_n": block_n,
                    "block_k": block_k,
                    "num_warps": warps,
                    "split_k": split,
                    "programs": num_n_blocks * split,
                }
                try:
                    us = time_cold(calls, num_copies)
                except Exception as exc:  # e.g. the inline assembly on a GPU without float16 pairs
                    row["tilings"].append(timing | {"error": str(exc)[:200]})
                    continue
                row["tilings"].append(timing | {"us": round(us, 2), "gbps": round(nbytes / us / 1e3, 1)})
        results.append(row)
        best = {
            mode: min(
                (t for t in row["tilings"] if t["mode"] == mode and "us" in t), key=lambda t: t["us"], default=None
            )
            for mode in modes
        }
        print(json.dumps({k2: v for k2, v in row.items() if k2 != "tilings"} | {"best_by_mode": best}))
        for t in row["tilings"]:
            print("   ", json.dumps(t))
    record = {**run_metadata(" ".join(["probe_gemv_floor.py", *sys.argv[1:]])), "shape": args.shape, "results": results}
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
