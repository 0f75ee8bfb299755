"""Where a decode step's time goes, on a CUDA GPU.

    python scripts/lab/profile_decode.py --shape r1-distill-qwen-1.5b --quantize --emulate-vram-gib 4 \
        --context 512 --batch-sizes 1,8 --json out.json

For eager steps and for CUDA-graph steps it reports the wall time of a decode step and the
GPU time of its kernels, so the gap (launches, Python, the scheduler) is visible; a kernel
timeline of each splits the GPU's idle time into launch gaps and waits for the host. The
quantized model has the profile's FP16-kept layers and compensation rank unless --rank and
--fp16-budget-mib say otherwise. --host-profile adds the Python functions that take a step's host time (cProfile).
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

from lowvram.bench.record import run_metadata
from lowvram.config import load_profile
from lowvram.core.sampling_params import SamplingParams
from lowvram.engine.engine import LLMEngine


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
    parser.add_argument(
        "--rank",
        type=int,
        default=None,
        help="compensation rank of the quantized model (default: the profile's)",
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

    profile = load_profile(args.profile)
    args.rank = profile.compensation_rank if args.rank is None else args.rank
    args.fp16_budget_mib = profile.fp16_budget_mib if args.fp16_budget_mib is None else args.fp16_budget_mib
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
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
