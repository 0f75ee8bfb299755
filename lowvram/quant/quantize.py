"""`lowvram quantize MODEL OUT`: AWQ INT4 in the AutoAWQ GEMM layout, one layer at a time.

Per decoder layer, on calibration activations: full-precision reference outputs, AWQ search
(`awq`), INT4 for every Linear, sensitivity of each fused group (with --fp16-budget-mib),
`compensation` (with --rank / --bias-correction); the next layer gets the full-precision output
(as in AutoAWQ). The most sensitive groups within the budget stay FP16 (`writer`).
"""

from __future__ import annotations

import logging
import math
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from lowvram.errors import ConfigError, ModelLoadError, OutOfMemoryError, UnsupportedModelError
from lowvram.kernels.awq_format import PACK_FACTOR, SUPPORTED_GROUP_SIZES, quantize_rtn
from lowvram.models.config import ModelConfig, load_model_config
from lowvram.quant import METHODS, awq, writer
from lowvram.quant.calibration import calibration_blocks, load_calibration_records
from lowvram.quant.compensation import InputStats, fit_compensation
from lowvram.quant.layer import INPUT_OF, NORMS, LayerRunner, SourceCheckpoint
from lowvram.quant.writer import GIB, MIB, LinearResult, QuantizeReport, float16

log = logging.getLogger("lowvram")

CHUNK_TOKENS = {"cuda": 8192, "cpu": 2048}
# Share of the device's (or emulated card's) memory that cached activations may fill.
MAX_RESIDENT_SHARE = 0.6
MAX_HEAD_TOKENS = 2048
HEAD_CHUNK_TOKENS = 256


def _mse(run: Callable, inputs: list, refs: list, load: Callable) -> float:
    """Mean squared difference between run(x) and its reference, over the chunks."""
    total, count = 0.0, 0
    for x, ref in zip(inputs, refs):
        out = run(load(x))
        total += float((out.float() - load(ref).float()).pow(2).sum())
        count += out.numel()
    return total / count


def _packed(weight: torch.Tensor, group_size: int) -> dict[str, torch.Tensor]:
    """The AutoAWQ tensors of a weight [N, K], on the host."""
    packed = quantize_rtn(weight, group_size)
    return {attr: getattr(packed, attr).cpu() for attr in ("qweight", "qzeros", "scales")}


class Quantizer:
    """Runs the per-layer pipeline over the calibration activations (see the module docstring)
    with the settings of `report`, into which it writes the AWQ alphas and sensitivity scores."""

    def __init__(self, config: ModelConfig, source: SourceCheckpoint, report: QuantizeReport, device: torch.device):
        self.config, self.source, self.report, self.device = config, source, report, device
        self.group_size, self.is_awq = report.group_size, report.method == "awq"
        self.is_compensated = report.rank > 0 or report.has_bias_correction
        self.dtype = torch.float16 if device.type == "cuda" else torch.float32
        self.runner = LayerRunner(config, report.seq_len, device)
        self.max_resident_bytes: int | None = None  # cached activations beyond it go to pinned host memory

    def keep(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.device.type != "cuda" or torch.cuda.memory_allocated(self.device) <= self.max_resident_bytes:
            return tensor
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        host.copy_(tensor)
        return host

    def load(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(self.device, non_blocking=True)

    def _cast(self, weights: dict) -> dict:
        return {name: tensor.to(self.dtype) for name, tensor in weights.items()}

    def quantize_layer(self, index: int, hs: list[torch.Tensor]) -> tuple[dict, dict, list[torch.Tensor]]:
        """Quantize layer `index` from its inputs: (its norms, {linear: LinearResult}, the next layer's inputs)."""
        weights = self.source.layer(self.config, index, self.device)
        compute = self._cast(weights)
        attn_ref, mlp_ref, next_hs = [], [], []
        for chunk in hs:
            attn, mlp, out = self.runner.blocks(compute, self.load(chunk))
            if not torch.isfinite(out).all():
                raise UnsupportedModelError(
                    f"layer {index} overflows {self.dtype} on the calibration text; quantize with --device cpu "
                    "(float32), or check the checkpoint"
                )
            attn_ref.append(self.keep(attn))
            mlp_ref.append(self.keep(mlp))
            next_hs.append(self.keep(out))

        input_scales, output_scales = {}, {}  # linear -> [K] scales of its columns, [N] divisors of its rows
        for group in awq.layer_scale_groups(self.config.num_heads, self.config.num_kv_heads) if self.is_awq else ():
            inputs = [self.keep(x[group.inputs]) for x in self._inputs(compute, hs, attn_ref, [group.inputs])]
            refs = attn_ref if group.inputs in ("attn_in", "o_in") else mlp_ref
            scales = self._search_group(index, group, weights, compute, inputs, refs)
            del inputs
            awq.fold_scales(weights, group, scales)
            compute = self._cast(weights)
            input_scales.update(dict.fromkeys(group.linears, scales.cpu()))
            if not group.prev.endswith("norm"):
                output_scales[group.prev] = scales.cpu()

        samples, stats = self._input_statistics(compute, hs, attn_ref)
        dequantized, linears = {}, {}
        for name, kind in INPUT_OF.items():
            weight = weights[f"{name}.weight"]
            if self.is_awq and name not in awq.NO_CLIP_LINEARS:
                max_abs = awq.search_clip(weight, samples[kind], self.group_size)
                weight = awq.clip_weight(weight, self.group_size, max_abs)
            dequantized[name] = awq.fake_quantize(weight, self.group_size)
            bias = weights.get(f"{name}.bias")
            bias = None if bias is None else float16(bias, f"model.layers.{index}.{name}.bias")
            packed = _packed(weight, self.group_size)
            linears[name] = LinearResult(packed, bias, input_scales.get(name), output_scales.get(name))
        if int(self.report.fp16_budget_mib * MIB) > 0:
            self._sensitivity(index, compute, dequantized, hs, next_hs)
        for name, kind in INPUT_OF.items() if self.is_compensated else ():
            error = weights[f"{name}.weight"] - dequantized[name]
            found = fit_compensation(error, stats[kind], self.report.rank, self.report.has_bias_correction)
            linears[name].compensation = _to_host(found)
        norms = {name: float16(weights[name], f"model.layers.{index}.{name}") for name in NORMS}
        return norms, linears, next_hs

    def _search_group(self, index: int, group, weights: dict, compute: dict, inputs: list, refs: list) -> torch.Tensor:
        num_tokens = 0
        x_sum = torch.zeros(inputs[0].shape[-1], dtype=torch.float32, device=self.device)
        for x in inputs:
            x = self.load(x)
            x_sum += x.abs().float().sum(dim=(0, 1))
            num_tokens += x.shape[0] * x.shape[1]

        def loss_fn(trial: list[torch.Tensor]) -> float:
            swapped = dict(compute)
            for name, weight in zip(group.linears, trial):
                swapped[f"{name}.weight"] = weight.to(self.dtype)
            return _mse(lambda x: self.runner.block(group.inputs, swapped, x), inputs, refs, self.load)

        linears = [weights[f"{n}.weight"] for n in group.linears]
        scales, alpha = awq.search_scales(x_sum / num_tokens, linears, self.group_size, loss_fn)
        self.report.awq_alphas[f"model.layers.{index}.{group.prev}->{','.join(group.linears)}"] = alpha
        return scales

    def _inputs(self, compute: dict, hs: list, attn_ref: list, kinds: list[str]):
        """Per chunk, the inputs of `kinds` as the layer, folded so far, computes them."""
        needs_attn = "mlp_in" in kinds or "down_in" in kinds  # the MLP reads h + attention
        for chunk, attn in zip(hs, attn_ref):
            attn = self.load(attn) if needs_attn else None
            yield self.runner.inputs(compute, self.load(chunk), attn, kinds)

    def _input_statistics(self, compute: dict, hs: list, attn_ref: list) -> tuple[dict, dict]:
        """Clipping samples (AWQ) and fit/eval moments (compensation) of every input kind."""
        if not self.is_awq and not self.is_compensated:
            return {}, {}
        c = self.config
        widths = {"attn_in": c.hidden_size, "o_in": c.q_size, "mlp_in": c.hidden_size, "down_in": c.intermediate_size}
        stats = {kind: InputStats(width, self.device) for kind, width in widths.items()} if self.is_compensated else {}
        samples = {kind: [] for kind in widths}
        per_chunk = math.ceil(awq.MAX_CLIP_TOKENS / len(hs))
        first_sample = 0
        for inputs in self._inputs(compute, hs, attn_ref, list(widths)):
            batch, length = inputs["attn_in"].shape[:2]
            # even samples fit the compensation, odd ones judge it
            is_fit = torch.arange(first_sample, first_sample + batch, device=self.device) % 2 == 0
            for kind, x in inputs.items():
                samples[kind].append(awq.sample_tokens(x.reshape(batch * length, -1), per_chunk))
                if stats:
                    stats[kind].add(x[is_fit].reshape(-1, x.shape[-1]), is_fit=True)
                    stats[kind].add(x[~is_fit].reshape(-1, x.shape[-1]), is_fit=False)
            first_sample += batch
        return {kind: torch.cat(parts)[: awq.MAX_CLIP_TOKENS] for kind, parts in samples.items()}, stats

    def _sensitivity(self, index: int, compute: dict, dequantized: dict, hs: list, outs: list) -> None:
        """Per fused group, with only that group in INT4: mean over tokens of |error of h|^2 / |h|^2
        (per token: the next layer reads h through an RMSNorm)."""
        for group_name, members in writer.FUSED_GROUPS.items():
            swapped = dict(compute)
            for name in members:
                swapped[f"{name}.weight"] = dequantized[name].to(self.dtype)
            total, num_tokens = 0.0, 0
            for chunk, ref in zip(hs, outs):
                ref = self.load(ref).float()
                out = self.runner.blocks(swapped, self.load(chunk))[2].float()
                per_token = (out - ref).pow(2).sum(-1) / ref.pow(2).sum(-1).clamp(min=1e-30)
                total += float(per_token.sum())
                num_tokens += per_token.numel()
            self.report.sensitivity[f"model.layers.{index}.{group_name}"] = total / num_tokens

    def quantize_head(self, hs: list[torch.Tensor]) -> tuple[dict, torch.Tensor]:
        """AWQ for lm_head, its scales folded into the final norm: (packed head, folded norm weight);
        in host memory where the device runs out (the search holds [vocab, hidden] float32 copies)."""
        try:
            return self._quantize_head(hs, self.device)
        except torch.cuda.OutOfMemoryError:
            if self.device.type != "cuda":
                raise
            log.info("lm_head's scale search does not fit the device; quantizing the head on the CPU")
            torch.cuda.empty_cache()
            return self._quantize_head(hs, torch.device("cpu"))

    def _quantize_head(self, hs: list[torch.Tensor], device: torch.device) -> tuple[dict, torch.Tensor]:
        on_device = device == self.device
        dtype = self.dtype if device.type == "cuda" else torch.float32
        keep = self.keep if on_device else (lambda t: t)
        load = self.load if on_device else (lambda t: t.to(device))
        norm = self.source.get("model.norm.weight").to(device, torch.float32)
        weight = self.source.get("lm_head.weight").to(device, torch.float32)
        per_chunk = math.ceil(MAX_HEAD_TOKENS / len(hs))
        normed = [self.runner.rms_norm(load(h).to(dtype), norm.to(dtype)).reshape(-1, norm.shape[0]) for h in hs]
        x = torch.cat([awq.sample_tokens(n, per_chunk) for n in normed])[:MAX_HEAD_TOKENS]
        del normed
        pieces = list(torch.split(x, HEAD_CHUNK_TOKENS))
        compute_weight = weight.to(dtype)
        refs = [keep(F.linear(piece, compute_weight)) for piece in pieces]
        del compute_weight
        if self.is_awq:

            def loss_fn(trial):
                trial_weight = trial[0].to(dtype)
                return _mse(lambda piece: F.linear(piece, trial_weight), pieces, refs, load)

            x_mean = x.abs().float().mean(dim=0)
            scales, self.report.awq_alphas["model.norm->lm_head"] = awq.search_scales(
                x_mean, [weight], self.group_size, loss_fn
            )
            norm, weight = norm / scales, weight * scales
            max_abs = awq.search_clip(weight, awq.sample_tokens(x / scales.to(x.dtype)), self.group_size)
            weight = awq.clip_weight(weight, self.group_size, max_abs)
        return _packed(weight, self.group_size), float16(norm, "model.norm.weight")


def _to_host(compensation):
    """The compensation's terms as float16 on the host; None where one overflows float16."""
    for name in ("lora_a", "lora_b", "bias_correction") if compensation else ():
        tensor = getattr(compensation, name)
        if tensor is not None:
            half = tensor.to(device="cpu", dtype=torch.float16).contiguous()
            if not torch.isfinite(half).all():
                log.warning("a compensation term overflows float16; that layer is left uncompensated")
                return None
            setattr(compensation, name, half)
    return compensation


def fitting_group_sizes(config: ModelConfig) -> list[int]:
    """The supported group sizes dividing every Linear's input size (K), smallest first."""
    sizes = (config.hidden_size, config.intermediate_size, config.q_size)
    return [g for g in SUPPORTED_GROUP_SIZES if all(size % g == 0 for size in sizes)]


def default_group_size(config: ModelConfig) -> int:
    """128, or the largest supported size dividing the model's sizes (SmolLM2's 576: 64)."""
    return max(fitting_group_sizes(config), default=128)


def check_quantizable(config: ModelConfig, group_size: int, is_head_quantized: bool) -> None:
    """Raise before any work when the model cannot be written as AWQ with this group size."""
    if config.quantization is not None:
        raise UnsupportedModelError(
            "the model is already quantized (config.json has quantization_config); "
            "quantize its FP16/BF16 original instead"
        )
    if group_size not in SUPPORTED_GROUP_SIZES:
        raise ConfigError(f"--group-size {group_size} is not supported; allowed: {list(SUPPORTED_GROUP_SIZES)}")
    inputs = {"hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size}
    inputs["num_attention_heads * head_dim"] = config.q_size
    for name, value in inputs.items():
        if value % group_size:
            fitting = fitting_group_sizes(config)
            hint = f"; use --group-size {fitting[-1]}" if fitting else "; no supported group size divides all of them"
            raise ConfigError(
                f"--group-size {group_size} does not divide the model's {name} ({value}), which is "
                f"the input size (K) of some of its Linears{hint}"
            )
    outputs = {**inputs, "num_key_value_heads * head_dim": config.kv_size}
    if is_head_quantized:
        outputs["vocab_size"] = config.vocab_size
    for name, value in outputs.items():
        if value % PACK_FACTOR:
            raise UnsupportedModelError(
                f"the model's {name} ({value}) is not a multiple of 8, which the AWQ "
                "layout needs (eight 4-bit outputs per int32)"
            )
    if is_head_quantized and config.is_tied_head:
        raise ConfigError(
            "--quantize-head: this model's lm_head is tied to its embeddings, which stay FP16; drop --quantize-head"
        )


def _compute_device(requested: str, emulate_vram_gib: float | None) -> tuple[torch.device, int | None]:
    """The device to compute on and the bytes it may use (None on the CPU), capped as emulated."""
    from lowvram.memory.device import pick_device

    device = pick_device(requested)
    if device.type != "cuda":
        return device, None
    # set_per_process_memory_fraction insists on an explicit index
    device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
    torch.cuda.reset_peak_memory_stats(device)
    total = torch.cuda.get_device_properties(device).total_memory
    if emulate_vram_gib is None:
        return device, total
    fraction = emulate_vram_gib * GIB / total
    if not 0 < fraction <= 1:
        raise ConfigError(
            f"--emulate-vram-gib {emulate_vram_gib} must be positive and at most this card's {total / GIB:.1f} GiB"
        )
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    return device, int(emulate_vram_gib * GIB)


def quantize_model(
    model_dir: str | Path,
    out_dir: str | Path,
    *,
    method: str = "awq",
    group_size: int | None = None,
    fp16_budget_mib: float = 0.0,
    rank: int = 0,
    bias_correction: bool = False,
    quantize_head: bool = False,
    calib_texts: list[str] | None = None,
    calib_path: str | Path | None = None,
    num_samples: int = 128,
    seq_len: int = 512,
    device: str = "auto",
    emulate_vram_gib: float | None = None,
    force: bool = False,
    show_progress: bool = False,
    on_layer: Callable[[int, int], None] | None = None,
) -> QuantizeReport:
    """Quantize an FP16/BF16 checkpoint to AWQ INT4 (AutoAWQ GEMM layout) in `out_dir`.

    The options are the CLI's (`lowvram quantize --help`); calib_texts (strings) replace the
    calibration file; show_progress draws a bar on stderr; on_layer(done, total) follows each
    layer. Raises ConfigError, ModelLoadError, UnsupportedModelError saying what to do; on any
    error no output directory is left behind.
    """
    start = time.perf_counter()
    model_dir, out_dir = Path(model_dir).expanduser(), Path(out_dir).expanduser()
    if model_dir.suffix.lower() == ".gguf":
        from lowvram.models.gguf import convert_gguf

        model_dir = convert_gguf(model_dir)
    if method not in METHODS:
        raise ConfigError(f"--method {method!r} is not supported; use one of {list(METHODS)}")
    if rank < 0 or fp16_budget_mib < 0:
        raise ConfigError(f"--rank ({rank}) and --fp16-budget-mib ({fp16_budget_mib}) must not be negative")
    if not model_dir.is_dir():
        raise ModelLoadError(
            f"MODEL {model_dir} is not a directory; pass a Hugging Face model directory "
            "(config.json, *.safetensors, tokenizer files)"
        )
    config, raw_config = load_model_config(model_dir)
    if group_size is None:
        group_size = default_group_size(config)
    check_quantizable(config, group_size, quantize_head)
    if out_dir.resolve() == model_dir.resolve():
        raise ConfigError(f"OUT {out_dir} is the input model directory; choose a new directory")
    if not out_dir.parent.is_dir():
        raise ConfigError(f"the parent of OUT ({out_dir.parent}) does not exist; create it first")
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"OUT {out_dir} exists and is not a directory")
    if out_dir.exists() and any(out_dir.iterdir()) and not force:
        raise ConfigError(f"OUT {out_dir} already exists and is not empty; pass --force to replace it")
    free_bytes = shutil.disk_usage(out_dir.parent).free
    linear_int4 = sum(writer.group_bytes(config, group_size, members)[1] for members in writer.FUSED_GROUPS.values())
    embeddings = config.vocab_size * config.hidden_size * 2 * (1 if config.is_tied_head else 2)
    needed_bytes = config.num_layers * linear_int4 + embeddings + int(fp16_budget_mib * MIB)
    if free_bytes < needed_bytes:
        raise ConfigError(
            f"the disk holding {out_dir.parent} has {free_bytes / MIB:.0f} MiB free but the checkpoint "
            f"needs about {needed_bytes / MIB:.0f} MiB; free some space or choose another OUT"
        )

    compute_device, cap_bytes = _compute_device(device, emulate_vram_gib)
    from lowvram.engine.tokenizer import Tokenizer

    records = [{"text": t} for t in calib_texts] if calib_texts is not None else load_calibration_records(calib_path)
    ids = calibration_blocks(Tokenizer(model_dir).hf, records, num_samples, seq_len)
    if int(ids.max()) >= config.vocab_size:
        raise ModelLoadError(
            f"the tokenizer gives token id {int(ids.max())} but the model has {config.vocab_size} "
            "embeddings; the tokenizer does not belong to this model"
        )
    num_samples, seq_len = ids.shape
    source = SourceCheckpoint(model_dir)
    settings = (method, group_size, str(compute_device), num_samples, seq_len, rank, bias_correction)
    report = QuantizeReport(str(model_dir), str(out_dir), *settings, fp16_budget_mib, quantize_head)
    quantizer = Quantizer(config, source, report, compute_device)
    quantizer.max_resident_bytes = int(MAX_RESIDENT_SHARE * cap_bytes) if cap_bytes else None
    samples_per_chunk = max(1, CHUNK_TOKENS[compute_device.type] // seq_len)
    indices = range(config.num_layers)
    if show_progress:
        from rich.console import Console
        from rich.progress import track

        indices = track(indices, description="quantizing layers", console=Console(stderr=True))
    layers = []  # (norms, linears) per layer
    try:
        with torch.inference_mode():
            table = source.get("model.embed_tokens.weight")
            hs = [  # layer 0's inputs, [b, L, hidden] per chunk of samples
                quantizer.keep(F.embedding(ids[i : i + samples_per_chunk], table).to(compute_device, quantizer.dtype))
                for i in range(0, num_samples, samples_per_chunk)
            ]
            for index in indices:
                *result, hs = quantizer.quantize_layer(index, hs)
                layers.append(result)
                if on_layer is not None:
                    on_layer(index + 1, config.num_layers)
            head = quantizer.quantize_head(hs) if quantize_head else None
            del hs
    except torch.cuda.OutOfMemoryError:
        cap = f"{cap_bytes / GIB:.1f} GiB" if cap_bytes else "the card"
        raise OutOfMemoryError(
            f"quantizing layer {len(layers)} ran out of device memory ({cap}) with {num_samples} x {seq_len} "
            "calibration tokens; lower --num-samples or --seq-len, or use --device cpu"
        ) from None
    skipped = writer.choose_fp16_groups(report, config)
    tensors, extras = writer.assemble(source, config, layers, set(skipped), head, report)
    report.seconds = time.perf_counter() - start
    if compute_device.type == "cuda":
        report.peak_device_bytes = torch.cuda.max_memory_allocated(compute_device)
    if sys.platform != "win32":  # no resource module there
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        report.peak_host_bytes = peak if sys.platform == "darwin" else peak * 1024
    writer.write_output(model_dir, out_dir, raw_config, skipped, tensors, extras, report)
    return report
