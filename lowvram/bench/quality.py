"""The quality bench: exact-match accuracy on held-out chat tasks and perplexity on held-out
Python, for every weight and KV format, through the real generation path. All rows come from
one run so they compare; FP16 comes first and is the reference for greedy agreement.
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

from lowvram.bench.record import git_commit
from lowvram.core.sampling_params import SamplingParams
from lowvram.engine.llm import LLM

PPL_WINDOW_TOKENS = 512
MAX_ANSWER_TOKENS = 32


@dataclass
class QualityRow:
    variant: str
    description: str
    accuracy: float
    accuracy_by_kind: dict[str, float]
    perplexity: float
    num_tasks: int
    num_ppl_tokens: int
    agreement_with_fp16: float | None
    weight_mib: float
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


def evaluate(name: str, description: str, build: Callable[[], LLM], tasks, text: str, reference) -> QualityRow:
    """One format's row; `reference`: the FP16 row's replies, or None."""
    from lowvram.demo.tasks import is_correct

    start = time.perf_counter()
    llm = build()
    params = SamplingParams(temperature=0.0, max_tokens=MAX_ANSWER_TOKENS)
    replies = [out.outputs[0].text for out in llm.chat([t.messages for t in tasks], params)]
    correct_by_kind: dict[str, list[bool]] = {}
    for task, reply in zip(tasks, replies):
        correct_by_kind.setdefault(task.kind, []).append(is_correct(task, reply))
    ppl, num_tokens = perplexity(llm, text)
    all_correct = [c for cs in correct_by_kind.values() for c in cs]
    agreement = None if reference is None else sum(a == b for a, b in zip(replies, reference)) / len(replies)
    by_kind = {k: sum(v) / len(v) for k, v in correct_by_kind.items()}
    mib = llm.engine.model.weight_bytes / 2**20
    accuracy = sum(all_correct) / len(all_correct)
    row = (name, description, accuracy, by_kind, ppl, len(tasks), num_tokens, agreement, mib)
    return QualityRow(*row, time.perf_counter() - start, replies)


def builtin_variants(model: str | None, device: str, calib_samples: int = 32) -> dict[str, tuple[str, Callable]]:
    """Every weight and KV format the project has, FP16 first: name -> (description, build)."""
    from lowvram.config import load_profile

    profile = load_profile("cpu" if device == "cpu" else "4gb")

    def with_kv(description: str, precision: str) -> tuple[str, Callable]:
        return description, lambda: LLM(model, profile.replace(kv_precision=precision), device=device)

    def quantized(description: str, **options) -> tuple[str, Callable]:
        def build() -> LLM:
            from lowvram.models.loader import resolve_model_path
            from lowvram.quant.quantize import quantize_model

            out = Path(tempfile.mkdtemp(prefix="lowvram-quality-")) / "model"
            quantize_model(resolve_model_path(model), out, device=device, num_samples=calib_samples, **options)
            return LLM(str(out), profile.replace(kv_precision="fp16"), device=device)

        return description, build

    mib = 1.0  # FP16-kept layers: the demo model's are small; about 10% of its INT4 weight bytes
    comp = dict(method="awq", rank=16, bias_correction=True)
    comp_text = "residual compensation (rank 16 low-rank term + bias correction)"
    kept, kv = f"FP16-kept layers ({mib:g} MiB)", "KV pages (asymmetric per token and head)"
    sensitive = f"the most sensitive layers kept in FP16 ({mib:g} MiB budget)"
    return {
        "fp16": with_kv("checkpoint weights (FP16; FP32 compute on the CPU), full-precision KV", "fp16"),
        "rtn-int4": quantized("round-to-nearest INT4, group 128 (AutoAWQ layout)", method="rtn"),
        "awq-int4": quantized("AWQ INT4, group 128 (scale and clipping search)", method="awq"),
        "awq-fp16": quantized(f"AWQ INT4 with {sensitive}", method="awq", fp16_budget_mib=mib),
        "awq-fp16-comp": quantized(f"AWQ INT4, {kept} and {comp_text}", fp16_budget_mib=mib, **comp),
        # The two corrections apart, and half the rank: what each buys against what it costs in
        # decode speed (every compensated INT4 matmul does the rank's products too).
        "awq-comp": quantized(f"AWQ INT4 and {comp_text}, no FP16-kept layers", **comp),
        "awq-fp16-comp-r8": quantized(
            f"AWQ INT4, {kept} and residual compensation of rank 8 (+ bias correction)",
            **{**comp, "rank": 8, "fp16_budget_mib": mib},
        ),
        "kv-int8": with_kv(f"FP16 weights, INT8 {kv}", "int8"),
        "kv-int4": with_kv(f"FP16 weights, INT4 {kv}", "int4"),
    }


def run_quality_bench(
    model: str | None = None,
    *,
    variant_names: list[str] | None = None,
    device: str = "cpu",
    num_per_kind: int | None = None,
    max_chars: int | None = None,
    command: str = "",
    calib_samples: int = 32,
    progress: Callable[[str], None] | None = None,
) -> QualityReport:
    from lowvram.demo.corpus import heldout_text
    from lowvram.demo.tasks import heldout_tasks
    from lowvram.errors import ConfigError

    tasks = heldout_tasks(num_per_kind)
    text = heldout_text(max_chars)
    variants = builtin_variants(model, device, calib_samples)
    unknown = [n for n in variant_names or () if n not in variants]
    if unknown:
        raise ConfigError(f"unknown quality variant {unknown[0]!r}; available: {', '.join(variants)}")
    rows: list[QualityRow] = []
    for name in variant_names or variants:
        if progress:
            progress(f"evaluating {name} ...")
        reference = rows[0].replies if rows and rows[0].variant == "fp16" else None
        rows.append(evaluate(name, *variants[name], tasks, text, reference))
    machine = f"{platform.machine()} {platform.processor() or ''} {platform.system()}"
    machine = f"{machine}, Python {platform.python_version()}".strip()
    date = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    header = (str(model or "bundled demo model"), device, command, date, git_commit(short=True), machine)
    return QualityReport(*header, num_per_kind, max_chars, rows)


def to_markdown(report: QualityReport) -> str:
    rows = report.rows
    kinds = list(rows[0].accuracy_by_kind) if rows else []
    lines = [
        "| format | accuracy | perplexity | agreement with fp16 | weights MiB | " + " | ".join(kinds) + " |",
        "|" + "---|" * (5 + len(kinds)),
    ]
    for r in rows:
        agree = "-" if r.agreement_with_fp16 is None else f"{100 * r.agreement_with_fp16:.1f}%"
        per_kind = " | ".join(f"{100 * r.accuracy_by_kind[k]:.0f}%" for k in kinds)
        lines.append(
            f"| {r.variant} | {100 * r.accuracy:.1f}% | {r.perplexity:.3f} | {agree} | {r.weight_mib:.1f} | {per_kind} |"
        )
    by_name = {r.variant: r for r in rows}
    gaps = []
    if {"fp16", "rtn-int4"} <= by_name.keys():
        base, rtn = by_name["fp16"].perplexity, by_name["rtn-int4"].perplexity
        for name in ("awq-int4", "awq-fp16", "awq-fp16-comp", "awq-comp", "awq-fp16-comp-r8"):
            if name in by_name and rtn > base:
                closed = (rtn - by_name[name].perplexity) / (rtn - base)
                gaps.append(
                    f"- {name} closes {100 * closed:.0f}% of RTN's perplexity gap to FP16 "
                    f"({by_name[name].perplexity:.3f} vs RTN {rtn:.3f}, FP16 {base:.3f}); accuracy "
                    f"{100 * (by_name[name].accuracy - by_name['fp16'].accuracy):+.1f} points vs FP16"
                )
    gap_text = ("Quantization, against FP16:\n\n" + "\n".join(gaps) + "\n\n") if gaps else ""
    table, detail = "\n".join(lines), "\n".join(f"- **{r.variant}**: {r.description} ({r.seconds:.0f} s)" for r in rows)
    num_tasks, num_tokens = (rows[0].num_tasks, rows[0].num_ppl_tokens) if rows else (0, 0)
    return (
        "# Quality of lowvram's weight and KV formats\n\n"
        f"Model: {report.model}. Device: {report.device}. Held-out chat tasks: {num_tasks} "
        f"(exact match, greedy, through the chat template); perplexity over {num_tokens} "
        f"tokens of held-out Python in {PPL_WINDOW_TOKENS}-token windows, each scored from BOS.\n\n"
        f"{table}\n\n{gap_text}{detail}\n\n"
        f"Produced by `{report.command}` on {report.date}, commit {report.git_commit}, {report.machine}.\n"
    )
