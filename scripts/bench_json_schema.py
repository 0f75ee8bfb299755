"""Decode throughput with and without a JSON schema (response_format) at a fixed batch: what the
per-step token masks cost (computed on the CPU, applied on the device) and the pipelined decode
that constrained steps give up.

    python scripts/bench_json_schema.py                                   # bundled model, CPU
    python scripts/bench_json_schema.py --shape r1-distill-qwen-1.5b --device cuda --max-tokens 256

Every request decodes exactly --max-tokens tokens in both runs (the schema asks for more items
than fit, plain requests ignore EOS), so the batch stays full. Writes a JSON record with --json PATH.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from lowvram import SamplingParams
from lowvram.bench.record import git_commit
from lowvram.config import load_profile
from lowvram.engine.engine import LLMEngine

# Nested objects, enums, arrays and bounded strings; never complete within max_tokens.
SCHEMA = {
    "type": "object",
    "properties": {
        "rows": {
            "type": "array",
            "minItems": 10_000,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 16},
                    "kind": {"enum": ["cat", "dog", "fish"]},
                    "age": {"type": "integer", "minimum": 0, "maximum": 99},
                },
                "required": ["name", "kind", "age"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["rows"],
    "additionalProperties": False,
}


def decode_tokens_per_s(engine: LLMEngine, batch: int, max_tokens: int, schema: dict | None) -> dict:
    """Run `batch` requests to `max_tokens` each; decode tokens/s from the engine's counters."""
    stats = engine.stats
    before = (stats.num_decode_tokens, stats.decode_s, stats.num_pipelined_steps)
    for i in range(batch):
        params = SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens, ignore_eos=True, json_schema=schema)
        engine.add_request(f"{'json' if schema else 'plain'}-{i}-{time.perf_counter_ns()}", f"Item {i}:", params)
    num_output = 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        num_output += sum(out.finished * len(out.outputs[0].token_ids) for out in engine.step())
    wall_s = time.perf_counter() - start
    num_decode, decode_s = stats.num_decode_tokens - before[0], stats.decode_s - before[1]
    return {
        "output_tokens": num_output,
        "output_tokens_per_s": round(num_output / wall_s, 1),
        "decode_tokens_per_s": round(num_decode / decode_s, 1) if decode_s else 0.0,
        "pipelined_steps": stats.num_pipelined_steps - before[2],
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model dir (default: the bundled demo model)")
    parser.add_argument("--shape", default=None, help="random weights of a named shape instead of --model")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--json", default=None, help="write the record here")
    args = parser.parse_args(argv)

    model = args.model
    tmp = tempfile.TemporaryDirectory()
    if args.shape:
        from lowvram.models.shapes import write_random_checkpoint

        model = str(write_random_checkpoint(Path(tmp.name) / "model", args.shape))
    profile = load_profile("cpu" if args.device == "cpu" else "8gb").replace(
        max_num_seqs=args.batch, max_model_len=args.max_tokens + 64
    )
    engine = LLMEngine(model, profile, device=args.device)
    engine.grammars.check(SCHEMA)  # builds the grammar's token tables (~1 s) outside the timing
    decode_tokens_per_s(engine, args.batch, 4, None)  # warm up (CUDA graphs, allocator)
    decode_tokens_per_s(engine, args.batch, 4, SCHEMA)
    record = {
        "command": " ".join([Path(sys.argv[0]).name, *(sys.argv[1:] if argv is None else argv)]),
        "device": args.device,
        "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
        "machine": f"{platform.machine()} {platform.system()}, {torch.get_num_threads()} threads",
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "git_commit": git_commit(short=True),
        "model": args.shape or model or "bundled demo model",
        "batch": args.batch,
        "max_tokens": args.max_tokens,
        "plain": decode_tokens_per_s(engine, args.batch, args.max_tokens, None),
        "json_schema": decode_tokens_per_s(engine, args.batch, args.max_tokens, SCHEMA),
    }
    plain, constrained = record["plain"], record["json_schema"]
    record["json_schema_speed_ratio"] = round(constrained["output_tokens_per_s"] / plain["output_tokens_per_s"], 3)
    for name in ("plain", "json_schema"):
        row = record[name]
        print(
            f"{name:>11}: {row['output_tokens_per_s']:8.1f} output tokens/s ({row['decode_tokens_per_s']:.1f} in decode "
            f"steps), {row['output_tokens']} tokens, {row['pipelined_steps']} pipelined steps"
        )
    print(f"with a JSON schema: {record['json_schema_speed_ratio']:.2f}x the plain throughput at batch {args.batch}")
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=2) + "\n")
    return record


if __name__ == "__main__":
    main()
