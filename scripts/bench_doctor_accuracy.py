"""How well `lowvram doctor` predicts the real engine's peak device memory.

Builds a DeepSeek-R1-Distill-Qwen-1.5B-shaped checkpoint (hidden 1536, 28 layers,
GQA 12/2, vocab 151936, untied head) with random BF16 weights written straight to
safetensors, then for every context x batch x KV precision runs the real engine
(`lowvram.engine.engine.LLMEngine`, FP16 on the GPU, a profile sized for that context and
batch, KV pages in ordinary device memory, the controller off) over prompts of that
length plus a few decode steps. It compares
`torch.cuda.max_memory_allocated()` since before the engine was built, plus the
CUDA context measured once at start, with the doctor's prediction (the plan's
weights + KV + workspace + cuBLAS workspaces, plus the same measured context).

It also prints reserved - allocated at the peak, which calibrates the doctor's
fragmentation reserve, and the measured context, which calibrates
`memory_plan.CUDA_CONTEXT_BYTES`.

Usage:
    python scripts/bench_doctor_accuracy.py [--json PATH] [--contexts 1024,4096,8192] [--batches 1,4]
        [--kv-precisions fp16,int8,int4] [--profile 8gb] [--num-layers 28] [--decode-steps 4]

Exit status: 0 when every row is within --tolerance (10%), 1 when one is not, 2 without CUDA.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import random
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from lowvram.bench.record import git_commit

GIB = 2**30
MIB = 2**20
SHAPE = {
    "hidden_size": 1536,
    "intermediate_size": 8960,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "max_position_embeddings": 131072,
}
WEIGHT_STD = 0.02
LAYERS_PER_SHARD = 4
# The card a plan is checked against is irrelevant here: only predicted sizes are compared.
UNLIMITED_CAPACITY = (1 << 50, "not checked")


def _tensor_shapes(num_layers: int) -> dict[str, tuple[int, ...]]:
    h, i = SHAPE["hidden_size"], SHAPE["intermediate_size"]
    head_dim = h // SHAPE["num_attention_heads"]
    q, kv, v = h, SHAPE["num_key_value_heads"] * head_dim, SHAPE["vocab_size"]
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,), "lm_head.weight": (v, h)}
    for layer in range(num_layers):
        p = f"model.layers.{layer}"
        shapes.update(
            {
                f"{p}.input_layernorm.weight": (h,),
                f"{p}.post_attention_layernorm.weight": (h,),
                f"{p}.self_attn.q_proj.weight": (q, h),
                f"{p}.self_attn.q_proj.bias": (q,),
                f"{p}.self_attn.k_proj.weight": (kv, h),
                f"{p}.self_attn.k_proj.bias": (kv,),
                f"{p}.self_attn.v_proj.weight": (kv, h),
                f"{p}.self_attn.v_proj.bias": (kv,),
                f"{p}.self_attn.o_proj.weight": (h, q),
                f"{p}.mlp.gate_proj.weight": (i, h),
                f"{p}.mlp.up_proj.weight": (i, h),
                f"{p}.mlp.down_proj.weight": (h, i),
            }
        )
    return shapes


def write_checkpoint(out_dir: Path, num_layers: int, seed: int = 0) -> Path:
    """Random BF16 weights in sharded safetensors, a config.json and a small tokenizer."""
    from safetensors.torch import save_file

    from lowvram.demo.tokenizer import BOS, EOS
    from lowvram.testing import train_tiny_tokenizer

    tokenizer_dir = train_tiny_tokenizer(out_dir, extra_special_tokens=("<|endoftext|>",))
    vocab = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    special = {t["content"]: t["id"] for t in vocab["added_tokens"]}
    config = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        **SHAPE,
        "num_hidden_layers": num_layers,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": special[BOS],
        "eos_token_id": special[EOS],
    }
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    generator = torch.Generator(device="cuda").manual_seed(seed)
    shapes = _tensor_shapes(num_layers)
    groups: list[list[str]] = [["model.embed_tokens.weight"], ["lm_head.weight", "model.norm.weight"]]
    for start in range(0, num_layers, LAYERS_PER_SHARD):
        prefixes = tuple(f"model.layers.{layer}." for layer in range(start, min(start + LAYERS_PER_SHARD, num_layers)))
        groups.append([name for name in shapes if name.startswith(prefixes)])
    weight_map = {}
    for index, names in enumerate(groups):
        filename = f"model-{index + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {}
        for name in names:
            values = torch.randn(shapes[name], generator=generator, device="cuda") * WEIGHT_STD
            if name.endswith("norm.weight"):
                values += 1.0
            tensors[name] = values.to(torch.bfloat16).cpu()
        save_file(tensors, str(out_dir / filename), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, filename))
    (out_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    torch.cuda.empty_cache()
    return out_dir


def measure_context_bytes() -> tuple[int, str]:
    """The CUDA context of this process: NVML before/after init, else free memory after init."""
    from lowvram.memory.environment import measure_cuda_context_bytes

    measured = measure_cuda_context_bytes()
    if measured is not None:
        return measured, "NVML used memory before and after CUDA init, minus torch's reserved memory"
    torch.empty(1, device="cuda")
    free, total = torch.cuda.mem_get_info()
    return int(
        total - free - torch.cuda.memory_reserved()
    ), "torch.cuda.mem_get_info after init (a shared GPU inflates it)"


def run_row(
    model_dir: Path, base_profile, context: int, batch: int, precision: str, decode_steps: int, context_bytes: int
) -> dict:
    from lowvram.core.sampling_params import SamplingParams
    from lowvram.engine.engine import LLMEngine
    from lowvram.memory.doctor import plan_memory
    from lowvram.models.config import load_model_config

    # KV pages in torch's allocator (kv_backend device): unified-memory pages are invisible to
    # max_memory_allocated. The controller stays off so the planned precision and batch hold.
    profile = base_profile.replace(
        max_model_len=context,
        max_num_seqs=batch,
        kv_precision=precision,
        max_num_batched_tokens=max(base_profile.max_num_batched_tokens, batch),
        kv_backend="device",
        controller={"is_enabled": False},
    )
    config, _ = load_model_config(model_dir)
    plan = plan_memory(config, profile, context_len=context, num_seqs=batch, device="cuda", capacity=UNLIMITED_CAPACITY)
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    start = time.perf_counter()
    engine = LLMEngine(str(model_dir), profile)
    params = SamplingParams(temperature=0.0, max_tokens=decode_steps, ignore_eos=True)
    rng = random.Random(context * 31 + batch)
    prompt_len = context - decode_steps
    for i in range(batch):  # distinct prompts, so no prefix pages are shared
        engine.add_request(
            str(i), None, params, prompt_token_ids=[rng.randrange(10, config.vocab_size) for _ in range(prompt_len)]
        )
    while engine.has_unfinished_requests():
        engine.step()
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    peak_allocated = torch.cuda.max_memory_allocated() - before
    peak_reserved = torch.cuda.max_memory_reserved()
    weight_bytes = engine.model.weight_bytes
    stats = engine.stats
    del engine
    gc.collect()
    torch.cuda.empty_cache()

    predicted = plan.peak_allocated_bytes + context_bytes
    measured = peak_allocated + context_bytes
    predicted_rest = plan.peak_allocated_bytes - plan.weights.total_bytes
    measured_rest = peak_allocated - weight_bytes
    return {
        "context": context,
        "batch": batch,
        "kv_precision": precision,
        "predicted_bytes": predicted,
        "measured_bytes": measured,
        "error": (predicted - measured) / measured,
        "predicted_peak_allocated_bytes": plan.peak_allocated_bytes,
        "measured_peak_allocated_bytes": peak_allocated,
        "predicted_weight_bytes": plan.weights.total_bytes,
        "measured_weight_bytes": weight_bytes,
        "predicted_beyond_weights_bytes": predicted_rest,
        "measured_beyond_weights_bytes": measured_rest,
        "error_beyond_weights": (predicted_rest - measured_rest) / measured_rest if measured_rest else None,
        "predicted_kv_bytes": plan.kv_bytes,
        "predicted_workspace_bytes": plan.workspace.peak_bytes,
        "workspace_peak_phase": plan.workspace.peak_phase,
        "peak_reserved_bytes": peak_reserved,
        "reserved_minus_allocated_bytes": peak_reserved - peak_allocated - before,
        "predicted_fragmentation_bytes": plan.fragmentation_bytes,
        "prefill_tokens_per_s": stats.prefill_tokens_per_s,
        "decode_tokens_per_s": stats.decode_tokens_per_s,
        "wall_s": elapsed,
    }


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON")
    parser.add_argument("--contexts", default="1024,4096,8192")
    parser.add_argument("--batches", default="1,4")
    parser.add_argument(
        "--kv-precisions",
        default="fp16,int8,int4",
        help="precisions to run; one the engine rejects is recorded as unsupported",
    )
    parser.add_argument(
        "--profile", default="8gb", help="base profile; max_model_len, max_num_seqs, kv_precision are set per row"
    )
    parser.add_argument(
        "--num-layers",
        type=int,
        default=28,
        help="decoder layers (28 = the real model; fewer only if the GPU is too small)",
    )
    parser.add_argument("--decode-steps", type=int, default=4)
    parser.add_argument("--tolerance", type=float, default=0.10)
    parser.add_argument("--max-seconds", type=float, default=220.0, help="skip the remaining rows after this long")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_doctor_accuracy: needs a CUDA GPU (it measures device memory)", file=sys.stderr)
        return 2

    from lowvram.config import load_profile
    from lowvram.errors import LowvramError
    from lowvram.memory.plan import CUDA_CONTEXT_BYTES, FRAGMENTATION_RESERVE_FRACTION
    from lowvram.memory.workspace import CUBLAS_WORKSPACE_BYTES

    started = time.perf_counter()
    context_bytes, context_source = measure_context_bytes()
    base_profile = load_profile(args.profile)
    gpu = torch.cuda.get_device_name(0)
    print(
        f"GPU {gpu}; CUDA context {context_bytes / MIB:.0f} MiB ({context_source}); "
        f"{args.num_layers} layers; profile {args.profile}",
        flush=True,
    )
    rows = []
    with tempfile.TemporaryDirectory(prefix="lowvram-doctor-bench-") as tmp:
        model_dir = write_checkpoint(Path(tmp), args.num_layers)
        print(f"checkpoint written in {time.perf_counter() - started:.1f} s", flush=True)
        for precision in args.kv_precisions.split(","):
            for batch in _ints(args.batches):
                for context in _ints(args.contexts):
                    key = {"context": context, "batch": batch, "kv_precision": precision}
                    if time.perf_counter() - started > args.max_seconds:
                        rows.append({**key, "skipped": f"time limit of {args.max_seconds:.0f} s"})
                        continue
                    try:
                        row = run_row(
                            model_dir, base_profile, context, batch, precision, args.decode_steps, context_bytes
                        )
                    except LowvramError as exc:
                        rows.append({**key, "skipped": f"{type(exc).__name__}: {exc}"})
                        print(f"{precision} {context} x {batch}: skipped ({exc})", flush=True)
                        continue
                    rows.append(row)
                    print(
                        f"{precision:>5} {context:>6} x {batch}: predicted {row['predicted_bytes'] / GIB:.3f} GiB, "
                        f"measured {row['measured_bytes'] / GIB:.3f} GiB ({row['error']:+.1%}); beyond weights "
                        f"{row['predicted_beyond_weights_bytes'] / MIB:.0f} vs "
                        f"{row['measured_beyond_weights_bytes'] / MIB:.0f} MiB; "
                        f"reserved-allocated {row['reserved_minus_allocated_bytes'] / MIB:.0f} MiB; "
                        f"{row['wall_s']:.1f} s",
                        flush=True,
                    )

    measured_rows = [r for r in rows if "error" in r]
    worst = max((abs(r["error"]) for r in measured_rows), default=math.nan)
    print()
    print(
        "| KV | context | batch | predicted GiB | measured GiB | error | beyond weights: predicted / measured MiB "
        "| reserved - allocated MiB |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        if "skipped" in r:
            print(f"| {r['kv_precision']} | {r['context']} | {r['batch']} | skipped: {r['skipped']} | | | | |")
            continue
        print(
            f"| {r['kv_precision']} | {r['context']} | {r['batch']} | {r['predicted_bytes'] / GIB:.3f} | "
            f"{r['measured_bytes'] / GIB:.3f} | {r['error']:+.1%} | {r['predicted_beyond_weights_bytes'] / MIB:.0f} / "
            f"{r['measured_beyond_weights_bytes'] / MIB:.0f} | {r['reserved_minus_allocated_bytes'] / MIB:.0f} |"
        )
    print(f"\nworst error {worst:.1%} (tolerance {args.tolerance:.0%}); total {time.perf_counter() - started:.0f} s")
    if args.json:
        report = {
            "command": "python " + " ".join(sys.argv),
            "gpu": gpu,
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "git_commit": git_commit(),
            "torch": torch.__version__,
            "num_layers": args.num_layers,
            "profile": args.profile,
            "cuda_context_bytes": context_bytes,
            "cuda_context_source": context_source,
            "constants": {
                "CUDA_CONTEXT_BYTES": CUDA_CONTEXT_BYTES,
                "CUBLAS_WORKSPACE_BYTES": CUBLAS_WORKSPACE_BYTES,
                "FRAGMENTATION_RESERVE_FRACTION": FRAGMENTATION_RESERVE_FRACTION,
            },
            "tolerance": args.tolerance,
            "worst_error": worst,
            "rows": rows,
        }
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0 if measured_rows and worst <= args.tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
