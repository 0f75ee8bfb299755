"""Stress the engine with many concurrent requests, with the feedback controller off and on.

    python scripts/stress_engine.py --shape r1-distill-qwen-1.5b --quantize --profile 4gb \
        --emulate-vram-gib 4 --num-requests 64 --max-prompt-tokens 16384 --json out.json --plot out.png

For each controller mode it reports completed requests, requests failed by OOM, refusals,
throughput, p95 per-token latency and peak device memory, and checks (on --check-alone N
requests) that each greedy output equals the same request run alone. --slow-step-ms
injects a slow decode step to exercise the latency path. Per-step timelines (memory,
latency, batch size, KV precision) go to JSONL files beside the JSON, and --plot draws them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from lowvram.config import load_profile
from lowvram.engine import LLMEngine
from lowvram.errors import LowvramError
from lowvram.sampling import SamplingParams

WORDS = "the engine keeps every request and spills pages when memory runs short while tokens stream".split()


def make_requests(tokenizer, num: int, max_prompt_tokens: int, max_output_tokens: int, seed: int):
    """Mixed prompt lengths (log-uniform up to the maximum) and output lengths, reproducible."""
    rng = random.Random(seed)
    requests = []
    for i in range(num):
        length = int(2 ** rng.uniform(4, max(4.1, (max_prompt_tokens - 8).bit_length() - 1)))
        text = " ".join(rng.choice(WORDS) for _ in range(length))
        ids = tokenizer.encode(text)[:length] or tokenizer.encode("hello")
        requests.append((f"r{i}", ids, rng.randint(8, max_output_tokens)))
    return requests


def run_mode(model: str, profile, requests, *, is_controller_on: bool, slow_step_ms: float, timeline: Path) -> dict:
    controller = dataclasses.replace(profile.controller, is_enabled=is_controller_on)
    engine = LLMEngine(model, profile.replace(controller=controller), timeline_path=str(timeline))
    if slow_step_ms:
        run = engine.runner.run

        def slow_run(batch, **kwargs):
            if not batch.is_prefill and engine.stats.num_steps % 50 == 25:
                time.sleep(slow_step_ms / 1000)
            return run(batch, **kwargs)

        engine.runner.run = slow_run
    if engine.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    refused, outputs = [], {}
    start = time.perf_counter()
    for request_id, ids, max_tokens in requests:
        try:
            engine.add_request(request_id, None, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                               prompt_token_ids=ids)
        except LowvramError as exc:
            refused.append((request_id, str(exc)))
    peak_memory = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
        peak_memory = max(peak_memory, engine.memory_in_use_bytes())
    elapsed = time.perf_counter() - start
    latencies = sorted(engine.recent_token_latency_ms) or [0.0]
    num_ooms = sum(1 for e in engine.controller_events if "ran out of device memory" in e.reason)
    result = {
        "controller": "on" if is_controller_on else "off",
        "num_requests": len(requests), "num_completed": len(outputs), "num_refused": len(refused),
        "num_oom_steps": num_ooms, "refusals": refused[:5],
        "output_tokens_per_s": round(sum(len(v) for v in outputs.values()) / elapsed, 2),
        "p95_token_latency_ms": round(latencies[int(0.95 * (len(latencies) - 1))], 3),
        "median_token_latency_ms": round(statistics.median(latencies), 3),
        "peak_memory_in_use_gib": round(peak_memory / 2**30, 3),
        "peak_torch_allocated_gib": round(torch.cuda.max_memory_allocated() / 2**30, 3) if engine.device.type == "cuda" else None,
        "budget_gib": round(engine.kv_plan.budget_bytes / 2**30, 3),
        "num_controller_events": engine.num_controller_events,
        "final_mode": engine.controller_state.mode, "elapsed_s": round(elapsed, 2), "timeline": timeline.name,
    }
    return result, outputs, engine


def check_alone(engine: LLMEngine, requests, outputs, num: int) -> dict:
    """Run the first `num` requests one at a time on a fresh (relaxed) engine state."""
    same = 0
    for request_id, ids, max_tokens in requests[:num]:
        engine.add_request(request_id + "-alone", None, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                                       ignore_eos=True), prompt_token_ids=ids)
        alone = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    alone = out.outputs[0].token_ids
        same += alone == outputs.get(request_id)
    return {"num_checked": num, "num_identical": same}


def plot(timelines: list[Path], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(4, 1, figsize=(10, 9), sharex=True)
    for timeline in timelines:
        steps = [json.loads(line) for line in timeline.read_text().splitlines() if '"type": "step"' in line]
        x = [s["step"] for s in steps]
        label = timeline.stem
        axes[0].plot(x, [s["memory_used_bytes"] / s["memory_budget_bytes"] for s in steps], label=label)
        axes[1].plot(x, [s["token_latency_ms"] or float("nan") for s in steps], ".", markersize=2, label=label)
        axes[2].plot(x, [s["num_running"] for s in steps], label=label)
        axes[3].plot(x, [{"fp16": 16, "int8": 8, "int4": 4}[s["kv_precision"]] for s in steps], label=label)
    for ax, name in zip(axes, ("memory / budget", "token latency (ms)", "running sequences", "KV bits")):
        ax.set_ylabel(name)
        ax.legend(loc="upper right", fontsize=7)
    axes[-1].set_xlabel("engine step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--shape", default=None, help="random weights of a named shape (lowvram.shapes)")
    parser.add_argument("--quantize", action="store_true", help="quantize the model to AWQ INT4 first")
    parser.add_argument("--profile", default="4gb")
    parser.add_argument("--emulate-vram-gib", type=float, default=None)
    parser.add_argument("--device", default=None)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--max-prompt-tokens", type=int, default=16384)
    parser.add_argument("--max-output-tokens", type=int, default=128)
    parser.add_argument("--modes", default="off,on", help="controller modes to run, in order")
    parser.add_argument("--slow-step-ms", type=float, default=0.0, help="inject a slow decode step now and then")
    parser.add_argument("--check-alone", type=int, default=4, help="requests whose output is checked against a solo run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    parser.add_argument("--plot", default=None)
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="lowvram-stress-"))
    model = args.model
    if args.shape:
        from lowvram.shapes import write_random_checkpoint

        model = str(write_random_checkpoint(work / "model", args.shape))
    if args.quantize:
        from lowvram.quantize import quantize_model

        quantize_model(model, work / "awq", num_samples=16, emulate_vram_gib=args.emulate_vram_gib)
        model = str(work / "awq")
    profile = load_profile(args.profile).replace(emulate_vram_gib=args.emulate_vram_gib, device=args.device,
                                                 max_model_len=args.max_prompt_tokens + args.max_output_tokens)
    out_dir = Path(args.json).parent if args.json else work
    results = []
    timelines = []
    for mode in args.modes.split(","):
        timeline = out_dir / f"stress_timeline_controller_{mode}.jsonl"
        timeline.unlink(missing_ok=True)
        tokenizer_probe = LLMEngine(model, profile.replace(max_num_seqs=1, max_model_len=256)).tokenizer
        requests = make_requests(tokenizer_probe, args.num_requests, args.max_prompt_tokens, args.max_output_tokens,
                                 args.seed)
        result, outputs, engine = run_mode(model, profile, requests, is_controller_on=mode == "on",
                                           slow_step_ms=args.slow_step_ms, timeline=timeline)
        if args.check_alone:
            result["alone"] = check_alone(engine, requests, outputs, min(args.check_alone, len(requests)))
        results.append(result)
        timelines.append(timeline)
        print(json.dumps({k: v for k, v in result.items() if k != "refusals"}))
        del engine
    record = {"command": " ".join(["stress_engine.py", *sys.argv[1:]]),
              "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
              "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "results": results}
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=2) + "\n")
    if args.plot:
        plot(timelines, Path(args.plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())
