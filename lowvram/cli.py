"""The `lowvram` command, a thin layer over the library: every LowvramError becomes one
line on stderr and exit code 2, never a traceback."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

from lowvram import __version__
from lowvram.engine.args import add_engine_args, engine_kwargs
from lowvram.errors import LowvramError
from lowvram.memory.crash_report import report_cuda_oom

# Options passed on under their own names: to SamplingParams, run_quality_bench and run_speed_bench.
SAMPLING_OPTIONS = "temperature top_k top_p min_p repetition_penalty max_tokens stop seed".split()
QUALITY_OPTIONS = "device max_chars calib_samples text".split()
SPEED_OPTIONS = (
    "shape quantize fp16_budget_mib rank profile device emulate_vram_gib batch_sizes context_lens max_tokens cuda_graphs"
).split()


def _progress(msg: str) -> None:
    print(f"lowvram: {msg}", file=sys.stderr, flush=True)


@report_cuda_oom
def cmd_generate(args) -> int:
    from lowvram.core.sampling_params import SamplingParams
    from lowvram.engine.llm import LLM

    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if args.model is None:
        _progress(
            "using the bundled demo model (a few-million-parameter model trained for lowvram's tests, "
            "not a real DeepSeek model); pass --model for a real one"
        )
    llm = LLM(args.model, args.profile, **engine_kwargs(args))
    params = SamplingParams(**{name: getattr(args, name) for name in SAMPLING_OPTIONS})
    messages = [{"role": "system", "content": args.system}] if args.system else []
    messages.append({"role": "user", "content": prompt})
    use_chat = not args.raw and llm.engine.tokenizer.has_chat_template
    start = time.perf_counter()
    last = None
    for last in llm.stream(messages=messages, sampling_params=params) if use_chat else llm.stream(prompt, params):
        print(last.text_delta, end="", flush=True)
    print()
    stats = llm.engine.stats
    ttft = last.metrics.ttft_s if last and last.metrics else None
    _progress(
        f"prefill {stats.num_prefill_tokens} tokens at {stats.prefill_tokens_per_s:.1f} tok/s | "
        f"decode {stats.num_decode_tokens} tokens at {stats.decode_tokens_per_s:.1f} tok/s | "
        f"TTFT {ttft * 1000 if ttft is not None else float('nan'):.0f} ms | "
        f"total {time.perf_counter() - start:.2f} s | finish: {last.outputs[0].finish_reason if last else '-'}"
    )
    return 0


def cmd_profiles(args) -> int:
    import dataclasses

    import yaml
    from rich.console import Console
    from rich.table import Table

    from lowvram.config import FIELD_DOCS, builtin_profile_names, load_profile, profiles_markdown

    console = Console()
    if args.markdown:
        sys.stdout.write(profiles_markdown())
    elif args.fields:
        table = Table("field", "meaning")
        for name, doc in FIELD_DOCS.items():
            table.add_row(name, doc)
        console.print(table)
    elif args.show:
        console.print(yaml.safe_dump(dataclasses.asdict(load_profile(args.show)), sort_keys=False))
    else:
        table = Table("profile", "budget GiB", "max len", "seqs", "batch tokens", "KV", "backend", "weights")
        profiles = [load_profile(name) for name in builtin_profile_names()]
        for p in profiles:
            budget = f"{p.memory_budget_gib:g} x {p.memory_utilization:g}"
            sizes = (p.max_model_len, p.max_num_seqs, p.max_num_batched_tokens)
            table.add_row(p.name, budget, *map(str, sizes), p.kv_precision, p.kv_backend, p.weight_format)
        console.print(table)
        for p in profiles:
            console.print(f"[bold]{p.name}[/bold]: {p.description}")
    return 0


def cmd_bench_quality(args) -> int:
    from lowvram.bench.quality import run_quality_bench, to_markdown

    options = {name: getattr(args, name) for name in QUALITY_OPTIONS}
    options.update(variant_names=args.variants.split(",") if args.variants else None, num_per_kind=args.limit)
    report = run_quality_bench(args.model, **options, command=_command_line("quality"), progress=_progress)
    _write_bench_outputs(args, report.to_json(), to_markdown(report))
    return 0


@report_cuda_oom
def cmd_bench_speed(args) -> int:
    from lowvram.bench.speed import run_speed_bench, write_markdown

    options = {name: getattr(args, name) for name in SPEED_OPTIONS}
    result = run_speed_bench(args.model, **options, command=_command_line("speed"), progress=_progress)
    _write_bench_outputs(args, result, write_markdown(result))
    return 0


def _command_line(bench: str) -> str:
    """The command as typed, for the benchmark record."""
    typed = sys.argv and sys.argv[0].endswith("lowvram")
    return "lowvram " + " ".join(sys.argv[1:]) if typed else f"lowvram bench {bench}"


def _write_bench_outputs(args, record: dict, markdown: str) -> None:
    """--json PATH (or '-' for stdout instead of the tables), --output PATH for the Markdown."""
    import json
    from pathlib import Path

    if args.json == "-":
        print(json.dumps(record, indent=2))
    else:
        if args.json:
            Path(args.json).write_text(json.dumps(record, indent=2) + "\n")
        print(markdown)
    if args.output:
        Path(args.output).write_text(markdown)


def _int_list(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not values:
        raise argparse.ArgumentTypeError("give at least one integer")
    return values


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lowvram", description="Run DeepSeek-family LLMs on 4 GB GPUs.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what the engine does")
    parser.add_argument("--version", action="version", version=f"lowvram {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text for one prompt, streamed to stdout")
    add_engine_args(gen)
    gen.add_argument("--prompt", "-p", required=True, help="the prompt ('-' reads stdin)")
    gen.add_argument("--system", default=None, help="system prompt (chat models)")
    gen.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    gen.add_argument("--max-tokens", "-n", type=int, default=256)
    gen.add_argument("--temperature", "-t", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--repeat-penalty", dest="repetition_penalty", metavar="REPEAT_PENALTY", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    gen.set_defaults(func=cmd_generate)
    bench = sub.add_parser("bench", help="measure quality or speed").add_subparsers(dest="bench_command", required=True)
    quality = bench.add_parser("quality", help="accuracy on held-out tasks and perplexity, for every format")
    quality.add_argument("--model", "-m", default=None, help="model directory (default: the bundled demo model)")
    quality.add_argument("--variants", default=None, help="comma-separated formats to compare (default: all)")
    quality.add_argument("--limit", type=int, default=None, help="held-out tasks per kind (default: all 100)")
    quality.add_argument("--max-chars", type=int, default=None, help="use only this much of the held-out text")
    text_help = "demo: the demo model's held-out tasks; real: real prose and code, llama.cpp formats too"
    quality.add_argument("--text", choices=["demo", "real"], default="demo", help=text_help)
    quality.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    quality.add_argument("--calib-samples", type=int, default=32, help="calibration blocks for the quantized rows")
    quality.add_argument("--json", default=None, metavar="PATH", help="write the report as JSON ('-' for stdout)")
    quality.add_argument("--output", default=None, metavar="PATH", help="write the Markdown table here")
    quality.set_defaults(func=cmd_bench_quality)
    speed = bench.add_parser(
        "speed",
        help="prefill and decode tokens/s, TTFT, achieved GB/s and peak memory through the engine",
        description="Measure the engine at a named real model shape (random weights) or on a model directory: "
        "prefill tokens/s and TTFT per context length, decode tokens/s per batch size and context, "
        "achieved GB/s against the measured copy bandwidth, and peak device memory.",
    )
    source = speed.add_mutually_exclusive_group()
    source.add_argument("--model", "-m", default=None, help="model directory or hub id")
    shapes = "r1-distill-qwen-1.5b (default), deepseek-coder-1.3b, r1-distill-qwen-7b, or tiny (CPU, seconds)"
    source.add_argument("--shape", default=None, help=f"random weights of a named shape: {shapes}")
    speed.add_argument("--quantize", action="store_true", help="quantize to AWQ INT4 first, as the profile says")
    speed.add_argument("--fp16-budget-mib", type=float, default=None, help="with --quantize: MiB of layers kept FP16")
    awq = "--fp16-budget-mib 0 --rank 0 quantizes as a published AutoAWQ checkpoint is"
    speed.add_argument("--rank", type=int, default=None, help=f"with --quantize: the compensation's rank; {awq}")
    speed.add_argument("--profile", default=None, help="built-in profile or YAML file (default: 4gb, cpu without CUDA)")
    speed.add_argument("--device", choices=["auto", "cuda", "cpu"], default=None, help="override the profile's device")
    speed.add_argument("--emulate-vram-gib", type=float, default=None, help="behave like a card with this much memory")
    speed.add_argument("--batch-sizes", type=_int_list, default=[1, 4, 8], help="decode batch sizes (default 1,4,8)")
    context_help = "prompt lengths (default: those of 512,4096 that fit the model)"
    speed.add_argument("--context-lens", type=_int_list, default=None, help=context_help)
    speed.add_argument("--max-tokens", type=int, default=128, help="tokens generated per decode request (default 128)")
    speed.add_argument(
        "--cuda-graphs", action=argparse.BooleanOptionalAction, default=None, help="replay decode from CUDA graphs"
    )
    speed.add_argument("--json", default=None, metavar="PATH", help="write the record as JSON ('-' for stdout)")
    speed.add_argument("--output", default=None, metavar="PATH", help="write the Markdown tables here")
    speed.set_defaults(func=cmd_bench_speed)
    prof = sub.add_parser("profiles", help="list the built-in profiles")
    prof.add_argument("--fields", action="store_true", help="describe every profile field")
    prof.add_argument("--show", metavar="PROFILE", help="print one profile (name or file) in full")
    prof.add_argument("--markdown", action="store_true", help="every field and each profile's value, as Markdown")
    prof.set_defaults(func=cmd_profiles)

    from lowvram.memory.cli import add_doctor_parser
    from lowvram.models.cli import add_model_parsers
    from lowvram.quant.cli import add_quantize_parser
    from lowvram.server.cli import add_serve_parser
    from lowvram.server.ps import add_ps_parser
    from lowvram.tui.cli import add_chat_parser

    for add in (
        add_chat_parser,
        add_doctor_parser,
        add_quantize_parser,
        add_serve_parser,
        add_model_parsers,
        add_ps_parser,
    ):
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="lowvram: %(message)s")
    try:
        return args.func(args)
    except LowvramError as exc:
        print(f"lowvram: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("lowvram: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (`| head`): stop quietly, and keep Python's exit-time flush from failing again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
