"""`lowvram quantize`'s command line; it imports no torch, so `lowvram --help` starts at once."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lowvram.quant import METHODS


def add_quantize_parser(subparsers) -> argparse.ArgumentParser:
    """Register `lowvram quantize MODEL OUT` on an argparse subparsers object."""
    parser = subparsers.add_parser(
        "quantize",
        help="quantize a model to AWQ INT4 (AutoAWQ GEMM layout, loads in vLLM and transformers)",
        description="Quantize an FP16/BF16 Hugging Face checkpoint to AWQ INT4, layer by layer, optionally keeping "
        "the most sensitive layers in FP16 and adding a low-rank correction of the INT4 error.",
    )
    add = parser.add_argument
    add(
        "model",
        metavar="MODEL",
        help="input model directory (config.json, *.safetensors, tokenizer), GGUF file or a name `lowvram list` shows",
    )
    add("out", metavar="OUT", help="output directory (must not exist, or be empty, unless --force)")
    add("--method", choices=METHODS, default="awq", help="awq (default) or rtn (round-to-nearest)")
    group_help = "32, 64 or 128 inputs sharing one scale and zero point (default 128, or the largest that divides the model's sizes)"
    add("--group-size", type=int, help=group_help)
    calib_help = (
        "calibration text: .jsonl ({'text'} or {'messages'} records) or plain text (default: the shipped corpus)"
    )
    add("--calib", metavar="FILE", help=calib_help)
    add("--num-samples", type=int, default=128, help="calibration blocks (default 128)")
    add("--seq-len", type=int, default=512, help="tokens per calibration block (default 512)")
    budget_help = "extra MiB the most sensitive layers may use to stay FP16 (default 0: none)"
    add("--fp16-budget-mib", type=float, default=0.0, help=budget_help)
    head = parser.add_mutually_exclusive_group()
    keep_help = "keep lm_head in FP16 (default; what vLLM and transformers expect)"
    head.add_argument("--keep-head", dest="quantize_head", action="store_false", help=keep_help)
    quantize_help = "quantize lm_head too (smaller, but only lowvram loads the result)"
    head.add_argument("--quantize-head", action="store_true", help=quantize_help)
    add("--rank", type=int, default=0, help="largest rank of the low-rank INT4 error correction (default 0: off)")
    bias_help = "also correct each layer's mean INT4 error with a bias (off: it fits the calibration text's mean input)"
    add("--bias-correction", action="store_true", help=bias_help)
    where_help = "where to compute (the model itself stays in host memory)"
    add("--device", choices=["auto", "cuda", "cpu"], default="auto", help=where_help)
    add("--emulate-vram-gib", type=float, help="behave like a card with this much memory")
    add("--force", action="store_true", help="replace OUT if it exists")
    parser.set_defaults(func=cmd_quantize, quantize_head=False)
    return parser


# quantize_model's arguments that the command line passes as they are
CLI_OPTIONS = ("method", "group_size", "fp16_budget_mib", "rank", "bias_correction", "quantize_head")
CLI_OPTIONS += ("num_samples", "seq_len", "device", "emulate_vram_gib", "force")


def cmd_quantize(args) -> int:
    if args.quantize_head:
        warning = "vLLM and transformers keep lm_head in FP16 and will not load this checkpoint; lowvram will"
        print(f"lowvram: --quantize-head: {warning}", file=sys.stderr)
    from lowvram.quant.quantize import quantize_model

    model = args.model
    if not Path(model).expanduser().exists():  # a hub id or a name `lowvram list` shows
        from lowvram.models.loader import resolve_model_path

        model = resolve_model_path(model)
    options = {name: getattr(args, name) for name in CLI_OPTIONS}
    report = quantize_model(model, args.out, calib_path=args.calib, show_progress=True, **options)
    print(report.summary())
    return 0
