"""`lowvram chat`: the terminal UI, or the plain line mode without a terminal. Cheap to import (no Textual,
no torch): lowvram's CLI imports it to register the subcommand."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_chat_parser(subparsers) -> None:
    """Register `chat` on lowvram's subcommand parser."""
    from lowvram.engine.args import add_engine_args

    p = subparsers.add_parser(
        "chat",
        help="chat in the terminal and watch memory, KV pages and speed live",
        description="Chat with a model in the terminal while a side panel shows what the "
        "engine is doing. F1 in the chat lists the keys.",
    )
    # SUPPRESS keeps `lowvram -v chat` working: a default here would overwrite the top-level flag.
    p.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="log what the engine does")
    add_engine_args(p)
    p.add_argument("--system", default="", help="system prompt (F2 or /system changes it in the chat)")
    p.add_argument("--temperature", "-t", type=float, default=0.0, help="0 = greedy (default); F3 or /temp changes it")
    p.add_argument("--max-tokens", "-n", type=int, default=512, help="most tokens per reply (default 512)")
    plain = "line mode: each input line is a message, replies go to stdout (automatic without a terminal)"
    p.add_argument("--plain", action="store_true", help=plain)
    quantize = "quantize an FP16/BF16 model to AWQ INT4 before chatting (done once, kept under the data dir)"
    p.add_argument("--quantize", action="store_true", help=quantize)
    where = "$XDG_DATA_HOME/lowvram/transcripts, else ~/.local/share/lowvram/transcripts"
    hide = "a reasoning model's thinking: not printed with --plain (else it goes to stderr); folded in the screen"
    p.add_argument("--hide-reasoning", action="store_true", help=hide)
    p.add_argument("--transcripts", metavar="DIR", help=f"where Ctrl+S saves transcripts (default: {where})")
    p.set_defaults(func=cmd_chat)


def cmd_chat(args) -> int:
    from lowvram.engine.args import engine_kwargs
    from lowvram.tui.backend import EngineSpec
    from lowvram.tui.conversation import ChatSettings

    spec = EngineSpec(args.model, args.profile, engine_kwargs(args), is_quantized_on_load=args.quantize)
    settings = ChatSettings(args.system, args.temperature, args.max_tokens)
    transcript_dir = Path(args.transcripts).expanduser() if args.transcripts else None
    if args.plain or not sys.stdout.isatty() or not sys.stdin.isatty():
        from lowvram.tui.plain import run_plain

        return run_plain(spec, settings, transcript_dir=transcript_dir, is_reasoning_hidden=args.hide_reasoning)

    from lowvram.tui.app import ChatApp
    from lowvram.tui.widgets import describe_error

    app = ChatApp(spec, settings, transcript_dir=transcript_dir, is_reasoning_hidden=args.hide_reasoning)
    app.run()
    if app.backend is None and app.load_error is not None:
        message, hint = describe_error(app.load_error)
        print(f"lowvram: error: {message}" + (f"\nlowvram: {hint}" if hint else ""), file=sys.stderr)
        return 2
    return app.return_code or 0
