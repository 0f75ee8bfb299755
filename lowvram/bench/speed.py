"""`lowvram bench speed`: prefill and decode speed of the real engine at the shapes users run.

Without a model: random weights of a named shape (`lowvram.models.shapes`), AWQ INT4 with
`quantize`. Prefill: TTFT of one prompt alone, the median over distinct random prompts (no
prefix-cache hits). Decode: only steps after every prefill, after a warm-up of the same shape.
Bytes per step: every weight but the embedding table plus the KV read, against the measured
copy bandwidth. Peak memory: torch's plus the KV pages in unified memory, and again on a second
engine whose pool is sized for one request of the longest context (llama-bench's figure).
"""

from __future__ import annotations

import gc
import itertools
import random
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from lowvram.bench.record import measure_copy_bandwidth_gbps, run_metadata
from lowvram.core.sampling_params import SamplingParams
from lowvram.errors import ConfigError

TINY_SHAPE = "tiny"  # lowvram.testing's small Qwen2 checkpoint: a CPU run in seconds
DEFAULT_SHAPE = "r1-distill-qwen-1.5b"
DEFAULT_CALIB_SAMPLES = 8
NUM_PREFILL_REPEATS = 3
NUM_WARMUP_TOKENS = 8
# Large enough to leave the caches far behind, small enough for two buffers on a 4 GB card.
COPY_BYTES = {"cuda": 512 * 2**20, "cpu": 128 * 2**20}
# Random prompts avoid the lowest ids, where tokenizers keep their special tokens.
MIN_PROMPT_TOKEN_ID = 10
DEFAULT_CONTEXT_LENS = (512, 4096)
GIB = 2**30
MB = 1e6
# The cards lowvram is for, by memory bandwidth: a batch-1 step there is bound by the bytes it reads.
CARD_BANDWIDTH_GBPS = {"GTX 1650": 128, "RTX 3050 laptop": 192}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _release(device: torch.device, is_peak_reset: bool = False) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        if is_peak_reset:
            torch.cuda.reset_peak_memory_stats(device)


def _prompt_maker(vocab_size: int, seed: int) -> Callable[[int, int], list[tuple[str, list[int]]]]:
    """make(num, length): distinct random prompts with request ids, reproducible from the seed."""
    rng, ids = random.Random(seed), itertools.count()
    low = MIN_PROMPT_TOKEN_ID if vocab_size > 2 * MIN_PROMPT_TOKEN_ID else 0
    return lambda num, length: [
        (f"bench-{next(ids)}", [rng.randrange(low, vocab_size) for _ in range(length)]) for _ in range(num)
    ]


def time_prefill(engine, make_prompts: Callable, prompt_len: int) -> dict:
    """TTFT of one prompt alone: the median over NUM_PREFILL_REPEATS runs after one warm-up run."""
    times_s, params = [], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    for repeat in range(NUM_PREFILL_REPEATS + 1):
        [(request_id, ids)] = make_prompts(1, prompt_len)
        _sync(engine.device)
        start = time.perf_counter()
        engine.add_request(request_id, None, params, prompt_token_ids=ids)
        while engine.has_unfinished_requests():
            engine.step()  # sampling reads the token back, so the step's work is done when it returns
        if repeat:
            times_s.append(time.perf_counter() - start)
    ttft_s = statistics.median(times_s)
    return {
        "prompt_tokens": prompt_len,
        "ttft_ms": round(ttft_s * 1000, 3),
        "prefill_tokens_per_s": round(prompt_len / ttft_s, 1),
        "num_repeats": NUM_PREFILL_REPEATS,
    }


def _generate(engine, requests: list[tuple[str, list[int]]], max_tokens: int) -> tuple[float, int, int]:
    """Run the requests to the end; returns (seconds, tokens, steps) of the steps after every prefill."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for request_id, ids in requests:
        engine.add_request(request_id, None, params, prompt_token_ids=ids)
    waiting_first = {request_id for request_id, _ in requests}
    while waiting_first and engine.has_unfinished_requests():
        for out in engine.step():
            waiting_first.discard(out.request_id)
    _sync(engine.device)
    num_steps_before = engine.stats.num_steps
    start = time.perf_counter()
    num_tokens = 0
    while engine.has_unfinished_requests():
        num_tokens += len(engine.step())
    _sync(engine.device)
    return time.perf_counter() - start, num_tokens, engine.stats.num_steps - num_steps_before


def time_decode(
    engine, make_prompts, context_len: int, batch_size: int, max_tokens: int, step_bytes: tuple, copy_gbps
) -> dict:
    """Decode speed of `batch_size` requests of `context_len` prompt tokens, after a warm-up of the same shape;
    step_bytes: (weight bytes read per step, KV bytes per token)."""
    _generate(engine, make_prompts(batch_size, context_len), NUM_WARMUP_TOKENS)
    num_preemptions = engine.stats.num_preemptions
    num_pipelined = engine.stats.num_pipelined_steps
    decode_s, num_tokens, num_steps = _generate(engine, make_prompts(batch_size, context_len), max_tokens)
    step_s = decode_s / max(num_steps, 1)
    # Step k (k = 1 .. max_tokens - 1; token 0 came from the prefill) reads context_len + k tokens of KV.
    mean_context = context_len + max_tokens / 2
    bytes_per_step = int(step_bytes[0] + batch_size * mean_context * step_bytes[1])
    gbps = bytes_per_step / step_s / 1e9 if num_steps else 0.0
    return {
        "context_tokens": context_len,
        "batch_size": batch_size,
        "decode_tokens_per_s": round(num_tokens / decode_s, 2) if decode_s else 0.0,
        "step_ms": round(step_s * 1000, 4),
        "num_steps": num_steps,
        "num_decode_tokens": num_tokens,
        "bytes_per_step": bytes_per_step,
        "achieved_gbps": round(gbps, 2),
        "fraction_of_copy": round(gbps / copy_gbps, 4) if copy_gbps else None,
        "num_preemptions": engine.stats.num_preemptions - num_preemptions,
        "num_pipelined_steps": engine.stats.num_pipelined_steps - num_pipelined,
        "projected_tokens_per_s": projected_tokens_per_s(bytes_per_step, batch_size),
    }


def projected_tokens_per_s(bytes_per_step: int, batch_size: int) -> dict[str, float]:
    """Decode tokens/s on each card of CARD_BANDWIDTH_GBPS if a step took only the time to read its
    bytes at the card's full bandwidth: an upper bound."""
    return {card: round(batch_size * gbps * 1e9 / bytes_per_step, 1) for card, gbps in CARD_BANDWIDTH_GBPS.items()}


def memory_summary(engine, cuda_context_bytes: int | None) -> dict:
    """Peak device memory (None on the CPU) and what the weights and KV pool hold."""
    pool = engine.kv_pool
    allocated = reserved = peak = None
    if engine.device.type == "cuda":
        allocated = torch.cuda.max_memory_allocated(engine.device)
        reserved = torch.cuda.max_memory_reserved(engine.device)
        # Managed pages are invisible to torch's statistics; the pool counts its resident ones.
        peak = allocated + (pool.device_bytes if pool.backend == "um" else 0)
    return {
        "kv_pool_backend": pool.backend,
        "kv_pool_device_bytes": pool.device_bytes,
        "budget_bytes": engine.memory_budget_bytes,
        "weight_bytes": engine.model.weight_bytes,
        "cuda_context_bytes": cuda_context_bytes,
        "peak_device_bytes": peak,
        "torch_max_allocated_bytes": allocated,
        "torch_max_reserved_bytes": reserved,
        "peak_with_context_bytes": None if peak is None or cuda_context_bytes is None else peak + cuda_context_bytes,
    }


def measure_one_request(model_dir: Path, base, device, context_len: int, max_tokens: int, seed: int, context_bytes):
    """Peak device memory and decode speed of one request (`context_len` prompt tokens,
    `max_tokens` new ones) on an engine whose KV pool is sized for that request alone."""
    from lowvram.engine.engine import LLMEngine

    _release(device, is_peak_reset=True)
    engine = LLMEngine(str(model_dir), base.replace(max_num_seqs=1, max_model_len=context_len + max_tokens))
    make_prompts = _prompt_maker(engine.config.vocab_size, seed + 1)
    # A warm-up request first, as in time_decode: without it the figure includes graph capture.
    _generate(engine, make_prompts(1, context_len), NUM_WARMUP_TOKENS)
    elapsed_s, num_tokens, _ = _generate(engine, make_prompts(1, context_len), max_tokens)
    result = {
        "context_tokens": context_len,
        "new_tokens": max_tokens,
        "max_num_seqs": 1,
        "max_model_len": engine.max_model_len,
        "kv_pool_blocks": engine.block_manager.num_blocks,
        "decode_tokens_per_s": round(num_tokens / elapsed_s, 1) if elapsed_s > 0 else None,
        **memory_summary(engine, context_bytes),
    }
    del engine
    _release(device)
    return result


def run_speed_bench(
    model: str | None = None,
    *,
    shape: str | None = None,
    quantize: bool = False,
    calib_samples: int = DEFAULT_CALIB_SAMPLES,
    fp16_budget_mib: float | None = None,
    rank: int | None = None,
    profile: str | None = None,
    device: str | None = None,
    emulate_vram_gib: float | None = None,
    batch_sizes: Sequence[int] = (1, 4, 8),
    context_lens: Sequence[int] | None = None,
    max_tokens: int = 128,
    cuda_graphs: bool | None = None,
    seed: int = 0,
    command: str = "lowvram bench speed",
    progress: Callable[[str], None] | None = None,
) -> dict:
    """Measure prefill and decode speed through LLMEngine; returns the JSON-ready record.

    The options are `lowvram bench speed`'s; model None: random weights of `shape` (default
    r1-distill-qwen-1.5b); `fp16_budget_mib` and `rank` replace the profile's when quantizing;
    context_lens None: those of DEFAULT_CONTEXT_LENS that fit the model.
    """
    from lowvram.config import load_profile
    from lowvram.engine.engine import LLMEngine
    from lowvram.memory.device import pick_device
    from lowvram.memory.environment import measure_cuda_context_bytes
    from lowvram.models.config import load_model_config
    from lowvram.models.loader import resolve_model_path
    from lowvram.models.shapes import SHAPES

    say = progress or (lambda message: None)
    is_default_context = context_lens is None
    batch_sizes, context_lens = sorted(set(batch_sizes)), sorted(set(context_lens or DEFAULT_CONTEXT_LENS))
    if not batch_sizes or not context_lens or min(batch_sizes + context_lens) < 1:
        raise ConfigError(f"batch sizes {batch_sizes} and context lengths {context_lens} must be integers >= 1")
    if max_tokens < 2:
        raise ConfigError(f"max_tokens = {max_tokens} must be at least 2: decode starts after the first token")
    if model is not None and shape is not None:
        raise ConfigError("give a model or a shape, not both")
    shape_name = None if model is not None else (shape or DEFAULT_SHAPE)
    if shape_name not in (None, *SHAPES, TINY_SHAPE):
        raise ConfigError(f"unknown shape {shape!r}; known shapes: {', '.join([*SHAPES, TINY_SHAPE])}")
    model_dir = None if model is None else resolve_model_path(model)
    started = time.perf_counter()
    base = load_profile(profile).replace(
        device=device, emulate_vram_gib=emulate_vram_gib, enable_cuda_graphs=cuda_graphs
    )
    compute_device = pick_device(base.device)
    is_cuda = compute_device.type == "cuda"
    context_bytes = measure_cuda_context_bytes(compute_device.index or 0) if is_cuda else None
    record = run_metadata(command)
    say("measuring the copy bandwidth")
    copy_gbps = measure_copy_bandwidth_gbps(COPY_BYTES[compute_device.type], compute_device)
    with tempfile.TemporaryDirectory(prefix="lowvram-bench-speed-") as work:
        work_dir = Path(work)
        label = str(model)
        if model_dir is None:
            from lowvram.models.shapes import cached_checkpoint, write_random_checkpoint
            from lowvram.testing import make_tiny_model

            if shape_name != TINY_SHAPE:
                from lowvram.models.config import model_config_from_dict
                from lowvram.models.shapes import shape_config

                num_bytes = 2 * model_config_from_dict(shape_config(shape_name)).num_params()
                say(f"writing random weights of {shape_name} ({num_bytes / 1e9:.1f} GB, removed at the end)")
            label = f"{shape_name} (random weights)"
            if shape_name == TINY_SHAPE:
                model_dir = make_tiny_model(work_dir / "model", "qwen2", num_layers=2)
            else:  # shared with other benchmarks of this session where the checkpoint cache is set
                model_dir = cached_checkpoint(
                    f"{shape_name}-bf16", lambda d: write_random_checkpoint(d, shape_name), work_dir
                )
        source = load_model_config(model_dir)[0]
        if is_default_context:
            fitting = [n for n in context_lens if n + max_tokens <= source.max_position_embeddings]
            context_lens = fitting or [max(source.max_position_embeddings - max_tokens, 1)]
        needed_len = max(context_lens) + max_tokens
        base = base.replace(
            max_model_len=needed_len if base.max_model_len < needed_len else None,
            max_num_seqs=max(batch_sizes) if base.max_num_seqs < max(batch_sizes) else None,
        )
        if source.max_position_embeddings < needed_len:
            raise ConfigError(
                f"{max(context_lens)} context tokens plus {max_tokens} new ones need {needed_len} "
                f"positions, but this model has {source.max_position_embeddings}; use shorter --context-lens"
            )
        quantization = None
        if quantize:
            from lowvram.models.shapes import random_awq_checkpoint
            from lowvram.quant.cache import quantize_time_text
            from lowvram.quant.quantize import fitting_group_sizes, quantize_model

            estimate = quantize_time_text(source, calib_samples, compute_device.type)
            say(f"quantizing to AWQ INT4 ({calib_samples} calibration samples; {estimate})")
            fitting = fitting_group_sizes(source)
            if source.quantization is not None:
                quantization = {"note": "the checkpoint is already AWQ INT4; used as is"}
            elif not fitting:
                raise ConfigError(
                    "no AWQ group size (32, 64, 128) divides this model's hidden, intermediate and attention sizes "
                    f"{(source.hidden_size, source.intermediate_size, source.q_size)}; it cannot be quantized"
                )
            else:
                quantization = dict(
                    num_samples=calib_samples,
                    fp16_budget_mib=base.fp16_budget_mib if fp16_budget_mib is None else fp16_budget_mib,
                    rank=base.compensation_rank if rank is None else rank,
                    group_size=max(fitting),
                )
                options = dict(device=compute_device.type, emulate_vram_gib=emulate_vram_gib, **quantization)
                if shape_name not in (None, TINY_SHAPE):  # random weights of a shape: shared through the cache
                    model_dir = random_awq_checkpoint(shape_name, work_dir, **options)[1]
                else:
                    report = quantize_model(model_dir, work_dir / "awq", **options)
                    model_dir = work_dir / "awq"
                    quantization.update(seconds=round(report.seconds, 2), peak_device_bytes=report.peak_device_bytes)
        _release(compute_device, is_peak_reset=True)
        say("loading the engine")
        engine = LLMEngine(str(model_dir), base)
        config, report, p = engine.config, engine.model.weight_report, engine.profile
        # A tied head reads the whole embedding table; otherwise a step reads one row of it.
        weight_read_bytes = report.total_bytes - (0 if config.is_tied_head else report.embedding_bytes)
        pool = engine.kv_pool
        step_bytes = (weight_read_bytes, pool.shape.block_bytes(engine.kv_precision) // pool.block_size)
        make_prompts = _prompt_maker(config.vocab_size, seed)
        prefill = []
        for context_len in context_lens:
            say(f"prefill: {context_len} tokens")
            prefill.append(time_prefill(engine, make_prompts, context_len))
        decode = []
        for context_len, batch_size in itertools.product(context_lens, batch_sizes):
            say(f"decode: batch {batch_size} at {context_len} tokens of context")
            decode.append(time_decode(engine, make_prompts, context_len, batch_size, max_tokens, step_bytes, copy_gbps))
        dtypes = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
        weight_format = dtypes.get(engine.dtype, str(engine.dtype))
        if config.quantization is not None:
            weight_format = f"awq-int4-g{config.quantization.group_size}"
        record.update(
            device=str(engine.device),
            copy_bandwidth_gbps=round(copy_gbps, 1),
            model={
                "name": label,
                "shape": shape_name,
                "architecture": config.architecture,
                "num_layers": config.num_layers,
                "num_params": config.num_params(),
                "weight_format": weight_format,
                "quantization": quantization,
                "weight_bytes": report.as_dict(),
                "weight_bytes_read_per_step": weight_read_bytes,
            },
            profile={
                "name": p.name,
                "emulate_vram_gib": p.emulate_vram_gib,
                "kv_backend": engine.kv_pool.backend,
                "kv_precision": engine.kv_precision,
                "kv_block_size": engine.kv_pool.block_size,
                "max_num_seqs": p.max_num_seqs,
                "max_num_batched_tokens": p.max_num_batched_tokens,
                "max_model_len": engine.max_model_len,
                "enable_cuda_graphs": p.enable_cuda_graphs,
                "pipelined_decode": engine.pipelines_decode,
            },
            kv_bytes_per_token=step_bytes[1],
            max_tokens=max_tokens,
            prefill=prefill,
            decode=decode,
            memory=memory_summary(engine, context_bytes),
        )
        del engine
        say(f"one request of {context_lens[-1]} + {max_tokens} tokens, KV pool sized for it")
        record["one_request"] = measure_one_request(
            model_dir, base, compute_device, context_lens[-1], max_tokens, seed, context_bytes
        )
    record["elapsed_s"] = round(time.perf_counter() - started, 1)
    return record


def _size(num_bytes: int | None) -> str:
    if num_bytes is None:
        return "-"
    return f"{num_bytes / GIB:.2f} GiB" if num_bytes >= GIB / 10 else f"{num_bytes / 2**20:.1f} MiB"


def _memory_text(mem: dict) -> str:
    kv = f"KV pool ({mem['kv_pool_backend']}) {_size(mem['kv_pool_device_bytes'])}"
    if mem["peak_device_bytes"] is None:
        return f"weights {_size(mem['weight_bytes'])} and {kv} in host memory"
    context = mem["peak_with_context_bytes"]
    return (
        f"peak device memory {_size(mem['peak_device_bytes'])}"
        + ("" if context is None else f" ({_size(context)} with the CUDA context)")
        + f"; torch allocated {_size(mem['torch_max_allocated_bytes'])}, {kv}; budget {_size(mem['budget_bytes'])}"
    )


def write_markdown(result: dict) -> str:
    """The record as Markdown: prefill and decode tables, then memory."""
    m, p = result["model"], result["profile"]
    emulated = f", emulating {p['emulate_vram_gib']:g} GiB" if p.get("emulate_vram_gib") else ""
    copy = result.get("copy_bandwidth_gbps")
    setup = (
        f"KV pages: {p['kv_precision']} in {p['kv_backend']} memory; copy bandwidth "
        f"{'-' if copy is None else f'{copy:,.0f}'} GB/s (read + write); weights read per decode step "
        f"{m['weight_bytes_read_per_step'] / MB:,.1f} MB."
    )
    quantized = m.get("quantization") or {}
    if "rank" in quantized:
        setup += (
            f" Quantized here: {quantized['fp16_budget_mib']:g} MiB of layers kept FP16, compensation rank "
            f"{quantized['rank']}, lm_head FP16."
        )
    prefill = [
        f"| {r['prompt_tokens']} | {r['ttft_ms']:.1f} | {r['prefill_tokens_per_s']:,.0f} |" for r in result["prefill"]
    ]
    decode = []
    for r in result["decode"]:
        fraction = "-" if r["fraction_of_copy"] is None else f"{100 * r['fraction_of_copy']:.1f}%"
        projected = projected_tokens_per_s(r["bytes_per_step"], r["batch_size"])
        decode.append(
            f"| {r['context_tokens']} | {r['batch_size']} | {r['decode_tokens_per_s']:,.1f} | "
            + " | ".join(f"{tokens_per_s:,.0f}" for tokens_per_s in projected.values())
            + f" | {r['step_ms']:.2f} | {r['bytes_per_step'] / MB:,.1f} | {r['achieved_gbps']:,.1f} | {fraction} |"
        )
    blocks = [
        f"## Speed: {m['name']}, {m['weight_format']}, profile {p['name']}{emulated}, on "
        f"{result.get('gpu') or result.get('device', 'cpu')}",
        setup,
        "\n".join(["| prompt tokens | TTFT ms | prefill tokens/s |", "|---:|---:|---:|", *prefill]),
        f"Decode: each request generates {result['max_tokens']} tokens (greedy, ignore_eos); only the "
        "steps after every prefill are timed.",
        "| context tokens | batch | decode tokens/s | "
        + " | ".join(f"{card} ({gbps} GB/s) tokens/s, projected" for card, gbps in CARD_BANDWIDTH_GBPS.items())
        + " | ms per step | MB read per step | GB/s | of copy |\n"
        + "\n".join(["|---:|---:|---:|---:|---:|---:|---:|---:|---:|", *decode]),
        "Projected: the tokens/s a card would reach if a step took only the time to read its bytes at the "
        "card's full memory bandwidth: an upper bound (the last column shows the share of copy bandwidth reached here).",
        f"Memory: {_memory_text(result['memory'])}.",
    ]
    one = result.get("one_request")
    if one:
        speed = f", decode {one['decode_tokens_per_s']:,.1f} tokens/s" if one.get("decode_tokens_per_s") else ""
        blocks.append(
            f"One request of {one['context_tokens']} + {one['new_tokens']} tokens with the KV pool sized "
            f"for it alone: {_memory_text(one)}{speed}."
        )
    versions = result.get("versions", {})
    blocks.append(
        f"Produced by `{result['command']}` on {result['date']}, commit {result['git_commit']}, "
        f"torch {versions.get('torch')}, triton {versions.get('triton')}, {result['elapsed_s']} s."
    )
    return "\n\n".join(blocks) + "\n"
