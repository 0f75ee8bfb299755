"""DeepSeek-V2-Lite (MLA + MoE, AWQ INT4) on an emulated 4 GB card: speed, expert cache, memory.

    python scripts/bench_deepseek_v2.py --model-dir /tmp/dsv2-lite-awq --profile 4gb \\
        --emulate-vram-gib 4 --json bench_deepseek_v2.json

Writes (once; reused when the directory already holds one) a random-weight checkpoint of
the full DeepSeek-V2-Lite shape straight in the AutoAWQ GEMM layout: packed int32 words
drawn at random, fp16 scales around 0.004 and zero points of 7 or 8, so weights have a
spread like N(0, 0.02) without ever building FP16 weights (15.7B parameters, 8.3 GiB
in safetensors shards, tensor by tensor). Layers whose inputs do not split into
AWQ groups (layer 0's down_proj: 10944 is not a multiple of 128) stay FP16, listed in
modules_to_not_convert as a quantizer would list them.

It then loads the checkpoint with LLMEngine under the profile (the expert cache is sized
from its budget), and measures on random prompts: prefill tokens/s, decode tokens/s at
batch 1 and batch 4 (one sequence per request, all decoding together), the expert
cache's hit rate and host-to-device bytes per decoded token, KV bytes per token, and
the peak device memory. Routing of random weights is close to uniform, so the hit rate
is a floor: a trained model routes with more locality.

`--tiny` runs the same path at a tiny shape (CPU tests); `--max-cached-experts` overrides
the profile's choice.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import random
import sys
import time
from pathlib import Path

import torch

from lowvram.core.sampling_params import SamplingParams
from lowvram.engine.engine import LLMEngine
from lowvram.errors import LowvramError, OutOfMemoryError
from lowvram.kernels.awq_format import pack_awq
from lowvram.memory.plan import decoder_linears
from lowvram.models.deepseek_v2 import ARCHITECTURE, MODEL_TYPE, DeepseekV2Config

# The shape fields of DeepSeek-V2-Lite(-Chat)'s published config.json (16B parameters,
# 2.4B active per token), for benchmarks and plans at the real size.
DEEPSEEK_V2_LITE_CONFIG = {
    "architectures": [ARCHITECTURE],
    "model_type": MODEL_TYPE,
    "vocab_size": 102400,
    "hidden_size": 2048,
    "intermediate_size": 10944,
    "moe_intermediate_size": 1408,
    "num_hidden_layers": 27,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "n_routed_experts": 64,
    "n_shared_experts": 2,
    "num_experts_per_tok": 6,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "n_group": 1,
    "topk_group": 1,
    "topk_method": "greedy",
    "norm_topk_prob": False,
    "routed_scaling_factor": 1.0,
    "scoring_func": "softmax",
    "q_lora_rank": None,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "max_position_embeddings": 163840,
    "rope_theta": 10000,
    "rope_scaling": {
        "type": "yarn",
        "factor": 40,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
    },
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "hidden_act": "silu",
    "bos_token_id": 100000,
    "eos_token_id": 100001,
    "torch_dtype": "bfloat16",
}


# The weight spread of N(0, 0.02): codes minus zero points have a std of about 4.6.
SCALE = 0.02 / 4.6
TINY_OVERRIDES = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "max_position_embeddings": 512,
    "rope_scaling": {
        "type": "yarn",
        "factor": 4,
        "original_max_position_embeddings": 64,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
    },
}


# ---------------------------------------------------------------- the checkpoint


def checkpoint_config(is_tiny: bool, group_size: int) -> dict:
    """config.json of the benchmark checkpoint, with its quantization_config."""
    raw = copy.deepcopy(DEEPSEEK_V2_LITE_CONFIG)
    if is_tiny:
        raw.update(copy.deepcopy(TINY_OVERRIDES))
    config = DeepseekV2Config.from_dict(raw)
    fp16_kept = [linear.name for linear in decoder_linears(config) if linear.in_features % group_size]
    raw["quantization_config"] = {
        "quant_method": "awq",
        "bits": 4,
        "group_size": group_size,
        "zero_point": True,
        "version": "gemm",
        "modules_to_not_convert": fp16_kept,
    }
    return raw


def _tensor_specs(config: DeepseekV2Config, fp16_kept: set[str]):
    """(name, kind, shape) of every checkpoint tensor, in file order; kind: awq (K, N), fp16, norm."""
    h = config.hidden_size
    yield "model.embed_tokens.weight", "fp16", (config.vocab_size, h)
    linears = {linear.name: linear for linear in decoder_linears(config)}
    for layer in range(config.num_layers):
        prefix = f"model.layers.{layer}"
        yield f"{prefix}.input_layernorm.weight", "norm", (h,)
        yield f"{prefix}.post_attention_layernorm.weight", "norm", (h,)
        yield f"{prefix}.self_attn.kv_a_layernorm.weight", "norm", (config.kv_lora_rank,)
        if config.q_lora_rank is not None:
            yield f"{prefix}.self_attn.q_a_layernorm.weight", "norm", (config.q_lora_rank,)
        if config.is_moe_layer(layer):
            yield f"{prefix}.mlp.gate.weight", "fp16", (config.num_routed_experts, h)
        for name, linear in linears.items():
            if name.startswith(prefix + "."):
                if name in fp16_kept:
                    yield f"{name}.weight", "fp16", (linear.out_features, linear.in_features)
                else:
                    yield name, "awq", (linear.in_features, linear.out_features)
    yield "model.norm.weight", "norm", (h,)
    yield "lm_head.weight", "fp16", (config.vocab_size, h)


def _awq_tensors(name: str, k: int, n: int, group_size: int, gen: torch.Generator, device: str) -> dict:
    qweight = torch.randint(-(2**31), 2**31 - 1, (k, n // 8), generator=gen, dtype=torch.int32, device=device)
    zeros = torch.randint(7, 9, (k // group_size, n), generator=gen, dtype=torch.int32, device=device)
    scales = (torch.rand((k // group_size, n), generator=gen, device=device) + 0.5) * SCALE
    return {
        f"{name}.qweight": qweight.cpu(),
        f"{name}.qzeros": pack_awq(zeros).cpu(),
        f"{name}.scales": scales.half().cpu(),
    }


def write_checkpoint(out_dir: Path, raw: dict, *, seed: int = 0, max_shard_bytes: int = 2 * 2**30) -> Path:
    """A random-weight AWQ checkpoint of `raw` (config.json dict), written tensor by tensor
    into safetensors shards; returns the directory."""
    from safetensors.torch import save_file

    from lowvram.testing import train_tiny_tokenizer

    out_dir.mkdir(parents=True, exist_ok=True)
    train_tiny_tokenizer(out_dir)
    raw = dict(raw, bos_token_id=0, eos_token_id=1)  # the tokenizer's ids
    config = DeepseekV2Config.from_dict(raw)
    group_size = raw["quantization_config"]["group_size"]
    fp16_kept = set(raw["quantization_config"]["modules_to_not_convert"])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=device).manual_seed(seed)
    shard: dict[str, torch.Tensor] = {}
    shard_names: list[list[str]] = []
    total_bytes = 0

    def flush() -> None:
        shard_names.append(list(shard))
        save_file(shard, str(out_dir / f"shard-{len(shard_names):05d}.safetensors"), metadata={"format": "pt"})
        shard.clear()

    for name, kind, shape in _tensor_specs(config, fp16_kept):
        if kind == "awq":
            tensors = _awq_tensors(name, *shape, group_size, gen, device)
        elif kind == "norm":
            tensors = {name: torch.ones(shape, dtype=torch.float16)}
        else:
            tensors = {name: (torch.randn(shape, generator=gen, device=device) * 0.02).half().cpu()}
        num_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        if shard and sum(t.numel() * t.element_size() for t in shard.values()) + num_bytes > max_shard_bytes:
            flush()
        shard.update(tensors)
        total_bytes += num_bytes
    flush()
    # Shard files named as published checkpoints name them, now that their count is known.
    weight_map = {}
    for i, names in enumerate(shard_names, 1):
        file = f"model-{i:05d}-of-{len(shard_names):05d}.safetensors"
        (out_dir / f"shard-{i:05d}.safetensors").rename(out_dir / file)
        weight_map.update(dict.fromkeys(names, file))
    index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    (out_dir / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 1}))
    (out_dir / "config.json").write_text(json.dumps(raw, indent=2))  # last: its presence marks a complete checkpoint
    return out_dir


# ---------------------------------------------------------------- the measurements


def _run(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> dict:
    """Run the prompts together; returns the engine's prefill/decode counters and the expert
    cache's counters over this run."""
    stats_before = dataclasses.asdict(engine.stats)
    experts_before = engine.model.expert_stats.copy()
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    ids = [f"r{time.perf_counter_ns()}-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(request_id, prompt_token_ids=prompt, params=params)
    num_finished = 0
    decode_experts_before = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            num_finished += out.finished
        if decode_experts_before is None and all(
            engine.requests[i].output_token_ids for i in ids if i in engine.requests
        ):
            decode_experts_before = engine.model.expert_stats.copy()  # every prompt is prefilled
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    after = dataclasses.asdict(engine.stats)
    delta = {
        k: after[k] - stats_before[k] for k in ("num_prefill_tokens", "prefill_s", "num_decode_tokens", "decode_s")
    }
    decode_experts = engine.model.expert_stats.since(decode_experts_before or experts_before)
    return {
        "num_requests": len(prompts),
        "num_finished": num_finished,
        "prefill_tokens_per_s": delta["num_prefill_tokens"] / delta["prefill_s"] if delta["prefill_s"] else 0.0,
        "decode_tokens_per_s": delta["num_decode_tokens"] / delta["decode_s"] if delta["decode_s"] else 0.0,
        **delta,
        "decode_expert_cache": decode_experts.as_dict(),
        "expert_cache": engine.model.expert_stats.since(experts_before).as_dict(),
    }


def _prompts(count: int, num_tokens: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, vocab_size) for _ in range(num_tokens)] for _ in range(count)]


def bench(args) -> dict:
    model_dir = Path(args.model_dir)
    if not (model_dir / "config.json").is_file():
        start = time.perf_counter()
        write_checkpoint(model_dir, checkpoint_config(args.tiny, args.group_size), seed=args.seed)
        print(f"wrote {model_dir} in {time.perf_counter() - start:.1f} s", flush=True)
    start = time.perf_counter()
    engine = LLMEngine(
        str(model_dir),
        args.profile,
        device=args.device,
        emulate_vram_gib=args.emulate_vram_gib,
        max_model_len=args.max_model_len,
    )
    load_s = time.perf_counter() - start
    if args.max_cached_experts is not None:
        engine.model.offload_experts(args.max_cached_experts)
    model, config = engine.model, engine.config
    is_cuda = engine.device.type == "cuda"
    print(
        f"loaded in {load_s:.1f} s: {model.weight_report.summary()}; routed experts cached per layer: "
        f"{model.num_cached_experts or config.num_routed_experts} of {config.num_routed_experts}",
        flush=True,
    )

    _run(engine, _prompts(1, 16, config.vocab_size, args.seed + 1), 4)  # compiles the kernels
    peak_before_runs = torch.cuda.max_memory_allocated(engine.device) if is_cuda else None
    if is_cuda:
        torch.cuda.reset_peak_memory_stats(engine.device)
    results = {}
    for batch in args.batch_sizes:
        results[f"batch_{batch}"] = _run(
            engine, _prompts(batch, args.prompt_tokens, config.vocab_size, args.seed + batch), args.output_tokens
        )
        r = results[f"batch_{batch}"]
        print(
            f"batch {batch}: prefill {r['prefill_tokens_per_s']:.0f} tok/s, decode {r['decode_tokens_per_s']:.1f} "
            f"tok/s, decode expert hits {r['decode_expert_cache']['hit_rate']:.1%}, "
            f"{r['decode_expert_cache']['bytes_per_token'] / 2**20:.1f} MiB moved per token",
            flush=True,
        )
    cache = next((moe.cache for moe in model.moe_layers if moe.cache is not None), None)
    record = {
        "shape": "tiny" if args.tiny else "deepseek-v2-lite",
        "device": torch.cuda.get_device_name(engine.device) if is_cuda else "cpu",
        "torch": torch.__version__,
        "profile": engine.profile.name,
        "emulate_vram_gib": engine.profile.emulate_vram_gib,
        "budget_bytes": engine.memory_budget_bytes,
        "load_s": load_s,
        "num_params": config.num_params(),
        "weight_bytes_on_device": model.weight_bytes,
        "num_routed_experts": config.num_routed_experts,
        "num_cached_experts": model.num_cached_experts or config.num_routed_experts,
        "expert_bytes": cache.expert_bytes if cache is not None else None,
        "kv_bytes_per_token": engine.kv_plan.bytes_per_token,
        "kv_row_values": config.kv_head_dim,
        "kv_num_blocks": engine.kv_plan.num_blocks,
        "kv_block_size": engine.kv_plan.block_size,
        "prompt_tokens": args.prompt_tokens,
        "output_tokens": args.output_tokens,
        "prefill_tokens_per_s": results[f"batch_{args.batch_sizes[0]}"]["prefill_tokens_per_s"],
        "decode_tokens_per_s": {str(b): results[f"batch_{b}"]["decode_tokens_per_s"] for b in args.batch_sizes},
        "decode_expert_hit_rate": {
            str(b): results[f"batch_{b}"]["decode_expert_cache"]["hit_rate"] for b in args.batch_sizes
        },
        "decode_bytes_moved_per_token": {
            str(b): results[f"batch_{b}"]["decode_expert_cache"]["bytes_per_token"] for b in args.batch_sizes
        },
        "peak_device_memory_bytes": torch.cuda.max_memory_allocated(engine.device) if is_cuda else None,
        "peak_device_memory_load_bytes": peak_before_runs,
        "peak_device_reserved_bytes": torch.cuda.max_memory_reserved(engine.device) if is_cuda else None,
        "is_oom_free": engine.last_crash_report is None
        and all(r["num_finished"] == r["num_requests"] for r in results.values()),
        "runs": results,
    }
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", required=True, help="checkpoint directory (written when it has no config.json)")
    parser.add_argument("--profile", default="4gb")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: the profile's)")
    parser.add_argument("--emulate-vram-gib", type=float, default=None)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--batch-sizes", type=lambda s: [int(b) for b in s.split(",")], default=[1, 4])
    parser.add_argument("--max-cached-experts", type=int, default=None, help="routed experts per layer on the device")
    parser.add_argument("--tiny", action="store_true", help="a tiny shape (CPU tests of this script)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    try:
        record = bench(args)
    except (LowvramError, torch.OutOfMemoryError) as exc:
        is_oom = isinstance(exc, (OutOfMemoryError, torch.OutOfMemoryError))
        record = {"error": f"{type(exc).__name__}: {exc}", "is_oom_free": not is_oom}
        print(record["error"], file=sys.stderr)
    text = json.dumps(record, indent=2, default=str)
    if args.json:
        Path(args.json).write_text(text + "\n")
    print(text)
    return 0 if "error" not in record else 1


if __name__ == "__main__":
    sys.exit(main())
