"""`lowvram doctor`: predict out-of-memory before a run, explain it after one.

`plan_memory` turns a model's config.json and a profile into a memory plan:
weights by kind, KV per token at each precision, KV for the requested context
and batch, the workspace of the largest step, the CUDA context, allocator
overhead and a fragmentation reserve; the verdict against the engine's budget
and against the card; the largest context that fits at each KV precision; and
profile changes ranked by what they free. Every engine-side number comes from
lowvram.memory.plan, the code the engine sizes its KV pool with.

`explain_oom_input` reads an out-of-memory message, a crash report or a torch
memory snapshot (lowvram.memory.oom) and adds, for a crash report, the plan of the
run that failed.

Exit status of the command: 0 = fits (or the evidence was explained),
1 = the plan does not fit, 2 = an error (missing file, bad option).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from lowvram.config import Profile, load_profile, profile_from_dict
from lowvram.errors import ConfigError, LowvramError, ModelLoadError
from lowvram.memory import plan as mp
from lowvram.memory.plan import GIB, MIB, WeightBytes, Workspace
from lowvram.models.config import ModelConfig, model_config_from_dict

EXIT_FITS = 0
EXIT_DOES_NOT_FIT = 1
# Below this a change is noise, not a recommendation.
MIN_USEFUL_FREED_BYTES = 1 * MIB
# Recommendations are shown when the plan does not fit or is this close to the edge.
TIGHT_MARGIN_FRACTION = 0.05
AWQ_DEFAULT_GROUP_SIZE = 128
# Smaller prefill steps than this make long prompts slow for little memory.
MIN_RECOMMENDED_BATCHED_TOKENS = 256


@dataclass
class Recommendation:
    """One profile change: `field: value`, the memory it frees, whether it alone makes the plan fit."""

    field: str
    value: object
    freed_bytes: int
    is_sufficient: bool
    note: str = ""

    @property
    def setting(self) -> str:
        value = str(self.value).lower() if isinstance(self.value, bool) else self.value
        return f"{self.field}: {value}"


@dataclass
class _Fit:
    engine_need_bytes: int
    budget_bytes: int
    device_need_bytes: int
    capacity_bytes: int
    fragmentation_bytes: int
    context_bytes: int  # the CUDA context, when the capacity has to hold it

    @property
    def fits(self) -> bool:
        return self.engine_need_bytes <= self.budget_bytes and self.device_need_bytes <= self.capacity_bytes


@dataclass
class MemoryPlan:
    """Everything `lowvram doctor` prints about memory; sizes in bytes."""

    model: str
    architecture: str
    profile_name: str
    device_type: str
    dtype: str
    element_bytes: int
    context_len: int
    num_seqs: int
    kv_precision: str
    block_size: int
    weights: WeightBytes
    kv_bytes_per_token: dict[str, int]
    kv_bytes: int
    workspace: Workspace
    budget_bytes: int
    cuda_context_bytes: int
    is_context_measured: bool
    fragmentation_bytes: int
    device_capacity_bytes: int
    device_capacity_source: str
    is_context_in_capacity: bool
    max_context: dict[str, int] = field(default_factory=dict)
    max_position_embeddings: int = 0
    recommendations: list[Recommendation] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def engine_need_bytes(self) -> int:
        """What the engine checks against its budget: weights + workspace + KV."""
        return self.weights.total_bytes + self.workspace.peak_bytes + self.kv_bytes

    @property
    def peak_allocated_bytes(self) -> int:
        """Predicted torch.cuda.max_memory_allocated() of the run (the cuBLAS workspace is in
        the workspace)."""
        return self.engine_need_bytes

    @property
    def device_need_bytes(self) -> int:
        """Predicted device memory at the peak, with context and fragmentation reserve."""
        context = self.cuda_context_bytes if self.is_context_in_capacity else 0
        return self.peak_allocated_bytes + self.fragmentation_bytes + context

    @property
    def engine_margin_bytes(self) -> int:
        return self.budget_bytes - self.engine_need_bytes

    @property
    def device_margin_bytes(self) -> int:
        return self.device_capacity_bytes - self.device_need_bytes

    @property
    def margin_bytes(self) -> int:
        """Room to spare (negative: how much is missing) on the tighter of the two checks."""
        return min(self.engine_margin_bytes, self.device_margin_bytes)

    @property
    def fits(self) -> bool:
        return self.margin_bytes >= 0

    def to_json(self) -> dict:
        data = {
            "model": self.model,
            "architecture": self.architecture,
            "profile": self.profile_name,
            "device_type": self.device_type,
            "dtype": self.dtype,
            "context_len": self.context_len,
            "num_seqs": self.num_seqs,
            "kv_precision": self.kv_precision,
            "block_size": self.block_size,
            "weights": {
                **{k: v for k, v in dataclasses.asdict(self.weights).items()},
                "total_bytes": self.weights.total_bytes,
            },
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "kv_bytes": self.kv_bytes,
            "workspace": {
                "peak_bytes": self.workspace.peak_bytes,
                "peak_phase": self.workspace.peak_phase,
                "phases": self.workspace.phases,
                "rope_bytes": self.workspace.rope_bytes,
                "metadata_bytes": self.workspace.metadata_bytes,
                "num_tokens": self.workspace.num_tokens,
                "graph_bytes": self.workspace.graph_bytes,
                "cublas_bytes": self.workspace.cublas_bytes,
                "uses_kernels": self.workspace.uses_kernels,
            },
            "cuda_context_bytes": self.cuda_context_bytes,
            "is_context_measured": self.is_context_measured,
            "fragmentation_bytes": self.fragmentation_bytes,
            "engine_need_bytes": self.engine_need_bytes,
            "budget_bytes": self.budget_bytes,
            "peak_allocated_bytes": self.peak_allocated_bytes,
            "device_need_bytes": self.device_need_bytes,
            "device_capacity_bytes": self.device_capacity_bytes,
            "device_capacity_source": self.device_capacity_source,
            "fits": self.fits,
            "margin_bytes": self.margin_bytes,
            "engine_margin_bytes": self.engine_margin_bytes,
            "device_margin_bytes": self.device_margin_bytes,
            "max_context": self.max_context,
            "max_position_embeddings": self.max_position_embeddings,
            "recommendations": [dataclasses.asdict(r) | {"setting": r.setting} for r in self.recommendations],
            "notes": self.notes,
        }
        return data


# ---------------------------------------------------------------- inputs


def load_plan_inputs(model: str | None) -> tuple[ModelConfig, dict, str, Path | None]:
    """(config, raw config.json, label, model directory or None) for a model directory,
    a config.json file, a hub id (only its config.json is fetched) or None (the bundled
    demo model)."""
    from lowvram.models.config import load_model_config
    from lowvram.models.loader import resolve_model_path

    if model is not None:
        path = Path(model).expanduser()
        if path.is_file() and path.name == "config.json":
            # its directory: a legacy quant_config.json and the compensation file sit beside it
            config, raw = load_model_config(path.parent)
            return config, raw, str(path), path.parent
        if path.is_file():
            try:
                raw = json.loads(path.read_text())
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise ModelLoadError(f"{path} is not a readable config.json ({exc})") from None
            if not isinstance(raw, dict):
                raise ModelLoadError(f"{path} must hold a JSON object")
            return model_config_from_dict(raw, str(path)), raw, str(path), None
        if not path.is_dir() and str(model).count("/") == 1 and not str(model).startswith((".", "/", "~")):
            return _hub_config(str(model))
    model_dir = resolve_model_path(model)
    config, raw = load_model_config(model_dir)
    return config, raw, "bundled demo model" if model is None else str(model), model_dir


def _hub_config(repo_id: str) -> tuple[ModelConfig, dict, str, None]:
    try:
        from huggingface_hub import hf_hub_download

        path = Path(hf_hub_download(repo_id, "config.json"))
    except Exception as exc:  # offline, 404, gated: the hub raises many types
        raise ModelLoadError(
            f"could not fetch config.json of {repo_id!r} from the Hugging Face hub ({type(exc).__name__}); "
            "pass a local model directory or its config.json"
        ) from None
    raw = json.loads(path.read_text())
    return model_config_from_dict(raw, repo_id), raw, repo_id, None


# ---------------------------------------------------------------- planning


def _device_type(profile: Profile, device: str | None, cuda_available: bool, notes: list[str]) -> str:
    requested = device if device not in (None, "auto") else profile.device
    if requested != "auto":
        return requested
    if cuda_available:
        return "cuda"
    if profile.device == "auto" and profile.name != "cpu":
        notes.append(
            f"no CUDA GPU here: planned for the {profile.memory_budget_gib:g} GiB card of profile "
            f"{profile.name!r}; on this machine the engine would run on the CPU (--device cpu plans that)"
        )
        return "cuda"
    return "cpu"


def _element_bytes(profile: Profile, device_type: str) -> tuple[str, int]:
    if profile.dtype == "auto":
        return ("float16", 2) if device_type == "cuda" else ("float32", 4)
    return profile.dtype, 4 if profile.dtype == "float32" else 2


@dataclass
class _Setup:
    """What stays fixed while the doctor tries variations of the plan."""

    config: ModelConfig
    raw: dict
    model_dir: Path | None
    device_type: str
    cuda_context_bytes: int
    capacity_bytes: int | None  # None: the profile's card
    capacity_source: str
    is_context_in_capacity: bool


def _capacity(setup: _Setup, profile: Profile) -> int:
    if setup.capacity_bytes is not None:
        return setup.capacity_bytes
    if profile.emulate_vram_gib is not None and setup.device_type == "cuda":
        return int(profile.emulate_vram_gib * GIB)
    return int(profile.memory_budget_gib * GIB)


def _evaluate(
    setup: _Setup, profile: Profile, context_len: int, num_seqs: int, element_bytes: int
) -> tuple[_Fit, WeightBytes, mp.KVPlan, int]:
    """The two checks for `num_seqs` sequences of `context_len` tokens under `profile`."""
    config = setup.config
    weights = mp.weight_bytes_by_kind(
        config,
        setup.raw,
        element_bytes,
        model_dir=setup.model_dir,
        is_embedding_on_host=mp.keeps_embeddings_on_host(config, profile, setup.device_type),
    )
    weights.offload = mp.plan_weight_offload(
        config,
        profile,
        weights,
        element_bytes,
        context_len,
        device_type=setup.device_type,
        raw_config=setup.raw,
        num_seqs=num_seqs,
    )
    pool = mp.size_kv_pool(
        config,
        profile,
        weights.total_bytes,
        element_bytes,
        context_len,
        device_type=setup.device_type,
        raw_config=setup.raw,
    )
    kv_bytes = num_seqs * mp.kv_pool_bytes(config, context_len, profile.kv_block_size, pool.kv_precision, element_bytes)
    engine_need = weights.total_bytes + pool.activation_bytes + kv_bytes
    fragmentation = int(mp.FRAGMENTATION_RESERVE_FRACTION * (kv_bytes + pool.activation_bytes))
    # torch's allocator cap (emulation) leaves the context out; a real card holds it.
    is_emulated = profile.emulate_vram_gib is not None and setup.device_type == "cuda" and setup.capacity_bytes is None
    context = setup.cuda_context_bytes if setup.is_context_in_capacity and not is_emulated else 0
    device_need = engine_need + fragmentation + context
    fit = _Fit(engine_need, pool.budget_bytes, device_need, _capacity(setup, profile), fragmentation, context)
    return fit, weights, pool, kv_bytes


def _variant(profile: Profile, context_len: int, num_seqs: int, **changes) -> Profile:
    """The profile the engine would run a context of `context_len` x `num_seqs` with."""
    values = {"max_model_len": max(16, context_len), "max_num_seqs": num_seqs, **changes}
    tokens = values.get("max_num_batched_tokens", profile.max_num_batched_tokens)
    values["max_num_batched_tokens"] = max(tokens, num_seqs)
    return profile.replace(**values)


def _largest_context(setup: _Setup, profile: Profile, num_seqs: int, element_bytes: int, limit: int, **changes) -> int:
    """The longest context (whole pages) that passes both checks; 0 if none does."""
    block = profile.kv_block_size

    def fits(num_blocks: int) -> bool:
        tokens = num_blocks * block
        return _evaluate(setup, _variant(profile, tokens, num_seqs, **changes), tokens, num_seqs, element_bytes)[0].fits

    low, high = 0, max(1, limit // block)
    if fits(high):
        return high * block
    while high - low > 1:  # fits(low) or low == 0; not fits(high)
        mid = (low + high) // 2
        if fits(mid):
            low = mid
        else:
            high = mid
    return low * block


def plan_memory(
    config: ModelConfig,
    raw_config: dict | None,
    profile: Profile,
    *,
    context_len: int | None = None,
    num_seqs: int = 1,
    device: str | None = None,
    env=None,
    model_label: str = "",
    capacity: tuple[int, str] | None = None,
    model_dir: str | Path | None = None,
) -> MemoryPlan:
    """The memory plan for `num_seqs` sequences of `context_len` tokens.

    env: a lowvram.memory.environment.Environment (its measured CUDA context and free
    GPU memory refine the device check); None plans for the profile's card with
    typical overheads. capacity: (bytes, description) overriding the device size.
    model_dir: the checkpoint directory, whose compensation side file adds its terms.
    """
    notes: list[str] = []
    raw = raw_config or {}
    cuda_available = bool(env.cuda_available) if env is not None else _cuda_available()
    device_type = _device_type(profile, device, cuda_available, notes)
    dtype, element_bytes = _element_bytes(profile, device_type)
    limit = config.max_position_embeddings
    requested = context_len or min(profile.max_model_len, limit)
    if requested > limit:
        notes.append(f"the model supports at most {limit} positions (max_position_embeddings); planned for {limit}")
    context_len = min(requested, limit)
    if num_seqs < 1:
        raise ConfigError(f"--batch = {num_seqs} must be at least 1")
    if num_seqs > profile.max_num_batched_tokens:
        notes.append(f"max_num_batched_tokens raised to {num_seqs} so that {num_seqs} sequences can decode together")
    planned = _variant(profile, context_len, num_seqs)

    is_cuda = device_type == "cuda"
    measured = env.cuda_context_bytes if (env is not None and is_cuda and env.cuda_context_bytes) else None
    context_bytes = (measured or mp.CUDA_CONTEXT_BYTES) if is_cuda else 0
    capacity_bytes, capacity_source = None, ""
    gpu = env.gpu if env is not None and env.cuda_available else None
    if capacity is not None:
        capacity_bytes, capacity_source = capacity
    elif not is_cuda:
        if env is not None and env.host_available_bytes:
            capacity_bytes, capacity_source = env.host_available_bytes, "host RAM available now"
        else:
            capacity_source = f"profile budget {profile.memory_budget_gib:g} GiB of host RAM"
    elif planned.emulate_vram_gib is not None:
        capacity_source = f"emulated {planned.emulate_vram_gib:g} GiB card (torch's allocator cap; context not counted)"
    else:
        card = int(profile.memory_budget_gib * GIB)
        capacity_source = f"the profile's {profile.memory_budget_gib:g} GiB card"
        if gpu is not None and gpu.free_bytes is not None:
            # Free memory is read after this process made its own context, which a run would make too.
            available = gpu.free_bytes + (env.cuda_context_bytes or 0)
            if available < card:
                capacity_bytes, capacity_source = available, f"free on {gpu.name} now"
    setup = _Setup(
        config,
        raw,
        Path(model_dir) if model_dir is not None else None,
        device_type,
        context_bytes,
        capacity_bytes,
        capacity_source,
        is_cuda,
    )
    fit, weights, pool, kv_bytes = _evaluate(setup, planned, context_len, num_seqs, element_bytes)
    if weights.weight_format == "fp16" and profile.weight_format == "awq":
        notes.append(
            "the profile asks for weight_format awq but the checkpoint is not AWQ: weights are planned as "
            "stored; quantize it (AutoAWQ GEMM layout) to get the INT4 sizes"
        )
    if is_cuda and profile.kv_backend in ("um", "pinned", "auto") and profile.host_spill_gib > 0:
        tokens = int(profile.host_spill_gib * GIB) // mp.kv_bytes_per_token(config, pool.kv_precision, element_bytes)
        notes.append(
            f"kv_backend {profile.kv_backend}: up to {profile.host_spill_gib:g} GiB more KV (about {tokens} "
            "tokens) can wait in host RAM beyond the device share; the verdict asks the device to hold "
            "every planned sequence"
        )
        blocks_per_seq = -(-context_len // pool.block_size)
        host_blocks = mp.host_kv_blocks(config, planned, element_bytes, device_type)
        if pool.num_blocks < blocks_per_seq <= pool.num_blocks + host_blocks:
            on_host = (blocks_per_seq - pool.num_blocks) * pool.block_size
            notes.append(
                f"with unified memory (kv_backend um, or auto where the GPU offers it) the engine still "
                f"runs a {context_len}-token context: about {on_host} of its tokens wait in host RAM and "
                "each step reads them over the bus, so long-context steps are slower; a pinned pool "
                "cannot"
            )
    if weights.offload is not None:
        notes.append(f"weight offload ({weights.offload.strategy}): {weights.offload.summary()}")
    if not pool.workspace.uses_kernels and is_cuda:
        notes.append(
            "the plain-torch attention path runs here (no Triton, or a head_dim that is not a power of two): "
            "its float32 scores grow with context x max_num_batched_tokens"
        )

    plan = MemoryPlan(
        model=model_label,
        architecture=config.architecture,
        profile_name=profile.name,
        device_type=device_type,
        dtype=dtype,
        element_bytes=element_bytes,
        context_len=context_len,
        num_seqs=num_seqs,
        kv_precision=pool.kv_precision,
        block_size=planned.kv_block_size,
        weights=weights,
        kv_bytes_per_token={p: mp.kv_bytes_per_token(config, p, element_bytes) for p in mp.KV_PRECISIONS},
        kv_bytes=kv_bytes,
        workspace=pool.workspace,
        budget_bytes=pool.budget_bytes,
        cuda_context_bytes=context_bytes,
        is_context_measured=measured is not None,
        fragmentation_bytes=fit.fragmentation_bytes,
        device_capacity_bytes=fit.capacity_bytes,
        device_capacity_source=capacity_source,
        is_context_in_capacity=fit.context_bytes > 0,
        max_position_embeddings=limit,
        notes=notes,
    )
    for precision in mp.KV_PRECISIONS:
        plan.max_context[precision] = _largest_context(
            setup, planned, num_seqs, element_bytes, limit, kv_precision=precision
        )
    plan.recommendations = recommend(setup, planned, plan, element_bytes)
    return plan


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:  # pragma: no cover
        return False


def recommend(setup: _Setup, profile: Profile, plan: MemoryPlan, element_bytes: int) -> list[Recommendation]:
    """Profile changes ranked by the device memory they free (or the budget they add)."""
    n, b = plan.context_len, plan.num_seqs
    base, _, _, _ = _evaluate(setup, profile, n, b, element_bytes)
    found: list[Recommendation] = []

    def consider(field_name: str, value, fit: _Fit, note: str = "", freed: int | None = None) -> None:
        freed = base.device_need_bytes - fit.device_need_bytes if freed is None else freed
        if freed >= MIN_USEFUL_FREED_BYTES:
            found.append(Recommendation(field_name, value, int(freed), fit.fits, note))

    order = list(mp.KV_PRECISIONS)
    for precision in order[order.index(plan.kv_precision) + 1 :]:
        fit = _evaluate(setup, _variant(profile, n, b, kv_precision=precision), n, b, element_bytes)[0]
        consider(
            "kv_precision",
            precision,
            fit,
            "INT8 KV is near lossless" if precision == "int8" else "INT4 KV costs a little quality",
        )

    tokens = profile.max_num_batched_tokens // 2
    best = None
    while tokens >= max(MIN_RECOMMENDED_BATCHED_TOKENS, b):
        fit = _evaluate(setup, _variant(profile, n, b, max_num_batched_tokens=tokens), n, b, element_bytes)[0]
        best = (tokens, fit)
        if fit.fits:
            break
        tokens //= 2
    if best is not None:
        consider("max_num_batched_tokens", best[0], best[1], "longer prompts take more, smaller prefill steps")

    fitting_len = plan.max_context.get(plan.kv_precision, 0)
    if 0 < fitting_len < n:
        fit = _evaluate(setup, _variant(profile, fitting_len, b), fitting_len, b, element_bytes)[0]
        consider("max_model_len", fitting_len, fit, "the longest context that fits as planned")

    if b > 1:
        for seqs in range(b - 1, 0, -1):
            fit = _evaluate(setup, _variant(profile, n, seqs), n, seqs, element_bytes)[0]
            if fit.fits or seqs == 1:
                consider("max_num_seqs", seqs, fit, "fewer sequences decode together")
                break

    if plan.weights.weight_format == "fp16":
        awq_raw = dict(
            setup.raw,
            quantization_config={
                "quant_method": "awq",
                "bits": 4,
                "version": "gemm",
                "group_size": AWQ_DEFAULT_GROUP_SIZE,
                "zero_point": True,
            },
        )
        awq_setup = dataclasses.replace(setup, raw=awq_raw, model_dir=None)
        fit = _evaluate(awq_setup, _variant(profile, n, b, weight_format="awq"), n, b, element_bytes)[0]
        consider("weight_format", "awq", fit, "needs an AWQ INT4 checkpoint (AutoAWQ GEMM layout, group size 128)")

    if element_bytes == 4 and setup.device_type == "cpu":
        fit = _evaluate(setup, _variant(profile, n, b, dtype="bfloat16"), n, b, 2)[0]
        consider("dtype", "bfloat16", fit, "halves weights and KV; slower on CPUs without BF16 instructions")

    if base.engine_need_bytes > base.budget_bytes and setup.capacity_bytes is not None:
        # The device (host RAM, or a GPU larger than the profile's card) has room the budget does not allow.
        quarters = -(-base.engine_need_bytes * 4 // int(profile.memory_utilization * GIB))
        budget_gib = quarters / 4
        if budget_gib * GIB <= setup.capacity_bytes:
            changed = _variant(profile, n, b, memory_budget_gib=budget_gib)
            fit = _evaluate(setup, changed, n, b, element_bytes)[0]
            consider(
                "memory_budget_gib",
                budget_gib,
                fit,
                f"this device has {_size(setup.capacity_bytes)} available",
                freed=fit.budget_bytes - base.budget_bytes,
            )

    if base.engine_need_bytes > base.budget_bytes and profile.memory_utilization < 0.98:
        utilization = min(0.98, -(-base.engine_need_bytes * 100 // int(profile.memory_budget_gib * GIB)) / 100)
        if utilization > profile.memory_utilization:
            changed = _variant(profile, n, b, memory_utilization=utilization)
            fit = _evaluate(setup, changed, n, b, element_bytes)[0]
            consider(
                "memory_utilization",
                utilization,
                fit,
                "less headroom for other programs",
                freed=fit.budget_bytes - base.budget_bytes,
            )

    found.sort(key=lambda r: (-r.freed_bytes, r.field))
    return found


# ---------------------------------------------------------------- OOM evidence


@dataclass
class OomExplanation:
    kind: str
    findings: list  # oom.Finding
    facts: object | None = None  # oom.OomFacts
    snapshot: object | None = None  # oom.SnapshotSummary
    report: object | None = None  # crash_report.CrashReport
    plan: MemoryPlan | None = None
    plan_error: str | None = None

    def to_json(self) -> dict:
        data = {"kind": self.kind, "findings": [dataclasses.asdict(f) for f in self.findings]}
        if self.facts is not None:
            data["facts"] = dataclasses.asdict(self.facts)
        if self.snapshot is not None:
            data["snapshot"] = dataclasses.asdict(self.snapshot)
        if self.report is not None:
            data["crash_report"] = {k: v for k, v in self.report.to_json().items() if k != "model"}
        if self.plan is not None:
            data["plan"] = self.plan.to_json()
        if self.plan_error:
            data["plan_error"] = self.plan_error
        return data


def read_oom_source(source: str) -> tuple[bytes, str]:
    if source == "-":
        return sys.stdin.buffer.read(), "stdin"
    path = Path(source).expanduser()
    if not path.is_file():
        raise ConfigError(
            f"--oom {source}: no such file; pass the file holding the error text, a crash report "
            "(crash-*.json) or a memory snapshot, or '-' to read stdin"
        )
    try:
        return path.read_bytes(), str(path)
    except OSError as exc:
        raise ConfigError(f"--oom {source}: cannot read it ({exc})") from None


def explain_oom_input(data: bytes, source: str) -> OomExplanation:
    from lowvram.memory import oom

    evidence = oom.read_oom_input(data, source)
    if evidence.kind == "snapshot":
        return OomExplanation("snapshot", oom.explain_snapshot(evidence.snapshot), snapshot=evidence.snapshot)
    findings = oom.explain_oom(evidence.facts) if evidence.facts is not None else []
    if evidence.kind == "message":
        return OomExplanation("message", findings, facts=evidence.facts)
    report = evidence.report
    explanation = OomExplanation("crash_report", findings, facts=evidence.facts, report=report)
    if evidence.facts is None:
        explanation.findings.append(oom.Finding(f"The run failed with: {report.exception_text.strip()[:300]}"))
    _explain_report_memory(explanation)
    try:
        explanation.plan = _plan_from_report(report)
    except LowvramError as exc:
        explanation.plan_error = str(exc)
    plan = explanation.plan
    if plan is not None and not plan.fits and plan.recommendations:
        top = plan.recommendations[0]
        explanation.findings.append(
            oom.Finding(
                f"For this profile and model the plan needs {oom.gib(plan.device_need_bytes)} of "
                f"{oom.gib(plan.device_capacity_bytes)}; the change that frees the most is `{top.setting}` "
                f"({oom.gib(top.freed_bytes)}).",
                top.setting,
            )
        )
    elif plan is not None and plan.fits:
        explanation.findings.append(
            oom.Finding(
                f"The plan for this profile and model fits ({oom.gib(plan.device_need_bytes)} of "
                f"{oom.gib(plan.device_capacity_bytes)}), so the run used memory the plan does not count: other "
                "processes, fragmentation, or a path the plan misses (see above).",
                "the changes above; if none applies, report it with this crash report",
            )
        )
    return explanation


def _explain_report_memory(explanation: OomExplanation) -> None:
    from lowvram.memory import oom

    memory = explanation.report.memory
    parts = [
        f"{label} {oom.gib(memory[key])}"
        for key, label in (
            ("weight_bytes", "weights"),
            ("kv_pool_bytes", "KV pool"),
            ("workspace_reserve_bytes", "workspace reserve"),
            ("budget_bytes", "budget"),
        )
        if isinstance(memory.get(key), int)
    ]
    if parts:
        explanation.findings.append(oom.Finding("The engine had planned: " + ", ".join(parts) + "."))
    if isinstance(memory.get("kv_blocks_in_use"), int):
        cached = memory.get("kv_blocks_cached_reclaimable", 0)
        explanation.findings.append(
            oom.Finding(
                f"KV pages at the failure: {memory['kv_blocks_in_use']} in use by requests "
                f"({oom.gib(memory.get('kv_bytes_in_use', 0))}), {cached} cached for reuse by later requests; cached pages "
                "are reclaimable (evicted on demand), so they did not cause the failure."
            )
        )
    planned = sum(
        memory.get(k, 0)
        for k in ("weight_bytes", "kv_pool_bytes", "workspace_reserve_bytes")
        if isinstance(memory.get(k), int)
    )
    allocated = memory.get("peak_allocated_bytes")
    if planned and isinstance(allocated, int) and allocated > planned * 1.05:
        explanation.findings.append(
            oom.Finding(
                f"torch's peak allocation ({oom.gib(allocated)}) exceeded the engine's plan ({oom.gib(planned)}) by "
                f"{oom.gib(allocated - planned)}: something outside the plan allocated (scoring all logits, another "
                "model in the process, or a workspace the plan undercounts).",
                "report it with this crash report; meanwhile lower max_num_batched_tokens",
            )
        )
    events = explanation.report.controller_events
    if events:
        last = ", ".join(json.dumps(e, sort_keys=True) for e in events[-3:])
        explanation.findings.append(oom.Finding(f"The controller's last actions: {last}."))


def _plan_from_report(report) -> MemoryPlan | None:
    raw = report.model.get("config")
    if not isinstance(raw, dict) or not report.profile:
        return None
    profile = profile_from_dict(dict(report.profile), "the crash report's profile")
    config = model_config_from_dict(raw, "the crash report's model config")
    memory = report.memory
    context = memory.get("max_model_len") if isinstance(memory.get("max_model_len"), int) else None
    # A report without a device type comes from a CUDA out-of-memory error.
    device = memory.get("device_type") if memory.get("device_type") in ("cuda", "cpu") else "cuda"
    capacity = None
    if isinstance(memory.get("device_total_bytes"), int) and profile.emulate_vram_gib is None:
        capacity = (memory["device_total_bytes"], f"{memory.get('device_name', 'the GPU')} (whole card)")
    path = report.model.get("path")
    model_dir = Path(path) if path and Path(path).is_dir() else None
    return plan_memory(
        config,
        raw,
        profile,
        context_len=context,
        device=device,
        model_label=str(path or "model of the crash report"),
        capacity=capacity,
        model_dir=model_dir,
    )


# ---------------------------------------------------------------- rendering


def _size(num_bytes: int | None) -> str:
    if num_bytes is None:
        return "?"
    sign = "-" if num_bytes < 0 else ""
    value = abs(num_bytes)
    if value >= GIB:
        return f"{sign}{value / GIB:.2f} GiB"
    if value >= MIB:
        return f"{sign}{value / MIB:.1f} MiB"
    if value >= 1024:
        return f"{sign}{value / 1024:.1f} KiB"
    return f"{sign}{value} B"


def render_environment(console, env, problems) -> None:
    from rich.table import Table

    table = Table(title="environment", title_justify="left", show_header=False)
    table.add_column("item", style="bold")
    table.add_column("value")
    table.add_row("platform", f"{env.platform}{' (WSL2)' if env.is_wsl else ''}, Python {env.python_version}")
    runtime = (
        f"CUDA {env.torch_cuda_version}"
        if env.torch_cuda_version
        else (f"HIP {env.torch_hip_version}" if env.torch_hip_version else "CPU-only build")
    )
    table.add_row("torch", f"{env.torch_version} ({runtime})")
    table.add_row(
        "driver",
        f"{env.driver_version} (supports CUDA {env.driver_cuda_version})" if env.driver_version else "not found",
    )
    if not env.gpus:
        table.add_row("GPU", "none visible to torch")
    for gpu in env.gpus:
        table.add_row(
            f"GPU {gpu.index}", f"{gpu.name}, compute capability {gpu.sm}, {gpu.num_multiprocessors or '?'} SMs"
        )
        table.add_row("  memory", f"{_size(gpu.total_bytes)} total, {_size(gpu.free_bytes)} free")
        managed = {True: "yes", False: "no", None: "unknown"}
        oversubscription = {True: "possible", False: "not possible", None: "unknown"}[gpu.can_oversubscribe]
        table.add_row(
            "  managed memory",
            f"concurrent access {managed[gpu.concurrent_managed_access]}, "
            f"pageable access {managed[gpu.pageable_memory_access]}, oversubscription {oversubscription} "
            f"({gpu.managed_source})",
        )
    if env.cuda_context_bytes:
        table.add_row("CUDA context", f"{_size(env.cuda_context_bytes)} (measured)")
    table.add_row("Triton", f"{env.triton_version or 'not installed'}: kernels {env.triton_status}")
    table.add_row("cuda-bindings", "installed" if env.has_cuda_bindings else "not installed")
    table.add_row(
        "host RAM",
        f"{_size(env.host_total_bytes)} total, {_size(env.host_available_bytes)} available, "
        f"swap {_size(env.swap_free_bytes)} free",
    )
    if env.memlock_known:
        table.add_row(
            "pinned-memory limit",
            "unlimited" if env.memlock_soft_bytes is None else f"{_size(env.memlock_soft_bytes)} (ulimit -l)",
        )
    console.print(table)
    for note in env.notes:
        console.print(f"[dim]note: {note}[/dim]", highlight=False)
    if not problems:
        console.print("[green]no problems found[/green]")
    colors = {"error": "red", "warning": "yellow", "info": "cyan"}
    for problem in problems:
        console.print(f"[{colors[problem.severity]}]{problem.severity}[/]: {problem.message}", highlight=False)
        console.print(f"  fix: {problem.fix}", highlight=False)


def render_plan(console, plan: MemoryPlan) -> None:
    from rich.markup import escape
    from rich.table import Table

    seqs = f"{plan.num_seqs} sequence{'s' if plan.num_seqs != 1 else ''}"
    title = (
        f"memory plan: {plan.model} ({plan.architecture}) on profile {plan.profile_name} "
        f"({plan.device_type}, {plan.dtype}), context {plan.context_len} x {seqs}, KV {plan.kv_precision}"
    )
    table = Table(title=escape(title), title_justify="left")
    table.add_column("item")
    table.add_column("size", justify="right")
    table.add_column("detail")
    for label, size in plan.weights.rows():
        detail = plan.dtype
        if label.startswith("INT4"):
            detail = f"AWQ GEMM, group size {plan.weights.awq_group_size}"
        elif label.startswith("compensation"):
            detail = f"{plan.dtype} low-rank and bias-correction terms"
        table.add_row(f"weights: {label}", _size(size), detail)
    table.add_row("[bold]weights total[/bold]", f"[bold]{_size(plan.weights.total_bytes)}[/bold]", "")
    per_token = " · ".join(f"{p} {_size(b)}" for p, b in plan.kv_bytes_per_token.items())
    table.add_row("KV per token", _size(plan.kv_bytes_per_token[plan.kv_precision]), per_token)
    pages = plan.num_seqs * -(-plan.context_len // plan.block_size)
    table.add_row(
        f"KV cache ({plan.context_len} tokens x {plan.num_seqs})",
        _size(plan.kv_bytes),
        f"{pages} pages of {plan.block_size} tokens, {plan.kv_precision}",
    )
    ws = plan.workspace
    path = "Triton attention" if ws.uses_kernels else "plain-torch attention"
    graphs = f"; decode CUDA graphs {_size(ws.graph_bytes)}" if ws.graph_bytes else ""
    graphs += f"; cuBLAS workspace {_size(ws.cublas_bytes)}" if ws.cublas_bytes else ""
    table.add_row(
        f"workspace (peak: {ws.peak_phase})",
        _size(ws.peak_bytes),
        f"{ws.num_tokens}-token step, {path}; RoPE tables {_size(ws.rope_bytes)}{graphs}",
    )
    table.add_row(
        "[bold]engine total[/bold]",
        f"[bold]{_size(plan.engine_need_bytes)}[/bold]",
        f"engine budget {_size(plan.budget_bytes)}",
    )
    if plan.device_type == "cuda":
        if plan.is_context_in_capacity:
            table.add_row(
                "CUDA context",
                _size(plan.cuda_context_bytes),
                "measured here" if plan.is_context_measured else "typical, not measured",
            )
    table.add_row(
        f"fragmentation reserve ({mp.FRAGMENTATION_RESERVE_FRACTION:.0%})",
        _size(plan.fragmentation_bytes),
        "of KV + workspace",
    )
    table.add_row(
        "[bold]device total[/bold]",
        f"[bold]{_size(plan.device_need_bytes)}[/bold]",
        f"capacity {_size(plan.device_capacity_bytes)}: {plan.device_capacity_source}",
    )
    console.print(table)

    if plan.fits:
        console.print(
            f"[bold green]verdict: fits[/bold green], {_size(plan.margin_bytes)} to spare "
            f"(engine budget {_size(plan.engine_margin_bytes)}, device {_size(plan.device_margin_bytes)})",
            highlight=False,
        )
    else:
        short = []
        if plan.engine_margin_bytes < 0:
            short.append(f"the engine budget by {_size(-plan.engine_margin_bytes)}")
        if plan.device_margin_bytes < 0:
            short.append(f"the device by {_size(-plan.device_margin_bytes)}")
        console.print(f"[bold red]verdict: does not fit[/bold red]: over {' and '.join(short)}", highlight=False)
    contexts = " · ".join(
        f"{p} {n if n else 'none'}{' (model limit)' if n == plan.max_position_embeddings else ''}"
        for p, n in plan.max_context.items()
    )
    console.print(f"largest context that fits ({plan.num_seqs} x): {contexts}", highlight=False)
    for note in plan.notes:
        console.print(f"[dim]note: {note}[/dim]", highlight=False)
    tight = plan.margin_bytes < TIGHT_MARGIN_FRACTION * plan.device_capacity_bytes
    if plan.recommendations and (not plan.fits or tight):
        rec = Table(title="recommendations, ranked by memory freed", title_justify="left")
        for column, justify in (
            ("#", "right"),
            ("profile change", "left"),
            ("frees", "right"),
            ("fits alone", "left"),
            ("note", "left"),
        ):
            rec.add_column(column, justify=justify)
        for i, r in enumerate(plan.recommendations, 1):
            rec.add_row(str(i), r.setting, _size(r.freed_bytes), "yes" if r.is_sufficient else "no", r.note)
        console.print(rec)
    elif plan.fits:
        console.print("no change needed")


def render_oom(console, explanation: OomExplanation) -> None:
    from rich.table import Table

    titles = {
        "message": "out-of-memory message",
        "crash_report": "lowvram crash report",
        "snapshot": "torch memory snapshot",
    }
    console.print(f"[bold]{titles[explanation.kind]}[/bold]")
    if explanation.report is not None and explanation.report.command:
        console.print(f"command: {explanation.report.command}", highlight=False)
    for i, finding in enumerate(explanation.findings, 1):
        console.print(f"{i}. {finding.what}", highlight=False)
        if finding.change:
            console.print(f"   [bold]change:[/bold] {finding.change}", highlight=False)
    summary = explanation.snapshot
    if summary is not None and summary.sites:
        table = Table(title="largest live allocations by call site", title_justify="left")
        for column, justify in (("where", "left"), ("kind", "left"), ("blocks", "right"), ("size", "right")):
            table.add_column(column, justify=justify)
        for site in summary.sites:
            table.add_row(site.where, site.category, str(site.num_blocks), _size(site.num_bytes))
        console.print(table)
    if explanation.plan is not None:
        render_plan(console, explanation.plan)
    elif explanation.plan_error:
        console.print(f"[dim]no plan: {explanation.plan_error}[/dim]", highlight=False)


# ---------------------------------------------------------------- the command


def add_doctor_parser(subparsers) -> argparse.ArgumentParser:
    """Add `lowvram doctor` to the CLI's subparsers."""
    parser = subparsers.add_parser(
        "doctor",
        help="check this machine, plan memory for a model and profile, or explain an out-of-memory error",
        description="Without --oom: environment checks and a memory plan (exit 0 = fits, 1 = does not fit). "
        "With --oom FILE: explain an out-of-memory message, crash report or torch memory snapshot.",
    )
    parser.add_argument(
        "--model",
        "-m",
        default=None,
        help="model directory, its config.json, or a hub id (only config.json is fetched); "
        "default: the bundled demo model",
    )
    parser.add_argument(
        "--profile", default=None, help="built-in profile or YAML file (default: 4gb with CUDA, cpu without)"
    )
    parser.add_argument(
        "--context",
        type=int,
        default=None,
        metavar="N",
        help="context length to plan for (default: the profile's max_model_len)",
    )
    parser.add_argument(
        "--batch", type=int, default=1, metavar="B", help="sequences of that length at once (default 1)"
    )
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default=None, help="plan for this device")
    parser.add_argument(
        "--oom",
        default=None,
        metavar="FILE",
        help="explain an out-of-memory message, a lowvram crash report or a torch memory snapshot ('-' reads stdin)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="skip the checks that start CUDA (Triton kernel test, CUDA context measurement)",
    )
    parser.set_defaults(func=cmd_doctor)
    return parser


def _console():
    from rich.console import Console

    return Console(width=max(120, Console().width), highlight=False)


def cmd_doctor(args) -> int:
    if args.oom is not None:
        data, source = read_oom_source(args.oom)
        explanation = explain_oom_input(data, source)
        if args.json:
            print(json.dumps(explanation.to_json(), indent=2, default=str))
        else:
            render_oom(_console(), explanation)
        return 0

    from lowvram.memory.environment import find_problems, probe_environment

    profile = load_profile(args.profile)
    env = probe_environment(test_triton=not args.quick, measure_context=not args.quick)
    # Problems concern the device a run would really use here, not the card a plan is for.
    run_device = args.device if args.device not in (None, "auto") else profile.device
    if run_device == "auto":
        run_device = "cuda" if env.cuda_available else "cpu"
    problems = find_problems(env, profile, run_device)
    console = None if args.json else _console()
    if console is not None:
        render_environment(console, env, problems)
    try:
        config, raw, label, model_dir = load_plan_inputs(args.model)
    except ModelLoadError:
        if console is not None:
            console.print()
        raise
    plan = plan_memory(
        config,
        raw,
        profile,
        context_len=args.context,
        num_seqs=args.batch,
        device=args.device,
        env=env,
        model_label=label,
        model_dir=model_dir,
    )
    if args.json:
        print(
            json.dumps(
                {
                    "environment": dataclasses.asdict(env),
                    "problems": [dataclasses.asdict(p) for p in problems],
                    "plan": plan.to_json(),
                },
                indent=2,
                default=str,
            )
        )
    else:
        console.print()
        render_plan(console, plan)
    return EXIT_FITS if plan.fits else EXIT_DOES_NOT_FIT


def main(argv: list[str] | None = None) -> int:
    """`lowvram doctor` on its own (the same as the CLI subcommand)."""
    parser = argparse.ArgumentParser(prog="lowvram")
    add_doctor_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["doctor", *(argv or [])])
    try:
        return args.func(args)
    except LowvramError as exc:
        print(f"lowvram: error: {exc}", file=sys.stderr)
        return 2
