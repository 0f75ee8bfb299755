"""How much device memory a run needs: the one set of formulas the engine sizes its
KV pool with and `lowvram doctor` prints, so a plan and a run cannot disagree.

Three kinds of memory make up a run:

- weights, counted from config.json alone by kind (INT4 layers, FP16 layers,
  compensation terms, embeddings, head, norms) so the doctor can plan for a
  checkpoint it has not loaded;
- the KV pool, `kv_bytes_per_token` per token at the pool's precision;
- the workspace of one step: the largest set of tensors alive at once while a
  step runs. It is modelled phase by phase from what the running code really
  allocates (see `step_workspace`), because a rule of thumb misses by far: the
  plain-torch attention path materialises float32 scores of
  `[heads, new tokens, context]`, which dwarfs everything else at long contexts.

Outside torch's allocator the device also holds the CUDA context and the
allocator's own slack; `CUDA_CONTEXT_BYTES`, `CUBLAS_WORKSPACE_BYTES` and
`FRAGMENTATION_RESERVE_FRACTION` carry those, and
`scripts/bench_doctor_accuracy.py` measures them on a GPU.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from lowvram.config import Profile
from lowvram.errors import OutOfMemoryError
from lowvram.kernels.w4a16 import DEQUANT_MATMUL_MIN_M
from lowvram.model_config import ModelConfig

GIB = 2**30
MIB = 2**20

KV_PRECISIONS = ("fp16", "int8", "int4")
FP16_BYTES = 2
# Quantized KV rows carry an fp16 scale and an fp16 zero per token and KV head.
KV_SCALE_ZERO_BYTES = 4

# The CUDA context (driver state, the kernel images torch loads lazily, cuBLAS
# handles) lives outside torch's allocator. With lazy module loading (CUDA 11.7+,
# torch's default) it is typically 300-500 MiB; a measured value replaces this
# constant whenever the doctor runs on the GPU itself (environment.measure_cuda_context_bytes).
CUDA_CONTEXT_BYTES = 400 * MIB
# cuBLAS and cuBLASLt workspaces, which torch allocates through its caching
# allocator once per handle and stream: 8 MiB by torch's default
# CUBLAS_WORKSPACE_CONFIG, 32 MiB on Hopper, plus the Lt workspace.
CUBLAS_WORKSPACE_BYTES = 33 * MIB
# Memory the caching allocator holds in blocks too small for the next request,
# as a fraction of the KV pool and workspace (weights are allocated once and
# barely fragment). Calibrate with scripts/bench_doctor_accuracy.py (it prints
# reserved - allocated at the peak).
FRAGMENTATION_RESERVE_FRACTION = 0.10

# Rotary keeps float32 cos and sin tables of [positions, head_dim / 2]; they start
# at this many positions and double when a longer context arrives (model.Rotary).
ROPE_MIN_POSITIONS = 2048
# A top-p / top-k sampling step keeps a few float32 [vocab] tensors plus an int64
# sort order alive per row (sampling.filter_logits); rows are sampled one at a time.
SAMPLING_BYTES_PER_VOCAB_ENTRY = 32
# AWQ layers on the Triton path dequantize the whole weight to fp16 and use cuBLAS
# at this many rows or more.
AWQ_DEQUANT_MATMUL_MIN_TOKENS = DEQUANT_MATMUL_MIN_M
# The plain-torch AWQ path (no Triton) dequantizes in float32 through about five
# [K, N] temporaries (awq_format.dequantize_awq).
AWQ_TORCH_DEQUANT_BYTES_PER_ELEMENT = 20
# The Triton decode kernel splits a context into partitions of at least this many
# tokens, each writing a float32 partial output (kernels/paged_attention).
MIN_DECODE_PARTITION_TOKENS = 128


# ---------------------------------------------------------------- KV cache


def kv_bytes_per_token(config: ModelConfig, precision: str = "fp16", element_bytes: int = FP16_BYTES) -> int:
    """K and V of every layer for one token at a KV precision.

    "fp16" pages hold the compute dtype (`element_bytes`: 2, or 4 for float32 on
    the CPU); "int8" holds one byte per element and "int4" half a byte, each with
    an fp16 scale and zero per token and KV head (kv_quant.KVPages).
    """
    heads = config.num_layers * config.num_kv_heads
    if precision == "fp16":
        return 2 * heads * config.head_dim * element_bytes
    if precision == "int8":
        return 2 * heads * (config.head_dim + KV_SCALE_ZERO_BYTES)
    if precision == "int4":
        return 2 * heads * (config.head_dim // 2 + KV_SCALE_ZERO_BYTES)
    raise ValueError(f"unknown KV precision {precision!r}; expected one of {KV_PRECISIONS}")


def kv_precision_for(profile: Profile) -> str:
    """The precision the engine allocates its pages in: "auto" starts at fp16."""
    return "fp16" if profile.kv_precision == "auto" else profile.kv_precision


def kv_pool_bytes(config: ModelConfig, num_tokens: int, block_size: int, precision: str, element_bytes: int) -> int:
    """Bytes of whole pages holding `num_tokens` tokens."""
    num_blocks = -(-num_tokens // block_size)
    return num_blocks * block_size * kv_bytes_per_token(config, precision, element_bytes)


# ---------------------------------------------------------------- weights


@dataclass(frozen=True)
class LinearShape:
    """One decoder Linear, K inputs -> N outputs, named as in the checkpoint."""

    name: str
    in_features: int
    out_features: int
    has_bias: bool


def decoder_linears(config: ModelConfig) -> list[LinearShape]:
    """Every Linear inside the decoder layers (the ones AWQ quantizes)."""
    h, i = config.hidden_size, config.intermediate_size
    bias = config.has_qkv_bias
    shapes = []
    for layer in range(config.num_layers):
        prefix = f"model.layers.{layer}"
        shapes += [
            LinearShape(f"{prefix}.self_attn.q_proj", h, config.q_size, bias),
            LinearShape(f"{prefix}.self_attn.k_proj", h, config.kv_size, bias),
            LinearShape(f"{prefix}.self_attn.v_proj", h, config.kv_size, bias),
            LinearShape(f"{prefix}.self_attn.o_proj", config.q_size, h, False),
            LinearShape(f"{prefix}.mlp.gate_proj", h, i, False),
            LinearShape(f"{prefix}.mlp.up_proj", h, i, False),
            LinearShape(f"{prefix}.mlp.down_proj", i, h, False),
        ]
    return shapes


@dataclass(frozen=True)
class AwqSettings:
    """The parts of an AWQ quantization config that decide tensor sizes."""

    bits: int
    group_size: int
    modules_to_not_convert: tuple[str, ...]

    def is_quantized(self, linear_name: str) -> bool:
        # AutoAWQ's rule: a layer stays FP16 when any listed fragment occurs in its name.
        return not any(fragment in linear_name for fragment in self.modules_to_not_convert)


def awq_settings(raw_config: dict | None, config: ModelConfig | None = None) -> AwqSettings | None:
    """AWQ settings of a checkpoint: the ModelConfig's parsed quantization (which also
    reads a legacy quant_config.json) when present, else config.json's
    `quantization_config`; None for an unquantized checkpoint."""
    parsed = getattr(config, "quantization", None)
    if parsed is not None:
        return AwqSettings(int(parsed.bits), int(parsed.group_size), tuple(parsed.modules_to_not_convert))
    quant = (raw_config or {}).get("quantization_config")
    if not isinstance(quant, dict) or str(quant.get("quant_method", "")).lower() != "awq":
        return None
    return AwqSettings(
        bits=int(quant.get("bits", quant.get("w_bit", 4))),
        group_size=int(quant.get("group_size", quant.get("q_group_size", 128))),
        modules_to_not_convert=tuple(quant.get("modules_to_not_convert") or ()),
    )


@dataclass(frozen=True)
class Compensation:
    """Residual compensation stored beside INT4 layers: the low-rank rank of each
    layer and the layers that keep a bias correction."""

    ranks: dict[str, int] = field(default_factory=dict)
    bias_corrected: frozenset[str] = frozenset()

    def bytes_of(self, linear: LinearShape, element_bytes: int) -> int:
        """Low-rank A [r, K] and B [N, r] plus a bias correction [N], in the compute dtype
        (the loader converts them like every floating tensor)."""
        rank = self.ranks.get(linear.name, 0)
        correction = linear.out_features if linear.name in self.bias_corrected else 0
        return (rank * (linear.in_features + linear.out_features) + correction) * element_bytes


def _safetensors_shapes(path: Path) -> dict[str, list[int]]:
    """Tensor shapes from a safetensors header (8-byte length, then JSON), without reading data."""
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(length))
    return {name: info["shape"] for name, info in header.items() if name != "__metadata__"}


def compensation_settings(model_dir: str | Path | None) -> Compensation:
    """The compensation `lowvram quantize` stored for a checkpoint: per-layer ranks and
    bias corrections, read from the shapes in its side file (loader.COMPENSATION_FILE).
    A config.json alone (a plan without the directory) has none."""
    if model_dir is None:
        return Compensation()
    from lowvram.awq_linear import BIAS_CORRECTION, LORA_A
    from lowvram.loader import COMPENSATION_FILE

    path = Path(model_dir) / COMPENSATION_FILE
    if not path.is_file():
        return Compensation()
    try:
        shapes = _safetensors_shapes(path)
    except (OSError, ValueError):
        return Compensation()
    ranks = {name[: -len(LORA_A) - 1]: shape[0] for name, shape in shapes.items() if name.endswith("." + LORA_A)}
    corrected = frozenset(name[: -len(BIAS_CORRECTION) - 1] for name in shapes if name.endswith("." + BIAS_CORRECTION))
    return Compensation(ranks, corrected)


def awq_linear_bytes(linear: LinearShape, group_size: int, bias_bytes: int = FP16_BYTES) -> int:
    """AutoAWQ GEMM tensors of one INT4 Linear K -> N: qweight int32 [K, N/8],
    qzeros int32 [K/G, N/8], scales fp16 [K/G, N], bias [N] if any."""
    k, n = linear.in_features, linear.out_features
    num_groups = k // group_size
    qweight = k * (n // 8) * 4
    qzeros = num_groups * (n // 8) * 4
    scales = num_groups * n * FP16_BYTES
    bias = n * bias_bytes if linear.has_bias else 0
    return qweight + qzeros + scales + bias


@dataclass
class WeightBytes:
    """Device bytes of the weights, by kind."""

    weight_format: str  # "fp16" (any unquantized checkpoint) or "awq"
    int4_bytes: int = 0
    fp16_linear_bytes: int = 0
    compensation_bytes: int = 0
    embedding_bytes: int = 0
    head_bytes: int = 0
    norm_bytes: int = 0
    num_int4_layers: int = 0
    num_fp16_layers: int = 0
    # K * N of the largest INT4 layer: the dequantization scratch scales with it.
    max_int4_layer_elements: int = 0
    awq_group_size: int = 0

    @property
    def total_bytes(self) -> int:
        return (self.int4_bytes + self.fp16_linear_bytes + self.compensation_bytes + self.embedding_bytes
                + self.head_bytes + self.norm_bytes)

    def rows(self) -> list[tuple[str, int]]:
        """(label, bytes) for every kind present, in the order a table shows them."""
        rows = []
        if self.num_int4_layers:
            rows.append((f"INT4 layers ({self.num_int4_layers})", self.int4_bytes))
        if self.num_fp16_layers:
            kept = "FP16-kept layers" if self.weight_format == "awq" else "linear layers"
            rows.append((f"{kept} ({self.num_fp16_layers})", self.fp16_linear_bytes))
        if self.compensation_bytes:
            rows.append(("compensation terms", self.compensation_bytes))
        rows.append(("embeddings", self.embedding_bytes))
        if self.head_bytes:
            rows.append(("lm head", self.head_bytes))
        rows.append(("norms", self.norm_bytes))
        return rows


def weight_bytes_by_kind(config: ModelConfig, raw_config: dict | None, element_bytes: int, *,
                         model_dir: str | Path | None = None) -> WeightBytes:
    """Weights on the device, from config.json (and, given the directory, the shapes
    in the compensation side file).

    Floating tensors take `element_bytes` (the compute dtype: 2 on CUDA, 4 for
    float32 on the CPU); AWQ qweight/qzeros stay int32 and scales stay fp16, as the
    loader keeps them. A tied head shares the embedding and costs nothing.
    """
    awq = awq_settings(raw_config, config)
    compensation = compensation_settings(model_dir) if awq else Compensation()
    weights = WeightBytes(weight_format="awq" if awq else "fp16", awq_group_size=awq.group_size if awq else 0)
    for linear in decoder_linears(config):
        k, n = linear.in_features, linear.out_features
        if awq is not None and awq.is_quantized(linear.name):
            weights.int4_bytes += awq_linear_bytes(linear, awq.group_size, element_bytes)
            weights.num_int4_layers += 1
            weights.max_int4_layer_elements = max(weights.max_int4_layer_elements, k * n)
            weights.compensation_bytes += compensation.bytes_of(linear, element_bytes)
        else:
            weights.fp16_linear_bytes += (k * n + (n if linear.has_bias else 0)) * element_bytes
            weights.num_fp16_layers += 1
    table = config.vocab_size * config.hidden_size * element_bytes
    weights.embedding_bytes = table
    weights.head_bytes = 0 if config.is_tied_head else table
    weights.norm_bytes = (2 * config.num_layers + 1) * config.hidden_size * element_bytes
    return weights


# ---------------------------------------------------------------- workspace


def uses_attention_kernels(device_type: str, head_dim: int) -> bool:
    """Whether a step runs the Triton attention kernels (else the plain-torch path).

    Mirrors attention._is_kernel_path: CUDA and a power-of-two head_dim >= 16,
    with Triton importable and not forced off.
    """
    if device_type != "cuda" or head_dim < 16 or head_dim & (head_dim - 1):
        return False
    try:
        from lowvram.kernels import paged_attention
    except Exception:  # planning must not fail where the kernels cannot even be imported
        return False
    return bool(getattr(paged_attention, "HAS_TRITON", False)) and not getattr(paged_attention, "FORCE_REFERENCE", False)


def rope_table_bytes(config: ModelConfig, context_len: int) -> int:
    """Rotary's float32 cos and sin tables once they cover `context_len` positions."""
    positions = ROPE_MIN_POSITIONS
    while positions < context_len:
        positions *= 2
    return 2 * positions * (config.head_dim // 2) * 4


def int4_scratch_bytes(weights: WeightBytes | None, num_tokens: int, uses_kernels: bool) -> int:
    """Temporary dequantized weight of the largest INT4 layer during a step of `num_tokens`."""
    if weights is None or not weights.max_int4_layer_elements:
        return 0
    if not uses_kernels:
        return AWQ_TORCH_DEQUANT_BYTES_PER_ELEMENT * weights.max_int4_layer_elements
    if num_tokens >= AWQ_DEQUANT_MATMUL_MIN_TOKENS:
        return FP16_BYTES * weights.max_int4_layer_elements
    return 0  # the Triton GEMM/GEMV kernels read INT4 directly


@dataclass
class Workspace:
    """Peak bytes of each phase of a step; the step's peak is the largest phase
    plus what stays allocated across steps (Rotary's tables, step metadata)."""

    phases: dict[str, int]
    rope_bytes: int
    metadata_bytes: int
    num_tokens: int
    num_seqs: int
    context_len: int
    uses_kernels: bool

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.phases.get)

    @property
    def peak_bytes(self) -> int:
        return self.phases[self.peak_phase] + self.rope_bytes + self.metadata_bytes


def step_workspace(config: ModelConfig, *, num_tokens: int, num_seqs: int, context_len: int, element_bytes: int,
                   uses_kernels: bool, block_size: int = 16, int4_scratch: int = 0) -> Workspace:
    """Peak workspace of any step of at most `num_tokens` tokens and `num_seqs`
    sequences over contexts of at most `context_len` tokens.

    Counted from what model.py, kernels/paged_attention.py and sampling.py
    allocate, phase by phase. In every phase of a layer the layer's input and
    (after attention) its running sum stay alive as [T, hidden] tensors,
    because the caller still holds the input while the layer runs.

    - mlp: the normed input and three [T, intermediate] tensors at once
      (silu(gate), up, and their product); with INT4 layers the dequantized
      weight of the layer being computed replaces one of them at most.
    - rotary: q, k, v, and float32 copies and halves of q while RoPE runs
      (about 12 bytes per q element), or of k while q's result is kept.
    - attention: the Triton kernels add only their [T, H, D] output (decode
      also float32 partials per context partition); the plain-torch path
      gathers the context as float32 K/V, repeats them over the query heads,
      and keeps two float32 score tensors [H, Q, L] for the longest prefill
      chunk (Q = min(T, L)), sequence by sequence.
    - logits: float32 logits of every sequence plus one sampling row.
    """
    e = element_bytes
    t, s, l = num_tokens, min(num_seqs, num_tokens), context_len
    hidden, inter = config.hidden_size, config.intermediate_size
    q, kv, heads, d = config.q_size, config.kv_size, config.num_heads, config.head_dim
    residual = 2 * t * hidden * e  # layer input and running sum
    phases: dict[str, int] = {}

    phases["mlp"] = residual + t * hidden * e + max(3 * t * inter * e, 2 * t * inter * e + int4_scratch)

    qkv = t * (q + 2 * kv) * e
    cos_sin = 2 * t * (d // 2) * 4
    rotary_q = 12 * t * q
    rotary_k = t * q * e + max(4 * t * q + 4 * t * kv, 12 * t * kv)
    phases["rotary"] = residual + qkv + cos_sin + max(rotary_q, rotary_k)

    if uses_kernels:
        num_partitions = max(1, math.ceil(l / MIN_DECODE_PARTITION_TOKENS))
        decode_partials = s * heads * num_partitions * (d + 1) * 4
        phases["attention"] = residual + qkv + max(t * q * e + t * hidden * e, decode_partials)
    else:
        q_len = min(t, l)
        gathered = 2 * l * kv * 4 + 2 * l * q * 4  # float32 K, V and their copies per query head
        scores = 2 * heads * q_len * l * 4 + q_len * l  # two float32 [H, Q, L] plus the causal mask
        phases["attention"] = residual + qkv + t * q * 4 + q_len * q * 4 + gathered + scores

    phases["logits"] = residual + s * hidden * e + s * config.vocab_size * (e + 4) + \
        SAMPLING_BYTES_PER_VOCAB_ENTRY * config.vocab_size

    # input ids, positions and slots (int64 [T]) and the int32 block table [S, blocks]
    metadata = 3 * t * 8 + s * -(-l // block_size) * 4
    return Workspace(phases, rope_table_bytes(config, l), metadata, t, num_seqs, l, uses_kernels)


def step_tokens(profile: Profile, max_model_len: int) -> int:
    """The most tokens one step can hold: the token budget, or every sequence at full length."""
    return min(profile.max_num_batched_tokens, profile.max_num_seqs * max_model_len)


def profile_workspace(config: ModelConfig, profile: Profile, max_model_len: int, element_bytes: int,
                      device_type: str, weights: WeightBytes | None = None) -> Workspace:
    """The workspace the engine reserves for a profile: its largest possible step."""
    num_tokens = step_tokens(profile, max_model_len)
    kernels = uses_attention_kernels(device_type, config.head_dim)
    return step_workspace(
        config, num_tokens=num_tokens, num_seqs=profile.max_num_seqs, context_len=max_model_len,
        element_bytes=element_bytes, uses_kernels=kernels, block_size=profile.kv_block_size,
        int4_scratch=int4_scratch_bytes(weights, num_tokens, kernels),
    )


def activation_bytes(config: ModelConfig, profile: Profile, element_bytes: int, max_model_len: int | None = None,
                     device_type: str = "cuda") -> int:
    """Peak workspace of one step at the profile's token budget."""
    max_model_len = max_model_len or profile.max_model_len
    return profile_workspace(config, profile, max_model_len, element_bytes, device_type).peak_bytes


# ---------------------------------------------------------------- the pool


def memory_budget_bytes(profile: Profile) -> int:
    """What weights, KV and workspace may use together: the profile's budget times
    its utilisation, capped by an emulated card."""
    budget = profile.memory_budget_bytes
    if profile.emulate_vram_gib is not None:
        budget = min(budget, int(profile.emulate_vram_gib * profile.memory_utilization * GIB))
    return budget


@dataclass
class KVPlan:
    num_blocks: int
    block_size: int
    bytes_per_token: int
    budget_bytes: int
    weight_bytes: int
    activation_bytes: int
    kv_precision: str = "fp16"
    workspace: Workspace | None = None

    @property
    def kv_bytes(self) -> int:
        return self.num_blocks * self.block_size * self.bytes_per_token

    @property
    def max_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def free_bytes(self) -> int:
        """Budget left for KV after weights and workspace (negative: over budget)."""
        return self.budget_bytes - self.weight_bytes - self.activation_bytes


def read_raw_config(model_dir: str | Path | None) -> dict | None:
    """config.json as a dict, or None when there is no directory or no readable file."""
    if model_dir is None:
        return None
    try:
        raw = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return raw if isinstance(raw, dict) else None


def size_kv_pool(config: ModelConfig, profile: Profile, weight_bytes: int, element_bytes: int, max_model_len: int, *,
                 device_type: str = "cuda", raw_config: dict | None = None) -> KVPlan:
    """Pages for what is left of the budget after weights and workspace, never more
    than max_num_seqs full-length sequences need (may be fewer than one: see plan_kv)."""
    precision = kv_precision_for(profile)
    weights = weight_bytes_by_kind(config, raw_config, element_bytes) if raw_config else None
    workspace = profile_workspace(config, profile, max_model_len, element_bytes, device_type, weights)
    per_token = kv_bytes_per_token(config, precision, element_bytes)
    block_size = profile.kv_block_size
    budget = memory_budget_bytes(profile)
    free = budget - weight_bytes - workspace.peak_bytes
    blocks_per_seq = -(-max_model_len // block_size)
    num_blocks = max(0, min(free // (per_token * block_size), profile.max_num_seqs * blocks_per_seq))
    return KVPlan(int(num_blocks), block_size, per_token, budget, weight_bytes, workspace.peak_bytes, precision,
                  workspace)


def largest_fitting_context(config: ModelConfig, profile: Profile, weight_bytes: int, element_bytes: int,
                            max_len: int, *, device_type: str = "cuda", raw_config: dict | None = None) -> int:
    """The longest max_model_len (whole pages, at most `max_len`) for which the pool
    holds one full-length sequence; 0 if none does."""
    block_size = profile.kv_block_size

    def fits(num_blocks: int) -> bool:
        length = num_blocks * block_size
        changed = profile.replace(max_model_len=max(16, length))
        pool = size_kv_pool(config, changed, weight_bytes, element_bytes, length, device_type=device_type,
                            raw_config=raw_config)
        return pool.num_blocks >= num_blocks

    low, high = 0, max(1, max_len // block_size)
    if fits(high):
        return high * block_size
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low * block_size


def plan_kv(config: ModelConfig, profile: Profile, weight_bytes: int, element_bytes: int, max_model_len: int, *,
            device_type: str = "cuda", model_dir: str | Path | None = None) -> KVPlan:
    """Pages for what is left of the budget after weights and workspace.

    Never more than max_num_seqs full-length sequences need; never fewer than one
    full-length sequence needs (that is an OutOfMemoryError with the numbers).
    `device_type` decides which attention path the workspace is counted for;
    `model_dir` lets INT4 dequantization scratch be counted from config.json.
    """
    raw_config = read_raw_config(model_dir)
    plan = size_kv_pool(config, profile, weight_bytes, element_bytes, max_model_len, device_type=device_type,
                        raw_config=raw_config)
    blocks_per_seq = -(-max_model_len // plan.block_size)
    if plan.num_blocks < blocks_per_seq:
        kv = blocks_per_seq * plan.block_size * plan.bytes_per_token
        need = weight_bytes + plan.activation_bytes + kv
        fitting = largest_fitting_context(config, profile, weight_bytes, element_bytes, max_model_len - 1,
                                          device_type=device_type, raw_config=raw_config)
        raise OutOfMemoryError(
            f"a {max_model_len}-token context does not fit: weights {weight_bytes / GIB:.2f} GiB + workspace "
            f"{plan.activation_bytes / GIB:.2f} GiB + KV {kv / GIB:.2f} GiB = {need / GIB:.2f} GiB "
            f"> budget {plan.budget_bytes / GIB:.2f} GiB. "
            + (f"Lower max_model_len (e.g. --max-model-len {fitting}), " if fitting else
               "Even the shortest context does not fit beside the weights and workspace: ")
            + f"lower max_num_batched_tokens, use kv_precision int8, INT4 (AWQ) weights, or a larger profile; "
            f"run `lowvram doctor --profile {profile.name} --context {max_model_len}` (with --model) for a plan"
        )
    return plan
