"""Host time of one decode step: the Python the GPU waits for, measured on the CPU.

With CUDA graphs a decode step's GPU work is a few milliseconds and the engine's own
Python (scheduling, page bookkeeping, the spill policy, the controller's observation,
sampling, detokenizing, building outputs) runs while the GPU idles. This script keeps
that Python and removes the model: a tiny Qwen2 checkpoint is built, and the runner's
forward pass is replaced by a stand-in that gathers the step's inputs as the graph
replay does (`ModelRunner.gather`) and returns precomputed logits at once. The rest of
`ModelRunner.run` stays, so the KV pool's page bookkeeping runs as on the GPU.

Settings follow the 4gb profile where they apply on the CPU (scheduler budgets, page
size, controller thresholds, controller on), greedy sampling with ignore_eos, and a
um pool sized as on a 4 GB card whose managed memory is faked (at this load every live
page fits the device share, so no page moves). Logits are a fixed random [B, vocab] matrix rolled every step,
so argmax gives varied token ids and the detokenizer sees realistic input.

    python scripts/lab/bench_host_step.py                          # batch 1 and 8, 512-token context
    python scripts/lab/bench_host_step.py --repeats 5 --json docs/bench/host_step_cpu.json

Per-step numbers are decode steps after `--warmup` of them; each repeat runs fresh
requests on the same engine. A separate run under cProfile gives the top functions.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from lowvram.bench.record import run_metadata
from lowvram.config import load_profile
from lowvram.core.block_manager import BlockManager
from lowvram.core.sampling_params import SamplingParams
from lowvram.core.scheduler import Scheduler
from lowvram.engine.engine import LLMEngine
from lowvram.engine.model_runner import ModelRunner
from lowvram.kv.pool import KVShape
from lowvram.testing import make_tiny_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
from profile_decode import cprofile_rows  # noqa: E402  (a sibling script)

UM_DEVICE_SHARE_TOKENS = 69_000  # the 4gb profile's um device share for R1-Distill-Qwen-1.5B (docs/kv_pool.md)
NUM_LOGIT_SHIFTS = 97  # distinct rolled logit matrices cycled through (prime: no short period with the batch)


class HostManagedMemory:
    """Managed memory stood in for by CPU tensors: the um pool's bookkeeping without a GPU.

    One OS page per KV page, so pages move one by one as the 1.5B shape's FP16 pages do."""

    def __init__(self, page_bytes: int):
        self.page_bytes = page_bytes

    def free_bytes(self) -> int:
        return 64 * 2**30

    def is_concurrent(self) -> bool:
        return True

    def allocate(self, num_bytes: int) -> torch.Tensor:
        return torch.zeros(num_bytes, dtype=torch.uint8)

    def place(self, tensor, start_bytes, num_bytes, *, on_host, stream) -> None:
        pass

    def advise_preferred(self, tensor, start_bytes, num_bytes, *, on_host) -> None:
        pass


def build_engine(model_dir: Path, kv_backend: str, max_model_len: int) -> LLMEngine:
    """The tiny model under the 4gb profile's scheduler, page and controller settings, on the CPU."""
    gb4 = load_profile("4gb")
    profile = load_profile("cpu").replace(
        max_model_len=max_model_len,
        max_num_seqs=gb4.max_num_seqs,
        max_num_batched_tokens=gb4.max_num_batched_tokens,
        kv_block_size=gb4.kv_block_size,
        kv_recent_fp16_tokens=gb4.kv_recent_fp16_tokens,
        enable_prefix_caching=gb4.enable_prefix_caching,
        controller=gb4.controller,
    )
    engine = LLMEngine(str(model_dir), profile)
    if kv_backend == "um":
        from lowvram.kv.tiers import ManagedKVPool

        # Sized as the 4gb profile plans it for the 1.5B shape: every sequence at full length,
        # of which the device share (about 69K tokens) is resident; the rest waits on the host.
        c = engine.config
        shape = KVShape(c.num_layers, profile.kv_block_size, c.num_kv_heads, c.head_dim, engine.dtype)
        num_blocks = gb4.max_num_seqs * -(-gb4.max_model_len // gb4.kv_block_size)
        share = UM_DEVICE_SHARE_TOKENS // gb4.kv_block_size
        pool = ManagedKVPool(
            shape,
            num_blocks,
            "fp16",
            "cpu",
            max_device_blocks=share,
            memory=HostManagedMemory(shape.code_block_bytes("fp16")),
            budget_bytes=2**40,
        )
        engine.kv_pool = pool
        engine.block_manager = BlockManager(
            num_blocks, pool.block_size, enable_prefix_caching=profile.enable_prefix_caching
        )
        engine.scheduler = Scheduler(engine.block_manager, profile.max_num_seqs, profile.max_num_batched_tokens)
        engine.runner = ModelRunner(
            engine.model,
            pool,
            max_num_seqs=profile.max_num_seqs,
            max_model_len=engine.max_model_len,
        )
    return engine


def stub_forward(engine: LLMEngine, max_batch: int, seed: int = 0) -> None:
    """Replace the forward pass with precomputed logits [S, vocab], rolled one column per step."""
    vocab = engine.config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(max_batch, vocab, generator=gen)
    tables = [torch.roll(base, shifts=7 * i, dims=1) for i in range(NUM_LOGIT_SHIFTS)]
    runner = engine.runner
    calls = [0]

    def forward(batch, is_all_rows):
        runner.gather(batch)  # the host lists a graph replay copies into its buffers
        calls[0] += 1
        return tables[calls[0] % NUM_LOGIT_SHIFTS][: len(batch.seqs)]

    runner._forward = forward


def add_requests(engine: LLMEngine, num: int, context: int, num_tokens: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    params = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True)
    low = 8  # above the special tokens
    for i in range(num):
        prompt = torch.randint(low, engine.config.vocab_size, (context,), generator=gen).tolist()
        engine.add_request(f"r{seed}-{i}", prompt_token_ids=prompt, params=params)


def decode_step_times_us(engine: LLMEngine) -> list[float]:
    """Run every queued request to the end; the wall time of each decode step, in µs."""
    times = []
    while engine.has_unfinished_requests():
        num_decode = engine.stats.num_decode_tokens
        start = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - start
        if engine.stats.num_decode_tokens != num_decode:
            times.append(elapsed * 1e6)
    return times


def profile_rows(engine: LLMEngine, batch: int, context: int, num_tokens: int, warmup: int, top: int) -> list[dict]:
    """cProfile of one run's decode steps after the warm-up: the top functions by own time."""
    add_requests(engine, batch, context, num_tokens, seed=10_000)
    num_decode_steps = 0
    while engine.has_unfinished_requests() and num_decode_steps < warmup:  # prefill, then the warm-up
        before = engine.stats.num_decode_tokens
        engine.step()
        num_decode_steps += engine.stats.num_decode_tokens != before
    profiler = cProfile.Profile()
    num_profiled = 0
    profiler.enable()
    while engine.has_unfinished_requests():
        engine.step()
        num_profiled += 1
    profiler.disable()
    return cprofile_rows(profiler, num_profiled, top)


def bench(engine: LLMEngine, batch: int, args) -> dict:
    stub_forward(engine, batch)
    medians, means, every = [], [], []
    for repeat in range(args.repeats):
        add_requests(engine, batch, args.context, args.num_tokens, seed=1000 * batch + repeat)
        times = decode_step_times_us(engine)[args.warmup :]
        medians.append(statistics.median(times))
        means.append(statistics.fmean(times))
        every += times
    every.sort()
    return {
        "batch_size": batch,
        "num_decode_steps_timed": len(every),
        "median_us": round(statistics.median(medians), 1),
        "mean_us": round(statistics.median(means), 1),
        "p90_us": round(every[int(0.9 * (len(every) - 1))], 1),
        "median_us_by_repeat": [round(m, 1) for m in medians],
        "mean_us_by_repeat": [round(m, 1) for m in means],
        "host_functions": profile_rows(engine, batch, args.context, args.num_tokens, args.warmup, args.top),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", default="1,8", help="comma-separated decode batch sizes")
    parser.add_argument("--context", type=int, default=512, help="prompt tokens per request")
    parser.add_argument("--num-tokens", type=int, default=200, help="tokens decoded per request")
    parser.add_argument("--warmup", type=int, default=20, help="decode steps left out at the start of each run")
    parser.add_argument(
        "--repeats", type=int, default=3, help="runs per batch size (the median of their medians is reported)"
    )
    parser.add_argument(
        "--kv-backend",
        choices=("um", "device"),
        default="um",
        help="um: the 4gb profile's pool with its page bookkeeping; device: no spill bookkeeping",
    )
    parser.add_argument("--top", type=int, default=25, help="functions listed from the profile")
    parser.add_argument("--json", help="write the record to this path")
    args = parser.parse_args()
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_model(Path(tmp) / "tiny-qwen2", "qwen2")
        engine = build_engine(model_dir, args.kv_backend, args.context + args.num_tokens + 64)
        record = run_metadata("bench_host_step.py " + " ".join(sys.argv[1:]))
        record["settings"] = {
            "context": args.context,
            "num_tokens": args.num_tokens,
            "warmup": args.warmup,
            "repeats": args.repeats,
            "kv_backend": args.kv_backend,
            "vocab_size": engine.config.vocab_size,
            "profile": "4gb scheduler/controller on cpu",
            "torch_threads": torch.get_num_threads(),
        }
        record["runs"] = []
        for batch in batch_sizes:
            run = bench(engine, batch, args)
            record["runs"].append(run)
            print(
                f"batch {batch}: median {run['median_us']:.1f} µs, mean {run['mean_us']:.1f} µs, "
                f"p90 {run['p90_us']:.1f} µs per decode step (repeat medians {run['median_us_by_repeat']})"
            )
            for row in run["host_functions"][:12]:
                print(
                    f"    {row['self_us_per_step']:8.1f} self {row['cumulative_us_per_step']:8.1f} cum "
                    f"{row['calls_per_step']:7.1f}x  {row['function']}"
                )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
