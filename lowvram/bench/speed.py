"""`lowvram bench speed`: prefill and decode speed of the real engine at the shapes users run.

Without a model, a checkpoint of a named real shape (`lowvram.models.shapes`) is written with
random weights: speed and memory do not depend on the weights' values. With `quantize`
it becomes AWQ INT4 first, with the profile's FP16 budget and compensation rank (what
`lowvram chat --quantize` makes) but few calibration samples, since random weights have
no quality to keep.

Everything is measured through one LLMEngine built with the profile:
- prefill: one prompt of each context length, alone. TTFT runs from add_request to the
  first token; it is the median of a few runs on distinct random prompts, so prefix
  caching never hits. Prefill tokens/s is the prompt length over TTFT.
- decode: B requests of one context length, greedy with ignore_eos and `max_tokens` each.
  Only the steps after every prefill is done are timed. A short generation of the same
  batch and context runs first, so Triton compilation and CUDA graph capture are not in
  the numbers.
- bytes read per decode step: every weight except the embedding table (a step reads one
  row of it per sequence), plus the KV of every sequence at the step's mean context
  length. Achieved GB/s is those bytes over the step time, set against the card's copy
  bandwidth measured at the start (`lowvram.bench.record`).
- peak device memory: torch's peak allocation plus the KV pages held in CUDA unified
  memory, which torch's allocator does not see; the CUDA context is measured once at the
  start where NVML allows. The engine above sizes its KV pool from the whole budget, so
  its peak is about the budget; a second engine then serves one request of the longest
  context plus `max_tokens` with the pool sized for that request alone (max_num_seqs 1),
  the figure llama-bench's peak memory compares with; its decode speed is timed after a
  short warm-up request, as above.
With `vs_hf`, transformers' own `generate` runs on the same unquantized checkpoint,
batch 1: FP16 on CUDA, float32 on the CPU.
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
from lowvram.errors import ConfigError, RequestError

TINY_SHAPE = "tiny"  # lowvram.testing's small Qwen2 checkpoint: a CPU run in seconds
DEFAULT_SHAPE = "r1-distill-qwen-1.5b"
DEFAULT_BATCH_SIZES = (1, 4, 8)
DEFAULT_CONTEXT_LENS = (512, 4096)
DEFAULT_MAX_TOKENS = 128
DEFAULT_CALIB_SAMPLES = 8
NUM_PREFILL_REPEATS = 3
NUM_WARMUP_TOKENS = 8
# Large enough to leave the caches far behind, small enough for two buffers on a 4 GB card.
COPY_BYTES = {"cuda": 512 * 2**20, "cpu": 128 * 2**20}
# Random prompts avoid the lowest ids, where tokenizers keep their special tokens.
MIN_PROMPT_TOKEN_ID = 10
GIB = 2**30
MB = 1e6


def known_shapes() -> list[str]:
    from lowvram.models.shapes import SHAPES

    return [*SHAPES, TINY_SHAPE]


def check_source(model: str | None, shape: str | None, num_layers: int | None) -> Path | None:
    """Fail before any measurement on a bad source: returns the model directory, or None for a shape."""
    from lowvram.models.loader import resolve_model_path

    if model is not None:
        if shape is not None:
            raise ConfigError("give a model or a shape, not both")
        return resolve_model_path(model)
    if (shape or DEFAULT_SHAPE) not in known_shapes():
        raise ConfigError(f"unknown shape {shape!r}; known shapes: {', '.join(known_shapes())}")
    if num_layers is not None and num_layers < 1:
        raise ConfigError(f"num_layers = {num_layers} must be at least 1")
    return None


def prepare_checkpoint(
    model: str | None, shape: str | None, num_layers: int | None, work_dir: Path
) -> tuple[Path, str]:
    """The checkpoint to measure and a label for it: `model` as given, or random weights of `shape`."""
    model_dir = check_source(model, shape, num_layers)
    if model_dir is not None:
        return model_dir, str(model)
    shape = shape or DEFAULT_SHAPE
    out_dir = work_dir / "model"
    if shape == TINY_SHAPE:
        from lowvram.testing import make_tiny_model

        make_tiny_model(out_dir, "qwen2", num_layers=num_layers or 2)
    elif num_layers is None:  # the full shape: shared with other benchmarks of this session when cached
        from lowvram.models.shapes import cached_checkpoint, write_random_checkpoint

        out_dir = cached_checkpoint(f"{shape}-bf16", lambda d: write_random_checkpoint(d, shape), work_dir)
    else:
        from lowvram.models.shapes import write_random_checkpoint

        write_random_checkpoint(out_dir, shape, num_layers=num_layers)
    layers = f", {num_layers} layers" if num_layers is not None else ""
    return out_dir, f"{shape} (random weights{layers})"


def largest_group_size(config) -> int:
    """The largest AWQ group size that divides every Linear's input size."""
    from lowvram.kernels.awq_format import SUPPORTED_GROUP_SIZES

    sizes = (config.hidden_size, config.intermediate_size, config.q_size)
    fitting = [g for g in SUPPORTED_GROUP_SIZES if all(size % g == 0 for size in sizes)]
    if not fitting:
        raise ConfigError(
            f"no AWQ group size ({', '.join(map(str, SUPPORTED_GROUP_SIZES))}) divides this model's "
            f"hidden, intermediate and attention sizes {sizes}; it cannot be quantized"
        )
    return max(fitting)


def quantize_checkpoint(
    model_dir: Path,
    out_dir: Path,
    profile,
    device: str,
    emulate_vram_gib: float | None,
    num_samples: int,
    shape: str | None = None,
    quantize_head: bool = False,
    fp16_budget_mib: float | None = None,
    rank: int | None = None,
) -> tuple[Path, dict]:
    """AWQ INT4 of `model_dir` with the profile's FP16 budget and rank unless `fp16_budget_mib`
    or `rank` are given (0 and 0: every linear INT4 without compensation, as a published AutoAWQ
    checkpoint is), and lm_head too with `quantize_head`; an AWQ input is used as is. `shape`:
    `model_dir` holds random weights of this named shape (lowvram.models.shapes), which lets the result
    be shared through the checkpoint cache."""
    from lowvram.models.config import load_model_config
    from lowvram.quant.quantize import quantize_model

    config, _ = load_model_config(model_dir)
    if config.quantization is not None:
        return model_dir, {"note": "the checkpoint is already AWQ INT4; used as is"}
    fp16_budget_mib = profile.fp16_budget_mib if fp16_budget_mib is None else fp16_budget_mib
    rank = profile.compensation_rank if rank is None else rank
    if shape is not None:  # random weights of a named shape: made once per session where cached
        from lowvram.models.shapes import random_awq_checkpoint

        settings = {
            "num_samples": num_samples,
            "group_size": largest_group_size(config),
            "fp16_budget_mib": fp16_budget_mib,
            "rank": rank,
            "quantize_head": quantize_head,
        }
        _, awq_dir = random_awq_checkpoint(
            shape, out_dir.parent, device=device, emulate_vram_gib=emulate_vram_gib, **settings
        )
        return awq_dir, settings
    report = quantize_model(
        model_dir,
        out_dir,
        group_size=largest_group_size(config),
        fp16_budget_mib=fp16_budget_mib,
        rank=rank,
        num_samples=num_samples,
        device=device,
        emulate_vram_gib=emulate_vram_gib,
        quantize_head=quantize_head,
    )
    return out_dir, {
        "quantize_head": quantize_head,
        "seconds": round(report.seconds, 2),
        "num_samples": report.num_samples,
        "seq_len": report.seq_len,
        "group_size": report.group_size,
        "fp16_budget_mib": report.fp16_budget_mib,
        "rank": report.rank,
        "num_fp16_groups": len(report.fp16_groups),
        "peak_device_bytes": report.peak_device_bytes,
    }


def weight_bytes_read_per_step(report, is_tied_head: bool) -> int:
    """Weight bytes one decode step reads: all but the embedding table, which a tied head reads whole."""
    return report.total_bytes - (0 if is_tied_head else report.embedding_bytes)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Prompts:
    """Distinct random prompts and request ids, reproducible from a seed."""

    def __init__(self, vocab_size: int, seed: int):
        self.rng = random.Random(seed)
        self.low = MIN_PROMPT_TOKEN_ID if vocab_size > 2 * MIN_PROMPT_TOKEN_ID else 0
        self.vocab_size = vocab_size
        self.ids = itertools.count()

    def make(self, num: int, length: int) -> list[tuple[str, list[int]]]:
        return [
            (f"bench-{next(self.ids)}", [self.rng.randrange(self.low, self.vocab_size) for _ in range(length)])
            for _ in range(num)
        ]


def _greedy(max_tokens: int, temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None):
    """The bench's requests: greedy, or sampled at `temperature` and `top_p` from `seed`; never stopped by EOS."""
    from lowvram.core.sampling_params import SamplingParams

    return SamplingParams(
        temperature=temperature, top_p=top_p, seed=seed if temperature else None, max_tokens=max_tokens, ignore_eos=True
    )


def time_prefill(engine, prompts: _Prompts, prompt_len: int, num_repeats: int = NUM_PREFILL_REPEATS) -> dict:
    """TTFT of one prompt alone: the median over `num_repeats` runs after one warm-up run."""
    times_s = []
    for repeat in range(num_repeats + 1):
        [(request_id, ids)] = prompts.make(1, prompt_len)
        _sync(engine.device)
        start = time.perf_counter()
        engine.add_request(request_id, None, _greedy(1), prompt_token_ids=ids)
        while engine.has_unfinished_requests():
            engine.step()  # sampling reads the token back, so the step's work is done when it returns
        if repeat:
            times_s.append(time.perf_counter() - start)
    ttft_s = statistics.median(times_s)
    return {
        "prompt_tokens": prompt_len,
        "ttft_ms": round(ttft_s * 1000, 3),
        "prefill_tokens_per_s": round(prompt_len / ttft_s, 1),
        "num_repeats": num_repeats,
    }


def _generate(
    engine, requests: list[tuple[str, list[int]]], max_tokens: int, temperature: float = 0.0, top_p: float = 1.0
) -> tuple[float, int, int]:
    """Run the requests to the end; returns (seconds, tokens, steps) of the steps after every prefill."""
    for seed, (request_id, ids) in enumerate(requests):
        engine.add_request(request_id, None, _greedy(max_tokens, temperature, top_p, seed), prompt_token_ids=ids)
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
    engine,
    prompts: _Prompts,
    context_len: int,
    batch_size: int,
    max_tokens: int,
    weight_read_bytes: int,
    copy_gbps: float | None,
    temperature: float = 0.0,
    top_p: float = 1.0,
) -> dict:
    """Decode speed of `batch_size` requests of `context_len` prompt tokens, after a warm-up of the same shape."""
    _generate(engine, prompts.make(batch_size, context_len), NUM_WARMUP_TOKENS, temperature, top_p)
    num_preemptions = engine.stats.num_preemptions
    num_events = engine.num_controller_events
    num_pipelined = engine.stats.num_pipelined_steps
    decode_s, num_tokens, num_steps = _generate(
        engine, prompts.make(batch_size, context_len), max_tokens, temperature, top_p
    )
    step_s = decode_s / max(num_steps, 1)
    pool = engine.kv_pool
    kv_bytes_per_token = pool.shape.block_bytes(engine.kv_precision) // pool.block_size
    # Step k (k = 1 .. max_tokens - 1; token 0 came from the prefill) reads context_len + k tokens of KV.
    mean_context = context_len + max_tokens / 2
    bytes_per_step = int(weight_read_bytes + batch_size * mean_context * kv_bytes_per_token)
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
        "kv_precision": engine.kv_precision,
        "num_preemptions": engine.stats.num_preemptions - num_preemptions,
        "num_controller_events": engine.num_controller_events - num_events,
        "num_pipelined_steps": engine.stats.num_pipelined_steps - num_pipelined,
    }


def memory_summary(engine, cuda_context_bytes: int | None) -> dict:
    pool = engine.kv_pool
    summary = {
        "kv_pool_backend": pool.backend,
        "kv_pool_device_bytes": pool.device_bytes,
        "budget_bytes": engine.memory_budget_bytes,
        "weight_bytes": engine.model.weight_bytes,
        "cuda_context_bytes": cuda_context_bytes,
        "peak_device_bytes": None,
        "torch_max_allocated_bytes": None,
        "torch_max_reserved_bytes": None,
        "peak_with_context_bytes": None,
    }
    if engine.device.type != "cuda":
        return summary
    allocated = torch.cuda.max_memory_allocated(engine.device)
    # Managed pages are invisible to torch's statistics; the pool counts its resident ones.
    managed = pool.device_bytes if pool.backend == "um" else 0
    summary.update(
        torch_max_allocated_bytes=allocated,
        torch_max_reserved_bytes=torch.cuda.max_memory_reserved(engine.device),
        peak_device_bytes=allocated + managed,
    )
    if cuda_context_bytes is not None:
        summary["peak_with_context_bytes"] = allocated + managed + cuda_context_bytes
    return summary


def measure_one_request(
    model_dir: Path, base, context_len: int, max_tokens: int, seed: int, cuda_context_bytes: int | None
) -> dict:
    """Peak device memory and decode speed of one request (`context_len` prompt tokens,
    `max_tokens` new ones) on an engine whose KV pool is sized for that request alone."""
    from lowvram.engine.engine import LLMEngine

    profile = base.replace(max_num_seqs=1, max_model_len=context_len + max_tokens)
    device = _device_of(profile)
    if device.type == "cuda":
        _release(device)
        torch.cuda.reset_peak_memory_stats(device)
    engine = LLMEngine(str(model_dir), profile)
    prompts = _Prompts(engine.config.vocab_size, seed + 1)
    # A short request of the same length first, as time_decode does: without it the figure
    # included the new engine's graph capture and moved between runs (314, then 202 tokens/s).
    _generate(engine, prompts.make(1, context_len), NUM_WARMUP_TOKENS)
    elapsed_s, num_tokens, _ = _generate(engine, prompts.make(1, context_len), max_tokens)
    result = {
        "context_tokens": context_len,
        "new_tokens": max_tokens,
        "max_num_seqs": 1,
        "max_model_len": engine.max_model_len,
        "kv_pool_blocks": engine.block_manager.num_blocks,
        "decode_tokens_per_s": round(num_tokens / elapsed_s, 1) if elapsed_s > 0 else None,
        **memory_summary(engine, cuda_context_bytes),
    }
    del engine
    _release(device)
    return result


def _device_of(profile) -> torch.device:
    from lowvram.memory.device import pick_device

    return pick_device(profile.device)


def _hf_generate_s(model, input_ids: torch.Tensor, num_new: int) -> float:
    _sync(input_ids.device)
    start = time.perf_counter()
    model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=num_new,
        min_new_tokens=num_new,
        do_sample=False,
        pad_token_id=0,
    )
    _sync(input_ids.device)
    return time.perf_counter() - start


def _hf_measure(model_dir: Path, device: torch.device, prompt_ids: list[int], max_new_tokens: int) -> dict:
    from transformers import AutoModelForCausalLM

    dtype = torch.float16 if device.type == "cuda" else torch.float32
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(device).eval()
    try:
        input_ids = torch.tensor([prompt_ids], device=device)
        _hf_generate_s(model, input_ids, NUM_WARMUP_TOKENS)
        ttft_s = statistics.median(_hf_generate_s(model, input_ids, 1) for _ in range(NUM_PREFILL_REPEATS))
        total_s = _hf_generate_s(model, input_ids, max_new_tokens)
        decode_s = max(total_s - ttft_s, 1e-9)
        embedding = model.get_input_embeddings().weight
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        is_tied = model.get_output_embeddings().weight is embedding
        read_bytes = weight_bytes - (0 if is_tied else embedding.numel() * embedding.element_size())
        c = model.config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        kv_bytes_per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * embedding.element_size()
        bytes_per_step = read_bytes + (len(prompt_ids) + max_new_tokens / 2) * kv_bytes_per_token
        step_s = decode_s / (max_new_tokens - 1)
        return {
            "dtype": str(dtype).removeprefix("torch."),
            "batch_size": 1,
            "prompt_tokens": len(prompt_ids),
            "new_tokens": max_new_tokens,
            "ttft_ms": round(ttft_s * 1000, 3),
            "prefill_tokens_per_s": round(len(prompt_ids) / ttft_s, 1),
            "decode_tokens_per_s": round((max_new_tokens - 1) / decode_s, 2),
            "bytes_per_step": int(bytes_per_step),
            "achieved_gbps": round(bytes_per_step / step_s / 1e9, 2),
            "torch_max_allocated_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        }
    finally:
        del model
        _release(device)


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run_hf_generate(
    model_dir: Path, device: torch.device, prompt_ids: list[int], max_new_tokens: int, emulate_vram_gib: float | None
) -> dict:
    """transformers' generate on the same checkpoint, batch 1, greedy, `max_new_tokens` new tokens.

    TTFT is a one-token generate; decode speed is the rest of a full generate over the
    remaining tokens. Under an emulated card that transformers does not fit, it is
    measured again without the cap, and the record says so.
    """
    try:
        return {
            **_hf_measure(model_dir, device, prompt_ids, max_new_tokens),
            "memory_cap_gib": emulate_vram_gib if device.type == "cuda" else None,
        }
    except torch.OutOfMemoryError:
        if device.type != "cuda" or emulate_vram_gib is None:
            raise
    _release(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    torch.cuda.set_per_process_memory_fraction(1.0, index)
    try:
        row = _hf_measure(model_dir, device, prompt_ids, max_new_tokens)
    finally:
        total = torch.cuda.get_device_properties(index).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, emulate_vram_gib * GIB / total), index)
    note = f"out of memory under the {emulate_vram_gib:g} GiB cap; measured without it"
    return {**row, "memory_cap_gib": None, "note": note}


def _check_sizes(batch_sizes: Sequence[int], context_lens: Sequence[int], max_tokens: int) -> None:
    if not batch_sizes or any(b < 1 for b in batch_sizes):
        raise ConfigError(f"batch sizes {list(batch_sizes)} must be one or more integers of at least 1")
    if not context_lens or any(c < 1 for c in context_lens):
        raise ConfigError(f"context lengths {list(context_lens)} must be one or more integers of at least 1")
    if max_tokens < 2:
        raise ConfigError(f"max_tokens = {max_tokens} must be at least 2: decode starts after the first token")


def _weight_format(engine) -> str:
    if engine.config.quantization is not None:
        return f"awq-int4-g{engine.config.quantization.group_size}"
    return {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}.get(engine.dtype, str(engine.dtype))


def run_speed_bench(
    model: str | None = None,
    *,
    shape: str | None = None,
    num_layers: int | None = None,
    quantize: bool = False,
    quantize_head: bool = False,
    calib_samples: int = DEFAULT_CALIB_SAMPLES,
    fp16_budget_mib: float | None = None,
    rank: int | None = None,
    profile: str | None = None,
    device: str | None = None,
    emulate_vram_gib: float | None = None,
    batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES,
    context_lens: Sequence[int] = DEFAULT_CONTEXT_LENS,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    temperature: float = 0.0,
    top_p: float = 1.0,
    vs_hf: bool = False,
    cuda_graphs: bool | None = None,
    prefill_graphs: bool | None = None,
    batch_invariant: bool | None = None,
    pipelined_decode: bool | None = None,
    seed: int = 0,
    command: str = "lowvram bench speed",
    progress: Callable[[str], None] | None = None,
) -> dict:
    """Measure prefill and decode speed through LLMEngine; returns the JSON-ready record.

    model: a model directory or hub id; None writes random weights of `shape` (a name from
        `lowvram.models.shapes.SHAPES`, or "tiny"; default r1-distill-qwen-1.5b), with `num_layers`
        decoder layers if given.
    quantize: make the checkpoint AWQ INT4 first (`calib_samples` calibration blocks);
        `quantize_head` makes lm_head INT4 too; `fp16_budget_mib` and `rank` replace the
        profile's FP16-kept layers and compensation rank (0 and 0: a plain AWQ checkpoint).
    profile, device, emulate_vram_gib: as for LLMEngine.
    batch_sizes, context_lens, max_tokens: decode is measured for every batch size at every
        context length, `max_tokens` tokens per request; prefill at every context length.
    temperature, top_p: how the decode requests sample (0: greedy), each from its own seed.
    cuda_graphs, prefill_graphs, batch_invariant, pipelined_decode: override the profile's
        enable_cuda_graphs, enable_prefill_graphs, batch_invariant and pipelined_decode (None keeps them).
    vs_hf: also time transformers' generate on the unquantized checkpoint (batch 1, the first
        context length).
    Raises ConfigError for an unknown shape or bad sizes, ModelLoadError for a missing model.
    """
    from lowvram.config import load_profile
    from lowvram.engine.engine import LLMEngine
    from lowvram.memory.device import pick_device
    from lowvram.models.config import load_model_config

    say = progress or (lambda message: None)
    batch_sizes, context_lens = sorted(set(batch_sizes)), sorted(set(context_lens))
    _check_sizes(batch_sizes, context_lens, max_tokens)
    try:
        _greedy(1, temperature, top_p, 0)
    except RequestError as exc:
        raise ConfigError(f"the decode requests' sampling: {exc}") from None
    check_source(model, shape, num_layers)
    started = time.perf_counter()
    base = load_profile(profile).replace(
        device=device,
        emulate_vram_gib=emulate_vram_gib,
        enable_cuda_graphs=cuda_graphs,
        enable_prefill_graphs=prefill_graphs,
        batch_invariant=batch_invariant,
        pipelined_decode=pipelined_decode,
    )
    needed_len = max(context_lens) + max_tokens
    base = base.replace(
        max_model_len=needed_len if base.max_model_len < needed_len else None,
        max_num_seqs=max(batch_sizes) if base.max_num_seqs < max(batch_sizes) else None,
    )
    compute_device = pick_device(base.device)

    cuda_context_bytes = None
    if compute_device.type == "cuda":
        from lowvram.memory.environment import measure_cuda_context_bytes

        cuda_context_bytes = measure_cuda_context_bytes(compute_device.index or 0)
    record = run_metadata(command)
    say("measuring the copy bandwidth")
    copy_gbps = measure_copy_bandwidth_gbps(COPY_BYTES[compute_device.type], compute_device)
    with tempfile.TemporaryDirectory(prefix="lowvram-bench-speed-") as work:
        work_dir = Path(work)
        if model is None:
            say(f"writing random weights of {shape or DEFAULT_SHAPE}")
        source_dir, label = prepare_checkpoint(model, shape, num_layers, work_dir)
        source_config = load_model_config(source_dir)[0]
        if source_config.max_position_embeddings < needed_len:
            raise ConfigError(
                f"{max(context_lens)} context tokens plus {max_tokens} new ones need {needed_len} "
                f"positions, but this model has {source_config.max_position_embeddings}; use shorter "
                "--context-lens"
            )
        if vs_hf and source_config.quantization is not None:
            raise ConfigError(
                "the transformers comparison needs an FP16/BF16 checkpoint; this one is AWQ INT4 "
                "(give the unquantized model and add --quantize)"
            )
        model_dir, quantization = source_dir, None
        if quantize:
            say(f"quantizing to AWQ INT4 ({calib_samples} calibration samples)")
            cacheable = model is None and num_layers is None and (shape or DEFAULT_SHAPE) != TINY_SHAPE
            model_dir, quantization = quantize_checkpoint(
                source_dir,
                work_dir / "awq",
                base,
                compute_device.type,
                emulate_vram_gib,
                calib_samples,
                shape=(shape or DEFAULT_SHAPE) if cacheable else None,
                quantize_head=quantize_head,
                fp16_budget_mib=fp16_budget_mib,
                rank=rank,
            )
        if compute_device.type == "cuda":
            _release(compute_device)
            torch.cuda.reset_peak_memory_stats(compute_device)
        say("loading the engine")
        engine = LLMEngine(str(model_dir), base)
        weight_read_bytes = weight_bytes_read_per_step(engine.model.weight_report, engine.config.is_tied_head)
        prompts = _Prompts(engine.config.vocab_size, seed)
        prefill = []
        for context_len in context_lens:
            say(f"prefill: {context_len} tokens")
            prefill.append(time_prefill(engine, prompts, context_len))
        decode = []
        for context_len in context_lens:
            for batch_size in batch_sizes:
                say(f"decode: batch {batch_size} at {context_len} tokens of context")
                decode.append(
                    time_decode(
                        engine,
                        prompts,
                        context_len,
                        batch_size,
                        max_tokens,
                        weight_read_bytes,
                        copy_gbps,
                        temperature,
                        top_p,
                    )
                )
        kv_pool = engine.kv_pool
        record.update(
            device=str(engine.device),
            copy_bandwidth_gbps=round(copy_gbps, 1),
            model={
                "name": label,
                "shape": None if model is not None else (shape or DEFAULT_SHAPE),
                "architecture": engine.config.architecture,
                "num_layers": engine.config.num_layers,
                "num_params": engine.config.num_params(),
                "weight_format": _weight_format(engine),
                "quantization": quantization,
                "weight_bytes": engine.model.weight_report.as_dict(),
                "weight_bytes_read_per_step": weight_read_bytes,
            },
            profile={
                "name": engine.profile.name,
                "emulate_vram_gib": engine.profile.emulate_vram_gib,
                "kv_backend": kv_pool.backend,
                "kv_precision": engine.kv_precision,
                "kv_block_size": kv_pool.block_size,
                "max_num_seqs": engine.profile.max_num_seqs,
                "max_num_batched_tokens": engine.profile.max_num_batched_tokens,
                "max_model_len": engine.max_model_len,
                "is_controller_enabled": engine.profile.controller.is_enabled,
                "enable_cuda_graphs": getattr(engine.profile, "enable_cuda_graphs", None),
                "enable_prefill_graphs": getattr(engine.profile, "enable_prefill_graphs", None),
                "batch_invariant": getattr(engine.profile, "batch_invariant", None),
                "pipelined_decode": engine.pipelines_decode,
            },
            kv_bytes_per_token=kv_pool.shape.block_bytes(engine.kv_precision) // kv_pool.block_size,
            max_tokens=max_tokens,
            sampling={"temperature": temperature, "top_p": top_p},
            prefill=prefill,
            decode=decode,
            memory=memory_summary(engine, cuda_context_bytes),
            num_controller_events=engine.num_controller_events,
            hf=None,
        )
        del engine, kv_pool
        _release(compute_device)
        say(f"one request of {context_lens[-1]} + {max_tokens} tokens, KV pool sized for it")
        record["one_request"] = measure_one_request(
            model_dir, base, context_lens[-1], max_tokens, seed, cuda_context_bytes
        )
        if vs_hf:
            say("transformers generate")
            prompt_ids = prompts.make(1, context_lens[0])[0][1]
            record["hf"] = run_hf_generate(source_dir, compute_device, prompt_ids, max_tokens, emulate_vram_gib)
    record["elapsed_s"] = round(time.perf_counter() - started, 1)
    return record


# -- reporting -----------------------------------------------------------------------------------


def _size(num_bytes: int | None) -> str:
    if num_bytes is None:
        return "-"
    return f"{num_bytes / GIB:.2f} GiB" if num_bytes >= GIB / 10 else f"{num_bytes / 2**20:.1f} MiB"


def write_markdown(result: dict) -> str:
    """The record as Markdown: prefill and decode tables, memory, and the transformers row."""
    m, p, mem = result["model"], result["profile"], result["memory"]
    copy = result.get("copy_bandwidth_gbps")
    where = result.get("gpu") or result.get("device", "cpu")
    emulated = f", emulating {p['emulate_vram_gib']:g} GiB" if p.get("emulate_vram_gib") else ""
    copy_text = "-" if copy is None else f"{copy:,.0f}"
    setup = (
        f"KV pages: {p['kv_precision']} in {p['kv_backend']} memory; copy bandwidth {copy_text} GB/s "
        f"(read + write); weights read per decode step {m['weight_bytes_read_per_step'] / MB:,.1f} MB."
    )
    quantized = m.get("quantization") or {}
    if "rank" in quantized:
        setup += (
            f" Quantized here: {quantized['fp16_budget_mib']:g} MiB of layers kept FP16, compensation rank "
            f"{quantized['rank']}, lm_head {'INT4' if quantized.get('quantize_head') else 'FP16'}."
        )
    lines = [
        f"## Speed: {m['name']}, {m['weight_format']}, profile {p['name']}{emulated}, on {where}",
        "",
        setup,
        "",
        "| prompt tokens | TTFT ms | prefill tokens/s |",
        "|---:|---:|---:|",
    ]
    lines += [
        f"| {r['prompt_tokens']} | {r['ttft_ms']:.1f} | {r['prefill_tokens_per_s']:,.0f} |" for r in result["prefill"]
    ]
    sampling = result.get("sampling") or {}
    how = (
        "greedy"
        if not sampling.get("temperature")
        else f"sampled at temperature {sampling['temperature']:g}, top-p {sampling.get('top_p', 1.0):g}, seeded"
    )
    decode_note = (
        f"Decode: each request generates {result['max_tokens']} tokens ({how}, ignore_eos); only the "
        "steps after every prefill are timed."
    )
    lines += [
        "",
        decode_note,
        "",
        "| context tokens | batch | decode tokens/s | ms per step | MB read per step | GB/s | of copy |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["decode"]:
        fraction = "-" if r["fraction_of_copy"] is None else f"{100 * r['fraction_of_copy']:.1f}%"
        lines.append(
            f"| {r['context_tokens']} | {r['batch_size']} | {r['decode_tokens_per_s']:,.1f} | "
            f"{r['step_ms']:.2f} | {r['bytes_per_step'] / MB:,.1f} | {r['achieved_gbps']:,.1f} | {fraction} |"
        )
    lines.append("")
    if mem["peak_device_bytes"] is not None:
        context = (
            f"; {_size(mem['peak_with_context_bytes'])} with the CUDA context"
            if mem["peak_with_context_bytes"] is not None
            else ""
        )
        lines.append(
            f"Peak device memory: {_size(mem['peak_device_bytes'])} (torch allocated "
            f"{_size(mem['torch_max_allocated_bytes'])}, reserved {_size(mem['torch_max_reserved_bytes'])}; "
            f"KV pool ({mem['kv_pool_backend']}) {_size(mem['kv_pool_device_bytes'])}){context}; "
            f"budget {_size(mem['budget_bytes'])}."
        )
    else:
        lines.append(
            f"Weights {_size(mem['weight_bytes'])} and KV pool {_size(mem['kv_pool_device_bytes'])} in host memory."
        )
    one = result.get("one_request")
    if one:
        where_kv = f"KV pool ({one['kv_pool_backend']}) {_size(one['kv_pool_device_bytes'])}"
        if one["peak_device_bytes"] is not None:
            context = (
                f", {_size(one['peak_with_context_bytes'])} with the CUDA context"
                if one["peak_with_context_bytes"] is not None
                else ""
            )
            peak = (
                f"peak device memory {_size(one['peak_device_bytes'])}{context} (torch allocated "
                f"{_size(one['torch_max_allocated_bytes'])}, {where_kv})"
            )
        else:
            peak = f"weights {_size(one['weight_bytes'])}, {where_kv}, in host memory"
        speed = f", decode {one['decode_tokens_per_s']:,.1f} tokens/s" if one.get("decode_tokens_per_s") else ""
        lines += [
            "",
            f"One request of {one['context_tokens']} + {one['new_tokens']} tokens with the KV pool sized "
            f"for it alone: {peak}{speed}.",
        ]
    hf = result.get("hf")
    if hf:
        ours = next(
            (r for r in result["decode"] if r["batch_size"] == 1 and r["context_tokens"] == hf["prompt_tokens"]), None
        )
        ratio = (
            f" lowvram decodes {ours['decode_tokens_per_s'] / hf['decode_tokens_per_s']:.1f}x as fast at batch 1."
            if ours and hf["decode_tokens_per_s"]
            else ""
        )
        note = f" ({hf['note']})" if hf.get("note") else ""
        hf_line = (
            f"transformers {hf['dtype']} generate, batch 1, {hf['prompt_tokens']}-token prompt, "
            f"{hf['new_tokens']} new tokens: decode {hf['decode_tokens_per_s']:,.1f} tokens/s "
            f"({hf['achieved_gbps']:,.1f} GB/s), TTFT {hf['ttft_ms']:.1f} ms{note}.{ratio}"
        )
        lines += ["", hf_line]
    versions = result.get("versions", {})
    provenance = (
        f"Produced by `{result['command']}` on {result['date']}, commit {result['git_commit']}, "
        f"torch {versions.get('torch')}, triton {versions.get('triton')}, {result['elapsed_s']} s."
    )
    lines += ["", provenance, ""]
    return "\n".join(lines)


def require_matplotlib() -> None:
    """Raise ConfigError, saying how to install it, when matplotlib is missing (check before a long run)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ConfigError(
            "the plot needs matplotlib, which lowvram does not depend on: pip install matplotlib"
        ) from None


def plot(result: dict, path: str | Path) -> None:
    """Decode tokens/s and achieved GB/s against batch size, one line per context length (PNG)."""
    require_matplotlib()
    from matplotlib.figure import Figure

    figure = Figure(figsize=(10, 4))
    speed_axes, bandwidth_axes = figure.subplots(1, 2)
    contexts = sorted({r["context_tokens"] for r in result["decode"]})
    for context in contexts:
        rows = [r for r in result["decode"] if r["context_tokens"] == context]
        batches = [r["batch_size"] for r in rows]
        speed_axes.plot(batches, [r["decode_tokens_per_s"] for r in rows], "o-", label=f"{context} tokens of context")
        bandwidth_axes.plot(batches, [r["achieved_gbps"] for r in rows], "o-", label=f"{context} tokens of context")
    hf = result.get("hf")
    if hf:
        speed_axes.plot(
            [1],
            [hf["decode_tokens_per_s"]],
            "kx",
            markersize=9,
            label=f"transformers {hf['dtype']}, {hf['prompt_tokens']} tokens",
        )
    if result.get("copy_bandwidth_gbps"):
        bandwidth_axes.axhline(result["copy_bandwidth_gbps"], color="grey", linestyle="--", label="copy bandwidth")
    batch_sizes = sorted({r["batch_size"] for r in result["decode"]})
    for axes, label in ((speed_axes, "decode tokens/s"), (bandwidth_axes, "achieved GB/s")):
        axes.set_xlabel("batch size")
        axes.set_ylabel(label)
        axes.set_xticks(batch_sizes)
        axes.set_ylim(bottom=0)
        axes.legend(fontsize=8)
    p = result["profile"]
    figure.suptitle(
        f"{result['model']['name']}, {result['model']['weight_format']}, profile {p['name']} "
        f"on {result.get('gpu') or result.get('device')}",
        fontsize=10,
    )
    figure.tight_layout()
    figure.savefig(str(path), dpi=110)
