"""Out-of-memory evidence in plain words: torch's messages of any version, lowvram crash
reports and torch memory snapshots (docs/doctor.md lists the forms). Sizes are binary."""

from __future__ import annotations

import dataclasses
import io
import json
import pickle
import re
from dataclasses import dataclass, field

from lowvram.errors import ConfigError

GIB = 2**30
MIB = 2**20

_UNITS = {"b": 1, "byte": 1, "bytes": 1} | {
    prefix + suffix: 2 ** (10 * power) for power, prefix in enumerate("kmgt", 1) for suffix in ("ib", "b")
}
SIZE = r"(\d+(?:\.\d+)?)\s*(bytes|byte|B|KiB|MiB|GiB|TiB|KB|MB|GB|TB)\b"
_SIZE_RE = re.compile(SIZE, re.IGNORECASE)

# Unallocated-but-reserved memory counts as fragmentation past this share of reserved memory.
FRAGMENTATION_SHARE = 0.10
# Other processes matter past this share of the card.
OTHER_PROCESS_SHARE = 0.05
# A CUDA context plus cuBLAS rarely exceeds this; more outside torch means something else.
TYPICAL_NON_TORCH_BYTES = 1 * GIB


def parse_size(number: str, unit: str) -> int:
    return int(round(float(number) * _UNITS[unit.lower()]))


def _sizes(pattern: str, text: str, flags: int = re.IGNORECASE) -> list[int] | None:
    """The sizes `{SIZE}` slots of `pattern` match in `text` (other groups come first)."""
    match = re.search(pattern.replace("{SIZE}", SIZE), text, flags)
    if match is None:
        return None
    groups = match.groups()
    first = len(groups) - 2 * pattern.count("{SIZE}")
    return [parse_size(groups[i], groups[i + 1]) for i in range(first, len(groups), 2)]


@dataclass
class OomFacts:
    """Numbers from one out-of-memory message; None where the message has none."""

    source: str  # "torch<2.1", "torch>=2.1", "mps", "driver" or "lowvram-plan"
    backend: str = "CUDA"  # CUDA, HIP, XPU, MPS
    exception_type: str | None = None
    requested_bytes: int | None = None
    device_index: int | None = None
    total_bytes: int | None = None
    free_bytes: int | None = None
    allowed_bytes: int | None = None
    process_bytes: int | None = None  # this process, PyTorch and not
    allocated_bytes: int | None = None
    private_pool_bytes: int | None = None
    reserved_unallocated_bytes: int | None = None
    other_processes: list[tuple[int, int]] = field(default_factory=list)  # (pid, bytes)
    plan: dict[str, float] = field(default_factory=dict)  # lowvram-plan numbers in bytes, and context_len

    @property
    def reserved_bytes(self) -> int | None:
        if self.allocated_bytes is None or self.reserved_unallocated_bytes is None:
            return None
        return self.allocated_bytes + self.reserved_unallocated_bytes

    @property
    def non_torch_bytes(self) -> int | None:
        """This process's device memory outside PyTorch's allocator (context, cuBLAS, managed pages)."""
        if self.process_bytes is None or self.reserved_bytes is None:
            return None
        return max(0, self.process_bytes - self.reserved_bytes)

    @property
    def other_process_bytes(self) -> int | None:
        if self.other_processes:
            return sum(size for _, size in self.other_processes)
        if None not in (self.total_bytes, self.free_bytes, self.process_bytes):
            return max(0, self.total_bytes - self.free_bytes - self.process_bytes)
        return None


_PLAN = (
    r"an? (\d+)-token context does not fit: weights {SIZE} \+ workspace {SIZE} \+ KV {SIZE} = {SIZE} > budget {SIZE}"
)
_MPS = (
    r"MPS backend out of memory \(MPS allocated: {SIZE}, other allocations: {SIZE}, max allowed: {SIZE}\)\. "
    r"Tried to allocate {SIZE}"
)
_DRIVER = (
    r"(CUDA error: out of memory|CUDA driver error: out of memory|CUBLAS_STATUS_ALLOC_FAILED|"
    r"cudaErrorMemoryAllocation|HIP error: out of memory|hipErrorOutOfMemory|CUDA out of memory)"
)
# torch 1.x: "3.82 GiB total capacity; 2.71 GiB already allocated; 13.31 MiB free; [2.00 GiB
# allowed;] 2.84 GiB reserved in total by PyTorch" (or "cached"): label start -> field
_V1_LABELS = {
    "total capacity": "total_bytes",
    "already allocated": "allocated_bytes",
    "free": "free_bytes",
    "allowed": "allowed_bytes",
    "reserved": "reserved",
    "cached": "reserved",
}
# torch 2.1+ (2.1 spelled it "capacty"): field -> pattern of its one size
_V2_SIZES = {
    "process_bytes": r"this process has\s*{SIZE}",
    "allowed_bytes": r"{SIZE}\s*allowed;",
    "allocated_bytes": r"Of the allocated memory\s*{SIZE}",
    "private_pool_bytes": r"with {SIZE} allocated in private pools",
    "reserved_unallocated_bytes": r"{SIZE}\s*is reserved by PyTorch but unallocated",
}


def parse_oom_message(text: str) -> OomFacts | None:
    """Facts from an out-of-memory message; None if the text holds none."""
    flat = re.sub(r"\s+", " ", text.replace("\r", " ")).strip()
    exc_type = re.search(r"((?:torch\.(?:cuda\.)?)?OutOfMemoryError|RuntimeError|lowvram: error)\s*:", flat)
    exc_type = exc_type.group(1) if exc_type else None
    plan = _sizes(_PLAN, flat, 0)
    if plan:
        names = ("weight_bytes", "workspace_bytes", "kv_bytes", "need_bytes", "budget_bytes")
        numbers = {"context_len": int(re.search(r"(\d+)-token context does not fit", flat).group(1))}
        numbers |= dict(zip(names, plan))
        return OomFacts(
            "lowvram-plan", exception_type=exc_type, plan=numbers, requested_bytes=plan[3], total_bytes=plan[4]
        )
    mps = _sizes(_MPS, flat)
    if mps:
        allocated, other, allowed, requested = mps
        facts = OomFacts("mps", "MPS", exc_type, requested, total_bytes=allowed, allowed_bytes=allowed)
        facts.allocated_bytes, facts.process_bytes, facts.reserved_unallocated_bytes = allocated, allocated + other, 0
        return facts
    head = re.search(rf"\b(CUDA|HIP|XPU)\b out of memory\. Tried to allocate {SIZE}", flat, re.IGNORECASE)
    if head:
        requested = parse_size(head.group(2), head.group(3))
        facts = OomFacts("torch>=2.1", head.group(1).upper(), exc_type, requested_bytes=requested)
        rest = flat[head.end() :]
        old = re.match(r"\s*\(GPU (\d+); ([^)]*)\)", rest)
        if old:
            facts.source, facts.device_index, values = "torch<2.1", int(old.group(1)), {}
            for piece in old.group(2).split(";"):
                size = _SIZE_RE.search(piece)
                label = piece[size.end() :].strip().lower() if size else ""
                name = next((name for start, name in _V1_LABELS.items() if label.startswith(start)), None)
                if name is not None:
                    values[name] = parse_size(size.group(1), size.group(2))
            reserved = values.pop("reserved", None)
            facts = dataclasses.replace(facts, **values)
            if reserved is not None and facts.allocated_bytes is not None:
                facts.reserved_unallocated_bytes = max(0, reserved - facts.allocated_bytes)
            return facts
        capacity = re.search(rf"GPU (\d+) has a total capac\w* of {SIZE} of which {SIZE} is free", rest, re.IGNORECASE)
        if capacity:
            facts.device_index = int(capacity.group(1))
            facts.total_bytes, facts.free_bytes = parse_size(*capacity.group(2, 3)), parse_size(*capacity.group(4, 5))
        for name, pattern in _V2_SIZES.items():
            setattr(facts, name, (_sizes(pattern, rest) or [None])[0])
        for pid, number, unit in re.findall(rf"Process (\d+) has {SIZE} memory in use", rest, re.IGNORECASE):
            facts.other_processes.append((int(pid), parse_size(number, unit)))
        if facts.process_bytes is None and len(facts.other_processes) == 1 and facts.reserved_bytes is not None:
            # In a container NVML reports host PIDs, so torch prints its own process as "Process N";
            # one process holding at least what torch reserved is this one.
            pid, size = facts.other_processes[0]
            if size >= facts.reserved_bytes:
                facts.process_bytes, facts.other_processes = size, []
        return facts
    driver = re.search(_DRIVER, flat, re.IGNORECASE)
    if driver:
        return OomFacts("driver", "HIP" if "hip" in driver.group(1).lower() else "CUDA", exc_type)
    return None


@dataclass
class Finding:
    """One plain-words statement: what happened, and what to change (may be empty)."""

    what: str
    change: str = ""


def gib(num_bytes: float | None) -> str:
    if num_bytes is None:
        return "?"
    return f"{num_bytes / MIB:.0f} MiB" if abs(num_bytes) < GIB else f"{num_bytes / GIB:.2f} GiB"


def explain_oom(facts: OomFacts) -> list[Finding]:
    """What held the memory and what to change, from a message's numbers alone."""
    if facts.source == "lowvram-plan":
        p = facts.plan
        refused = (
            f"lowvram refused to start: a {int(p['context_len'])}-token context needs {gib(p['need_bytes'])} "
            f"(weights {gib(p['weight_bytes'])}, workspace {gib(p['workspace_bytes'])}, KV "
            f"{gib(p['kv_bytes'])}) but the profile's budget is {gib(p['budget_bytes'])}."
        )
        return [
            Finding(refused),
            Finding(
                "Nothing ran out of memory on the device: the plan was checked before loading anything.",
                "run `lowvram doctor --model M --profile P --context N` for the largest context that fits and "
                "ranked changes (kv_precision: int8, a smaller max_model_len or max_num_batched_tokens)",
            ),
        ]
    if facts.source == "driver":
        what = (
            f"The {facts.backend} driver or a library (cuBLAS) could not allocate memory outside PyTorch's "
            "allocator; the message carries no numbers. This happens when the CUDA context or cuBLAS workspace "
            "is created on a card that is already full, or when unified-memory pages oversubscribe a card that "
            "cannot page."
        )
        change = (
            "free device memory before the run (other processes: nvidia-smi), lower max_num_batched_tokens, "
            "or set kv_backend: pinned"
        )
        return [Finding(what, change)]
    requested, total, free, allowed = facts.requested_bytes, facts.total_bytes, facts.free_bytes, facts.allowed_bytes
    where = f"GPU {facts.device_index}" if facts.device_index is not None else "the device"
    of_total = f"; only {gib(free)} was free of {gib(total)}" if free is not None else ""
    cap = f" (this process was capped at {gib(allowed)})" if allowed else ""
    findings = [Finding(f"PyTorch asked for {gib(requested)} more on {where}{of_total}{cap}.")]
    others, outside = facts.other_process_bytes, facts.non_torch_bytes
    held = [
        text.format(gib(value))
        for value, text in (
            (facts.allocated_bytes, "live PyTorch tensors {}"),
            (facts.private_pool_bytes or None, "of which CUDA-graph pools {}"),
            (facts.reserved_unallocated_bytes, "cached by PyTorch but unused {}"),
            (outside, "outside PyTorch in this process {} (CUDA context, cuBLAS, unified-memory pages)"),
            (others, "other processes {}"),
        )
        if value is not None
    ]
    if held:
        findings.append(Finding("Memory was held by: " + "; ".join(held) + "."))
    causes = []
    limit = allowed or total
    if requested is not None and limit is not None and requested > limit:
        what = (
            f"This single allocation ({gib(requested)}) is larger than everything the process may use "
            f"({gib(limit)}): no allocator setting helps, the tensor's shape must shrink."
        )
        change = (
            "lower max_num_batched_tokens (prefill chunk) and max_model_len; with the plain-torch attention path "
            "a prefill chunk allocates float32 scores of heads x chunk x context"
        )
        causes.append(Finding(what, change))
    elif None not in (allowed, free, requested) and facts.source != "mps" and free > requested:
        what = (
            f"The card still had {gib(free)} free: the process's own cap of {gib(allowed)} "
            "(torch.cuda.set_per_process_memory_fraction, which lowvram's emulate_vram_gib sets) stopped it."
        )
        change = (
            "plan for the cap (`lowvram doctor --profile P` with emulate_vram_gib set) or raise emulate_vram_gib "
            f"above {allowed / GIB:.1f}"
        )
        causes.append(Finding(what, change))
    unallocated, reserved = facts.reserved_unallocated_bytes, facts.reserved_bytes
    if (
        None not in (unallocated, requested)
        and reserved
        and unallocated >= max(requested, FRAGMENTATION_SHARE * reserved)
    ):
        what = (
            f"PyTorch held {gib(unallocated)} cached but unused, more than the request: the cache was fragmented "
            "into pieces too small for it."
        )
        alloc_conf = "PYTORCH_HIP_ALLOC_CONF" if facts.backend == "HIP" else "PYTORCH_CUDA_ALLOC_CONF"
        causes.append(Finding(what, f"export {alloc_conf}=expandable_segments:True"))
    if others is not None and total and others >= OTHER_PROCESS_SHARE * total:
        budget = max(0.25, (total - others) / GIB * 0.95)
        change = f"close them (nvidia-smi lists them), or plan for what is left: memory_budget_gib: {budget:.1f}"
        causes.append(Finding(f"Other processes held {gib(others)} of the card.", change))
    if outside is not None and outside > TYPICAL_NON_TORCH_BYTES:
        what = (
            f"This process held {gib(outside)} outside PyTorch's allocator, more than a CUDA context needs: "
            "unified-memory KV pages or another library's buffers."
        )
        change = "lower host_spill_gib or set kv_backend: pinned; lowvram's pool counts its managed pages itself"
        causes.append(Finding(what, change))
    if not causes:
        what = "Live tensors filled the card: the run needs more memory than the card has."
        change = (
            "kv_precision: int8 (halves the KV cache), a smaller max_model_len or max_num_batched_tokens, or "
            "weight_format: awq; `lowvram doctor --model M --profile P` gives exact values"
        )
        causes.append(Finding(what, change))
    return findings + causes


class _PlainUnpickler(pickle.Unpickler):
    """Snapshots are plain dicts and lists: refuse every class, so a hostile pickle cannot run code."""

    def find_class(self, module, name):
        if (module, name) in (("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset")):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a memory snapshot")


# What a frame's function or file name tells about a block; older snapshots name the files
# lowvram had before its packages (kv_pool.py, sampling.py, model.py).
_CATEGORIES = {
    "weights": ("load_weights", "loader.py"),
    "KV pages": ("allocate_pages", "pool.py", "tiers.py", "kv_pool.py", "managed_memory.py"),
    "logits and sampling": ("compute_logits", "sampler.py", "sampling.py"),
    "attention workspace": ("paged_attention", "attention.py", "_attend"),
    "layer activations": ("dense.py", "model.py"),
}
CATEGORY_ADVICE = {
    "weights": "weight_format: awq (INT4 weights take about a quarter of FP16)",
    "KV pages": "kv_precision: int8 (half the KV bytes) or a smaller max_model_len / max_num_seqs",
    "attention workspace": "a smaller max_num_batched_tokens (the prefill chunk) or max_model_len",
    "layer activations": "a smaller max_num_batched_tokens",
    "logits and sampling": "a smaller max_num_seqs",
}


@dataclass
class SnapshotSite:
    where: str  # "file.py:123 in function"
    category: str
    num_bytes: int
    num_blocks: int


@dataclass
class SnapshotSummary:
    num_segments: int
    reserved_bytes: int
    allocated_bytes: int
    largest_free_bytes: int
    largest_blocks: list[tuple[int, str]]  # (bytes, where), biggest first
    sites: list[SnapshotSite]
    categories: dict[str, int]


def _file_name(frame: dict) -> str:
    return str(frame.get("filename", "")).replace("\\", "/").rsplit("/", 1)[-1]


def _site(frames: list[dict]) -> tuple[str, str]:
    """Where a block was allocated: the innermost Python frame outside torch and Triton
    (frames run innermost first), and the category its frames name."""
    python = [f for f in frames if str(f.get("filename", "")).endswith(".py")]
    ours = [
        f for f in python if not re.search(r"/torch/|/site-packages/triton/", str(f["filename"]).replace("\\", "/"))
    ]
    frame = (ours or python or [None])[0]
    where = (
        f"{_file_name(frame)}:{frame.get('line', '?')} in {frame.get('name', '?')}" if frame else "(no stack recorded)"
    )
    tokens = set()
    for f in frames:
        name, filename = str(f.get("name", "")), _file_name(f)
        tokens.update((name, filename, f"{filename}:{name}"))
    return where, next((kind for kind, markers in _CATEGORIES.items() if tokens.intersection(markers)), "other")


def summarize_snapshot(snapshot: dict) -> SnapshotSummary:
    """Where the memory in a torch memory snapshot went, largest first."""
    reserved = allocated = largest_free = 0
    blocks: list[tuple[int, str]] = []
    sites: dict[str, SnapshotSite] = {}
    categories: dict[str, int] = {}
    for segment in snapshot.get("segments", []):
        reserved += int(segment.get("total_size", 0))
        allocated += int(segment.get("allocated_size", 0))
        for block in segment.get("blocks", []):
            size = int(block.get("size", 0))
            if block.get("state") == "inactive":
                largest_free = max(largest_free, size)
            if block.get("state") != "active_allocated":
                continue
            # torch 2.0 kept the frames per allocation event, in "history"
            frames = block.get("frames") or ((block.get("history") or [{}])[-1].get("frames") or [])
            where, category = _site(frames)
            blocks.append((size, where))
            site = sites.setdefault(where, SnapshotSite(where, category, 0, 0))
            site.num_bytes += size
            site.num_blocks += 1
            categories[category] = categories.get(category, 0) + size
    ranked_sites = sorted(sites.values(), key=lambda s: -s.num_bytes)[:10]
    ranked_categories = dict(sorted(categories.items(), key=lambda kv: -kv[1]))
    largest = sorted(blocks, key=lambda item: -item[0])[:10]
    num_segments = len(snapshot.get("segments", []))
    return SnapshotSummary(num_segments, reserved, allocated, largest_free, largest, ranked_sites, ranked_categories)


def explain_snapshot(summary: SnapshotSummary) -> list[Finding]:
    unallocated = summary.reserved_bytes - summary.allocated_bytes
    findings = [
        Finding(
            f"PyTorch had reserved {gib(summary.reserved_bytes)} in {summary.num_segments} segments; live tensors "
            f"used {gib(summary.allocated_bytes)}, and {gib(unallocated)} sat cached but unused "
            f"(largest free piece {gib(summary.largest_free_bytes)})."
        )
    ]
    if summary.categories:
        parts = [f"{name} {gib(size)}" for name, size in summary.categories.items()]
        findings.append(Finding("Live memory by kind: " + "; ".join(parts) + "."))
        top, top_bytes = next(iter(summary.categories.items()))
        if top in CATEGORY_ADVICE and summary.allocated_bytes:
            share = top_bytes / summary.allocated_bytes
            findings.append(
                Finding(f"{top.capitalize()} held the most ({share:.0%} of live memory).", CATEGORY_ADVICE[top])
            )
    if summary.reserved_bytes and unallocated >= FRAGMENTATION_SHARE * summary.reserved_bytes:
        what = "A large share of the reserved memory was cached but unused: fragmentation."
        findings.append(Finding(what, "export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"))
    return findings


def explain_report(report) -> list[Finding]:
    """What a crash report's exception, memory numbers and controller events say (its plan
    is added by lowvram.memory.doctor)."""
    memory = report.memory
    facts = parse_oom_message(report.exception_text)
    findings = explain_oom(facts) if facts else [Finding(f"The run failed with: {report.exception_text.strip()[:300]}")]
    labels = {"weight_bytes": "weights", "kv_pool_bytes": "KV pool", "workspace_reserve_bytes": "workspace reserve"}
    known = {key: memory[key] for key in (*labels, "budget_bytes") if isinstance(memory.get(key), int)}
    if known:
        parts = [f"{labels.get(key, 'budget')} {gib(value)}" for key, value in known.items()]
        findings.append(Finding("The engine had planned: " + ", ".join(parts) + "."))
    if isinstance(memory.get("kv_blocks_in_use"), int):
        what = (
            f"KV pages at the failure: {memory['kv_blocks_in_use']} in use by requests "
            f"({gib(memory.get('kv_bytes_in_use', 0))}), {memory.get('kv_blocks_cached_reclaimable', 0)} "
            "cached for reuse by later requests; cached pages are reclaimable (evicted on demand), so they "
            "did not cause the failure."
        )
        findings.append(Finding(what))
    planned = sum(value for key, value in known.items() if key in labels)
    allocated = memory.get("peak_allocated_bytes")
    if planned and isinstance(allocated, int) and allocated > planned * 1.05:
        what = (
            f"torch's peak allocation ({gib(allocated)}) exceeded the engine's plan ({gib(planned)}) by "
            f"{gib(allocated - planned)}: something outside the plan allocated (scoring all logits, another "
            "model in the process, or a workspace the plan undercounts)."
        )
        findings.append(Finding(what, "report it with this crash report; meanwhile lower max_num_batched_tokens"))
    if report.controller_events:
        last = ", ".join(json.dumps(e, sort_keys=True) for e in report.controller_events[-3:])
        findings.append(Finding(f"The controller's last actions: {last}."))
    return findings


@dataclass
class OomExplanation:
    """What one piece of evidence says, and what it was read from."""

    kind: str  # "message", "crash_report" or "snapshot"
    findings: list[Finding]
    facts: OomFacts | None = None
    snapshot: SnapshotSummary | None = None
    report: object | None = None  # crash_report.CrashReport
    plan: object | None = None  # doctor.MemoryPlan of a crash report's run
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


def read_oom_input(data: bytes, source: str) -> OomExplanation:
    """Recognise and explain what `data` holds; ConfigError (naming `source`) when it is
    none of an out-of-memory message, a crash report or a memory snapshot."""
    from lowvram.memory.crash_report import CRASH_REPORT_FORMAT, crash_report_from_dict

    snapshot, text = None, data.decode("utf-8", errors="replace")
    if data[:1] == b"\x80":  # pickle protocol 2+
        try:
            snapshot = _PlainUnpickler(io.BytesIO(data)).load()
        except Exception as exc:
            raise ConfigError(f"the memory snapshot could not be read ({type(exc).__name__}: {exc})") from None
        if not isinstance(snapshot, dict) or not isinstance(snapshot.get("segments"), list):
            raise ConfigError(
                "the pickle is not a torch memory snapshot (no 'segments' list); write one with "
                "torch.cuda.memory._dump_snapshot(PATH)"
            )
    elif text.lstrip().startswith("{"):
        try:
            parsed = json.loads(text)
        except json.JSONDecodeError:
            parsed = None
        if isinstance(parsed, dict) and parsed.get("format") == CRASH_REPORT_FORMAT:
            report = crash_report_from_dict(parsed, source)
            facts = parse_oom_message(report.exception_text)
            return OomExplanation("crash_report", explain_report(report), facts=facts, report=report)
        if isinstance(parsed, dict) and isinstance(parsed.get("segments"), list):
            snapshot = parsed
    if snapshot is not None:
        summary = summarize_snapshot(snapshot)
        return OomExplanation("snapshot", explain_snapshot(summary), snapshot=summary)
    facts = parse_oom_message(text)
    if facts is None:
        raise ConfigError(
            f"{source} holds no out-of-memory message, lowvram crash report or torch memory snapshot that lowvram "
            "recognises; pass the full error text (e.g. the line with 'CUDA out of memory. Tried to allocate'), "
            "a crash-*.json report, or a snapshot from torch.cuda.memory._dump_snapshot"
        )
    return OomExplanation("message", explain_oom(facts), facts=facts)
