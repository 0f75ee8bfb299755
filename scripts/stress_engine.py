"""Stress the engine with many concurrent requests, with the feedback controller off and on.

    python scripts/stress_engine.py --shape r1-distill-qwen-1.5b --quantize --profile 4gb \\
        --emulate-vram-gib 4 --num-requests 64 --max-prompt-tokens 16384 --max-output-tokens 64 \\
        --seed 6 --modes off,on,latency --check-alone 4 --json out.json --plot out.png --summary-md out.md

All requests are submitted at once. Prompt lengths are mixed: `--long-share` of them
are drawn uniformly from the upper half (max/2 .. max), the rest log-uniformly from
16 tokens to the maximum; output lengths are uniform from 8 to the maximum. Memory
pressure needs long contexts running together (with the 1.5B shape on the 4gb profile,
about 59K live tokens across the 8 running sequences reach the 90% mark), so whether
a mix reaches it depends on the draw: seed 6 keeps several long requests together for
a while at about 295K prompt tokens in all.

Modes, run in the order given, each on a fresh engine:
  off      the controller off;
  on       the controller on;
  latency  the controller on, replaying the first `--latency-num-requests` requests with
           runs of `--slow-steps` consecutive slow decode steps (`--slow-step-ms` each,
           default twice the profile's latency_high_ms) every `--slow-every` decode steps.
           The controller answers `patience_tokens` slow tokens in a row, not one slow
           step, so the default run is patience_tokens + 1 steps long.

Each mode reports completed requests, steps that ran out of device memory, refusals,
output throughput, median and p95 per-token latency, peak device memory (allocator peak
within each step plus the managed KV pages on the device), peak memory pressure (what the
controller watches: LLMEngine.memory_pressure_bytes) and the controller's events. Then
`--check-alone` requests, those whose run was disturbed first (KV compressed while they
ran, or preempted), run one at a time on a fresh engine with the controller off, and
every mode's greedy output is compared with those solo outputs. Per-step
timelines (pressure, device memory, latency, batch, KV precision, controller events) go
to JSONL files beside the JSON; `--plot` draws them with the events marked and
`--summary-md` writes a Markdown table with one row per mode.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import random
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from lowvram.config import Profile, load_profile
from lowvram.core.sampling_params import SamplingParams
from lowvram.engine.engine import LLMEngine
from lowvram.engine.tokenizer import Tokenizer
from lowvram.errors import LowvramError
from lowvram.models.loader import resolve_model_path

WORDS = "the engine keeps every request and spills pages when memory runs short while tokens stream".split()
MIN_PROMPT_TOKENS = 16
MIN_OUTPUT_TOKENS = 8
MODES = ("off", "on", "latency")
OOM_REASON = "ran out of device memory"
KV_BITS = {"fp16": 16, "int8": 8, "int4": 4}


@dataclasses.dataclass(frozen=True)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int


def prompt_lengths(num: int, max_prompt_tokens: int, long_share: float, seed: int) -> list[tuple[int, int]]:
    """(prompt length, draw for the output length) per request, reproducible from the seed."""
    rng = random.Random(seed)
    low = min(MIN_PROMPT_TOKENS, max_prompt_tokens)
    lengths = []
    for _ in range(num):
        if rng.random() < long_share:
            length = rng.randint(max(low, max_prompt_tokens // 2), max_prompt_tokens)
        else:
            length = int(2 ** rng.uniform(math.log2(low), math.log2(max_prompt_tokens)))
        lengths.append((max(low, min(length, max_prompt_tokens)), rng.random()))
    return lengths


def make_requests(
    tokenizer: Tokenizer, num: int, max_prompt_tokens: int, max_output_tokens: int, seed: int, long_share: float = 0.0
) -> list[Request]:
    """Mixed prompt lengths (a long share, the rest log-uniform) and output lengths, reproducible."""
    rng = random.Random(seed + 1)
    min_output = min(MIN_OUTPUT_TOKENS, max_output_tokens)
    requests = []
    for i, (length, draw) in enumerate(prompt_lengths(num, max_prompt_tokens, long_share, seed)):
        ids: list[int] = []
        while len(ids) < length:  # a word is at least one token; top up if the tokenizer merged some
            ids += tokenizer.encode(" ".join(rng.choice(WORDS) for _ in range(length - len(ids))))
        max_tokens = min_output + int(draw * (max_output_tokens - min_output + 1))
        requests.append(Request(f"r{i}", ids[:length], min(max_tokens, max_output_tokens)))
    return requests


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def inject_slow_steps(engine: LLMEngine, slow_step_ms: float, num_slow_steps: int, every_steps: int) -> None:
    """Make `num_slow_steps` consecutive decode steps `slow_step_ms` slower in the middle of
    every `every_steps` decode steps, as a throttled card or a noisy neighbour would."""
    run = engine.runner.run
    first = every_steps // 2
    counter = {"decode_steps": 0}

    def slow_run(batch, **kwargs):
        if not batch.is_prefill:
            if first <= counter["decode_steps"] % every_steps < first + num_slow_steps:
                time.sleep(slow_step_ms / 1000)
            counter["decode_steps"] += 1
        return run(batch, **kwargs)

    engine.runner.run = slow_run


def device_bytes_now(engine: LLMEngine) -> int:
    """Device memory at the peak of the step just run: the allocator's peak plus the KV
    codes held in managed memory, which the allocator does not see (their INT8/INT4
    scales are in both: an upper bound)."""
    if engine.device.type != "cuda":
        return engine.memory_in_use_bytes()
    managed = engine.kv_pool.device_bytes if engine.kv_pool.backend == "um" else 0
    return torch.cuda.max_memory_allocated(engine.device) + managed


def run_mode(
    model: str,
    profile: Profile,
    requests: list[Request],
    *,
    mode: str,
    timeline: Path,
    slow_step_ms: float = 0.0,
    num_slow_steps: int = 0,
    slow_every_steps: int = 50,
):
    """Submit every request at once and step until all are done. Returns (result, outputs, engine)."""
    controller = dataclasses.replace(profile.controller, is_enabled=mode != "off")
    allocated_before_load = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
    engine = LLMEngine(model, profile.replace(controller=controller), timeline_path=str(timeline))
    if slow_step_ms and num_slow_steps:
        inject_slow_steps(engine, slow_step_ms, num_slow_steps, slow_every_steps)
    is_cuda = engine.device.type == "cuda"
    refused, outputs = [], {}
    precisions: dict[str, set[str]] = {}
    preempted: set[str] = set()
    latencies_ms: list[float] = []
    peak_device = peak_pressure = peak_reserved = 0
    peak_steps: list[dict] = []  # the steps with the highest device memory, and what they did
    baseline_allocated = torch.cuda.memory_allocated(engine.device) if is_cuda else 0
    error = None
    start = time.perf_counter()
    for request in requests:
        try:
            engine.add_request(
                request.request_id, None, greedy(request.max_tokens), prompt_token_ids=request.prompt_token_ids
            )
        except LowvramError as exc:
            refused.append((request.request_id, str(exc)))
    while engine.has_unfinished_requests():
        decode_s = engine.stats.decode_s
        before = (
            engine.stats.num_prefill_tokens,
            engine.stats.num_decode_tokens,
            engine.num_controller_events,
            engine.runner.num_graph_captures,
        )
        if is_cuda:
            torch.cuda.reset_peak_memory_stats(engine.device)
        try:
            step_outputs = engine.step()
        except (LowvramError, torch.OutOfMemoryError) as exc:  # the engine is broken: report, do not hide
            error = f"{type(exc).__name__}: {exc}"
            break
        for out in step_outputs:
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
        if engine.stats.decode_s > decode_s:
            latencies_ms.append(1000 * (engine.stats.decode_s - decode_s))
        for seq in engine.scheduler.running:
            precisions.setdefault(seq.request_id, set()).add(engine.kv_precision)
            if seq.num_preemptions:
                preempted.add(seq.request_id)
        device_now = device_bytes_now(engine)
        peak_device = max(peak_device, device_now)
        if is_cuda and (len(peak_steps) < 3 or device_now > peak_steps[-1]["device_bytes"]):
            peak_steps = sorted(
                peak_steps
                + [
                    {
                        "step": engine.stats.num_steps,
                        "device_bytes": device_now,
                        "torch_peak_allocated": torch.cuda.max_memory_allocated(engine.device),
                        "torch_allocated_after": torch.cuda.memory_allocated(engine.device),
                        "torch_peak_reserved": torch.cuda.max_memory_reserved(engine.device),
                        "managed_device_bytes": engine.kv_pool.device_bytes if engine.kv_pool.backend == "um" else 0,
                        "prefill_tokens": engine.stats.num_prefill_tokens - before[0],
                        "decode_tokens": engine.stats.num_decode_tokens - before[1],
                        "controller_events": engine.num_controller_events - before[2],
                        "graph_captures": engine.runner.num_graph_captures - before[3],
                        "kv_precision": engine.kv_precision,
                    }
                ],
                key=lambda r: -r["device_bytes"],
            )[:3]
        if is_cuda:  # the peak statistics restart every step
            peak_reserved = max(peak_reserved, torch.cuda.max_memory_reserved(engine.device))
        peak_pressure = max(peak_pressure, engine.memory_pressure_bytes())
    elapsed = time.perf_counter() - start
    events = (
        [json.loads(line) for line in timeline.read_text().splitlines() if '"type": "event"' in line]
        if timeline.is_file()
        else []
    )
    ordered = sorted(latencies_ms) or [0.0]
    budget = engine.memory_budget_bytes
    result = {
        "mode": mode,
        "controller": "off" if mode == "off" else "on",
        "num_requests": len(requests),
        "num_completed": len(outputs),
        "num_refused": len(refused),
        "num_oom_steps": sum(1 for e in events if OOM_REASON in e["reason"]),
        "refusals": refused[:5],
        "error": error,
        "output_tokens_per_s": round(sum(len(v) for v in outputs.values()) / elapsed, 2),
        "p95_token_latency_ms": round(ordered[int(0.95 * (len(ordered) - 1))], 3),
        "median_token_latency_ms": round(statistics.median(ordered), 3),
        "peak_device_memory_gib": round(peak_device / 2**30, 3),
        "peak_torch_reserved_gib": round(peak_reserved / 2**30, 3) if is_cuda else None,
        "budget_gib": round(budget / 2**30, 3),
        "is_within_budget": peak_device <= budget,
        "torch_allocated_before_load_gib": round(allocated_before_load / 2**30, 3),
        "torch_allocated_after_load_gib": round(baseline_allocated / 2**30, 3),
        "peak_steps": peak_steps,
        "peak_memory_pressure": round(peak_pressure / budget, 3),
        "kv_backend": engine.kv_pool.backend,
        "num_kv_blocks": engine.block_manager.num_blocks,
        "num_kv_blocks_device_share": engine.kv_plan.num_blocks,
        "num_preemptions": engine.stats.num_preemptions,
        "num_controller_events": len(events),
        "controller_actions": [f"{e['step']}:{e['action']}={e['value']}" for e in events][:40],
        "kv_precisions_used": sorted({p for ps in precisions.values() for p in ps}, key=lambda p: -KV_BITS[p]),
        "final_mode": engine.controller_state.mode,
        "num_steps": engine.stats.num_steps,
        "elapsed_s": round(elapsed, 2),
        "timeline": timeline.name,
    }
    if slow_step_ms and num_slow_steps:
        result["slow_steps"] = {
            "slow_step_ms": slow_step_ms,
            "num_slow_steps": num_slow_steps,
            "every_decode_steps": slow_every_steps,
        }
    result["compressed_requests"] = sorted(r for r, ps in precisions.items() if ps != {"fp16"})
    result["preempted_requests"] = sorted(preempted)
    return result, outputs, engine


def requests_to_check(requests: list[Request], results: list[dict], num: int) -> list[Request]:
    """The requests compared with solo runs: first those whose run was disturbed (KV
    compressed while they ran, or preempted and recomputed), in submission order, then the others."""
    disturbed = {r for result in results for r in result["compressed_requests"] + result["preempted_requests"]}
    ordered = [r for r in requests if r.request_id in disturbed] + [
        r for r in requests if r.request_id not in disturbed
    ]
    return ordered[:num]


def run_alone(engine: LLMEngine, requests: list[Request]) -> dict[str, list[int]]:
    """Each request on its own, one after another, on `engine` (whose controller is off)."""
    outputs = {}
    for request in requests:
        request_id = request.request_id + "-alone"
        engine.add_request(request_id, None, greedy(request.max_tokens), prompt_token_ids=request.prompt_token_ids)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outputs[request.request_id] = out.outputs[0].token_ids
    return outputs


def compare_alone(
    result: dict, outputs: dict[str, list[int]], alone: dict[str, list[int]], submitted: set[str]
) -> None:
    """Record how many checked outputs equal their solo run, and where the others diverge."""
    alone = {r: ids for r, ids in alone.items() if r in submitted}
    same = [r for r, ids in alone.items() if outputs.get(r) == ids]
    result["alone"] = {"num_checked": len(alone), "num_identical": len(same)}
    mismatches = []
    for request_id, ids in alone.items():
        got = outputs.get(request_id)
        if got != ids:
            first = next((i for i, (a, b) in enumerate(zip(ids, got or [])) if a != b), min(len(ids), len(got or [])))
            mismatches.append(
                {
                    "request_id": request_id,
                    "first_different_token": first,
                    "was_kv_compressed": request_id in result["compressed_requests"],
                    "was_preempted": request_id in result["preempted_requests"],
                }
            )
    result["alone_mismatches"] = mismatches


def read_timeline(path: Path) -> tuple[list[dict], list[dict]]:
    records = [json.loads(line) for line in path.read_text().splitlines()]
    return [r for r in records if r["type"] == "step"], [r for r in records if r["type"] == "event"]


def event_label(event: dict) -> str:
    value = event["value"]
    if event["action"] == "kv_precision":
        return f"KV {value}"
    if event["action"] == "batch_limit":
        return f"batch {value}"
    return f"{event['action']} {'on' if value else 'off'}"


def plot(timelines: list[Path], path: Path, *, high_water: float, low_water: float) -> None:
    """Memory, latency, batch and KV precision per step, one colour per mode, with the
    controller's events as vertical lines labelled with their action."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(4, 1, figsize=(12, 10), sharex=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, timeline in enumerate(timelines):
        steps, events = read_timeline(timeline)
        color, label = colors[i % len(colors)], timeline.stem.removeprefix("stress_timeline_")
        x = [s["step"] for s in steps]
        axes[0].plot(
            x,
            [s["memory_used_bytes"] / s["memory_budget_bytes"] for s in steps],
            color=color,
            label=f"{label}: pressure",
        )
        axes[0].plot(
            x,
            [s.get("device_memory_bytes", 0) / s["memory_budget_bytes"] for s in steps],
            color=color,
            linestyle=":",
            label=f"{label}: on the device",
        )
        axes[1].plot(
            x,
            [s["token_latency_ms"] if s["token_latency_ms"] is not None else float("nan") for s in steps],
            ".",
            color=color,
            markersize=2,
            label=label,
        )
        axes[2].plot(x, [s["num_running"] for s in steps], color=color, label=f"{label}: running")
        axes[2].plot(
            x,
            [s["batch_limit"] for s in steps],
            color=color,
            linestyle="--",
            linewidth=0.8,
            label=f"{label}: batch limit",
        )
        axes[3].step(x, [KV_BITS[s["kv_precision"]] for s in steps], where="post", color=color, label=label)
        for n, event in enumerate(events):
            for ax in axes:
                ax.axvline(event["step"], color=color, alpha=0.35, linewidth=0.8)
            axes[0].annotate(
                event_label(event),
                (event["step"], 1.0),
                xycoords=("data", "axes fraction"),
                xytext=(2, -10 - 9 * ((n + 2 * i) % 6)),
                textcoords="offset points",
                fontsize=6,
                color=color,
            )
    axes[0].axhline(high_water, color="grey", linestyle="--", linewidth=0.8)
    axes[0].axhline(low_water, color="grey", linestyle=":", linewidth=0.8)
    names = ("memory / budget", "token latency (ms)", "sequences", "KV bits")
    for ax, name in zip(axes, names):
        ax.set_ylabel(name)
        ax.legend(loc="upper right", fontsize=6, ncol=2)
    axes[3].set_yticks(sorted(KV_BITS.values()))
    axes[-1].set_xlabel("engine step (vertical lines: controller events)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summary_markdown(results: list[dict]) -> str:
    """One table row per mode, for docs/performance.md."""
    header = (
        "| run | completed | OOM steps | refused | output tokens/s | median / p95 token latency | "
        "peak device memory (budget) | peak pressure | controller events | KV used | same as solo |"
    )
    lines = [header, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    for r in results:
        alone = r.get("alone")
        same = f"{alone['num_identical']}/{alone['num_checked']}" if alone else "-"
        lines.append(
            f"| {r['mode']} | {r['num_completed']}/{r['num_requests']} | {r['num_oom_steps']} | {r['num_refused']} | "
            f"{r['output_tokens_per_s']:.1f} | "
            f"{r['median_token_latency_ms']:.0f} / {r['p95_token_latency_ms']:.0f} ms | "
            f"{r['peak_device_memory_gib']:.2f} GiB ({r['budget_gib']:.2f}) | {100 * r['peak_memory_pressure']:.0f}% | "
            f"{r['num_controller_events']} | {', '.join(r['kv_precisions_used']) or '-'} | {same} |"
        )
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--shape", default=None, help="random weights of a named shape (lowvram.models.shapes)")
    parser.add_argument("--quantize", action="store_true", help="quantize the model to AWQ INT4 first")
    parser.add_argument("--profile", default="4gb", help="built-in profile name or YAML path")
    parser.add_argument("--emulate-vram-gib", type=float, default=None)
    parser.add_argument("--device", default=None)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--max-prompt-tokens", type=int, default=16384)
    parser.add_argument("--max-output-tokens", type=int, default=64)
    parser.add_argument(
        "--long-share",
        type=float,
        default=0.25,
        help="share of prompts drawn from the upper half of the length range (0..1)",
    )
    parser.add_argument("--modes", default="off,on", help=f"comma-separated, in order, from {', '.join(MODES)}")
    parser.add_argument(
        "--slow-step-ms",
        type=float,
        default=None,
        help="latency mode: extra time per slow decode step (default: 2 x latency_high_ms)",
    )
    parser.add_argument(
        "--slow-steps",
        type=int,
        default=None,
        help="latency mode: consecutive slow decode steps per run (default: patience_tokens + 1)",
    )
    parser.add_argument(
        "--slow-every", type=int, default=48, help="latency mode: decode steps from one run to the next"
    )
    parser.add_argument(
        "--latency-num-requests",
        type=int,
        default=16,
        help="latency mode replays this many of the requests (the first ones)",
    )
    parser.add_argument(
        "--check-alone", type=int, default=4, help="requests whose output is checked against a solo run"
    )
    parser.add_argument(
        "--seed", type=int, default=6, help="draw of the mix (6: several long requests run together; see above)"
    )
    parser.add_argument(
        "--batch-invariant",
        action="store_true",
        help="the profile's batch_invariant mode: requests decode as they would alone",
    )
    parser.add_argument("--json", default=None)
    parser.add_argument("--plot", default=None)
    parser.add_argument("--summary-md", default=None, help="write the Markdown summary table here too")
    args = parser.parse_args(argv)
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        parser.error(f"--modes: unknown mode {unknown[0]!r}; use {', '.join(MODES)}")
    if not 0 <= args.long_share <= 1:
        parser.error(f"--long-share = {args.long_share} must be between 0 and 1")
    if args.slow_every < 2:
        parser.error(f"--slow-every = {args.slow_every} must be at least 2")
    room = args.slow_every - args.slow_every // 2
    if args.slow_steps is not None and not 0 < args.slow_steps <= room:
        parser.error(f"--slow-steps = {args.slow_steps} must be between 1 and half of --slow-every ({room})")
    if args.plot:  # before the runs, not after them
        import importlib.util

        if importlib.util.find_spec("matplotlib") is None:
            parser.error("--plot needs matplotlib, which lowvram does not depend on: pip install matplotlib")
    return args


def prepare_model(args, work: Path) -> str:
    model = args.model
    if args.shape and args.quantize:
        from lowvram.models.shapes import random_awq_checkpoint

        return str(random_awq_checkpoint(args.shape, work, emulate_vram_gib=args.emulate_vram_gib)[1])
    if args.shape:
        from lowvram.models.shapes import cached_checkpoint, write_random_checkpoint

        model = str(cached_checkpoint(f"{args.shape}-bf16", lambda d: write_random_checkpoint(d, args.shape), work))
    if args.quantize:
        from lowvram.quant.quantize import quantize_model

        quantize_model(model, work / "awq", num_samples=8, emulate_vram_gib=args.emulate_vram_gib)
        model = str(work / "awq")
    return model


def free_device_memory() -> None:
    """Return a dropped engine's memory before the next one loads: two do not fit an emulated card."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def workload_record(args, requests: list[Request], controller) -> dict:
    lengths = sorted(len(r.prompt_token_ids) for r in requests)
    return {
        "num_requests": len(requests),
        "max_prompt_tokens": args.max_prompt_tokens,
        "long_share": args.long_share,
        "seed": args.seed,
        "num_prompt_tokens": sum(lengths),
        "prompt_tokens_min_median_max": [lengths[0], lengths[len(lengths) // 2], lengths[-1]],
        "num_output_tokens": sum(r.max_tokens for r in requests),
        "max_output_tokens": args.max_output_tokens,
        "controller": dataclasses.asdict(controller),
        "batch_invariant": args.batch_invariant,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="lowvram-stress-"))
    model = prepare_model(args, work)
    profile = load_profile(args.profile).replace(
        emulate_vram_gib=args.emulate_vram_gib,
        device=args.device,
        max_model_len=args.max_prompt_tokens + args.max_output_tokens,
        batch_invariant=args.batch_invariant or None,
    )
    requests = make_requests(
        Tokenizer(resolve_model_path(model)),
        args.num_requests,
        args.max_prompt_tokens,
        args.max_output_tokens,
        args.seed,
        args.long_share,
    )
    controller = profile.controller
    slow_step_ms = args.slow_step_ms if args.slow_step_ms is not None else 2 * controller.latency_high_ms
    num_slow_steps = (
        args.slow_steps
        if args.slow_steps is not None
        else min(controller.patience_tokens + 1, args.slow_every - args.slow_every // 2)
    )
    out_dir = Path(args.json).resolve().parent if args.json else work
    record = {
        "command": " ".join(["stress_engine.py", *(argv if argv is not None else sys.argv[1:])]),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "workload": workload_record(args, requests, controller),
        "results": [],
    }
    runs, timelines = [], []
    for mode in args.modes.split(","):
        timeline = out_dir / f"stress_timeline_{mode}.jsonl"
        timeline.unlink(missing_ok=True)
        is_latency = mode == "latency"
        workload = requests[: args.latency_num_requests] if is_latency else requests
        result, outputs, engine = run_mode(
            model,
            profile,
            workload,
            mode=mode,
            timeline=timeline,
            slow_step_ms=slow_step_ms if is_latency else 0.0,
            num_slow_steps=num_slow_steps if is_latency else 0,
            slow_every_steps=args.slow_every,
        )
        del engine
        free_device_memory()
        runs.append((result, outputs, {r.request_id for r in workload}))
        timelines.append(timeline)
        record["results"].append(result)
        if args.json:  # after every mode, so a run cut short still leaves its numbers
            Path(args.json).write_text(json.dumps(record, indent=2) + "\n")
        print(json.dumps({k: v for k, v in result.items() if k not in ("refusals", "controller_actions")}), flush=True)
    checked = requests_to_check(requests, record["results"], args.check_alone)
    if checked:
        reference = LLMEngine(model, profile.replace(controller=dataclasses.replace(controller, is_enabled=False)))
        alone = run_alone(reference, checked)
        record["checked_requests"] = [r.request_id for r in checked]
        del reference
        free_device_memory()
        for result, outputs, submitted in runs:
            compare_alone(result, outputs, alone, submitted)
    summary = summary_markdown(record["results"])
    print(summary)
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=2) + "\n")
    if args.summary_md:
        Path(args.summary_md).write_text(summary)
    if args.plot:
        plot(timelines, Path(args.plot), high_water=controller.memory_high_water, low_water=controller.memory_low_water)
    return 0


if __name__ == "__main__":
    sys.exit(main())
