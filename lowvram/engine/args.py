"""The engine's options on the command line, shared by `lowvram generate`, `chat` and `serve`."""

from __future__ import annotations

import argparse


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "-m", help="local model directory or hub id (default: the bundled demo model)")
    p.add_argument("--profile", help="2gb, 4gb, 6gb, 8gb, cpu or a YAML profile (default: 4gb with CUDA, else cpu)")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], help="override the profile's device")
    p.add_argument("--dtype", choices=["auto", "float16", "bfloat16", "float32"], help="override the compute dtype")
    p.add_argument("--emulate-vram-gib", type=float, help="behave like a card with this much memory")
    p.add_argument("--max-model-len", type=int, help="longest context in tokens")


def engine_kwargs(args) -> dict:
    """Those options as LLMEngine's keyword arguments (model and profile are passed apart)."""
    return {name: getattr(args, name) for name in ("device", "dtype", "emulate_vram_gib", "max_model_len")}
