"""The KV pool under an emulated 4 GB card: a 1.5B-shaped model decoding at 4K, 32K and 128K
tokens of context with and without spill, and the pool's spill / prefetch bandwidth
against the host link.

    python scripts/bench_kv_pool.py [--json results.json]

The whole model runs through the engine (`LLMEngine`: profile 4gb, emulate_vram_gib 4, one
sequence, controller off so nothing changes the KV precision): R1-Distill-Qwen-1.5B's shape
with random weights (`lowvram.models.shapes.write_random_checkpoint`), quantized to AWQ INT4 with
a few calibration samples (`--fp16-weights` skips that; FP16 weights leave room for about
4K tokens of KV on the card). One prompt stream is fed at each context in turn; each longer
prompt continues the shorter one, so the prefix cache holds the earlier pages and the
sequence grows by chunked prefill. At each context: prefill time, decode step time (after
warm-up steps, which also capture the CUDA graphs), and memory: the pool's device bytes,
torch's allocated bytes, their peaks, and the total against the card and the profile budget.

Runs (FP16 KV unless named otherwise):
- device: pages on the device only, no spill, at the contexts the profile's plan fits;
- device-int8: INT8 pages, no spill (128K fits the device share in INT8);
- um: unified memory with the profile's device share (about 69K tokens of FP16 KV beside
  INT4 weights): 128K keeps its oldest pages on the host and the kernels read them over the
  bus. Each context is decoded again with the device share cut to --forced-share-tokens,
  so that every context spills;
- pinned: device slots and a pinned host tier. A step must hold all its pages on the
  device, so one sequence longer than the device share cannot run there.

The engine plans um pools that hold one sequence longer than their device share (the rest
waits in the profile's host spill budget, `memory_plan.host_kv_blocks`); a pinned pool's
engine refuses such a context, which this script reports as not fitting.

Transfers: `spill()`, then `prefetch()` and `ensure_resident()`, of --transfer-mib of FP16
pages on standalone um and pinned pools of the same shape, against pinned host <-> device
copies of the same bytes (`copy_(non_blocking=True)`).

Without CUDA the same path runs on the CPU (device backend only, no transfers): that is how
CI checks this script (`--model` a small checkpoint, short `--contexts`). The exit status
is 1 when a spilling run went over the card.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from lowvram.bench.record import run_metadata
from lowvram.config import load_profile
from lowvram.core.sampling_params import SamplingParams
from lowvram.errors import ConfigError, KernelError, OutOfMemoryError
from lowvram.kv.pool import KVShape
from lowvram.kv.tiers import ManagedKVPool, PinnedKVPool

GIB = 2**30
MIB = 2**20
SHAPE_NAME = "r1-distill-qwen-1.5b"
RUNS = {  # name: (kv_backend, kv_precision)
    "device": ("device", "fp16"),
    "device-int8": ("device", "int8"),
    "um": ("um", "fp16"),
    "pinned": ("pinned", "fp16"),
}
SPILL_BACKENDS = ("um", "pinned")
# Tokens past the longest context: the decode steps of the run, with room.
DECODE_MARGIN_TOKENS = 64


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON to PATH")
    parser.add_argument("--model", help="an existing checkpoint instead of the random 1.5B-shaped one")
    parser.add_argument("--fp16-weights", action="store_true", help="do not quantize the random checkpoint")
    parser.add_argument("--quantize-samples", type=int, default=8, help="AWQ calibration samples (default 8)")
    parser.add_argument("--profile", default=None, help="profile (default: 4gb with CUDA, cpu without)")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when there is one)")
    parser.add_argument("--card-gib", type=float, default=4.0, help="emulated card on CUDA (default 4)")
    parser.add_argument("--contexts", default="4096,32768,131072", help="context lengths, comma-separated")
    parser.add_argument("--runs", default=None, help=f"which of {', '.join(RUNS)} (default: all; device on the CPU)")
    parser.add_argument("--warmup-steps", type=int, default=3, help="decode steps before timing (default 3)")
    parser.add_argument("--decode-steps", type=int, default=16, help="decode steps timed per context (default 16)")
    parser.add_argument(
        "--forced-share-tokens",
        type=int,
        default=1024,
        help="um device share for the forced-spill decode, in tokens (0 = skip; default 1024)",
    )
    parser.add_argument(
        "--max-prefill-s",
        type=float,
        default=90.0,
        help="give up growing a run's context after this many seconds of prefill (default 90)",
    )
    parser.add_argument("--transfer-mib", type=int, default=1024, help="bytes moved per transfer row (default 1024)")
    return parser.parse_args(argv)


# ---------------------------------------------------------------- model and engines


def make_model(args: argparse.Namespace, work: Path) -> tuple[str, str]:
    """The checkpoint to run and a line saying what it is."""
    if args.model:
        return args.model, f"checkpoint {args.model}"
    from lowvram.models.shapes import cached_checkpoint, random_awq_checkpoint, write_random_checkpoint

    start = time.perf_counter()
    if args.fp16_weights:
        model_dir = cached_checkpoint(f"{SHAPE_NAME}-bf16", lambda d: write_random_checkpoint(d, SHAPE_NAME), work)
        print(f"random {SHAPE_NAME} checkpoint ready in {time.perf_counter() - start:.1f} s")
        return str(model_dir), f"{SHAPE_NAME}, random FP16 weights"
    _, awq_dir = random_awq_checkpoint(
        SHAPE_NAME, work, num_samples=args.quantize_samples, emulate_vram_gib=args.card_gib
    )
    release_memory()
    print(
        f"random {SHAPE_NAME} checkpoint in AWQ INT4 ({args.quantize_samples} calibration samples) ready in "
        f"{time.perf_counter() - start:.1f} s"
    )
    return str(awq_dir), f"{SHAPE_NAME}, random weights, AWQ INT4 ({args.quantize_samples} calibration samples)"


def open_engine(model_dir: str, args: argparse.Namespace, backend: str, precision: str, max_model_len: int):
    from lowvram.engine.engine import LLMEngine

    profile = load_profile(args.profile)
    controller = dataclasses.replace(profile.controller, is_enabled=False)
    profile = profile.replace(
        device=args.device,
        emulate_vram_gib=args.card_gib if args.device == "cuda" else None,
        max_model_len=max_model_len,
        max_num_seqs=1,
        kv_backend=backend,
        kv_precision=precision,
        host_spill_gib=max(profile.host_spill_gib, 4.0),
        controller=controller,
    )
    return LLMEngine(model_dir, profile)


def release_memory() -> None:
    """Free what a closed (or half-built) engine held, before the next one is built."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def prompt_stream(num_tokens: int, vocab_size: int) -> list[int]:
    """Random ids of the tokenizer's ordinary range: every context's prompt is a prefix of it."""
    rng = random.Random(0)
    return [rng.randrange(8, min(vocab_size, 500)) for _ in range(num_tokens)]


# ---------------------------------------------------------------- one context


class Meter:
    """Memory of one engine, sampled after each step: the pool's own count, torch's, and the
    process's device total (managed pages are outside torch's allocator)."""

    def __init__(self, engine):
        self.engine = engine
        self.is_cuda = engine.device.type == "cuda"
        self.reset()

    def reset(self) -> None:
        self.peak_pool_bytes = 0
        self.peak_in_use_bytes = 0
        if self.is_cuda:
            torch.cuda.reset_peak_memory_stats()

    def sample(self) -> None:
        self.peak_pool_bytes = max(self.peak_pool_bytes, self.engine.kv_pool.device_bytes)
        self.peak_in_use_bytes = max(self.peak_in_use_bytes, self.engine.memory_in_use_bytes())

    def row(self, card_bytes: int | None) -> dict:
        pool = self.engine.kv_pool
        outside_torch = pool.backend == "um"  # managed pages; with FP16 pages nothing is counted twice
        allocated = torch.cuda.memory_allocated() if self.is_cuda else 0
        peak_allocated = torch.cuda.max_memory_allocated() if self.is_cuda else 0
        peak_total = peak_allocated + (self.peak_pool_bytes if outside_torch else 0)
        budget = self.engine.memory_budget_bytes
        row = {
            "pool_device_bytes": pool.device_bytes,
            "pool_host_bytes": pool.host_bytes,
            "num_live_blocks_on_host": self.engine.num_kv_blocks_on_host(),
            "torch_allocated_bytes": allocated,
            "torch_peak_allocated_bytes": peak_allocated,
            "peak_pool_device_bytes": self.peak_pool_bytes,
            "peak_device_total_bytes": peak_total,
            "peak_memory_in_use_bytes": self.peak_in_use_bytes,
            "budget_bytes": budget,
            "is_within_budget": self.peak_in_use_bytes <= budget,
        }
        if card_bytes is not None:
            row.update(card_bytes=card_bytes, is_within_card=peak_total <= card_bytes)
        if self.is_cuda:
            free, total = torch.cuda.mem_get_info()
            row["driver_used_bytes"] = total - free  # the whole card, CUDA context included
        return row


def _step(engine, meter: Meter) -> tuple[float, bool]:
    """One engine step: (seconds, whether it was a decode step)."""
    num_decoded = engine.stats.num_decode_tokens
    start = time.perf_counter()
    engine.step()
    if meter.is_cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    meter.sample()
    return seconds, engine.stats.num_decode_tokens > num_decoded


def _decode(engine, meter: Meter, num_warmup: int, num_timed: int) -> dict:
    """Median decode step after `num_warmup` steps (CUDA graph captures, first faults)."""
    times_s = []
    for i in range(num_warmup + num_timed):
        seconds, is_decode = _step(engine, meter)
        if not is_decode:  # out of memory: the engine preempted the sequence to recompute it
            return {"note": f"decoding stopped after {i} steps (preempted)"}
        if i >= num_warmup:
            times_s.append(seconds)
    step_s = statistics.median(times_s)
    # Pages of the running sequence that live on the host (the pool's free pages do not count).
    return {
        "step_ms": round(step_s * 1e3, 3),
        "tokens_per_s": round(1 / step_s, 1),
        "num_blocks_on_host": engine.num_kv_blocks_on_host(),
    }


def measure_context(engine, meter: Meter, tokens: list[int], context: int, args, card_bytes) -> dict:
    """Prefill `context` tokens (the prefix cache holds what earlier contexts computed), then
    time decode steps; with --forced-share-tokens (um) again with the device share cut."""
    pool = engine.kv_pool
    request_id = f"ctx{context}"
    num_decode = args.warmup_steps + args.decode_steps
    forced = args.forced_share_tokens if pool.backend == "um" else 0
    if forced:
        num_decode += args.warmup_steps + args.decode_steps
    # One token more than the steps sample: the request must still hold its pages when they are counted.
    params = SamplingParams(temperature=0, max_tokens=num_decode + 2, ignore_eos=True)
    engine.add_request(request_id, None, params, prompt_token_ids=tokens[:context])
    seq = engine.requests[request_id]
    meter.reset()
    num_prefilled = engine.stats.num_prefill_tokens
    prefill_s = 0.0
    row = {"context_tokens": context}
    while not seq.output_token_ids:  # the step that computes the prompt's last chunk samples the first token
        prefill_s += _step(engine, meter)[0]
        if prefill_s > args.max_prefill_s:
            engine.abort_request(request_id)
            computed = engine.stats.num_prefill_tokens - num_prefilled
            row.update(
                is_complete=False,
                prefill_s=round(prefill_s, 2),
                note=f"prefill stopped after {prefill_s:.0f} s with {computed} new tokens computed",
            )
            return row
    computed = engine.stats.num_prefill_tokens - num_prefilled
    row.update(
        is_complete=True,
        num_prefill_tokens=computed,
        prefill_s=round(prefill_s, 3),
        prefill_tokens_per_s=round(computed / prefill_s, 1) if prefill_s else None,
    )
    row["decode"] = _decode(engine, meter, args.warmup_steps, args.decode_steps)
    row["memory"] = meter.row(card_bytes)  # peaks of the prefill and decode at the profile's device share
    if forced:
        share = pool.max_device_blocks
        pool.set_max_device_blocks(max(1, forced // pool.block_size))
        row["decode_forced_spill"] = {
            "device_share_tokens": pool.max_device_blocks * pool.block_size,
            **_decode(engine, meter, args.warmup_steps, args.decode_steps),
        }
        pool.set_max_device_blocks(share)
    engine.abort_request(request_id)
    return row


# ---------------------------------------------------------------- one run


def run(name: str, model_dir: str, args: argparse.Namespace, contexts: list[int], card_bytes: int | None) -> dict:
    """One backend and precision at every context that fits it."""
    backend, precision = RUNS[name]
    result = {"run": name, "kv_backend": backend, "kv_precision": precision, "contexts": [], "not_fitting": []}
    wanted = sorted(contexts)
    engine = None
    while wanted:
        try:
            engine = open_engine(model_dir, args, backend, precision, wanted[-1] + DECODE_MARGIN_TOKENS)
            break
        except OutOfMemoryError as exc:  # the plan does not fit this context on the device
            result["not_fitting"].append({"context_tokens": wanted.pop(), "reason": str(exc).split(". ")[0]})
            release_memory()
        except ConfigError as exc:  # e.g. um without cuda-bindings
            print(f"{name:>12}  not run: {exc}")
            result["error"] = str(exc)
            return result
    if engine is None:
        return result
    # The model's own limit (131072 positions for the 1.5B shape) leaves room for the decode steps.
    max_context = engine.max_model_len - DECODE_MARGIN_TOKENS
    wanted = sorted({min(context, max_context) for context in wanted})
    pool = engine.kv_pool
    result.update(
        pool_backend=pool.backend,
        num_pool_blocks=pool.num_blocks,
        block_size=pool.block_size,
        device_share_tokens=getattr(pool, "max_device_blocks", pool.num_blocks) * pool.block_size,
        budget_bytes=engine.memory_budget_bytes,
        model_weight_bytes=engine.model.weight_bytes,
    )
    if pool.max_blocks_per_step is not None:  # pinned: a step's pages must all be on the device
        limit = pool.max_blocks_per_step * pool.block_size
        for context in [c for c in wanted if c + DECODE_MARGIN_TOKENS > limit]:
            wanted.remove(context)
            result["not_fitting"].append(
                {
                    "context_tokens": context,
                    "reason": (f"a pinned step holds all its pages on the device; the device share is {limit} tokens"),
                }
            )
    tokens = prompt_stream(max(wanted, default=0), engine.config.vocab_size)
    meter = Meter(engine)
    for context in wanted:
        row = measure_context(engine, meter, tokens, context, args, card_bytes)
        result["contexts"].append(row)
        _print_row(name, row)
        if not row["is_complete"]:
            break
    result.update(kv_precision_at_end=engine.kv_precision, num_preemptions=engine.stats.num_preemptions)
    del engine, pool, meter
    release_memory()
    return result


def _print_row(name: str, row: dict) -> None:
    if not row["is_complete"]:
        print(f"{name:>12} {row['context_tokens']:>7}  {row['note']}")
        return
    memory, decode = row["memory"], row["decode"]

    def speed(result: dict) -> str:
        if "tokens_per_s" not in result:
            return result["note"]
        return f"{result['tokens_per_s']:>7.1f} tok/s, {result['num_blocks_on_host']:>5} pages on host"

    forced = row.get("decode_forced_spill")
    forced_text = f"  | share {forced['device_share_tokens']} tokens: {speed(forced)}" if forced else ""
    verdict = "within budget" if memory["is_within_budget"] else "OVER BUDGET"
    if "card_bytes" in memory:
        verdict += f", peak {memory['peak_device_total_bytes'] / GIB:.2f} GiB " + (
            "within card" if memory["is_within_card"] else "OVER THE CARD"
        )
    print(
        f"{name:>12} {row['context_tokens']:>7}  prefill {row['prefill_tokens_per_s'] or 0:>8.0f} tok/s  "
        f"decode {speed(decode)}  pool {memory['pool_device_bytes'] / GIB:.2f} GiB  {verdict}{forced_text}"
    )


# ---------------------------------------------------------------- transfers


def link_mb_per_s(num_bytes: int) -> dict[str, float]:
    """Pinned host <-> device copies of `num_bytes`, best of three, in MB/s (1e6)."""
    host = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    rates = {}
    for direction, dst, src in (("h2d", device, host), ("d2h", host, device)):
        times_s = []
        for _ in range(3):
            torch.cuda.synchronize()
            start = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            times_s.append(time.perf_counter() - start)
        rates[direction] = num_bytes / min(times_s) / 1e6
    return rates


def _move(pool, operation: str, block_ids: range) -> float:
    """Seconds for one pool operation on `block_ids`, until its copies have landed."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    getattr(pool, operation)(block_ids)
    pool.synchronize()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def transfer_rows(shape: KVShape, num_bytes: int) -> list[dict]:
    """The pools' own spill, prefetch and ensure_resident of every page, against the link."""
    from lowvram.kv.managed_memory import ManagedMemory

    num_blocks = max(2, num_bytes // shape.block_bytes("fp16"))
    link = link_mb_per_s(num_blocks * shape.block_bytes("fp16"))
    pools = {
        "um": lambda: ManagedKVPool(
            shape,
            num_blocks,
            "fp16",
            "cuda",
            max_device_blocks=num_blocks,
            memory=ManagedMemory(torch.device("cuda")),
            budget_bytes=2 * num_blocks * shape.block_bytes("fp16"),
        ),
        "pinned": lambda: PinnedKVPool(
            shape, num_blocks, "fp16", "cuda", max_device_blocks=num_blocks, num_host_blocks=num_blocks
        ),
    }
    rows = []
    for backend, make in pools.items():
        try:
            pool = make()
        except (ConfigError, KernelError) as exc:  # um without a usable cuda-bindings
            print(f"{backend:>7}: not measured: {exc}")
            rows.append({"backend": backend, "error": str(exc)})
            continue
        for pages in pool.pages:  # touch every page, so each one is really on the device
            pages.k.fill_(1.0)
            pages.v.fill_(1.0)
        for operation in ("spill", "prefetch", "spill", "ensure_resident"):
            moved = pool.spilled_bytes + pool.fetched_bytes
            seconds = _move(pool, operation, range(num_blocks))
            moved = pool.spilled_bytes + pool.fetched_bytes - moved
            link_rate = link["d2h" if operation == "spill" else "h2d"]
            rate = moved / seconds / 1e6
            rows.append(
                {
                    "backend": backend,
                    "operation": operation,
                    "bytes": moved,
                    "ms": round(seconds * 1e3, 2),
                    "mb_per_s": round(rate),
                    "link_mb_per_s": round(link_rate),
                    "fraction_of_link": round(rate / link_rate, 3),
                }
            )
            print(
                f"{backend:>7} {operation:>15}: {moved / MIB:7.0f} MiB in {seconds * 1e3:8.1f} ms = {rate:8.0f} MB/s "
                f"({rate / link_rate:.0%} of the pinned {'d2h' if operation == 'spill' else 'h2d'} copy)"
            )
        del pool
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return rows


# ---------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    has_cuda = torch.cuda.is_available()
    args.device = args.device or ("cuda" if has_cuda else "cpu")
    args.profile = args.profile or ("4gb" if args.device == "cuda" else "cpu")
    runs = args.runs.split(",") if args.runs else (list(RUNS) if args.device == "cuda" else ["device"])
    unknown = [r for r in runs if r not in RUNS]
    if unknown:
        print(f"unknown run {unknown[0]!r}; choose from {', '.join(RUNS)}", file=sys.stderr)
        return 2
    if args.device == "cpu" and any(RUNS[r][0] in SPILL_BACKENDS for r in runs):
        print("the um and pinned runs need CUDA", file=sys.stderr)
        return 2
    contexts = [int(c) for c in args.contexts.split(",")]
    card_bytes = int(args.card_gib * GIB) if args.device == "cuda" else None
    given = argv if argv is not None else sys.argv[1:]
    record = run_metadata(" ".join(["python", "scripts/bench_kv_pool.py", *given]))
    with tempfile.TemporaryDirectory(prefix="lowvram-bench-kv-pool-") as work:
        model_dir, model_note = make_model(args, Path(work))
        print(
            f"model: {model_note}; profile {args.profile}"
            + (f", emulated {args.card_gib} GiB card" if card_bytes else "")
        )
        results = [run(name, model_dir, args, contexts, card_bytes) for name in runs]
        from lowvram.models.config import load_model_config

        config, _ = load_model_config(Path(model_dir))
    for result in results:
        for missing in result["not_fitting"]:
            print(f"{result['run']:>12} {missing['context_tokens']:>7}  does not fit: {missing['reason']}")
    transfers = []
    if args.device == "cuda" and args.transfer_mib > 0:
        shape = KVShape(
            config.num_layers,
            load_profile(args.profile).kv_block_size,
            config.num_kv_heads,
            config.head_dim,
            torch.float16,
        )
        transfers = transfer_rows(shape, args.transfer_mib * MIB)
    is_over = any(
        not row["memory"].get("is_within_card", True)
        for result in results
        if result["kv_backend"] in SPILL_BACKENDS
        for row in result["contexts"]
        if row["is_complete"]
    )
    record.update(
        model=model_note,
        profile=args.profile,
        card_bytes=card_bytes,
        runs=results,
        transfers=transfers,
        notes=["transfers: standalone pools of the model's KV shape, FP16 pages"],
    )
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=2) + "\n")
        print(f"wrote {args.json}")
    if is_over:
        print("a spilling run went over the card", file=sys.stderr)
    return 1 if is_over else 0


if __name__ == "__main__":
    sys.exit(main())
