"""`lowvram pull`, `lowvram list` and `lowvram rm`: models by name over the Hugging Face cache (models/hub.py).
Building the parsers imports nothing heavy."""

from __future__ import annotations

import sys

from lowvram.errors import ConfigError


def add_model_parsers(subparsers) -> None:
    """Register pull, list and rm on the `lowvram` command's subparsers."""
    pull = subparsers.add_parser(
        "pull",
        help="download a model from the Hugging Face hub into its cache (ORG/NAME)",
        description="Download (or update) a model into the Hugging Face cache, as `hf download` does; "
        "--model ORG/NAME then loads it from there, offline too.",
    )
    pull.add_argument("name", metavar="NAME", help="hub id, e.g. deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B")
    pull.add_argument("--quantize", action="store_true", help="also make its AWQ INT4 copy now (kept, made once)")
    pull.add_argument("--profile", default=None, help="with --quantize: the profile whose settings it uses")
    pull.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto", help="with --quantize: where")
    pull.add_argument("--num-samples", type=int, default=128, help="with --quantize: calibration blocks (default 128)")
    pull.set_defaults(func=cmd_pull)
    listing = subparsers.add_parser("list", help="the models in the Hugging Face cache and lowvram's copies of them")
    listing.set_defaults(func=cmd_list)
    rm = subparsers.add_parser(
        "rm", help="delete a model from the cache (with its AWQ copies) or one of lowvram's copies"
    )
    rm.add_argument("name", metavar="NAME", help="a name `lowvram list` shows")
    rm.add_argument("--yes", "-y", action="store_true", help="do not ask for confirmation")
    rm.set_defaults(func=cmd_rm)


def _size(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.2f} GiB" if num_bytes >= 2**30 else f"{num_bytes / 2**20:.1f} MiB"


def _progress(text: str) -> None:
    print(f"lowvram: {text}", file=sys.stderr, flush=True)


def cmd_pull(args) -> int:
    from lowvram.models.hub import describe, fetch, looks_like_hub_id

    if not looks_like_hub_id(args.name):
        raise ConfigError(
            f"{args.name!r} is not a hub id; pull takes ORG/NAME, e.g. deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B"
        )
    path = fetch(args.name, verb="pull")
    arch, is_runnable, why_not = describe(path)
    print(f"{args.name}: {path}")
    if not is_runnable:
        _progress(f"warning: lowvram cannot run {args.name} ({why_not})")
    elif args.quantize:
        from lowvram.quant.cache import quantized_copy

        copy = quantized_copy(
            args.name, args.profile, device=args.device, num_samples=args.num_samples, on_stage=_progress
        )
        print(f"AWQ INT4 copy: {copy}")
    return 0


def cmd_list(args) -> int:
    from lowvram.models.hub import hub_cache_dir, list_models

    models = list_models()
    if not models:
        print(f"no models in the Hugging Face cache ({hub_cache_dir()}); `lowvram pull ORG/NAME` downloads one")
        return 0
    kinds = {"hub": "hub", "awq": "AWQ INT4 copy", "gguf": "from GGUF"}
    rows = [("NAME", "SIZE", "KIND", "ARCHITECTURE", "RUNS")]
    for model in models:
        for row, prefix in [(model, "")] + [(copy, "  └ ") for copy in model.copies]:
            runs = "yes" if row.is_runnable else f"no: {row.note}" if row.note else "no"
            rows.append((prefix + row.name, _size(row.size_bytes), kinds[row.kind], row.architecture or "?", runs))
    # plain columns, never wrapped or cut: the names are what --model and `rm` take
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    for row in rows:
        print("  ".join([*(cell.ljust(width) for cell, width in zip(row, widths)), row[-1]]))
    return 0


def cmd_rm(args) -> int:
    from lowvram.models.hub import find_model, remove

    model = find_model(args.name)
    doomed = [model.path if model.kind != "hub" else model.name, *(copy.path for copy in model.copies)]
    total = model.size_bytes + sum(copy.size_bytes for copy in model.copies)
    if not args.yes:
        if not sys.stdin.isatty():
            raise ConfigError(f"rm asks before deleting and stdin is not a terminal; pass --yes to delete {args.name}")
        answer = input(f"delete {', '.join(map(str, doomed))} ({_size(total)})? [y/N] ")
        if answer.strip().lower() not in {"y", "yes"}:
            print("nothing deleted")
            return 1
    print(f"deleted {args.name}: freed {_size(remove(model))}")
    return 0
