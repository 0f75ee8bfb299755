"""`lowvram chat`: the terminal UI, or the plain line mode when there is no terminal.

Importing this module is cheap (no Textual, no torch): lowvram's CLI imports it
to register the subcommand.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path


def _add_chat_args(p: argparse.ArgumentParser) -> None:
    from lowvram.engine.args import add_engine_args

    add_engine_args(p)
    p.add_argument("--system", default="", help="system prompt (F2 or /system changes it in the chat)")
    p.add_argument("--temperature", "-t", type=float, default=0.0, help="0 = greedy (default); F3 or /temp changes it")
    p.add_argument("--max-tokens", "-n", type=int, default=512, help="most tokens per reply (default 512)")
    p.add_argument(
        "--plain",
        action="store_true",
        help="line mode: each input line is a message, replies go to stdout "
        "(automatic when stdin or stdout is not a terminal)",
    )
    p.add_argument(
        "--quantize",
        action="store_true",
        help="quantize an FP16/BF16 model to AWQ INT4 before chatting (done once, kept under the data dir)",
    )
    p.add_argument(
        "--transcripts",
        default=None,
        metavar="DIR",
        help="where Ctrl+S saves transcripts (default: $XDG_DATA_HOME/lowvram/transcripts, "
        "else ~/.local/share/lowvram/transcripts)",
    )


def add_chat_parser(subparsers) -> None:
    """Register `chat` on lowvram's subcommand parser."""
    p = subparsers.add_parser(
        "chat",
        help="chat in the terminal and watch memory, KV pages and speed live",
        description="Chat with a model in the terminal while a side panel shows what the "
        "engine is doing. F1 in the chat lists the keys.",
    )
    _add_chat_args(p)
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

        return run_plain(spec, settings, transcript_dir=transcript_dir)

    from lowvram.tui.app import ChatApp
    from lowvram.tui.screens import describe_error

    app = ChatApp(spec, settings, transcript_dir=transcript_dir)
    app.run()
    if app.backend is None and app.load_error is not None:
        message, hint = describe_error(app.load_error)
        print(f"lowvram: error: {message}" + (f"\nlowvram: {hint}" if hint else ""), file=sys.stderr)
        return 2
    return app.return_code or 0


def main(argv: list[str] | None = None) -> int:
    """`python -m lowvram.tui`: the chat on its own, with lowvram's CLI conventions."""
    from lowvram.errors import LowvramError

    parser = argparse.ArgumentParser(prog="lowvram chat", description="Chat with a model in the terminal.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what the engine does")
    _add_chat_args(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="lowvram: %(message)s")
    try:
        return cmd_chat(args)
    except LowvramError as exc:
        print(f"lowvram: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
