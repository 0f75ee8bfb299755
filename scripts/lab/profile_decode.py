"""Where a decode step's time goes, on a CUDA GPU.

    python scripts/lab/profile_decode.py --shape r1-distill-qwen-1.5b --quantize --emulate-vram-gib 4 \
        --context 512 --batch-sizes 1,8 --json out.json [--sweep-gemv]

For eager steps and for CUDA-graph steps it reports the wall time of a decode step and the
GPU time of its kernels, so the gap (launches, Python, the scheduler) is visible; a kernel
timeline of each splits the GPU's idle time into launch gaps and waits for the host. The
quantized model has the profile's FP16-kept layers and compensation rank unless --rank and
--fp16-budget-mib say otherwise. --sweep-gemv times the W4A16 decode kernel's block
configurations on the model's real shapes inside CUDA graphs, each call on weights not in
L2, which is what the tuned table in w4a16_gemv comes from (--sweep-gemv-only: just that).
--host-profile adds the Python functions that take a step's host time (cProfile).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from lab_shapes import (
    PROJECTIONS,
    attention_sizes,
    fused_projection_parts,
    layer_projection_shapes,
    projection_shapes,
    random_awq_tensors,
)

from lowvram.bench.record import run_metadata
from lowvram.config import load_profile
from lowvram.core.sampling_params import SamplingParams
from lowvram.engine.engine import LLMEngine
from lowvram.models.shapes import shape_config


def start_decoding(engine: LLMEngine, batch_size: int, context: int, num_tokens: int) -> None:
    vocab = engine.config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True)
    for b in range(batch_size):
        ids = [(31 * i + 7 * b) % (vocab - 10) + 5 for i in range(context)]
        engine.add_request(f"r{b}", None, params, prompt_token_ids=ids)
    while any(seq.num_uncomputed_tokens > 1 for seq in engine.requests.values()):  # until every prompt is in
        engine.step()
    engine.step()


def time_decode(engine: LLMEngine, num_steps: int) -> dict:
    """Wall time per decode step and the GPU time of the runner's work inside it."""
    run = engine.runner.run
    gpu_ms = []

    def timed_run(batch, **kwargs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        logits = run(batch, **kwargs)
        end.record()
        gpu_ms.append((start, end))
        return logits

    engine.runner.run = timed_run
    torch.cuda.synchronize()
    begin = time.perf_counter()
    for _ in range(num_steps):
        engine.step()
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - begin) * 1000 / num_steps
    engine.runner.run = run
    runner_ms = sum(s.elapsed_time(e) for s, e in gpu_ms) / len(gpu_ms)
    return {"step_ms": round(wall_ms, 3), "runner_gpu_span_ms": round(runner_ms, 3)}


def host_profile(engine: LLMEngine, num_steps: int, top: int = 25) -> list[dict]:
    """cProfile of decode steps: the Python functions that take the host's time per step."""
    import cProfile

    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(num_steps):
        engine.step()
    torch.cuda.synchronize()
    profiler.disable()
    return cprofile_rows(profiler, num_steps, top)


def cprofile_rows(profiler, num_steps: int, top: int) -> list[dict]:
    """A cProfile run's `top` functions by own time, per step of the `num_steps` it ran."""
    import pstats

    rows = []
    for (filename, line, name), (_, calls, tottime, cumtime, _) in pstats.Stats(profiler).stats.items():
        where = f"{Path(filename).name}:{line}:{name}" if line else name
        rows.append(
            {
                "function": where[:90],
                "calls_per_step": round(calls / num_steps, 2),
                "self_us_per_step": round(1e6 * tottime / num_steps, 2),
                "cumulative_us_per_step": round(1e6 * cumtime / num_steps, 2),
            }
        )
    rows.sort(key=lambda r: -r["self_us_per_step"])
    return rows[:top]


def kernel_table(engine: LLMEngine, num_steps: int) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(num_steps):
            engine.step()
        torch.cuda.synchronize()
    rows = []
    for event in prof.key_averages():
        device_us = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
        if device_us > 0 and event.count:
            rows.append(
                {
                    "kernel": event.key[:90],
                    "calls_per_step": event.count / num_steps,
                    "us_per_step": round(device_us / num_steps, 1),
                }
            )
    rows.sort(key=lambda r: -r["us_per_step"])
    return rows


# A gap between two kernels longer than this is the GPU waiting for the host (the step's
# Python); shorter ones are launch gaps inside a graph or a burst of launches.
HOST_GAP_US = 40.0


def kernel_timeline(engine: LLMEngine, num_steps: int, top: int = 15) -> dict:
    """Where the GPU's time goes between the kernels of decode steps, graphs included: each
    kernel's start and end from the profiler, so the idle time splits into launch gaps
    (< HOST_GAP_US) and waits for the host, and each kernel name gets its time and the gaps
    before it."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(num_steps):
            engine.step()
        torch.cuda.synchronize()
    kernels = []
    for event in prof.profiler.kineto_results.events():
        if event.device_type() == torch.autograd.DeviceType.CUDA and event.duration_ns() > 0:
            kernels.append((event.start_ns() / 1000, event.duration_ns() / 1000, event.name()))
    kernels.sort()
    if len(kernels) < 2:
        return {"error": "the profiler recorded no kernels"}
    by_name: dict[str, dict] = {}
    launch_gap_us = host_gap_us = 0.0
    previous_end = kernels[0][0]
    for start, duration, name in kernels:
        gap = max(0.0, start - previous_end)
        row = by_name.setdefault(name[:70], {"kernel": name[:70], "calls": 0, "us": 0.0, "gap_before_us": 0.0})
        row["calls"] += 1
        row["us"] += duration
        if gap < HOST_GAP_US:
            launch_gap_us += gap
            row["gap_before_us"] += gap
        else:
            host_gap_us += gap
        previous_end = max(previous_end, start + duration)
    span_us = previous_end - kernels[0][0]
    rows = sorted(by_name.values(), key=lambda r: -(r["us"] + r["gap_before_us"]))
    per_step = lambda v: round(v / num_steps, 1)  # noqa: E731
    return {
        "steps": num_steps,
        "kernels_per_step": round(len(kernels) / num_steps, 1),
        "span_us_per_step": per_step(span_us),
        "kernel_us_per_step": per_step(sum(d for _, d, _ in kernels)),
        "launch_gap_us_per_step": per_step(launch_gap_us),
        "host_gap_us_per_step": per_step(host_gap_us),
        "kernels": [
            {
                "kernel": r["kernel"],
                "calls_per_step": round(r["calls"] / num_steps, 1),
                "us_per_step": per_step(r["us"]),
                "gap_before_us_per_step": per_step(r["gap_before_us"]),
            }
            for r in rows[:top]
        ],
    }


def profile_prefill(engine: LLMEngine, num_tokens: int) -> dict:
    """One long prompt through chunked prefill: tokens/s, and the kernel table of its steps."""
    from torch.profiler import ProfilerActivity, profile

    vocab = engine.config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    ids = [(13 * i + 3) % (vocab - 10) + 5 for i in range(num_tokens)]
    engine.add_request("warm", None, params, prompt_token_ids=ids[:512])
    finish_all(engine)
    engine.add_request("prefill", None, params, prompt_token_ids=ids)
    torch.cuda.synchronize()
    begin = time.perf_counter()
    num_steps = 0
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        while engine.has_unfinished_requests():
            engine.step()
            num_steps += 1
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - begin
    rows = []
    for event in prof.key_averages():
        device_us = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
        if device_us > 0:
            rows.append({"kernel": event.key[:90], "calls": event.count, "ms": round(device_us / 1000, 2)})
    rows.sort(key=lambda r: -r["ms"])
    return {
        "prompt_tokens": num_tokens,
        "steps": num_steps,
        "seconds_profiled": round(elapsed, 3),
        "tokens_per_s_profiled": round(num_tokens / elapsed, 1),
        "kernel_ms_total": round(sum(r["ms"] for r in rows), 1),
        "kernels": rows[:25],
    }


def finish_all(engine: LLMEngine) -> None:
    while engine.has_unfinished_requests():
        engine.step()


def finish(engine: LLMEngine) -> None:
    for request_id in list(engine.requests):
        engine.abort_request(request_id)
    while engine.has_unfinished_requests():
        engine.step()


def gemv_candidates(rows: int, n: int, k: int, group_size: int, num_sms: int) -> list[dict]:
    """Block configurations to time: the interleaving kernel, and for one row the lane
    kernel with either reduction (see w4a16_gemv), each at split-K around two programs per SM
    and at one or two K blocks per program."""
    import triton

    def splits(bn: int, bk: int) -> list[int]:
        auto = max(1, triton.cdiv(2 * num_sms, triton.cdiv(n, bn)))
        # ... and one or two K blocks per program: every load of a program issued at once
        one_block = k // bk
        return sorted(
            s
            for s in {auto, max(1, auto // 2), 2 * auto, 1, 2, 4, 8, one_block, max(1, one_block // 2)}
            if s <= one_block
        )

    found = []
    if rows > 1:  # the interleaving kernel: one row is always faster in the lane kernel
        found += [
            {"block_n": bn, "block_k": bk, "split_k": sk, "num_warps": 4}
            for bn in (64, 128)
            for bk in (64, 128)
            if bk <= group_size
            for sk in splits(bn, bk)
        ]
    if rows == 1:
        # the lane kernel over tile sizes, reductions and splits
        found += [
            {"block_n": bn, "block_k": bk, "split_k": sk, "num_warps": w, "unpack": "lanes", "reduce": r}
            for bn in (64, 128)
            for bk in (64, 128)
            if bk <= group_size
            for r in ("block", "end")
            for w in (4,)
            for sk in splits(bn, bk)
        ]
        # the K-in-thread form: column blocks x row tiles x loads per step x warps, each thread
        # four or eight words of a row per load, at about 4, 8 and 16 programs per SM (the
        # first sweep's 512- and 1024-column blocks were never among the best)
        for bn, tile_rows, unroll, w in (
            (256, 16, 2, 4),
            (256, 8, 2, 2),
            (128, 16, 2, 2),
            (128, 16, 4, 2),
            (64, 16, 2, 1),
            (64, 32, 2, 2),
        ):
            if group_size % (tile_rows * unroll):
                continue
            blocks = triton.cdiv(n, bn)
            for per_sm in (4, 8, 16):
                sk = max(1, min(k // group_size, triton.cdiv(per_sm * num_sms, blocks)))
                found.append(
                    {
                        "block_n": bn,
                        "block_k": group_size,
                        "split_k": sk,
                        "num_warps": w,
                        "unpack": "rows",
                        "tile_rows": tile_rows,
                        "unroll": unroll,
                    }
                )
    return found


# The sweep's graph calls each layer over copies of its weights this large in all, so every
# call reads them from memory as a decode step does (an H200's L2 holds 50 MB).
SWEEP_COLD_BYTES = 256 * 2**20


def compensation_factors(
    num_inputs: int, parts: tuple[int, ...], rank: int, device: str = "cuda"
) -> tuple[torch.Tensor, torch.Tensor]:
    """A [R, K] and Bt [R, N] of a rank-`rank` compensation on each of a fused layer's `parts`
    (their output sizes, in order), as lowvram.models.fusion joins them: R = rank * len(parts), B
    block diagonal, Bt a contiguous [R, N] as the layer passes it."""
    total = rank * len(parts)
    lora_a = torch.randn(total, num_inputs, dtype=torch.float16, device=device) * 0.01
    lora_bt = torch.zeros(total, sum(parts), dtype=torch.float16, device=device)
    start = 0
    for index, size in enumerate(parts):
        lora_bt[index * rank : (index + 1) * rank, start : start + size] = torch.randn(rank, size, device=device) * 0.01
        start += size
    return lora_a, lora_bt


def sweep_gemv(
    shapes: dict[str, tuple[int, int]],
    group_size: int,
    rank: int = 0,
    row_counts: tuple[int, ...] = (1, 8),
    only_shapes: str = "",
    forms: str = "",
    parts: dict[str, tuple[int, ...]] | None = None,
) -> list[dict]:
    """Times W4A16 decode kernel configurations on projection shapes (name -> (K, N),
    lab_shapes.layer_projection_shapes), with a rank-`rank` compensation as the profile's
    quantization adds (0: none). Each timed graph runs one call over each of several copies
    of the weights (SWEEP_COLD_BYTES): from memory, not from L2. `forms` (comma-separated
    "unpack" values: interleave, lanes, rows) limits the candidates besides the default.
    `parts` gives a fused layer's output sizes (q, k, v; gate, up): its compensation then has
    the model's rank, one block of `rank` per part (compensation_factors)."""
    from triton.testing import do_bench_cudagraph

    from lowvram.kernels.w4a16 import InputNorm
    from lowvram.kernels.w4a16_gemv import (
        choose_gemv_config,
        decode_gemv_config,
        invariant_gemv_config,
        launch_awq_gemv,
    )

    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    results = []
    for name, (k, n) in shapes.items():
        if only_shapes and name not in only_shapes.split(","):
            continue
        nbytes = k * n // 2 + k // group_size * n // 2 + k // group_size * n * 2
        num_copies = max(1, min(64, SWEEP_COLD_BYTES // nbytes))
        copies = [random_awq_tensors(k, n, group_size, device="cuda") for _ in range(num_copies)]
        lora = compensation_factors(k, (parts or {}).get(name, (n,)), rank) if rank else (None, None)
        for rows in row_counts:
            # The one-row decode path's prologues, as the model runs them (awq_linear): RMSNorm
            # and the residual sum before q/k/v and gate/up, silu(gate) * up before down.
            norm = None
            if rows == 1 and name in ("qkv", "gate_up"):
                norm = InputNorm(
                    torch.rand(k, dtype=torch.float16, device="cuda") + 0.5,
                    1e-6,
                    torch.randn(1, k, dtype=torch.float16, device="cuda"),
                    torch.empty(1, k, dtype=torch.float16, device="cuda"),
                )
            is_gated = rows == 1 and name == "down"
            x = torch.randn(rows, 2 * k if is_gated else k, dtype=torch.float16, device="cuda")
            y = torch.empty(rows, n, dtype=torch.float16, device="cuda")

            def calls(cfg: dict, x=x, y=y, norm=norm, is_gated=is_gated, has_prologue=True) -> None:
                for qweight, qzeros, scales in copies:
                    if has_prologue:
                        launch_awq_gemv(
                            x, qweight, qzeros, scales, group_size, None, y, cfg, *lora, norm=norm, is_gated=is_gated
                        )
                    else:  # the batch-invariant form has no prologues: the model runs them as kernels of their own
                        launch_awq_gemv(x[:, :k], qweight, qzeros, scales, group_size, None, y, cfg, *lora)

            def time_config(cfg: dict, has_prologue: bool = True) -> dict:
                try:
                    ms = do_bench_cudagraph(lambda: calls(cfg, has_prologue=has_prologue), rep=20) / num_copies
                except Exception as exc:  # an invalid configuration for this shape
                    return {"config": cfg, "error": str(exc)[:80]}
                return {"config": cfg, "us": round(ms * 1000, 2), "gbps": round(nbytes / ms / 1e6, 1)}

            default = decode_gemv_config(rows, n, k, group_size, num_sms, bool(rank))
            lanes_default = choose_gemv_config(rows, n, k, group_size, num_sms)
            candidates = (
                [default]
                + ([lanes_default] if lanes_default != default else [])
                + [
                    c
                    for c in gemv_candidates(rows, n, k, group_size, num_sms)
                    if not forms or c.get("unpack", "interleave") in forms.split(",")
                ]
            )
            if rank and rows == 1:  # the compensation's x A^T in every column block, as before
                candidates.append({**default, "lora": "per_block" if default.get("lora") == "once" else "once"})
            timed = [time_config(cfg) for cfg in candidates]
            ok = [t for t in timed if "us" in t]
            # Second pass around the five fastest: the warp count (pipelining depths 1-4
            # measured the same on an H200), and with compensation for the one-row lane kernel
            # the other place to sum x A^T's products ("lora_reduce": "end" or per K block).
            for t in sorted(ok, key=lambda t: t["us"])[:5]:
                for warps in (2, 8):
                    timed.append(time_config({**t["config"], "num_warps": warps}))
                if rank and rows == 1 and t["config"].get("unpack") == "lanes":
                    other = "block" if t["config"].get("lora_reduce") == "end" else "end"
                    timed.append(time_config({**t["config"], "lora_reduce": other}))
            ok = [t for t in timed if "us" in t]
            best = min(ok, key=lambda t: t["us"])
            invariant = time_config(invariant_gemv_config(n, k, group_size, num_sms), has_prologue=False)
            by_form = {}
            for t in ok:
                if t["config"].get("unpack") == "rows":
                    form = "rows/{block_n}/{tile_rows}x{unroll}/w{num_warps}".format(**t["config"])
                    if form not in by_form or t["us"] < by_form[form]["us"]:
                        by_form[form] = t
                    continue
                form = "/".join(
                    (
                        t["config"].get("unpack", "interleave"),
                        t["config"].get("reduce", "block"),
                        t["config"].get("dequant", "magic" if t["config"].get("unpack") else "convert"),
                        t["config"].get("lora", "once"),
                        "lora-end" if t["config"].get("lora_reduce") == "end" else "",
                    )
                )
                if form not in by_form or t["us"] < by_form[form]["us"]:
                    by_form[form] = t
            results.append(
                {
                    "shape": name,
                    "k": k,
                    "n": n,
                    "rows": rows,
                    "weight_bytes": nbytes,
                    "lora_rank": rank,
                    "num_weight_copies": num_copies,
                    "best_by_form": by_form,
                    "default": ok[0] if ok and ok[0]["config"] is default else None,
                    "best": best,
                    "batch_invariant": invariant,
                    "top5": sorted(ok, key=lambda t: t["us"])[:5],
                }
            )
            print("   best by form: " + ", ".join(f"{f} {t['us']} us" for f, t in by_form.items()))
            print(
                json.dumps(
                    results[-1]["best"]
                    | {
                        "shape": name,
                        "rows": rows,
                        "default_us": results[-1]["default"]["us"] if results[-1]["default"] else None,
                    }
                )
            )
    return results


def sweep_shape_only(args) -> int:
    """--sweep-gemv-only: the GEMV sweep on a named shape's projection sizes ("head": the
    vocabulary projection, as an INT4 lm_head runs it)."""
    shapes = projection_shapes(args.shape)
    config = shape_config(args.shape)
    if "head" in args.sweep_shapes.split(","):
        shapes["head"] = (config["hidden_size"], config["vocab_size"])
    parts = fused_projection_parts(config["intermediate_size"], *attention_sizes(config))
    row_counts = tuple(int(r) for r in args.sweep_rows.split(","))
    metadata = run_metadata(" ".join(["profile_decode.py", *sys.argv[1:]]))
    record = {**metadata, "shape": args.shape, "group_size": args.group_size, "lora_rank": args.rank, "gemv_sweep": []}
    # in --sweep-shapes' order, and written after each shape: a run stopped by its time limit keeps those done
    names = [name for name in args.sweep_shapes.split(",") if name in shapes] if args.sweep_shapes else list(shapes)
    for name in names:
        results = sweep_gemv(
            {name: shapes[name]}, args.group_size, args.rank, row_counts, args.sweep_shapes, args.sweep_forms, parts
        )
        record["gemv_sweep"] += results
        if args.json:
            Path(args.json).write_text(json.dumps(record, indent=2) + "\n")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--shape", default="r1-distill-qwen-1.5b")
    parser.add_argument("--quantize", action="store_true")
    parser.add_argument("--profile", default="4gb")
    parser.add_argument("--emulate-vram-gib", type=float, default=None)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--sweep-gemv", action="store_true")
    parser.add_argument(
        "--sweep-gemv-only",
        action="store_true",
        help="only the GEMV sweep, on the shape's projections (no engine, no profile)",
    )
    parser.add_argument("--group-size", type=int, default=128, help="AWQ group size of --sweep-gemv-only")
    parser.add_argument("--sweep-rows", default="1,8", help="row counts of --sweep-gemv-only")
    parser.add_argument(
        "--sweep-shapes",
        default="",
        help=f"projections the GEMV sweep times, from {','.join(PROJECTIONS)} (default all), "
        "and head (the vocabulary projection, only when named)",
    )
    parser.add_argument(
        "--sweep-forms",
        default="",
        help="GEMV forms the sweep times besides the default, from interleave,lanes,rows (default all)",
    )
    parser.add_argument(
        "--rank",
        type=int,
        default=None,
        help="compensation rank of the quantized model and the sweep (default: the profile's)",
    )
    parser.add_argument(
        "--fp16-budget-mib",
        type=float,
        default=None,
        help="FP16-kept layers of the quantized model (default: the profile's)",
    )
    parser.add_argument("--host-profile", action="store_true", help="cProfile the decode steps (Python's share)")
    parser.add_argument("--prefill-tokens", type=int, default=8192)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    unknown = set(filter(None, args.sweep_shapes.split(","))) - set(PROJECTIONS) - {"head"}
    if unknown:
        parser.error(
            f"--sweep-shapes: unknown projections {', '.join(sorted(unknown))}; "
            f"choose from {', '.join(PROJECTIONS)}, head"
        )

    profile = load_profile(args.profile)
    args.rank = profile.compensation_rank if args.rank is None else args.rank
    args.fp16_budget_mib = profile.fp16_budget_mib if args.fp16_budget_mib is None else args.fp16_budget_mib
    if args.sweep_gemv_only:
        return sweep_shape_only(args)
    work = Path(tempfile.mkdtemp(prefix="lowvram-profile-"))
    model = args.model
    if model is None and args.quantize:
        from lowvram.models.shapes import random_awq_checkpoint

        model = str(
            random_awq_checkpoint(
                args.shape,
                work,
                emulate_vram_gib=args.emulate_vram_gib,
                rank=args.rank,
                fp16_budget_mib=args.fp16_budget_mib,
            )[1]
        )
    elif model is None:
        from lowvram.models.shapes import cached_checkpoint, write_random_checkpoint

        model = str(cached_checkpoint(f"{args.shape}-bf16", lambda d: write_random_checkpoint(d, args.shape), work))
    elif args.quantize:
        from lowvram.quant.quantize import quantize_model

        quantize_model(
            model,
            work / "awq",
            num_samples=8,
            emulate_vram_gib=args.emulate_vram_gib,
            rank=args.rank,
            fp16_budget_mib=args.fp16_budget_mib,
        )
        model = str(work / "awq")
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    base = profile.replace(
        emulate_vram_gib=args.emulate_vram_gib,
        max_model_len=max(args.context + 3 * args.steps + 64, args.prefill_tokens + 16),
        max_num_seqs=max(batch_sizes),
    )
    record = {**run_metadata(" ".join(["profile_decode.py", *sys.argv[1:]])), "runs": []}
    engine = None
    for use_graphs in (False, True):
        del engine
        gc.collect()  # the eager engine's weights must be gone before the next one measures memory
        torch.cuda.empty_cache()
        engine = LLMEngine(model, base.replace(enable_cuda_graphs=use_graphs))
        for batch_size in batch_sizes:
            start_decoding(engine, batch_size, args.context, 3 * args.steps)
            for _ in range(4):  # graph captures and compilations happen here, not in the timing
                engine.step()
            timing = time_decode(engine, args.steps)
            run = {
                "cuda_graphs": use_graphs,
                "batch_size": batch_size,
                "context": args.context,
                **timing,
                "tokens_per_s": round(1000 * batch_size / timing["step_ms"], 1),
            }
            if not use_graphs and batch_size == 1:
                kernels = kernel_table(engine, 8)
                run["kernels"] = kernels[:25]
                run["kernel_gpu_us_per_step"] = round(sum(r["us_per_step"] for r in kernels), 1)
            run["timeline"] = kernel_timeline(engine, 16)
            if args.host_profile:
                run["host_functions"] = host_profile(engine, 16)
            run["controller_events"] = [e.reason for e in engine.controller_events]
            run["kv_precision"] = engine.kv_precision
            run["kv_backend"] = engine.kv_pool.backend
            if use_graphs:
                run["graph_replays"] = engine.runner.graphs.num_replays
                run["graph_captures"] = engine.runner.graphs.num_captures
            record["runs"].append(run)
            print(json.dumps({k: v for k, v in run.items() if k not in ("kernels", "host_functions", "timeline")}))
            timeline = run["timeline"]
            print("  timeline per step: " + json.dumps({k: v for k, v in timeline.items() if k != "kernels"}))
            for row in timeline.get("kernels", []):
                print(
                    f"    {row['us_per_step']:>8.1f} us + {row['gap_before_us_per_step']:>7.1f} us gaps "
                    f"{row['calls_per_step']:>6.1f} calls  {row['kernel']}"
                )
            for row in run.get("host_functions", [])[:12]:
                print(
                    f"    {row['self_us_per_step']:>9.1f} us self {row['cumulative_us_per_step']:>9.1f} us cum "
                    f"{row['calls_per_step']:>7.1f} calls  {row['function']}"
                )
            finish(engine)
    record["prefill"] = profile_prefill(engine, args.prefill_tokens)
    print(json.dumps({k: v for k, v in record["prefill"].items() if k != "kernels"}))
    if args.sweep_gemv and engine.config.quantization is not None:
        c = engine.config
        shapes = layer_projection_shapes(c.hidden_size, c.intermediate_size, c.q_size, c.kv_size)
        record["gemv_sweep"] = sweep_gemv(
            shapes,
            c.quantization.group_size,
            args.rank,
            parts=fused_projection_parts(c.intermediate_size, c.q_size, c.kv_size),
        )
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
