"""Benchmark `lowvram quantize` on a DeepSeek-R1-Distill-Qwen-1.5B-shaped model under a 4 GB card.

Builds a random-weight BF16 checkpoint of the 1.5B shape (hidden 1536, intermediate 8960,
28 layers, 12 heads, 2 KV heads, vocab 151936) in a temporary directory, then quantizes it
with the model held in host memory and the device capped at --emulate-vram-gib (4 GiB),
running the whole pipeline by default: AWQ search, sensitivity scoring with an FP16 budget,
and rank-16 residual compensation. Reports wall time and peak device memory
(torch.cuda.max_memory_allocated) and checks the peak stays under the cap.

    python scripts/bench_quantize.py [--json PATH] [--num-layers 28] [--num-samples 128]

Random weights make the numbers a statement about time and memory only, not quality.
`--device cpu --num-layers 1 --num-samples 2 --seq-len 64` is a quick smoke run without a GPU.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
from pathlib import Path

# Activations of different sizes come and go per layer; growable segments keep the caching
# allocator from fragmenting under the 4 GiB cap. Must be set before CUDA initialises.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch
from safetensors.torch import save_file

from lowvram.bench.record import git_commit
from lowvram.quant.quantize import quantize_model
from lowvram.testing import train_tiny_tokenizer

GIB = 2**30
SHAPE = {
    "hidden_size": 1536,
    "intermediate_size": 8960,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
}
INIT_STD = 0.02


def write_random_checkpoint(out_dir: Path, num_layers: int, seed: int = 0) -> int:
    """A Qwen2ForCausalLM directory with random BF16 weights and a small tokenizer; returns its parameter count."""
    hidden, inter = SHAPE["hidden_size"], SHAPE["intermediate_size"]
    head_dim = hidden // SHAPE["num_attention_heads"]
    kv = SHAPE["num_key_value_heads"] * head_dim
    gen = torch.Generator().manual_seed(seed)

    def normal(*shape):
        return (torch.randn(*shape, generator=gen) * INIT_STD).to(torch.bfloat16)

    def norm():
        return (1 + 0.1 * torch.randn(hidden, generator=gen)).to(torch.bfloat16)

    tensors = {
        "model.embed_tokens.weight": normal(SHAPE["vocab_size"], hidden),
        "model.norm.weight": norm(),
        "lm_head.weight": normal(SHAPE["vocab_size"], hidden),
    }
    for i in range(num_layers):
        prefix = f"model.layers.{i}."
        tensors.update(
            {
                prefix + "input_layernorm.weight": norm(),
                prefix + "post_attention_layernorm.weight": norm(),
                prefix + "self_attn.q_proj.weight": normal(hidden, hidden),
                prefix + "self_attn.q_proj.bias": normal(hidden),
                prefix + "self_attn.k_proj.weight": normal(kv, hidden),
                prefix + "self_attn.k_proj.bias": normal(kv),
                prefix + "self_attn.v_proj.weight": normal(kv, hidden),
                prefix + "self_attn.v_proj.bias": normal(kv),
                prefix + "self_attn.o_proj.weight": normal(hidden, hidden),
                prefix + "mlp.gate_proj.weight": normal(inter, hidden),
                prefix + "mlp.up_proj.weight": normal(inter, hidden),
                prefix + "mlp.down_proj.weight": normal(hidden, inter),
            }
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    train_tiny_tokenizer(out_dir, extra_special_tokens=("<|endoftext|>",))
    config = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "num_hidden_layers": num_layers,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "hidden_act": "silu",
        "use_sliding_window": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
        **SHAPE,
    }
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    return sum(t.numel() for t in tensors.values())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    parser.add_argument("--num-layers", type=int, default=28, help="decoder layers (the real model has 28)")
    parser.add_argument("--num-samples", type=int, default=128, help="calibration blocks (default 128, as published)")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--fp16-budget-mib", type=float, default=64.0)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--emulate-vram-gib", type=float, default=4.0)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--work-dir", default=None, help="where to build the checkpoints (default: a temp dir)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_quantize needs a CUDA GPU (or --device cpu for a smoke run)", file=sys.stderr)
        return 2

    with tempfile.TemporaryDirectory(dir=args.work_dir) as work:
        work = Path(work)
        start = time.perf_counter()
        num_params = write_random_checkpoint(work / "bf16", args.num_layers)
        build_s = time.perf_counter() - start
        print(f"built a random {num_params / 1e9:.2f}B-parameter checkpoint in {build_s:.1f} s")
        report = quantize_model(
            work / "bf16",
            work / "awq",
            group_size=args.group_size,
            fp16_budget_mib=args.fp16_budget_mib,
            rank=args.rank,
            num_samples=args.num_samples,
            seq_len=args.seq_len,
            device=args.device,
            emulate_vram_gib=args.emulate_vram_gib if args.device == "cuda" else None,
            show_progress=True,
        )
        output_bytes = sum(p.stat().st_size for p in (work / "awq").iterdir())
    print(report.summary())

    cap_bytes = args.emulate_vram_gib * GIB
    is_under_cap = report.peak_device_bytes is None or report.peak_device_bytes < cap_bytes
    numbers = {
        "num_params": num_params,
        "num_layers": args.num_layers,
        "num_samples": report.num_samples,
        "seq_len": report.seq_len,
        "group_size": args.group_size,
        "fp16_budget_mib": args.fp16_budget_mib,
        "rank": args.rank,
        "checkpoint_build_s": build_s,
        "quantize_s": report.seconds,
        "peak_device_gib": None if report.peak_device_bytes is None else report.peak_device_bytes / GIB,
        "peak_device_reserved_gib": torch.cuda.max_memory_reserved() / GIB if args.device == "cuda" else None,
        "peak_host_gib": None if report.peak_host_bytes is None else report.peak_host_bytes / GIB,
        "emulated_vram_gib": args.emulate_vram_gib if args.device == "cuda" else None,
        "is_peak_under_cap": is_under_cap,
        "output_mib": output_bytes / 2**20,
        "num_fp16_groups": len(report.fp16_groups),
        "num_compensated_linears": len(report.compensation),
    }
    if args.device == "cuda":
        print(
            f"peak device memory {numbers['peak_device_gib']:.2f} GiB (cap {args.emulate_vram_gib:g} GiB): "
            f"{'OK' if is_under_cap else 'OVER THE CAP'}"
        )
    if args.json:
        record = {
            "command": " ".join([sys.executable, *sys.argv]),
            "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else None,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "git_commit": git_commit(),
            "torch": torch.__version__,
            "pytorch_cuda_alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
            "note": "random weights: time and memory only. The calibration text is the shipped corpus "
            "tokenized by a small test tokenizer.",
            "numbers": numbers,
        }
        with open(args.json, "w") as handle:
            json.dump(record, handle, indent=2)
        print(f"wrote {args.json}")
    return 0 if is_under_cap else 1


if __name__ == "__main__":
    sys.exit(main())
