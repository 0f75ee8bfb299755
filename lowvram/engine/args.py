"""The engine's options on the command line, shared by `lowvram generate`, `chat` and `serve`."""

from __future__ import annotations

import argparse


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The options every command that builds an engine takes (generate, chat, serve)."""
    p.add_argument(
        "--model", "-m", default=None, help="local model directory or hub id (default: the bundled demo model)"
    )
    p.add_argument(
        "--profile",
        default=None,
        help="built-in profile (2gb, 4gb, 6gb, 8gb, cpu) or a YAML file; default 4gb with CUDA, cpu without",
    )
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default=None, help="override the profile's device")
    p.add_argument(
        "--dtype", choices=["auto", "float16", "bfloat16", "float32"], default=None, help="override the compute dtype"
    )
    p.add_argument("--emulate-vram-gib", type=float, default=None, help="behave like a card with this much memory")
    p.add_argument("--max-model-len", type=int, default=None, help="longest context in tokens")


def engine_kwargs(args) -> dict:
    """Those options as LLMEngine's keyword arguments (model and profile are passed apart)."""
    return {name: getattr(args, name) for name in ("device", "dtype", "emulate_vram_gib", "max_model_len")}
