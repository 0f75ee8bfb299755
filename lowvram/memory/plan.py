"""How much device memory a run needs: the formulas the engine sizes its KV pool with and
`lowvram doctor` prints (docs/doctor.md), so a plan and a run cannot disagree."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from lowvram.config import Profile
from lowvram.errors import OutOfMemoryError
from lowvram.memory.workspace import FP16_BYTES, Workspace, is_mla, profile_workspace
from lowvram.models.config import AwqConfig, ModelConfig

GIB = 2**30
MIB = 2**20

KV_PRECISIONS = ("fp16", "int8", "int4")
# Quantized KV rows carry an fp16 scale and an fp16 zero per token and KV head.
KV_SCALE_ZERO_BYTES = 4
# The CUDA context, outside torch's allocator: 300-500 MiB with lazy loading (measured on a GPU).
CUDA_CONTEXT_BYTES = 400 * MIB
# Allocator fragmentation, as a share of KV pool and workspace (weights barely fragment).
FRAGMENTATION_RESERVE_FRACTION = 0.10


def kv_bytes_per_token(config: ModelConfig, precision: str = "fp16", element_bytes: int = FP16_BYTES) -> int:
    """K and V of every layer for one token: "fp16" pages hold the compute dtype, "int8" one
    byte and "int4" half a byte per element plus a scale and zero. DeepSeek-V2 caches one
    latent row per layer, two layers per pool layer."""
    heads = (config.num_kv_layers if is_mla(config) else config.num_layers) * config.num_kv_heads
    d = config.head_dim
    row = {"fp16": d * element_bytes, "int8": d + KV_SCALE_ZERO_BYTES, "int4": d // 2 + KV_SCALE_ZERO_BYTES}
    return 2 * heads * row[precision]


def kv_precision_for(profile: Profile) -> str:
    return "fp16" if profile.kv_precision == "auto" else profile.kv_precision  # "auto" starts at fp16


def kv_pool_bytes(config: ModelConfig, num_tokens: int, block_size: int, precision: str, element_bytes: int) -> int:
    """Bytes of whole pages holding `num_tokens` tokens."""
    return -(-num_tokens // block_size) * block_size * kv_bytes_per_token(config, precision, element_bytes)


@dataclass(frozen=True)
class LinearShape:
    """One decoder Linear, K inputs -> N outputs, named as in the checkpoint."""

    name: str
    in_features: int
    out_features: int
    has_bias: bool = False


def _mlp_linears(prefix: str, hidden: int, inter: int) -> list[LinearShape]:
    names = (("gate_proj", hidden, inter), ("up_proj", hidden, inter), ("down_proj", inter, hidden))
    return [LinearShape(f"{prefix}.{name}", k, n) for name, k, n in names]


def decoder_linears(config: ModelConfig) -> list[LinearShape]:
    """Every Linear inside the decoder layers (the ones AWQ quantizes). DeepSeek-V2: MLA
    projections, a dense MLP in the first `first_k_dense_replace` layers, then routed and
    shared experts (its float32 router is not counted here)."""
    h, shapes = config.hidden_size, []
    for layer in range(config.num_layers):
        attn, mlp = f"model.layers.{layer}.self_attn", f"model.layers.{layer}.mlp"
        if not is_mla(config):
            q, kv = config.q_size, config.kv_size
            qkv = (("q_proj", q), ("k_proj", kv), ("v_proj", kv))
            shapes += [LinearShape(f"{attn}.{name}", h, n, config.has_qkv_bias) for name, n in qkv]
            shapes += [LinearShape(f"{attn}.o_proj", q, h), *_mlp_linears(mlp, h, config.intermediate_size)]
            continue
        heads, q_out, rank = config.num_heads, config.num_heads * config.qk_head_dim, config.q_lora_rank
        if rank is None:
            shapes.append(LinearShape(f"{attn}.q_proj", h, q_out))
        else:
            shapes += [LinearShape(f"{attn}.q_a_proj", h, rank), LinearShape(f"{attn}.q_b_proj", rank, q_out)]
        kv_out = heads * (config.qk_nope_head_dim + config.v_head_dim)
        shapes += [
            LinearShape(f"{attn}.kv_a_proj_with_mqa", h, config.kv_head_dim),
            LinearShape(f"{attn}.kv_b_proj", config.kv_lora_rank, kv_out),
            LinearShape(f"{attn}.o_proj", heads * config.v_head_dim, h),
        ]
        if not config.is_moe_layer(layer):
            shapes += _mlp_linears(mlp, h, config.intermediate_size)
            continue
        for e in range(config.num_routed_experts):
            shapes += _mlp_linears(f"{mlp}.experts.{e}", h, config.moe_intermediate_size)
        if config.num_shared_experts:
            shapes += _mlp_linears(f"{mlp}.shared_experts", h, config.moe_intermediate_size * config.num_shared_experts)
    return shapes


def compensation_settings(model_dir: str | Path | None) -> tuple[dict[str, int], frozenset[str]]:
    """Each layer's low-rank rank and the layers with a bias correction, from the tensor
    shapes in the header of the checkpoint's compensation side file; none without one."""
    from lowvram.models.checkpoint import COMPENSATION_FILE
    from lowvram.quant.awq_linear import BIAS_CORRECTION, LORA_A

    path = Path(model_dir or "") / COMPENSATION_FILE
    if model_dir is None or not path.is_file():
        return {}, frozenset()
    try:
        with open(path, "rb") as f:  # safetensors: an 8-byte length, then a JSON header
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    except (OSError, ValueError):
        return {}, frozenset()
    ranks = {name[: -len(LORA_A) - 1]: t["shape"][0] for name, t in header.items() if name.endswith("." + LORA_A)}
    corrected = frozenset(name[: -len(BIAS_CORRECTION) - 1] for name in header if name.endswith("." + BIAS_CORRECTION))
    return ranks, corrected


def _is_int4(awq: AwqConfig | None, linear: LinearShape) -> bool:
    # DeepSeek-V2's kv_b_proj is dequantized at load (the model absorbs it into attention).
    return awq is not None and not awq.is_skipped(linear.name) and not linear.name.endswith("kv_b_proj")


def _linear_bytes(awq: AwqConfig | None, linear: LinearShape, element_bytes: int) -> int:
    """AutoAWQ GEMM tensors of an INT4 Linear K -> N (qweight int32 [K, N/8], qzeros int32
    [K/G, N/8], scales fp16 [K/G, N]), else its weight; plus bias [N] in the compute dtype."""
    k, n = linear.in_features, linear.out_features
    bias = n * element_bytes if linear.has_bias else 0
    if not _is_int4(awq, linear):
        return k * n * element_bytes + bias
    groups = k // awq.group_size
    return k * (n // 8) * 4 + groups * (n // 8) * 4 + groups * n * FP16_BYTES + bias


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
    max_int4_layer_elements: int = 0  # K * N of the largest INT4 layer: the dequantization scratch
    awq_group_size: int = 0
    layer_bytes: list[int] = field(default_factory=list)  # each decoder layer, norms and compensation included
    layer_mlp_bytes: list[int] = field(default_factory=list)  # its MLP's share
    offload: OffloadPlan | None = None  # some layers live in host memory (plan_weight_offload)
    # MoE: routed experts kept in host memory, and how many per layer the device caches.
    host_expert_bytes: int = 0
    num_cached_experts: int = 0
    num_routed_experts: int = 0
    is_embedding_on_host: bool = False  # profile embeddings_on_host; untied heads only

    @property
    def host_embedding_bytes(self) -> int:
        return self.embedding_bytes if self.is_embedding_on_host else 0

    @property
    def all_bytes(self) -> int:
        """Every weight, wherever it lives."""
        kinds = (self.int4_bytes, self.fp16_linear_bytes, self.compensation_bytes, self.embedding_bytes)
        return sum(kinds) + self.head_bytes + self.norm_bytes

    @property
    def total_bytes(self) -> int:
        """The weights the device holds."""
        if self.offload is not None:
            return self.offload.device_weight_bytes - self.host_expert_bytes
        return self.all_bytes - self.host_expert_bytes - self.host_embedding_bytes


# The projections lowvram.models.fusion concatenates in dense decoder layers.
FUSED_GROUPS = {"qkv": ("q_proj", "k_proj", "v_proj"), "gate_up": ("gate_proj", "up_proj")}
FUSED_GROUP_OF = {part: group for group, parts in FUSED_GROUPS.items() for part in parts}


def keeps_embeddings_on_host(config: ModelConfig, profile: Profile, device_type: str) -> bool:
    """The profile asks, on CUDA, and the head does not share the table."""
    return profile.embeddings_on_host and device_type == "cuda" and not config.is_tied_head and not is_mla(config)


def weight_bytes_by_kind(
    config: ModelConfig,
    element_bytes: int,
    *,
    model_dir: str | Path | None = None,
    max_cached_experts: int | None = None,
    is_embedding_on_host: bool = False,
) -> WeightBytes:
    """Weights on the device, from the config and (given `model_dir`) the compensation side
    file. Floating tensors take `element_bytes`; AWQ qweight/qzeros stay int32 and scales
    fp16. A tied head shares the embedding. DeepSeek-V2: `max_cached_experts` routed experts
    per MoE layer on the device, the rest in host memory (None: all); float32 routers.
    `is_embedding_on_host` (keeps_embeddings_on_host) leaves the table out of the total."""
    awq, mla = config.quantization, is_mla(config)
    ranks, corrected = compensation_settings(model_dir) if awq else ({}, frozenset())
    weights = WeightBytes("awq" if awq else "fp16", awq_group_size=awq.group_size if awq else 0)
    weights.layer_bytes = [2 * config.hidden_size * element_bytes] * config.num_layers  # the two norms
    weights.layer_mlp_bytes = [0] * config.num_layers
    fused_int4: dict[tuple[int, str], list[int]] = {}  # (layer, group) -> K * N of its INT4 parts
    for linear in decoder_linears(config):
        k, n, name = linear.in_features, linear.out_features, linear.name
        parts = name.split(".")  # model.layers.{i}.<module>
        layer, size = int(parts[2]), _linear_bytes(awq, linear, element_bytes)
        if _is_int4(awq, linear):
            weights.int4_bytes += size
            weights.num_int4_layers += 1
            weights.max_int4_layer_elements = max(weights.max_int4_layer_elements, k * n)
            group = None if mla else FUSED_GROUP_OF.get(parts[-1])
            if group is not None:
                fused_int4.setdefault((layer, group), []).append(k * n)
            # Low-rank A [r, K] and B [N, r] plus a bias correction [N], in the compute dtype; the
            # loader adds a correction into the layer's bias, so it costs bytes only without one.
            correction = n if name in corrected and not linear.has_bias else 0
            extra = (ranks.get(name, 0) * (k + n) + correction) * element_bytes
            weights.compensation_bytes += extra
            size += extra
        else:
            weights.fp16_linear_bytes += size
            weights.num_fp16_layers += 1
        weights.layer_bytes[layer] += size
        if ".mlp." in name:
            weights.layer_mlp_bytes[layer] += size
        # model.layers.{i}.mlp.experts.{e}.<proj>: routed expert e
        is_routed = mla and len(parts) > 6 and parts[3:5] == ["mlp", "experts"]
        if is_routed and max_cached_experts is not None and int(parts[5]) >= max_cached_experts:
            weights.host_expert_bytes += size
    # Dense layers run q/k/v and gate/up as one fused INT4 linear each (lowvram.models.fusion)
    # when every part is INT4: the dequantization scratch is then the fused weight's.
    for (_, group), sizes in fused_int4.items():
        if len(sizes) == len(FUSED_GROUPS[group]):
            weights.max_int4_layer_elements = max(weights.max_int4_layer_elements, sum(sizes))
    weights.embedding_bytes = config.vocab_size * config.hidden_size * element_bytes
    weights.head_bytes = 0 if config.is_tied_head else weights.embedding_bytes
    weights.is_embedding_on_host = is_embedding_on_host and not config.is_tied_head and not mla
    weights.norm_bytes = (2 * config.num_layers + 1) * config.hidden_size * element_bytes
    if mla:
        num_moe, num_routed = config.num_moe_layers, config.num_routed_experts
        weights.fp16_linear_bytes += num_moe * num_routed * config.hidden_size * 4  # routers
        weights.num_fp16_layers += num_moe
        weights.norm_bytes += config.num_layers * (config.kv_lora_rank + (config.q_lora_rank or 0)) * element_bytes
        weights.num_routed_experts = num_routed
        weights.num_cached_experts = num_routed if max_cached_experts is None else min(max_cached_experts, num_routed)
    return weights


def routed_expert_bytes(config, element_bytes: int) -> int:
    """Device bytes of one routed expert (DeepSeek-V2): what one expert-cache slot holds."""
    first_moe = next(i for i in range(config.num_layers) if config.is_moe_layer(i))
    expert = _mlp_linears(f"model.layers.{first_moe}.mlp.experts.0", config.hidden_size, config.moe_intermediate_size)
    return sum(_linear_bytes(config.quantization, linear, element_bytes) for linear in expert)


def memory_budget_bytes(profile: Profile, held_bytes: int = 0) -> int:
    """What weights, KV and workspace may use together: the profile's budget times its
    utilisation, capped by an emulated card, less `held_bytes` the process already held."""
    budget = profile.memory_budget_bytes
    if profile.emulate_vram_gib is not None:
        budget = min(budget, int(profile.emulate_vram_gib * profile.memory_utilization * GIB))
    return budget - held_bytes


@dataclass
class KVPlan:
    num_blocks: int
    block_size: int
    bytes_per_token: int
    budget_bytes: int
    weight_bytes: int
    kv_precision: str
    workspace: Workspace

    @property
    def activation_bytes(self) -> int:
        """The workspace the engine reserves beside weights and KV."""
        return self.workspace.peak_bytes

    @property
    def kv_bytes(self) -> int:
        return self.num_blocks * self.block_size * self.bytes_per_token

    @property
    def max_tokens(self) -> int:
        return self.num_blocks * self.block_size


def size_kv_pool(
    config: ModelConfig,
    profile: Profile,
    weight_bytes: int,
    element_bytes: int,
    max_model_len: int,
    device_type: str = "cuda",
    held_bytes: int = 0,
) -> KVPlan:
    """Pages for what the budget leaves after weights and workspace, never more than
    max_num_seqs full-length sequences need (may be fewer than one: see plan_kv)."""
    precision = kv_precision_for(profile)
    int4 = weight_bytes_by_kind(config, element_bytes).max_int4_layer_elements if config.quantization else 0
    workspace = profile_workspace(config, profile, max_model_len, element_bytes, device_type, int4)
    per_token = kv_bytes_per_token(config, precision, element_bytes)
    budget, block_size = memory_budget_bytes(profile, held_bytes), profile.kv_block_size
    free = budget - weight_bytes - workspace.peak_bytes
    num_blocks = max(0, min(free // (per_token * block_size), profile.max_num_seqs * -(-max_model_len // block_size)))
    return KVPlan(num_blocks, block_size, per_token, budget, weight_bytes, precision, workspace)


def longest_fitting(fits: Callable[[int], bool], max_len: int, block_size: int) -> int:
    """The longest whole-page length up to `max_len` for which `fits` holds (fitting shrinks
    as length grows); 0 if none does."""
    low, high = 0, max(1, max_len // block_size)
    if fits(high * block_size):
        return high * block_size
    while high - low > 1:  # fits(low) or low == 0; not fits(high)
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid * block_size) else (low, mid)
    return low * block_size


def host_kv_blocks(config: ModelConfig, profile: Profile, element_bytes: int, device_type: str) -> int:
    """Pages a unified-memory KV pool keeps beyond its device share: the profile's host
    spill, where the backend may be `um` (a pinned or device pool cannot)."""
    if device_type != "cuda" or profile.kv_backend not in ("um", "auto") or profile.host_spill_gib <= 0:
        return 0
    per_token = kv_bytes_per_token(config, kv_precision_for(profile), element_bytes)
    return int(profile.host_spill_gib * GIB) // (per_token * profile.kv_block_size)


def plan_kv(
    config: ModelConfig,
    profile: Profile,
    weight_bytes: int,
    element_bytes: int,
    max_model_len: int,
    *,
    device_type: str = "cuda",
    host_blocks: int = 0,
    held_bytes: int = 0,
) -> KVPlan:
    """size_kv_pool, or an OutOfMemoryError with the numbers when the pool and the
    `host_blocks` a unified-memory pool spills (host_kv_blocks) hold less than one
    full-length sequence. `held_bytes`: device memory the process held before loading."""

    def pool(profile: Profile, length: int) -> KVPlan:
        return size_kv_pool(config, profile, weight_bytes, element_bytes, length, device_type, held_bytes)

    plan = pool(profile, max_model_len)
    blocks_per_seq = -(-max_model_len // plan.block_size)
    if plan.num_blocks + host_blocks >= blocks_per_seq:
        return plan
    kv = blocks_per_seq * plan.block_size * plan.bytes_per_token
    need = weight_bytes + plan.activation_bytes + kv
    fitting = longest_fitting(
        lambda n: pool(profile.replace(max_model_len=max(16, n)), n).max_tokens >= n, max_model_len - 1, plan.block_size
    )
    held = f" (after {held_bytes / GIB:.2f} GiB this process already held)" if held_bytes else ""
    spill = ". "
    if host_blocks:
        spill = (
            f", and the unified-memory pool's host spill (host_spill_gib {profile.host_spill_gib:g}) holds only "
            f"{host_blocks * plan.block_size} tokens beyond it; raise host_spill_gib. "
        )
    shorter = "Even the shortest context does not fit beside the weights and workspace: "
    if fitting:
        shorter = f"Lower max_model_len (e.g. --max-model-len {fitting}), "
    offload = ""
    if profile.weight_offload in ("off", "auto"):
        offload = "weight_offload stream (decoder layers from host memory: room for KV, slower decode), "
    raise OutOfMemoryError(
        f"a {max_model_len}-token context does not fit: weights {weight_bytes / GIB:.2f} GiB + workspace "
        f"{plan.activation_bytes / GIB:.2f} GiB + KV {kv / GIB:.2f} GiB = {need / GIB:.2f} GiB "
        f"> budget {plan.budget_bytes / GIB:.2f} GiB{held}{spill}{shorter}"
        f"lower max_num_batched_tokens, use kv_precision int8, INT4 (AWQ) weights, {offload}or a larger profile; "
        f"run `lowvram doctor --profile {profile.name} --context {max_model_len}` (with --model) for a plan"
    )


OFFLOAD_STRATEGIES = ("stream", "cpu")
DEFAULT_OFFLOAD_STRATEGY = "stream"  # weight_offload "auto": the measured winner
# One streamed layer computes from one buffer while the next one's copy fills the other.
NUM_STAGING_BUFFERS = 2


@dataclass(frozen=True)
class OffloadPlan:
    """Weights split between the device and host memory (lowvram.models.layer_streaming).

    The first `num_resident_layers` decoder layers stay on the device; the others live in
    host memory and pass through `num_staging_buffers` buffers of the largest streamed
    layer each forward pass. Head and norms stay; an untied embedding moves to the host.
    With strategy "cpu" a streamed layer's MLP runs on the CPU. Budget, workspace and KV
    (`max_model_len` tokens of every planned sequence) are what the split was planned for.
    """

    strategy: str
    num_layers: int
    num_resident_layers: int
    num_staging_buffers: int
    staging_buffer_bytes: int
    resident_layer_bytes: int
    streamed_layer_bytes: int  # the streamed layers as the device would hold them
    copied_bytes_per_pass: int  # host-to-device bytes of one forward pass
    fixed_bytes: int  # what stays whatever the split: head, final norm, a tied embedding
    host_embedding_bytes: int
    budget_bytes: int
    workspace_bytes: int
    kv_bytes: int
    max_model_len: int = 0
    reserve_bytes: int = 0  # allocator slack kept free: cuBLAS workspaces, fragmentation

    @property
    def num_streamed_layers(self) -> int:
        return self.num_layers - self.num_resident_layers

    @property
    def staging_bytes(self) -> int:
        return self.num_staging_buffers * self.staging_buffer_bytes

    @property
    def device_weight_bytes(self) -> int:
        return self.fixed_bytes + self.resident_layer_bytes + self.staging_bytes

    @property
    def host_weight_bytes(self) -> int:
        """The weights moved off the device (at their device size)."""
        return self.streamed_layer_bytes + self.host_embedding_bytes

    @property
    def is_embedding_on_host(self) -> bool:
        return self.host_embedding_bytes > 0

    @property
    def room_bytes(self) -> int:
        """What the budget leaves the weights after workspace, KV and slack."""
        return self.budget_bytes - self.workspace_bytes - self.kv_bytes - self.reserve_bytes

    @property
    def fits(self) -> bool:
        return self.device_weight_bytes <= self.room_bytes

    def summary(self) -> str:
        streamed = self.num_streamed_layers
        mlp = " (their MLPs run on the CPU)" if self.strategy == "cpu" and streamed else ""
        text = f"{self.num_resident_layers} of {self.num_layers} decoder layers on the device, "
        text += f"{streamed} streamed from host memory{mlp}"
        if streamed:
            buffers = "buffer" if self.num_staging_buffers == 1 else "buffers"
            text += (
                f" ({self.copied_bytes_per_pass / MIB:.1f} MiB copied per forward pass, through "
                f"{self.num_staging_buffers} staging {buffers} of {self.staging_buffer_bytes / MIB:.1f} MiB)"
            )
        return text + ("; embeddings in host memory" if self.is_embedding_on_host else "")

    def check(self, profile_name: str) -> None:
        """Raise OutOfMemoryError with the numbers when even streaming every layer does not fit."""
        if self.fits:
            return
        tied = ", embeddings" if not self.is_embedding_on_host else ""
        hint = (
            "weight_offload cpu (only the attention part of a layer is staged), " if self.strategy == "stream" else ""
        )
        raise OutOfMemoryError(
            f"the model does not fit even with every decoder layer streamed from host memory: head, norms{tied} "
            f"{self.fixed_bytes / GIB:.2f} GiB + {self.num_staging_buffers} staging buffers of "
            f"{self.staging_buffer_bytes / MIB:.0f} MiB (one layer each) = {self.device_weight_bytes / GIB:.2f} GiB, "
            f"but the budget {self.budget_bytes / GIB:.2f} GiB leaves {self.room_bytes / GIB:.2f} GiB after the "
            f"workspace {self.workspace_bytes / GIB:.2f} GiB, KV {self.kv_bytes / GIB:.2f} GiB for a "
            f"{self.max_model_len}-token context and allocator slack {self.reserve_bytes / GIB:.2f} GiB. "
            f"Lower max_model_len, use kv_precision int8, lower max_num_batched_tokens, {hint}or use a larger "
            f"profile; run `lowvram doctor --profile {profile_name} --context {self.max_model_len}` "
            "(with --model) for a plan"
        )


def plan_offload(
    layer_bytes: list[int],
    staged_bytes: list[int],
    *,
    strategy: str = DEFAULT_OFFLOAD_STRATEGY,
    max_resident_layers: int | None = None,
    **budget: int,
) -> OffloadPlan:
    """Keep the most leading decoder layers on the device that fit beside the fixed weights,
    the staging buffers, the workspace, KV and allocator slack; the rest stream (the first
    copies then overlap the resident layers' compute). `budget`: the OffloadPlan fields
    fixed_bytes, host_embedding_bytes, budget_bytes, workspace_bytes, kv_bytes and optionally
    reserve_bytes and max_model_len. `layer_bytes[i]`: layer i as the device holds it;
    `staged_bytes[i]`: what a pass copies when it streams (without its MLP for "cpu").
    When not even every layer streaming fits, none is kept and `fits` is False."""
    num_layers = len(layer_bytes)
    plan = OffloadPlan(strategy, num_layers, 0, 0, 0, 0, 0, 0, **budget)
    room = plan.room_bytes - plan.fixed_bytes
    most = num_layers if max_resident_layers is None else max(0, min(num_layers, max_resident_layers))
    for num_resident in range(most, -1, -1):
        streamed = staged_bytes[num_resident:]
        num_buffers, buffer = min(NUM_STAGING_BUFFERS, len(streamed)), max(streamed, default=0)
        if sum(layer_bytes[:num_resident]) + num_buffers * buffer <= room:
            break
    return dataclasses.replace(
        plan,
        num_resident_layers=num_resident,
        num_staging_buffers=num_buffers,
        staging_buffer_bytes=buffer,
        resident_layer_bytes=sum(layer_bytes[:num_resident]),
        streamed_layer_bytes=sum(layer_bytes[num_resident:]),
        copied_bytes_per_pass=sum(streamed),
    )


def plan_weight_offload(
    config: ModelConfig,
    profile: Profile,
    weights: WeightBytes,
    element_bytes: int,
    max_model_len: int,
    *,
    device_type: str = "cuda",
    num_seqs: int = 1,
    held_bytes: int = 0,
) -> OffloadPlan | None:
    """The split the engine makes under the profile's `weight_offload`; None when every
    weight stays on the device. "auto" offloads only on CUDA and only when the weights do
    not fit beside the workspace and one KV page per sequence (a model that fits but leaves
    too little room for its context gets plan_kv's error, not a silent slowdown). The split
    leaves room for `num_seqs` sequences of `max_model_len` tokens and the allocator slack
    the doctor counts."""
    mode = profile.weight_offload
    # MoE models leave the device by routed expert instead (lowvram.models.expert_offload).
    if mode == "off" or (mode == "auto" and device_type != "cuda") or is_mla(config):
        return None
    pool = size_kv_pool(config, profile, 0, element_bytes, max_model_len, device_type, held_bytes)
    one_page_each = num_seqs * profile.kv_block_size * pool.bytes_per_token
    on_device = weights.all_bytes - weights.host_embedding_bytes
    if mode == "auto" and on_device + pool.activation_bytes + one_page_each <= pool.budget_bytes:
        return None
    strategy = DEFAULT_OFFLOAD_STRATEGY if mode == "auto" else mode
    staged = weights.layer_bytes
    if strategy == "cpu":
        staged = [layer - mlp for layer, mlp in zip(weights.layer_bytes, weights.layer_mlp_bytes)]
    host_embedding = 0 if config.is_tied_head else weights.embedding_bytes
    kv = num_seqs * kv_pool_bytes(config, max_model_len, profile.kv_block_size, pool.kv_precision, element_bytes)
    return plan_offload(
        weights.layer_bytes,
        staged,
        fixed_bytes=weights.all_bytes - sum(weights.layer_bytes) - host_embedding,
        host_embedding_bytes=host_embedding,
        budget_bytes=pool.budget_bytes,
        workspace_bytes=pool.activation_bytes,
        kv_bytes=kv,
        reserve_bytes=int(FRAGMENTATION_RESERVE_FRACTION * (kv + pool.activation_bytes)),
        strategy=strategy,
        max_resident_layers=profile.max_resident_layers,
        max_model_len=max_model_len,
    )


# One slot computes while the next expert copies in; fewer would serialize them.
MIN_CACHED_EXPERTS = 2


def plan_expert_cache(
    config,
    profile: Profile,
    element_bytes: int,
    max_model_len: int,
    *,
    device_type: str = "cuda",
    model_dir: str | Path | None = None,
    held_bytes: int = 0,
) -> int:
    """Routed experts per MoE layer to keep on the device (DeepSeek-V2): as many as fit
    beside the other weights, the workspace and the KV of one full-length sequence (the
    least plan_kv accepts; more pages spill to the host), since decode moves every missing
    expert over the bus. At least MIN_CACHED_EXPERTS; below that plan_kv reports the numbers."""
    weights = weight_bytes_by_kind(config, element_bytes, model_dir=model_dir, max_cached_experts=0)
    int4 = weights.max_int4_layer_elements
    workspace = profile_workspace(config, profile, max_model_len, element_bytes, device_type, int4).peak_bytes
    kv = kv_pool_bytes(config, max_model_len, profile.kv_block_size, kv_precision_for(profile), element_bytes)
    room = memory_budget_bytes(profile, held_bytes) - weights.total_bytes - workspace - kv
    per_layer = room // (routed_expert_bytes(config, element_bytes) * config.num_moe_layers)
    return int(max(MIN_CACHED_EXPERTS, min(config.num_routed_experts, per_layer)))
