"""A 7B-shaped model on a 4 GB budget: decoder layers that do not fit stream from host memory.

    python scripts/bench_7b_streaming.py --json results.json

Writes a random-weight AWQ INT4 checkpoint of R1-Distill-Qwen-7B (packed INT4 tensors
drawn at random directly in the AutoAWQ GEMM layout, FP16 embeddings, head, norms and
biases: seconds, where quantizing FP16 weights would take many minutes), then, for each
weight-offload strategy, builds LLMEngine under the 4gb profile on an emulated 4 GiB card
and measures, at batch 1:

- prefill tokens/s of one --prompt-tokens prompt, decode tokens/s of --decode-tokens more;
- the split: decoder layers resident / streamed, staging buffers, KV pool size;
- peak device memory (torch's allocator, plus KV pages in managed memory);
- host-to-device bytes per decode token and the achieved GB/s, against the pinned
  host-to-device bandwidth measured here, which bounds "stream" (its copy-bound
  ceiling, link GB/s / bytes per token, is printed beside the measured tokens/s);
- for "cpu", the share of decode time the CPU spends in the MLPs it computes.

The last line names the faster strategy for decode and for prefill; `weight_offload: auto`
uses memory_plan.DEFAULT_OFFLOAD_STRATEGY. On the H200 machine (128 GiB RAM) the run takes
about two minutes: the checkpoint is 5.6 GB, and "cpu" holds its MLPs as float32 in host
RAM (about 15 GB). `--shape tiny` runs the same path on a small Qwen2 shape (the CPU test).
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from lowvram.bench.record import run_metadata
from lowvram.config import load_profile
from lowvram.core.sampling_params import SamplingParams
from lowvram.engine.engine import EngineStats, LLMEngine
from lowvram.memory.plan import (
    DEFAULT_OFFLOAD_STRATEGY,
    OFFLOAD_STRATEGIES,
    decoder_linears,
)
from lowvram.models.config import model_config_from_dict
from lowvram.models.layer_streaming import HostComputed
from lowvram.models.shapes import SHAPES, shape_config

GIB = 2**30
MIB = 2**20
GROUP_SIZE = 128
# Every zero point 8, packed eight to an int32 (0x88888888): weights centred on zero.
PACKED_ZERO_EIGHTS = -2004318072
# q - z is uniform over -8..7 (std ~4.6): scales near 0.02 / 4.6 give weights of std ~0.02.
SCALE_RANGE = (0.003, 0.006)
LINK_BYTES = GIB
# A small Qwen2 shape for the CPU run: K and N multiples of the group size and of 8.
TINY_SHAPE = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 1024,
    "max_position_embeddings": 4096,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 0,
    "eos_token_id": 1,
    "hidden_act": "silu",
}


# ---------------------------------------------------------------- the checkpoint


def _awq_tensors(k: int, n: int, gen: torch.Generator, device: str) -> dict[str, torch.Tensor]:
    """Random AutoAWQ GEMM tensors of one Linear K -> N: qweight int32 [K, N/8],
    qzeros int32 [K/G, N/8], scales fp16 [K/G, N]."""
    num_groups = k // GROUP_SIZE
    # random bytes viewed as int32: every nibble uniform over 0..15
    qweight = torch.randint(0, 256, (k, n // 8 * 4), generator=gen, device=device, dtype=torch.uint8).view(torch.int32)
    qzeros = torch.full((num_groups, n // 8), PACKED_ZERO_EIGHTS, dtype=torch.int32, device=device)
    low, high = SCALE_RANGE
    scales = (torch.rand(num_groups, n, generator=gen, device=device) * (high - low) + low).to(torch.float16)
    return {"qweight": qweight.cpu(), "qzeros": qzeros.cpu(), "scales": scales.cpu()}


def write_random_awq_checkpoint(out_dir: Path, config: dict, *, seed: int = 0, max_shard_bytes: int = 2 * GIB) -> int:
    """A complete AWQ INT4 checkpoint of `config` (a config.json dict) with random weights;
    returns its bytes."""
    from safetensors.torch import save_file

    from lowvram.testing import train_tiny_tokenizer

    out_dir.mkdir(parents=True, exist_ok=True)
    config = dict(
        config,
        torch_dtype="float16",
        quantization_config={
            "quant_method": "awq",
            "bits": 4,
            "group_size": GROUP_SIZE,
            "zero_point": True,
            "version": "gemm",
            "modules_to_not_convert": None,
        },
    )
    train_tiny_tokenizer(out_dir, extra_special_tokens=("<|endoftext|>",) if config["model_type"] == "qwen2" else ())
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    (out_dir / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 1}))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=device).manual_seed(seed)
    hidden, vocab = config["hidden_size"], config["vocab_size"]

    def normal(*shape: int) -> torch.Tensor:
        return (torch.randn(shape, generator=gen, device=device) * 0.02).to(torch.float16).cpu()

    tensors: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": normal(vocab, hidden),
        "lm_head.weight": normal(vocab, hidden),
        "model.norm.weight": torch.ones(hidden, dtype=torch.float16),
    }
    for layer in range(config["num_hidden_layers"]):
        for norm in ("input_layernorm", "post_attention_layernorm"):
            tensors[f"model.layers.{layer}.{norm}.weight"] = torch.ones(hidden, dtype=torch.float16)
    for linear in decoder_linears(model_config_from_dict(config)):
        for attr, tensor in _awq_tensors(linear.in_features, linear.out_features, gen, device).items():
            tensors[f"{linear.name}.{attr}"] = tensor
        if linear.has_bias:
            tensors[f"{linear.name}.bias"] = normal(linear.out_features)
    shards: list[dict[str, torch.Tensor]] = [{}]
    shard_bytes = 0
    for name, tensor in tensors.items():
        size = tensor.numel() * tensor.element_size()
        if shards[-1] and shard_bytes + size > max_shard_bytes:
            shards.append({})
            shard_bytes = 0
        shards[-1][name] = tensor
        shard_bytes += size
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out_dir / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return total


# ---------------------------------------------------------------- measurements


def pinned_h2d_gbs(num_bytes: int = LINK_BYTES) -> float:
    """Pinned host -> device copy bandwidth (GB/s, 1e9), best of five."""
    host = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    device.copy_(host, non_blocking=True)
    best_s = float("inf")
    for _ in range(5):
        torch.cuda.synchronize()
        start = time.perf_counter()
        device.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        best_s = min(best_s, time.perf_counter() - start)
    del host, device
    torch.cuda.empty_cache()
    return num_bytes / best_s / 1e9


class _HostTimer:
    """Wall time spent inside HostComputed modules (the "cpu" strategy's MLPs)."""

    def __init__(self, model):
        self.seconds = 0.0
        for module in model.modules():
            if isinstance(module, HostComputed):
                module.register_forward_pre_hook(self._start)
                module.register_forward_hook(self._stop)
        self._started = 0.0

    def _start(self, module, args):
        self._started = time.perf_counter()

    def _stop(self, module, args, output):
        self.seconds += time.perf_counter() - self._started


def _random_prompt(vocab_size: int, num_tokens: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab_size, (num_tokens,), generator=gen).tolist()


def _finish(engine: LLMEngine) -> None:
    while engine.has_unfinished_requests():
        engine.step()


def run_strategy(model_dir: Path, args, strategy: str, link_gbs: float | None) -> dict:
    profile = load_profile(args.profile).replace(
        weight_offload=strategy, enable_prefix_caching=False, max_resident_layers=args.max_resident_layers
    )
    is_cuda = torch.cuda.is_available() and profile.device != "cpu"
    if is_cuda:
        torch.cuda.empty_cache()
    start = time.perf_counter()
    engine = LLMEngine(
        str(model_dir),
        profile,
        emulate_vram_gib=args.emulate_vram_gib if is_cuda else None,
        max_model_len=args.max_model_len,
    )
    load_s = time.perf_counter() - start
    streamer = getattr(engine.model, "layer_streamer", None)
    if streamer is None:
        raise SystemExit(f"strategy {strategy}: the engine kept every weight on the device; nothing to measure")
    timer = _HostTimer(engine.model)
    vocab = engine.config.vocab_size
    greedy = {"temperature": 0.0, "ignore_eos": True}
    num_decode_tokens = args.cpu_decode_tokens if strategy == "cpu" else args.decode_tokens
    # Warm-up: compiles the kernels of both the prefill and the decode path.
    engine.add_request(
        "warmup",
        prompt_token_ids=_random_prompt(vocab, args.prompt_tokens, 1),
        params=SamplingParams(max_tokens=3, **greedy),
    )
    _finish(engine)

    if is_cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    engine.stats = EngineStats()
    timer.seconds = 0.0
    copied_start = streamer.stats.copied_bytes
    engine.add_request(
        "measured",
        prompt_token_ids=_random_prompt(vocab, args.prompt_tokens, 2),
        params=SamplingParams(max_tokens=1 + num_decode_tokens, **greedy),
    )
    engine.step()  # the whole prompt fits one step's token budget
    prefill_host_s = timer.seconds
    copied_prefill = streamer.stats.copied_bytes - copied_start
    _finish(engine)
    stats = engine.stats
    copied_decode = streamer.stats.copied_bytes - copied_start - copied_prefill
    bytes_per_token = copied_decode / max(1, stats.num_decode_tokens)
    achieved_gbs = copied_decode / stats.decode_s / 1e9 if stats.decode_s else 0.0
    plan = streamer.plan
    row = {
        "strategy": strategy,
        "load_s": round(load_s, 1),
        "num_layers": plan.num_layers,
        "num_resident_layers": plan.num_resident_layers,
        "num_streamed_layers": plan.num_streamed_layers,
        "is_embedding_on_host": streamer.has_host_embedding,
        "staging_bytes": plan.staging_bytes,
        "device_weight_bytes": plan.device_weight_bytes,
        "kv_pool_tokens": engine.kv_plan.max_tokens,
        "kv_backend": engine.kv_pool.backend,
        "max_model_len": engine.max_model_len,
        "budget_bytes": engine.memory_budget_bytes,
        "prompt_tokens": stats.num_prefill_tokens,
        "decode_tokens": stats.num_decode_tokens,
        "prefill_tokens_per_s": round(stats.prefill_tokens_per_s, 1),
        "decode_tokens_per_s": round(stats.decode_tokens_per_s, 2),
        "decode_ms_per_token": round(1000 * stats.decode_s / max(1, stats.num_decode_tokens), 2),
        "h2d_bytes_prefill": copied_prefill,
        "h2d_bytes_per_decode_token": int(bytes_per_token),
        "achieved_h2d_gbs": round(achieved_gbs, 2),
        "num_missed_prefetches": streamer.stats.num_missed_prefetches,
    }
    if link_gbs:
        row["fraction_of_link"] = round(achieved_gbs / link_gbs, 3)
        if bytes_per_token:
            row["copy_bound_tokens_per_s"] = round(link_gbs * 1e9 / bytes_per_token, 2)
    if timer.seconds or prefill_host_s:
        row["cpu_mlp_share_of_decode"] = round((timer.seconds - prefill_host_s) / stats.decode_s, 3)
        row["cpu_mlp_share_of_prefill"] = round(prefill_host_s / stats.prefill_s, 3)
    if is_cuda:
        managed = engine.kv_pool.device_bytes if engine.kv_pool.backend == "um" else 0
        row.update(
            peak_allocated_bytes=torch.cuda.max_memory_allocated(),
            peak_reserved_bytes=torch.cuda.max_memory_reserved(),
            managed_kv_device_bytes=managed,
            peak_device_gib=round((torch.cuda.max_memory_reserved() + managed) / GIB, 3),
        )
    row["limit"] = _limit(row)
    del engine, streamer, timer
    gc.collect()
    if is_cuda:
        torch.cuda.empty_cache()
    return row


def _limit(row: dict) -> str:
    """What bounds this strategy's decode speed, from its own numbers."""
    if row.get("cpu_mlp_share_of_decode", 0) > 0.5:
        return f"CPU matmuls of the streamed layers' MLPs ({row['cpu_mlp_share_of_decode']:.0%} of decode time)"
    if row.get("fraction_of_link", 0) > 0.7:
        return (
            f"host-to-device bandwidth: {row['h2d_bytes_per_decode_token'] / 2**20:.0f} MiB per token at "
            f"{row['fraction_of_link']:.0%} of the link"
        )
    return "per-layer overhead (launches, host syncs) more than bytes: the copies do not fill the link"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="r1-distill-qwen-7b", choices=[*SHAPES, "tiny"])
    parser.add_argument("--num-layers", type=int, default=None, help="override the shape's decoder layer count")
    parser.add_argument("--profile", default="4gb")
    parser.add_argument("--emulate-vram-gib", type=float, default=4.0, help="emulated card on CUDA (ignored on CPU)")
    parser.add_argument("--max-model-len", type=int, default=None, help="default: the profile's")
    parser.add_argument("--max-resident-layers", type=int, default=None, help="default: as many as fit")
    parser.add_argument("--strategies", default=",".join(OFFLOAD_STRATEGIES))
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--cpu-decode-tokens", type=int, default=8, help="decode tokens for the slower cpu strategy")
    parser.add_argument("--work-dir", default=None, help="where the checkpoint goes (default: a temporary folder)")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoint")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    strategies = [s for s in args.strategies.split(",") if s]
    unknown = [s for s in strategies if s not in OFFLOAD_STRATEGIES]
    if unknown:
        parser.error(f"unknown strategy {unknown[0]!r}; choose from {', '.join(OFFLOAD_STRATEGIES)}")

    record = run_metadata(" ".join(["bench_7b_streaming.py", *sys.argv[1:]]))
    link_gbs = round(pinned_h2d_gbs(), 1) if torch.cuda.is_available() else None
    record["pinned_h2d_gbs"] = link_gbs
    print(f"pinned host->device: {link_gbs} GB/s" if link_gbs else "no CUDA: measuring on the CPU", flush=True)

    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="lowvram-7b-"))
    model_dir = work / f"{args.shape}-awq"
    try:
        config = dict(TINY_SHAPE) if args.shape == "tiny" else shape_config(args.shape)
        if args.num_layers is not None:
            config["num_hidden_layers"] = args.num_layers
        start = time.perf_counter()
        num_bytes = write_random_awq_checkpoint(model_dir, config)
        record["checkpoint"] = {
            "shape": args.shape,
            "num_layers": config["num_hidden_layers"],
            "bytes": num_bytes,
            "write_s": round(time.perf_counter() - start, 1),
        }
        print(f"checkpoint: {num_bytes / GIB:.2f} GiB in {record['checkpoint']['write_s']} s", flush=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        record["results"] = []
        for strategy in strategies:
            row = run_strategy(model_dir, args, strategy, link_gbs)
            record["results"].append(row)
            print(json.dumps(row), flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(work if not args.work_dir else model_dir, ignore_errors=True)
    results = record["results"]
    record["winner"] = {
        "decode": max(results, key=lambda r: r["decode_tokens_per_s"])["strategy"],
        "prefill": max(results, key=lambda r: r["prefill_tokens_per_s"])["strategy"],
        "default": DEFAULT_OFFLOAD_STRATEGY,
    }
    print(
        f"faster: decode {record['winner']['decode']}, prefill {record['winner']['prefill']} "
        f"(weight_offload auto uses {DEFAULT_OFFLOAD_STRATEGY})"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
