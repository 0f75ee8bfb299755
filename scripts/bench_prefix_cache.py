"""Time to first token of a chat's later turns with and without prefix caching, and
restoring a saved conversation versus recomputing it.

    python scripts/bench_prefix_cache.py                       # bundled model, CPU
    python scripts/bench_prefix_cache.py --shape r1-distill-qwen-1.5b --device cuda --restore-tokens 8192

Writes a JSON record with --json PATH (command, machine, date, commit, numbers).
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

from lowvram import LLM, SamplingParams
from lowvram.bench.record import git_commit
from lowvram.config import load_profile

QUESTIONS = [
    "What is 17 + 25?",
    "Sort these words: pear, apple, fig.",
    "How many letters r are in strawberry?",
    "What day comes 3 days after Monday?",
    "Convert 3 kilometers to meters.",
    "What is 120 - 45?",
    "Sort: 9, 2, 7, 4.",
    "What is the largest of 3, 17, 8?",
    "What comes next: 2, 4, 6, 8?",
    "What is 64 + 36?",
]


def _ttft_s(llm: LLM, messages: list[dict], max_tokens: int) -> tuple[float, str]:
    start = time.perf_counter()
    first = None
    text = ""
    for out in llm.stream(messages=messages, sampling_params=SamplingParams(temperature=0, max_tokens=max_tokens)):
        first = first or time.perf_counter()
        text += out.text_delta
    return first - start, text


def chat_turns(llm: LLM, num_turns: int, max_tokens: int, padding: str) -> list[dict]:
    messages: list[dict] = []
    rows = []
    for turn in range(num_turns):
        question = QUESTIONS[turn % len(QUESTIONS)]
        messages.append({"role": "user", "content": (padding + question) if turn == 0 else question})
        prompt_tokens = len(llm.engine.tokenizer.apply_chat_template(messages))
        before = llm.engine.stats.num_prefill_tokens
        ttft, reply = _ttft_s(llm, messages, max_tokens)
        rows.append(
            {
                "turn": turn + 1,
                "prompt_tokens": prompt_tokens,
                "ttft_ms": round(ttft * 1000, 2),
                "prefill_tokens_computed": llm.engine.stats.num_prefill_tokens - before,
            }
        )
        messages.append({"role": "assistant", "content": reply})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model dir (default: the bundled demo model)")
    parser.add_argument("--shape", default=None, help="random weights of a named shape instead of --model")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--padding-tokens", type=int, default=0, help="lengthen the first turn (a long system context)")
    parser.add_argument(
        "--restore-tokens", type=int, default=0, help="also time save/restore of a conversation this long"
    )
    parser.add_argument("--emulate-vram-gib", type=float, default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    model = args.model
    tmp = tempfile.TemporaryDirectory()
    if args.shape:
        from lowvram.models.shapes import write_random_checkpoint

        model = str(write_random_checkpoint(Path(tmp.name) / "model", args.shape))
    base = load_profile("cpu" if args.device == "cpu" else "8gb")
    max_len = max(4096, args.restore_tokens + 64)
    padding = "context " * args.padding_tokens
    record = {
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "device": args.device,
        "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
        "machine": f"{platform.machine()} {platform.system()}, {torch.get_num_threads()} threads",
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "git_commit": git_commit(short=True),
        "model": args.shape or model or "bundled demo model",
    }
    for enabled in (True, False):
        profile = base.replace(
            enable_prefix_caching=enabled,
            max_model_len=max_len,
            max_num_batched_tokens=2048,
            max_num_seqs=1,
            emulate_vram_gib=args.emulate_vram_gib,
        )
        llm = LLM(model, profile, device=args.device)
        _ttft_s(llm, [{"role": "user", "content": "warm up"}], 2)
        rows = chat_turns(llm, args.turns, args.max_tokens, padding)
        record["with_prefix_cache" if enabled else "without_prefix_cache"] = rows
        last = rows[-1]
        print(
            f"prefix caching {'on ' if enabled else 'off'}: turn {last['turn']} prompt {last['prompt_tokens']} tokens, "
            f"TTFT {last['ttft_ms']:.1f} ms, prefill computed {last['prefill_tokens_computed']} tokens"
        )
        del llm
    if args.restore_tokens:
        profile = base.replace(
            max_model_len=max_len, max_num_batched_tokens=2048, max_num_seqs=1, emulate_vram_gib=args.emulate_vram_gib
        )
        llm = LLM(model, profile, device=args.device)
        ids = llm.engine.tokenizer.encode("lorem ipsum dolor sit amet " * args.restore_tokens)[: args.restore_tokens]
        start = time.perf_counter()
        llm.engine.score(ids)
        if args.device == "cuda":
            torch.cuda.synchronize()
        recompute_s = time.perf_counter() - start
        from lowvram.kv.conversation_store import restore_conversation, save_conversation

        path = save_conversation(llm.engine, ids, Path(tmp.name) / "conv.kv")
        fresh = LLM(model, profile, device=args.device)
        result = restore_conversation(fresh.engine, path)
        if args.device == "cuda":
            torch.cuda.synchronize()
        record["restore"] = {
            "tokens": len(ids),
            "recompute_ms": round(recompute_s * 1000, 1),
            "restore_ms": round(result.seconds * 1000, 1),
            "file_mib": round(path.stat().st_size / 2**20, 1),
            "is_restored": result.is_restored,
        }
        print(
            f"{len(ids)}-token conversation: recompute {recompute_s * 1000:.0f} ms, restore {result.seconds * 1000:.0f} ms "
            f"({path.stat().st_size / 2**20:.0f} MiB file)"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
