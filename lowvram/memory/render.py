"""What `lowvram doctor` prints: the environment, a memory plan, out-of-memory evidence."""

from __future__ import annotations

from lowvram.memory.oom import OomExplanation
from lowvram.memory.plan import FRAGMENTATION_RESERVE_FRACTION, GIB, MIB, WeightBytes

# Recommendations are shown when the plan does not fit or is this close to the edge.
TIGHT_MARGIN_FRACTION = 0.05


def format_size(num_bytes: int | None) -> str:
    if num_bytes is None:
        return "?"
    sign, value = "-" if num_bytes < 0 else "", abs(num_bytes)
    if value >= GIB:
        return f"{sign}{value / GIB:.2f} GiB"
    if value >= MIB:
        return f"{sign}{value / MIB:.1f} MiB"
    return f"{sign}{value / 1024:.1f} KiB" if value >= 1024 else f"{sign}{value} B"


def weight_rows(weights: WeightBytes) -> list[tuple[str, int]]:
    """(label, bytes) of every kind of weight present, then what host memory takes off the device."""
    rows = []
    if weights.num_int4_layers:
        rows.append((f"INT4 layers ({weights.num_int4_layers})", weights.int4_bytes))
    if weights.num_fp16_layers:
        kept = "FP16-kept layers" if weights.weight_format == "awq" else "linear layers"
        rows.append((f"{kept} ({weights.num_fp16_layers})", weights.fp16_linear_bytes))
    if weights.compensation_bytes:
        rows.append(("compensation terms", weights.compensation_bytes))
    rows.append(("embeddings", weights.embedding_bytes))
    offload = weights.offload
    if weights.is_embedding_on_host and offload is None:
        rows.append(("embeddings held in host memory (embeddings_on_host)", -weights.embedding_bytes))
    if weights.head_bytes:
        rows.append(("lm head", weights.head_bytes))
    rows.append(("norms", weights.norm_bytes))
    if offload is not None:
        where = f"{offload.num_streamed_layers} of {offload.num_layers} layers stream"
        where += ", embeddings" if offload.is_embedding_on_host else ""
        rows.append((f"held in host memory ({where})", -offload.host_weight_bytes))
        if offload.staging_bytes:
            staging = f"staging buffers ({offload.num_staging_buffers} x largest streamed layer)"
            rows.append((staging, offload.staging_bytes))
    if weights.host_expert_bytes:
        cached = f"{weights.num_cached_experts} of {weights.num_routed_experts} per layer cached on the device"
        rows.append((f"routed experts held in host memory ({cached})", -weights.host_expert_bytes))
    return rows


def _table(title: str, *columns: str, **kwargs):
    """A rich table; a column named "<name>>" is right-aligned."""
    from rich.table import Table

    table = Table(title=title, title_justify="left", **kwargs)
    for column in columns:
        table.add_column(column.rstrip(">"), justify="right" if column.endswith(">") else "left")
    return table


def render_environment(console, env, problems) -> None:
    table = _table("environment", "item", "value", show_header=False)
    table.columns[0].style = "bold"
    row = table.add_row
    row("platform", f"{env.platform}{' (WSL2)' if env.is_wsl else ''}, Python {env.python_version}")
    runtime = f"CUDA {env.torch_cuda_version}" if env.torch_cuda_version else None
    runtime = runtime or (f"HIP {env.torch_hip_version}" if env.torch_hip_version else "CPU-only build")
    row("torch", f"{env.torch_version} ({runtime})")
    row(
        "driver",
        f"{env.driver_version} (supports CUDA {env.driver_cuda_version})" if env.driver_version else "not found",
    )
    if not env.gpus:
        row("GPU", "none visible to torch")
    answer = {True: "yes", False: "no", None: "unknown"}
    for gpu in env.gpus:
        row(f"GPU {gpu.index}", f"{gpu.name}, compute capability {gpu.sm}, {gpu.num_multiprocessors or '?'} SMs")
        row("  memory", f"{format_size(gpu.total_bytes)} total, {format_size(gpu.free_bytes)} free")
        # Managed memory larger than the card works only with concurrent managed access.
        concurrent = gpu.concurrent_managed_access
        oversubscription = {True: "possible", False: "not possible", None: "unknown"}[concurrent]
        access = f"concurrent access {answer[concurrent]}, pageable access {answer[gpu.pageable_memory_access]}"
        row("  managed memory", f"{access}, oversubscription {oversubscription} ({gpu.managed_source})")
    if env.cuda_context_bytes:
        row("CUDA context", f"{format_size(env.cuda_context_bytes)} (measured)")
    row("Triton", f"{env.triton_version or 'not installed'}: kernels {env.triton_status}")
    row("cuda-bindings", "installed" if env.has_cuda_bindings else "not installed")
    host = f"{format_size(env.host_total_bytes)} total, {format_size(env.host_available_bytes)} available"
    row("host RAM", f"{host}, swap {format_size(env.swap_free_bytes)} free")
    if env.memlock_known:
        limit = "unlimited" if env.memlock_soft_bytes is None else f"{format_size(env.memlock_soft_bytes)} (ulimit -l)"
        row("pinned-memory limit", limit)
    console.print(table)
    for note in env.notes:
        console.print(f"[dim]note: {note}[/dim]")
    if not problems:
        console.print("[green]no problems found[/green]")
    colors = {"error": "red", "warning": "yellow", "info": "cyan"}
    for problem in problems:
        console.print(f"[{colors[problem.severity]}]{problem.severity}[/]: {problem.message}")
        console.print(f"  fix: {problem.fix}")


def render_plan(console, plan) -> None:
    """The table of a doctor.MemoryPlan, its verdict, notes and recommendations."""
    from rich.markup import escape

    seqs = f"{plan.num_seqs} sequence{'s' if plan.num_seqs != 1 else ''}"
    title = (
        f"memory plan: {plan.model} ({plan.architecture}) on profile {plan.profile_name} "
        f"({plan.device_type}, {plan.dtype}), context {plan.context_len} x {seqs}, KV {plan.kv_precision}"
    )
    table = _table(escape(title), "item", "size>", "detail")
    row = table.add_row
    for label, size in weight_rows(plan.weights):
        detail = plan.dtype
        if label.startswith("INT4"):
            detail = f"AWQ GEMM, group size {plan.weights.awq_group_size}"
        elif label.startswith("compensation"):
            detail = f"{plan.dtype} low-rank and bias-correction terms"
        row(f"weights: {label}", format_size(size), detail)
    row("[bold]weights total[/bold]", f"[bold]{format_size(plan.weights.total_bytes)}[/bold]", "")
    per_token = " · ".join(f"{p} {format_size(b)}" for p, b in plan.kv_bytes_per_token.items())
    row("KV per token", format_size(plan.kv_bytes_per_token[plan.kv_precision]), per_token)
    pages = plan.num_seqs * -(-plan.context_len // plan.block_size)
    kv_detail = f"{pages} pages of {plan.block_size} tokens, {plan.kv_precision}"
    row(f"KV cache ({plan.context_len} tokens x {plan.num_seqs})", format_size(plan.kv_bytes), kv_detail)
    ws = plan.workspace
    path = "Triton attention" if ws.uses_kernels else "plain-torch attention"
    graphs = f"; decode CUDA graphs {format_size(ws.graph_bytes)}" if ws.graph_bytes else ""
    graphs += f"; cuBLAS workspace {format_size(ws.cublas_bytes)}" if ws.cublas_bytes else ""
    detail = f"{ws.num_tokens}-token step, {path}; RoPE tables {format_size(ws.rope_bytes)}{graphs}"
    row(f"workspace (peak: {ws.peak_phase})", format_size(ws.peak_bytes), detail)
    budget = f"engine budget {format_size(plan.budget_bytes)}"
    row("[bold]engine total[/bold]", f"[bold]{format_size(plan.engine_need_bytes)}[/bold]", budget)
    if plan.device_type == "cuda" and plan.is_context_in_capacity:
        measured = "measured here" if plan.is_context_measured else "typical, not measured"
        row("CUDA context", format_size(plan.cuda_context_bytes), measured)
    reserve = f"fragmentation reserve ({FRAGMENTATION_RESERVE_FRACTION:.0%})"
    row(reserve, format_size(plan.fragmentation_bytes), "of KV + workspace")
    capacity = f"capacity {format_size(plan.device_capacity_bytes)}: {plan.device_capacity_source}"
    row("[bold]device total[/bold]", f"[bold]{format_size(plan.device_need_bytes)}[/bold]", capacity)
    console.print(table)
    if plan.fits:
        console.print(
            f"[bold green]verdict: fits[/bold green], {format_size(plan.margin_bytes)} to spare "
            f"(engine budget {format_size(plan.engine_margin_bytes)}, device {format_size(plan.device_margin_bytes)})"
        )
    else:
        over = {"the engine budget": plan.engine_margin_bytes, "the device": plan.device_margin_bytes}
        short = " and ".join(f"{what} by {format_size(-margin)}" for what, margin in over.items() if margin < 0)
        console.print(f"[bold red]verdict: does not fit[/bold red]: over {short}")
    contexts = " · ".join(
        f"{p} {n or 'none'}{' (model limit)' if n == plan.max_position_embeddings else ''}"
        for p, n in plan.max_context.items()
    )
    console.print(f"largest context that fits ({plan.num_seqs} x): {contexts}")
    for note in plan.notes:
        console.print(f"[dim]note: {note}[/dim]")
    tight = plan.margin_bytes < TIGHT_MARGIN_FRACTION * plan.device_capacity_bytes
    if plan.recommendations and (not plan.fits or tight):
        rec = _table("recommendations, ranked by memory freed", "#>", "profile change", "frees>", "fits alone", "note")
        for i, r in enumerate(plan.recommendations, 1):
            rec.add_row(str(i), r.setting, format_size(r.freed_bytes), "yes" if r.is_sufficient else "no", r.note)
        console.print(rec)
    elif plan.fits:
        console.print("no change needed")


def render_oom(console, explanation: OomExplanation) -> None:
    titles = {"message": "out-of-memory message", "crash_report": "lowvram crash report"}
    console.print(f"[bold]{titles.get(explanation.kind, 'torch memory snapshot')}[/bold]")
    if explanation.report is not None and explanation.report.command:
        console.print(f"command: {explanation.report.command}")
    for i, finding in enumerate(explanation.findings, 1):
        console.print(f"{i}. {finding.what}")
        if finding.change:
            console.print(f"   [bold]change:[/bold] {finding.change}")
    summary = explanation.snapshot
    if summary is not None and summary.sites:
        table = _table("largest live allocations by call site", "where", "kind", "blocks>", "size>")
        for site in summary.sites:
            table.add_row(site.where, site.category, str(site.num_blocks), format_size(site.num_bytes))
        console.print(table)
    if explanation.plan is not None:
        render_plan(console, explanation.plan)
    elif explanation.plan_error:
        console.print(f"[dim]no plan: {explanation.plan_error}[/dim]")
