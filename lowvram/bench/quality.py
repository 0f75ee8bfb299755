"""The quality bench, for every weight and KV format through the real generation path: on the
demo model, exact-match accuracy on held-out chat tasks and perplexity on held-out Python; with
`--text real`, perplexity on real prose and code and agreement with FP16's greedy answers to
short instructions (bench/real_text.py), llama.cpp's formats of the same weights included. All
rows come from one run so they compare; FP16 comes first and is the reference for agreement.
"""

from __future__ import annotations

import math
import platform
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from lowvram.bench.real_text import GGML_BITS, LINEAR_SUFFIXES
from lowvram.bench.record import git_commit
from lowvram.core.sampling_params import SamplingParams
from lowvram.engine.llm import LLM

PPL_WINDOW_TOKENS = 512
DTYPE_BYTES = {"F32": 4, "F16": 2, "BF16": 2, "I32": 4, "I64": 8, "I8": 1, "U8": 1}
MAX_ANSWER_TOKENS = 32


@dataclass
class QualityRow:
    variant: str
    description: str
    accuracy: float | None  # None where the tasks have no answers (real text)
    by_kind: dict[str, float]  # accuracy, or agreement with FP16 where there are no answers
    perplexity: float
    num_tasks: int
    num_ppl_tokens: int
    agreement_with_fp16: float | None
    weight_mib: float
    bits_per_weight: float
    seconds: float
    replies: list[str] = field(default_factory=list, repr=False)


@dataclass
class QualityReport:
    model: str
    device: str
    command: str
    date: str
    git_commit: str
    machine: str
    num_per_kind: int | None
    max_chars: int | None
    text: str  # what the perplexity is measured on, and the tasks
    rows: list[QualityRow]

    def to_json(self) -> dict:
        data = asdict(self)
        for row in data["rows"]:
            row.pop("replies")
        return data


def perplexity(llm: LLM, text: str, window: int = PPL_WINDOW_TOKENS) -> tuple[float, int]:
    """exp(mean negative log-likelihood) over non-overlapping windows of `window` tokens,
    each scored with BOS as its only context (how the demo model's training measured it)."""
    hf = llm.engine.tokenizer.hf
    ids = list(hf.encode(text, add_special_tokens=False))
    window = min(window, llm.engine.max_model_len - 1)
    total, count = 0.0, 0
    for start in range(0, len(ids) - window + 1, window):
        logprobs = llm.engine.score([hf.bos_token_id] + ids[start : start + window])
        total -= sum(logprobs)
        count += len(logprobs)
    if not count:
        raise ValueError(f"the text has fewer than {window} tokens; nothing to score")
    return math.exp(total / count), count


def evaluate(name: str, description: str, build: Callable, tasks, text: str, reference, num_params: int) -> QualityRow:
    """One format's row; `build` gives (LLM, weight bytes); `reference`: FP16's replies, or None."""
    from lowvram.demo.tasks import is_correct

    start = time.perf_counter()
    llm, weight_bytes = build()
    params = SamplingParams(temperature=0.0, max_tokens=MAX_ANSWER_TOKENS)
    replies = [out.outputs[0].text for out in llm.chat([t.messages for t in tasks], params)]
    has_answers = hasattr(tasks[0], "answer")
    scores_by_kind: dict[str, list[bool]] = {}
    for i, (task, reply) in enumerate(zip(tasks, replies)):
        score = is_correct(task, reply) if has_answers else reference is None or reply == reference[i]
        scores_by_kind.setdefault(task.kind, []).append(score)
    ppl, num_tokens = perplexity(llm, text)
    agreement = None if reference is None else sum(a == b for a, b in zip(replies, reference)) / len(replies)
    by_kind = {k: sum(v) / len(v) for k, v in scores_by_kind.items()}
    accuracy = sum(sum(v) for v in scores_by_kind.values()) / len(tasks) if has_answers else None
    bits = 8 * weight_bytes / num_params
    row = (name, description, accuracy, by_kind, ppl, len(tasks), num_tokens, agreement, weight_bytes / 2**20, bits)
    return QualityRow(*row, time.perf_counter() - start, replies)


def builtin_variants(
    model_dir: Path, device: str, calib_samples: int = 32, is_real: bool = False
) -> dict[str, tuple[str, Callable]]:
    """Every weight and KV format the project has, FP16 first: name -> (description, build), where
    build() gives (LLM, weight bytes). `is_real` adds the 4gb profile's own quantization and
    llama.cpp's Q4_0, Q5_0 and Q8_0 of the same weights."""
    from lowvram.config import load_profile
    from lowvram.models.config import load_model_config
    from lowvram.quant.quantize import default_group_size

    profile = load_profile("cpu" if device == "cpu" else "4gb")
    group = default_group_size(load_model_config(model_dir)[0])

    def loaded(path, precision: str = "fp16", weight_bytes: float | None = None):
        llm = LLM(str(path), profile.replace(kv_precision=precision), device=device)
        return llm, weight_bytes or model_params(Path(path))[2]

    def with_kv(description: str, precision: str) -> tuple[str, Callable]:
        return description, lambda: loaded(model_dir, precision)

    def quantized(description: str, **options) -> tuple[str, Callable]:
        def build():
            from lowvram.quant.quantize import quantize_model

            out = Path(tempfile.mkdtemp(prefix="lowvram-quality-")) / "model"
            quantize_model(model_dir, out, device=device, num_samples=calib_samples, **options)
            return loaded(out)

        return description, build

    def llama_cpp(fmt: str) -> tuple[str, Callable]:
        def build():
            from lowvram.bench.real_text import ggml_roundtrip

            out = Path(tempfile.mkdtemp(prefix="lowvram-quality-")) / "model"
            return loaded(out, weight_bytes=ggml_roundtrip(model_dir, out, fmt))

        bits = GGML_BITS[fmt]
        text = f"llama.cpp {fmt.upper()} ({bits} bits per weight, blocks of 32) of the decoder linears"
        return f"{text}, scored through the FP16 path; embeddings and head as in the checkpoint", build

    # FP16-kept layers: about 10% of the INT4 weight bytes (1 MiB on the demo model)
    mib = max(1.0, round(0.1 * 0.5 * model_params(model_dir)[1] / 2**20))
    comp = dict(method="awq", rank=16, bias_correction=True)
    comp_text = "residual compensation (rank 16 low-rank term + bias correction)"
    kept, kv = f"FP16-kept layers ({mib:g} MiB)", "KV pages (asymmetric per token and head)"
    sensitive = f"the most sensitive layers kept in FP16 ({mib:g} MiB budget)"
    variants = {
        "fp16": with_kv("checkpoint weights (FP16; FP32 compute on the CPU), full-precision KV", "fp16"),
        "rtn-int4": quantized(f"round-to-nearest INT4, group {group} (AutoAWQ layout)", method="rtn"),
        "awq-int4": quantized(f"AWQ INT4, group {group} (scale and clipping search)", method="awq"),
        "awq-fp16": quantized(f"AWQ INT4 with {sensitive}", method="awq", fp16_budget_mib=mib),
        "awq-fp16-comp": quantized(f"AWQ INT4, {kept} and {comp_text}", fp16_budget_mib=mib, **comp),
    }
    if is_real:
        four = load_profile("4gb")
        variants["4gb"] = quantized(
            f"what `--profile 4gb --quantize` makes: AWQ INT4, group {group}, {four.fp16_budget_mib:g} MiB of "
            f"FP16-kept layers, rank-{four.compensation_rank} compensation",
            fp16_budget_mib=four.fp16_budget_mib,
            rank=four.compensation_rank,
        )
    else:
        # The two corrections apart, and half the rank: what each buys against what it costs in
        # decode speed (every compensated INT4 matmul does the rank's products too).
        variants["awq-comp"] = quantized(f"AWQ INT4 and {comp_text}, no FP16-kept layers", **comp)
        variants["awq-fp16-comp-r8"] = quantized(
            f"AWQ INT4, {kept} and residual compensation of rank 8 (+ bias correction)",
            **{**comp, "rank": 8, "fp16_budget_mib": mib},
        )
    variants["kv-int8"] = with_kv(f"FP16 weights, INT8 {kv}", "int8")
    variants["kv-int4"] = with_kv(f"FP16 weights, INT4 {kv}", "int4")
    if is_real:
        variants |= {f"llama.cpp-{fmt}": llama_cpp(fmt) for fmt in GGML_BITS}
    return variants


def model_params(model_dir: Path) -> tuple[int, int, int]:
    """(all parameters, those of the decoder linears, bytes) of the checkpoint's tensors, the
    compensation file's included: what the format stores, whatever dtype it computes in."""
    from safetensors import safe_open

    from lowvram.models.checkpoint import COMPENSATION_FILE

    total = linear = num_bytes = 0
    for path in sorted([*model_dir.glob("*.safetensors"), *model_dir.glob(COMPENSATION_FILE)]):
        with safe_open(path, "pt") as file:
            for name in file.keys():
                tensor = file.get_slice(name)
                numel = math.prod(tensor.get_shape())
                num_bytes += numel * DTYPE_BYTES[tensor.get_dtype()]
                total += numel
                linear += numel if name.removesuffix(".weight").endswith(LINEAR_SUFFIXES) else 0
    return total, linear, num_bytes


def run_quality_bench(
    model: str | None = None,
    *,
    variant_names: list[str] | None = None,
    device: str = "cpu",
    num_per_kind: int | None = None,
    max_chars: int | None = None,
    command: str = "",
    calib_samples: int = 32,
    text: str = "demo",
    progress: Callable[[str], None] | None = None,
) -> QualityReport:
    """`text`: "demo" (the demo model's held-out tasks and Python) or "real" (bench/real_text.py)."""
    from lowvram.errors import ConfigError
    from lowvram.models.loader import resolve_model_path

    if text == "real":
        from lowvram.bench import real_text

        tasks, corpus, text_source = real_text.instructions(), real_text.real_text(), real_text.corpus_source()
    else:
        from lowvram.demo.corpus import heldout_text
        from lowvram.demo.tasks import heldout_tasks

        tasks, corpus, text_source = heldout_tasks(num_per_kind), heldout_text(max_chars), "held-out Python"
    corpus = corpus[:max_chars] if max_chars else corpus
    model_dir = resolve_model_path(model)  # once: a GGUF file is hashed, a hub id looked up
    variants = builtin_variants(model_dir, device, calib_samples, is_real=text == "real")
    unknown = [n for n in variant_names or () if n not in variants]
    if unknown:
        raise ConfigError(f"unknown quality variant {unknown[0]!r}; available: {', '.join(variants)}")
    num_params = model_params(model_dir)[0]
    rows: list[QualityRow] = []
    for name in variant_names or variants:
        if progress:
            progress(f"evaluating {name} ...")
        reference = rows[0].replies if rows and rows[0].variant == "fp16" else None
        rows.append(evaluate(name, *variants[name], tasks, corpus, reference, num_params))
    machine = f"{platform.machine()} {platform.processor() or ''} {platform.system()}"
    machine = f"{machine}, Python {platform.python_version()}".strip()
    date = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    header = (str(model or "bundled demo model"), device, command, date, git_commit(short=True), machine)
    return QualityReport(*header, num_per_kind, max_chars, text_source, rows)


def to_markdown(report: QualityReport) -> str:
    rows = report.rows
    kinds = list(rows[0].by_kind) if rows else []
    has_accuracy = bool(rows) and rows[0].accuracy is not None
    scored = "accuracy" if has_accuracy else "agreement"
    lines = [
        "| format | accuracy | perplexity | agreement with fp16 | weights MiB | bits/weight | "
        + " | ".join(f"{kind} {scored}" for kind in kinds)
        + " |",
        "|" + "---|" * (6 + len(kinds)),
    ]
    for r in rows:
        agree = "-" if r.agreement_with_fp16 is None else f"{100 * r.agreement_with_fp16:.1f}%"
        accuracy = "-" if r.accuracy is None else f"{100 * r.accuracy:.1f}%"
        per_kind = " | ".join(f"{100 * r.by_kind[k]:.0f}%" for k in kinds)
        lines.append(
            f"| {r.variant} | {accuracy} | {r.perplexity:.3f} | {agree} | {r.weight_mib:.1f} | "
            f"{r.bits_per_weight:.2f} | {per_kind} |"
        )
    by_name = {r.variant: r for r in rows}
    gaps = []
    if {"fp16", "rtn-int4"} <= by_name.keys():
        base, rtn = by_name["fp16"].perplexity, by_name["rtn-int4"].perplexity
        for name in ("awq-int4", "awq-fp16", "awq-fp16-comp", "awq-comp", "awq-fp16-comp-r8", "4gb"):
            if name in by_name and rtn > base:
                closed = (rtn - by_name[name].perplexity) / (rtn - base)
                versus = (
                    f"accuracy {100 * (by_name[name].accuracy - by_name['fp16'].accuracy):+.1f} points vs FP16"
                    if has_accuracy
                    else f"agreement with FP16 {100 * by_name[name].agreement_with_fp16:.0f}%"
                )
                gaps.append(
                    f"- {name} closes {100 * closed:.0f}% of RTN's perplexity gap to FP16 "
                    f"({by_name[name].perplexity:.3f} vs RTN {rtn:.3f}, FP16 {base:.3f}); {versus}"
                )
    gap_text = ("Quantization, against FP16:\n\n" + "\n".join(gaps) + "\n\n") if gaps else ""
    table, detail = "\n".join(lines), "\n".join(f"- **{r.variant}**: {r.description} ({r.seconds:.0f} s)" for r in rows)
    num_tasks, num_tokens = (rows[0].num_tasks, rows[0].num_ppl_tokens) if rows else (0, 0)
    tasks = (
        f"Held-out chat tasks: {num_tasks} (exact match, greedy, through the chat template)"
        if has_accuracy
        else f"Instructions: {num_tasks} written for this bench (facts, arithmetic, code, format-following); "
        "agreement is the share of greedy answers (up to 32 tokens, through the chat template) equal to FP16's"
    )
    return (
        "# Quality of lowvram's weight and KV formats\n\n"
        f"Model: {report.model}. Device: {report.device}. {tasks}; perplexity over {num_tokens} "
        f"tokens of {report.text} in {PPL_WINDOW_TOKENS}-token windows, each scored from BOS. Bits per "
        "weight: the weights' bytes over all the checkpoint's parameters (embeddings included).\n\n"
        f"{table}\n\n{gap_text}{detail}\n\n"
        f"Produced by `{report.command}` on {report.date}, commit {report.git_commit}, {report.machine}.\n"
    )
