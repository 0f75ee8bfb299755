"""`lowvram doctor`: predict out-of-memory before a run, explain it after one. Exit status:
0 = fits (or the evidence was explained), 1 = does not fit, 2 = an error."""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from lowvram.config import Profile, load_profile, profile_from_dict
from lowvram.errors import ConfigError, LowvramError, ModelLoadError
from lowvram.memory import oom
from lowvram.memory import plan as mp
from lowvram.memory.plan import GIB, MIB, WeightBytes
from lowvram.memory.render import format_size, render_environment, render_oom, render_plan
from lowvram.memory.workspace import Workspace
from lowvram.models.config import AwqConfig, ModelConfig, model_config_from_dict

# Below this a change is noise, not a recommendation.
MIN_USEFUL_FREED_BYTES = 1 * MIB
AWQ_DEFAULT_GROUP_SIZE = 128
# Smaller prefill steps than this make long prompts slow for little memory.
MIN_RECOMMENDED_BATCHED_TOKENS = 256


@dataclass
class Recommendation:
    """One profile change `field: value`, the memory it frees, whether it alone makes the plan fit."""

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
class MemoryPlan:
    """Everything `lowvram doctor` prints about memory; sizes in bytes."""

    model: str
    architecture: str
    profile_name: str
    device_type: str
    dtype: str
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
    device_capacity_bytes: int
    device_capacity_source: str
    is_context_in_capacity: bool  # False on the CPU and under emulation (torch's cap leaves it out)
    max_position_embeddings: int
    max_context: dict[str, int] = field(default_factory=dict)
    recommendations: list[Recommendation] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def engine_need_bytes(self) -> int:
        """What the engine checks against its budget: weights + workspace + KV."""
        return self.weights.total_bytes + self.workspace.peak_bytes + self.kv_bytes

    @property
    def peak_allocated_bytes(self) -> int:
        """Predicted torch.cuda.max_memory_allocated() of the run."""
        return self.engine_need_bytes

    @property
    def fragmentation_bytes(self) -> int:
        return int(mp.FRAGMENTATION_RESERVE_FRACTION * (self.kv_bytes + self.workspace.peak_bytes))

    @property
    def device_need_bytes(self) -> int:
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
        """Room to spare (negative: what is missing) on the tighter of the two checks."""
        return min(self.engine_margin_bytes, self.device_margin_bytes)

    @property
    def fits(self) -> bool:
        return self.margin_bytes >= 0

    def to_json(self) -> dict:
        data = dataclasses.asdict(self)
        data["profile"] = data.pop("profile_name")
        data["weights"]["total_bytes"] = self.weights.total_bytes
        data["workspace"].update(peak_bytes=self.workspace.peak_bytes, peak_phase=self.workspace.peak_phase)
        data["recommendations"] = [dataclasses.asdict(r) | {"setting": r.setting} for r in self.recommendations]
        derived = ("engine_need_bytes", "peak_allocated_bytes", "fragmentation_bytes", "device_need_bytes", "fits")
        for name in (*derived, "margin_bytes", "engine_margin_bytes", "device_margin_bytes"):
            data[name] = getattr(self, name)
        return data


def load_plan_inputs(model: str | None) -> tuple[ModelConfig, str, Path | None]:
    """(config, label, model directory or None) for a model directory, a config.json, a GGUF
    file, a hub id (only its config.json is fetched) or None (the bundled demo model)."""
    from lowvram.models.config import load_model_config
    from lowvram.models.loader import resolve_model_path

    if model is not None:
        path = Path(model).expanduser()
        if path.is_file() and path.name == "config.json":
            # its directory: a legacy quant_config.json and the compensation file sit beside it
            return load_model_config(path.parent)[0], str(path), path.parent
        if path.is_file() and path.suffix.lower() != ".gguf":  # a GGUF file is converted below
            try:
                raw = json.loads(path.read_text())
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise ModelLoadError(f"{path} is not a readable config.json ({exc})") from None
            if not isinstance(raw, dict):
                raise ModelLoadError(f"{path} must hold a JSON object")
            return model_config_from_dict(raw, str(path)), str(path), None
        from lowvram.models.hub import cached_snapshot, looks_like_hub_id

        if not path.is_dir() and looks_like_hub_id(model) and cached_snapshot(model) is None:
            try:
                from huggingface_hub import hf_hub_download

                path = Path(hf_hub_download(model, "config.json"))
            except Exception as exc:  # offline, 404, gated: the hub raises many types
                raise ModelLoadError(
                    f"could not fetch config.json of {model!r} from the Hugging Face hub ({type(exc).__name__}); "
                    f"pass a local model directory or its config.json (`hf download {model} config.json` fetches it)"
                ) from None
            return model_config_from_dict(json.loads(path.read_text()), model), model, None
    model_dir = resolve_model_path(model)
    return load_model_config(model_dir)[0], "bundled demo model" if model is None else model, model_dir


def _variant(profile: Profile, context_len: int, num_seqs: int, **changes) -> Profile:
    """The profile the engine would run a context of `context_len` x `num_seqs` with."""
    values = {"max_model_len": max(16, context_len), "max_num_seqs": num_seqs, **changes}
    values["max_num_batched_tokens"] = max(
        values.get("max_num_batched_tokens", profile.max_num_batched_tokens), num_seqs
    )
    return profile.replace(**values)


def _capacity(profile: Profile, device_type: str, env, capacity: tuple[int, str] | None) -> tuple[int | None, str]:
    """(bytes, description) the device check uses; None bytes: the profile's card."""
    if capacity is not None:
        return capacity
    if device_type != "cuda":
        if env is not None and env.host_available_bytes:
            return env.host_available_bytes, "host RAM available now"
        return None, f"profile budget {profile.memory_budget_gib:g} GiB of host RAM"
    if profile.emulate_vram_gib is not None:
        return None, f"emulated {profile.emulate_vram_gib:g} GiB card (torch's allocator cap; context not counted)"
    gpu = env.gpu if env is not None and env.cuda_available else None
    if gpu is not None and gpu.free_bytes is not None:
        # Free memory is read after this process made its own context, which a run would make too.
        available = gpu.free_bytes + (env.cuda_context_bytes or 0)
        if available < profile.memory_budget_gib * GIB:
            return available, f"free on {gpu.name} now"
    return None, f"the profile's {profile.memory_budget_gib:g} GiB card"


def plan_memory(
    config: ModelConfig,
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
    """The memory plan for `num_seqs` sequences of `context_len` tokens. `env`: an
    environment.Environment, whose measured CUDA context and free GPU memory refine the
    device check (None: the profile's card, typical overheads). `capacity`: (bytes,
    description) of the device. `model_dir`: adds its compensation side file's terms."""
    import torch

    notes: list[str] = []
    device_type = device if device not in (None, "auto") else profile.device
    if device_type == "auto":
        device_type = "cpu"
        if env.cuda_available if env is not None else torch.cuda.is_available():
            device_type = "cuda"
        elif profile.device == "auto" and profile.name != "cpu":
            device_type = "cuda"
            notes.append(
                f"no CUDA GPU here: planned for the {profile.memory_budget_gib:g} GiB card of profile "
                f"{profile.name!r}; on this machine the engine would run on the CPU (--device cpu plans that)"
            )
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
    measured = env.cuda_context_bytes if env is not None and is_cuda else None
    context_bytes = (measured or mp.CUDA_CONTEXT_BYTES) if is_cuda else 0
    capacity_bytes, capacity_source = _capacity(planned, device_type, env, capacity)

    def evaluate(profile: Profile, context_len: int, num_seqs: int, config=config, model_dir=model_dir) -> MemoryPlan:
        if profile.dtype == "auto":
            dtype, element_bytes = ("float16", 2) if is_cuda else ("float32", 4)
        else:
            dtype, element_bytes = profile.dtype, 4 if profile.dtype == "float32" else 2
        on_host = mp.keeps_embeddings_on_host(config, profile, device_type)
        weights = mp.weight_bytes_by_kind(config, element_bytes, model_dir=model_dir, is_embedding_on_host=on_host)
        weights.offload = mp.plan_weight_offload(
            config, profile, weights, element_bytes, context_len, device_type=device_type, num_seqs=num_seqs
        )
        pool = mp.size_kv_pool(config, profile, weights.total_bytes, element_bytes, context_len, device_type)
        kv_bytes = num_seqs * mp.kv_pool_bytes(config, context_len, pool.block_size, pool.kv_precision, element_bytes)
        is_emulated = profile.emulate_vram_gib is not None and is_cuda and capacity_bytes is None
        card_gib = profile.emulate_vram_gib if is_emulated else profile.memory_budget_gib
        return MemoryPlan(
            model=model_label,
            architecture=config.architecture,
            profile_name=profile.name,
            device_type=device_type,
            dtype=dtype,
            context_len=context_len,
            num_seqs=num_seqs,
            kv_precision=pool.kv_precision,
            block_size=pool.block_size,
            weights=weights,
            kv_bytes_per_token={p: mp.kv_bytes_per_token(config, p, element_bytes) for p in mp.KV_PRECISIONS},
            kv_bytes=kv_bytes,
            workspace=pool.workspace,
            budget_bytes=pool.budget_bytes,
            cuda_context_bytes=context_bytes,
            is_context_measured=bool(measured),
            device_capacity_bytes=int(card_gib * GIB) if capacity_bytes is None else capacity_bytes,
            device_capacity_source=capacity_source,
            is_context_in_capacity=is_cuda and not is_emulated,
            max_position_embeddings=config.max_position_embeddings,
        )

    plan = evaluate(planned, context_len, num_seqs)
    plan.notes = notes
    if plan.weights.weight_format == "fp16" and profile.weight_format == "awq":
        notes.append(
            "the profile asks for weight_format awq but the checkpoint is not AWQ: weights are planned as "
            "stored; quantize it (AutoAWQ GEMM layout) to get the INT4 sizes"
        )
    if is_cuda and profile.kv_backend in ("um", "pinned", "auto") and profile.host_spill_gib > 0:
        tokens = int(profile.host_spill_gib * GIB) // plan.kv_bytes_per_token[plan.kv_precision]
        notes.append(
            f"kv_backend {profile.kv_backend}: up to {profile.host_spill_gib:g} GiB more KV (about {tokens} "
            "tokens) can wait in host RAM beyond the device share; the verdict asks the device to hold "
            "every planned sequence"
        )
        element_bytes = 4 if plan.dtype == "float32" else 2
        pool = mp.size_kv_pool(config, planned, plan.weights.total_bytes, element_bytes, context_len, device_type)
        blocks_per_seq = -(-context_len // pool.block_size)
        host_blocks = mp.host_kv_blocks(config, planned, element_bytes, device_type)
        if pool.num_blocks < blocks_per_seq <= pool.num_blocks + host_blocks:
            on_host = (blocks_per_seq - pool.num_blocks) * pool.block_size
            notes.append(
                f"with unified memory (kv_backend um, or auto where the GPU offers it) the engine still "
                f"runs a {context_len}-token context: about {on_host} of its tokens wait in host RAM and "
                "each step reads them over the bus, so long-context steps are slower; a pinned pool cannot"
            )
    if plan.weights.offload is not None:
        notes.append(f"weight offload ({plan.weights.offload.strategy}): {plan.weights.offload.summary()}")
    if not plan.workspace.uses_kernels and is_cuda:
        notes.append(
            "the plain-torch attention path runs here (no Triton, or a head_dim that is not a power of two): "
            "its float32 scores grow with context x max_num_batched_tokens"
        )
    for precision in mp.KV_PRECISIONS:

        def fits(n: int) -> bool:
            return evaluate(_variant(planned, n, num_seqs, kv_precision=precision), n, num_seqs).fits

        plan.max_context[precision] = mp.longest_fitting(fits, limit, planned.kv_block_size)
    plan.recommendations = recommend(evaluate, config, planned, plan, capacity_bytes)
    return plan


def recommend(evaluate, config: ModelConfig, profile: Profile, plan: MemoryPlan, capacity: int | None) -> list:
    """Profile changes ranked by the device memory they free (or the budget they add).
    `evaluate(profile, context_len, num_seqs, config=, model_dir=)`: plan_memory's; `capacity`:
    the device's bytes where known."""
    n, b = plan.context_len, plan.num_seqs
    found: list[Recommendation] = []

    def variant(context_len: int = n, num_seqs: int = b, **changes) -> MemoryPlan:
        return evaluate(_variant(profile, context_len, num_seqs, **changes), context_len, num_seqs)

    def consider(field_name: str, value, fit: MemoryPlan, note: str, freed: int | None = None) -> None:
        freed = plan.device_need_bytes - fit.device_need_bytes if freed is None else freed
        if freed >= MIN_USEFUL_FREED_BYTES:
            found.append(Recommendation(field_name, value, int(freed), fit.fits, note))

    for precision in mp.KV_PRECISIONS[mp.KV_PRECISIONS.index(plan.kv_precision) + 1 :]:
        note = "INT8 KV is near lossless" if precision == "int8" else "INT4 KV costs a little quality"
        consider("kv_precision", precision, variant(kv_precision=precision), note)
    tokens, best = profile.max_num_batched_tokens // 2, None
    while tokens >= max(MIN_RECOMMENDED_BATCHED_TOKENS, b):
        best = (tokens, variant(max_num_batched_tokens=tokens))
        if best[1].fits:
            break
        tokens //= 2
    if best is not None:
        consider("max_num_batched_tokens", *best, "longer prompts take more, smaller prefill steps")
    fitting_len = plan.max_context.get(plan.kv_precision, 0)
    if 0 < fitting_len < n:
        consider("max_model_len", fitting_len, variant(fitting_len), "the longest context that fits as planned")
    for seqs in range(b - 1, 0, -1):
        fit = variant(num_seqs=seqs)
        if fit.fits or seqs == 1:
            consider("max_num_seqs", seqs, fit, "fewer sequences decode together")
            break
    if plan.weights.weight_format == "fp16":
        awq = dataclasses.replace(config, quantization=AwqConfig(group_size=AWQ_DEFAULT_GROUP_SIZE))
        fit = evaluate(_variant(profile, n, b, weight_format="awq"), n, b, config=awq, model_dir=None)
        consider("weight_format", "awq", fit, "needs an AWQ INT4 checkpoint (AutoAWQ GEMM layout, group size 128)")
    if plan.dtype == "float32" and plan.device_type == "cpu":
        note = "halves weights and KV; slower on CPUs without BF16 instructions"
        consider("dtype", "bfloat16", variant(dtype="bfloat16"), note)
    over_budget = plan.engine_need_bytes > plan.budget_bytes
    if over_budget and capacity is not None:
        # The device (host RAM, or a GPU larger than the profile's card) has room the budget does not allow.
        budget_gib = -(-plan.engine_need_bytes * 4 // int(profile.memory_utilization * GIB)) / 4
        if budget_gib * GIB <= capacity:
            fit = variant(memory_budget_gib=budget_gib)
            note = f"this device has {format_size(capacity)} available"
            consider("memory_budget_gib", budget_gib, fit, note, freed=fit.budget_bytes - plan.budget_bytes)
    if over_budget and profile.memory_utilization < 0.98:
        utilization = min(0.98, -(-plan.engine_need_bytes * 100 // int(profile.memory_budget_gib * GIB)) / 100)
        if utilization > profile.memory_utilization:
            fit = variant(memory_utilization=utilization)
            note = "less headroom for other programs"
            consider("memory_utilization", utilization, fit, note, freed=fit.budget_bytes - plan.budget_bytes)
    return sorted(found, key=lambda r: (-r.freed_bytes, r.field))


def explain_oom_input(data: bytes, source: str) -> oom.OomExplanation:
    """What the evidence in `data` says, and for a crash report the plan of its run."""
    explanation = oom.read_oom_input(data, source)
    report = explanation.report
    if report is None:
        return explanation
    raw, memory = report.model.get("config"), report.memory
    if not isinstance(raw, dict) or not report.profile:
        return explanation
    path = report.model.get("path")
    try:
        profile = profile_from_dict(dict(report.profile), "the crash report's profile")
        capacity = None
        if isinstance(memory.get("device_total_bytes"), int) and profile.emulate_vram_gib is None:
            capacity = (memory["device_total_bytes"], f"{memory.get('device_name', 'the GPU')} (whole card)")
        explanation.plan = plan = plan_memory(
            model_config_from_dict(raw, "the crash report's model config"),
            profile,
            context_len=memory.get("max_model_len") if isinstance(memory.get("max_model_len"), int) else None,
            # A report without a device type comes from a CUDA out-of-memory error.
            device=memory.get("device_type") if memory.get("device_type") in ("cuda", "cpu") else "cuda",
            model_label=str(path or "model of the crash report"),
            capacity=capacity,
            model_dir=Path(path) if path and Path(path).is_dir() else None,
        )
    except LowvramError as exc:
        explanation.plan_error = str(exc)
        return explanation
    need = f"{oom.gib(plan.device_need_bytes)} of {oom.gib(plan.device_capacity_bytes)}"
    if not plan.fits and plan.recommendations:
        top = plan.recommendations[0]
        what = (
            f"For this profile and model the plan needs {need}; the change that frees the most is "
            f"`{top.setting}` ({oom.gib(top.freed_bytes)})."
        )
        explanation.findings.append(oom.Finding(what, top.setting))
    elif plan.fits:
        what = (
            f"The plan for this profile and model fits ({need}), so the run used memory the plan does not count: "
            "other processes, fragmentation, or a path the plan misses (see above)."
        )
        change = "the changes above; if none applies, report it with this crash report"
        explanation.findings.append(oom.Finding(what, change))
    return explanation


def _read_oom_source(source: str) -> tuple[bytes, str]:
    if source == "-":
        return sys.stdin.buffer.read(), "stdin"
    path = Path(source).expanduser()
    try:
        is_file = path.is_file()
    except OSError:  # longer than a file name can be: the message itself
        is_file = False
    if not is_file:
        if any(c.isspace() for c in source.strip()) or "memory" in source.lower():
            return source.encode(), "the text given"
        raise ConfigError(
            f"--oom {source}: no such file; pass the error message in quotes, the file holding it, a crash report "
            "(crash-*.json) or a memory snapshot, or '-' to read stdin"
        )
    try:
        return path.read_bytes(), str(path)
    except OSError as exc:
        raise ConfigError(f"--oom {source}: cannot read it ({exc})") from None


def cmd_doctor(args) -> int:
    from rich.console import Console

    console = None if args.json else Console(width=max(120, Console().width), highlight=False)
    if args.oom is not None:
        explanation = explain_oom_input(*_read_oom_source(args.oom))
        if console is None:
            print(json.dumps(explanation.to_json(), indent=2, default=str))
        else:
            render_oom(console, explanation)
        return 0
    from lowvram.memory.environment import find_problems, probe_environment

    if args.context is not None and args.context < 1:
        raise ConfigError(f"--context {args.context}: the context to plan for is a positive number of tokens")
    profile = load_profile(args.profile)
    env = probe_environment(test_triton=not args.quick, measure_context=not args.quick)
    # Problems concern the device a run would really use here, not the card a plan is for.
    run_device = args.device if args.device not in (None, "auto") else profile.device
    if run_device == "auto":
        run_device = "cuda" if env.cuda_available else "cpu"
    problems = find_problems(env, profile, run_device)
    if console is not None:
        render_environment(console, env, problems)
    try:
        config, label, model_dir = load_plan_inputs(args.model)
    except ModelLoadError:
        if console is not None:
            console.print()
        raise
    plan = plan_memory(
        config,
        profile,
        context_len=args.context,
        num_seqs=args.batch,
        device=args.device,
        env=env,
        model_label=label,
        model_dir=model_dir,
    )
    if console is None:
        data = {"environment": dataclasses.asdict(env), "problems": [dataclasses.asdict(p) for p in problems]}
        print(json.dumps(data | {"plan": plan.to_json()}, indent=2, default=str))
    else:
        console.print()
        render_plan(console, plan)
    return 0 if plan.fits and not any(p.severity == "error" for p in problems) else 1
