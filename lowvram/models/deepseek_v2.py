"""DeepseekV2ForCausalLM (DeepSeek-V2 / V2-Lite, DeepSeek-Coder-V2) over paged KV.

Latent attention caches per token and layer the normed KV latent c and the RoPE key all heads
share: one "KV head" (576 values for V2-Lite). `kv_b_proj` is absorbed, not applied to the cache:

    score_h = q_nope_h . (W_uk_h c) + q_pe_h . k_pe = [W_uk_h^T q_nope_h | q_pe_h] . [c | k_pe]
    out_h   = sum_t p_t W_uv_h c_t = W_uv_h (sum_t p_t c_t)

so it is multi-query attention whose values are the keys' first `kv_lora_rank` entries. Two
model layers share a pool layer: 2j keeps its rows in pool layer j's K pages, 2j+1 in its V pages.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch
from torch import nn

from lowvram.errors import ConfigError, UnsupportedModelError
from lowvram.kernels.kv_quant import KVPages
from lowvram.kv.attention import AttentionMetadata, paged_attention
from lowvram.models.checkpoint import weight_report
from lowvram.models.config import AwqConfig, awq_config_from_dict, eos_token_ids
from lowvram.models.dense import MLP, CausalLM, DecoderModel, RMSNorm, Rotary
from lowvram.models.expert_offload import ExpertCache, ExpertCacheStats, expert_adder

ARCHITECTURE = "DeepseekV2ForCausalLM"
MODEL_TYPE = "deepseek_v2"


def is_deepseek_v2(raw: dict) -> bool:
    """Whether a config.json dict describes a DeepSeek-V2 model."""
    return ARCHITECTURE in (raw.get("architectures") or []) or raw.get("model_type") == MODEL_TYPE


@dataclass
class DeepseekV2Config:
    """The config.json fields the model reads; it answers what a dense ModelConfig is asked
    (`num_kv_heads`, `head_dim`, ...) as the pages hold it: one KV head of `kv_head_dim` values."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    num_routed_experts: int
    num_experts_per_tok: int
    num_shared_experts: int
    moe_intermediate_size: int
    first_k_dense_replace: int
    topk_method: str
    num_groups: int | None
    topk_group: int | None
    routed_scaling_factor: float
    is_topk_normalized: bool
    rms_norm_eps: float
    rope_theta: float
    rope: dict
    is_tied_head: bool
    max_position_embeddings: int = 163840
    eos_token_ids: tuple[int, ...] = ()
    quantization: AwqConfig | None = None
    architecture: str = ARCHITECTURE
    num_kv_heads: int = 1

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_head_dim(self) -> int:
        """Values per token and layer in the KV pages (one KV head); also the absorbed query's width."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    head_dim = kv_size = kv_head_dim

    @property
    def q_size(self) -> int:
        return self.num_heads * self.kv_head_dim

    @property
    def num_kv_layers(self) -> int:
        """Pool layers: two model layers share one."""
        return -(-self.num_layers // 2)

    def is_moe_layer(self, layer_idx: int) -> bool:
        return self.num_routed_experts > 0 and layer_idx >= self.first_k_dense_replace

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_layers))

    def num_params(self) -> int:
        """Parameter count, every routed expert included."""
        h, heads, rank = self.hidden_size, self.num_heads, self.kv_lora_rank
        if self.q_lora_rank is None:
            q = h * heads * self.qk_head_dim
        else:
            q = h * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * heads * self.qk_head_dim
        kv = h * self.kv_head_dim + rank + rank * heads * (self.qk_nope_head_dim + self.v_head_dim)
        attn = q + kv + heads * self.v_head_dim * h
        expert = 3 * h * self.moe_intermediate_size
        moe = (self.num_routed_experts + self.num_shared_experts) * expert + self.num_routed_experts * h
        dense = 3 * h * self.intermediate_size
        layers = sum(attn + 2 * h + (moe if self.is_moe_layer(i) else dense) for i in range(self.num_layers))
        head = 0 if self.is_tied_head else self.vocab_size * h
        return self.vocab_size * h + layers + h + head

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config.json") -> DeepseekV2Config:
        # Fields read under the same name, required ones and ones that default to 0; then the renamed.
        required = ("vocab_size", "hidden_size", "intermediate_size", "kv_lora_rank", "v_head_dim")
        or_zero = ("num_experts_per_tok", "moe_intermediate_size", "first_k_dense_replace")
        try:
            # transformers 5 writes rope_parameters; published checkpoints carry rope_theta/rope_scaling.
            rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
            rope_theta = float(rope.pop("rope_theta", raw.get("rope_theta", 10000.0)))
            rope["rope_type"] = rope.pop("rope_type", None) or rope.pop("type", None) or "default"
            rope.pop("type", None)
            quant = raw.get("quantization_config")
            config = cls(
                **{name: int(raw[name]) for name in required},
                **{name: int(raw.get(name) or 0) for name in or_zero},
                num_routed_experts=int(raw.get("n_routed_experts") or 0),
                num_shared_experts=int(raw.get("n_shared_experts") or 0),
                num_layers=int(raw["num_hidden_layers"]),
                num_heads=int(raw["num_attention_heads"]),
                q_lora_rank=raw.get("q_lora_rank"),
                qk_nope_head_dim=int(raw["qk_nope_head_dim"]),
                qk_rope_head_dim=int(raw["qk_rope_head_dim"]),
                topk_method=raw.get("topk_method") or "greedy",
                num_groups=raw.get("n_group"),
                topk_group=raw.get("topk_group"),
                routed_scaling_factor=float(raw.get("routed_scaling_factor") or 1.0),
                is_topk_normalized=bool(raw.get("norm_topk_prob")),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=rope_theta,
                rope=rope,
                is_tied_head=bool(raw.get("tie_word_embeddings", False)),
                max_position_embeddings=int(raw.get("max_position_embeddings", 163840)),
                eos_token_ids=eos_token_ids(raw),
                quantization=None if quant is None else awq_config_from_dict(quant, f"{source} quantization_config"),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"{source} of a {ARCHITECTURE} is missing or has a bad field ({exc!r})") from None
        for setting, value, supported in (
            ("rope type", config.rope["rope_type"], ("default", "yarn")),
            ("topk_method", config.topk_method, ("greedy", "group_limited_greedy")),
            ("scoring_func", raw.get("scoring_func", "softmax"), ("softmax",)),
        ):
            if value not in supported:
                raise UnsupportedModelError(
                    f"{setting} {value!r} is not supported for {ARCHITECTURE}; supported: {', '.join(supported)}"
                )
        if config.qk_rope_head_dim % 2:
            raise ConfigError(f"qk_rope_head_dim={config.qk_rope_head_dim} must be even")
        return config


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


class InterleavedRotary(Rotary):
    """RoPE over adjacent pairs (x[2i], x[2i+1]) with yarn scaling: low frequencies interpolated by
    `factor`, high ones kept, a ramp between, cos/sin times mscale ratio."""

    def _frequencies(self, device: torch.device) -> tuple[torch.Tensor, float, float]:
        dim, base, rope = self.config.qk_rope_head_dim, self.config.rope_theta, self.config.rope
        pos_freqs = base ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim)
        if rope["rope_type"] == "default":
            return 1.0 / pos_freqs, 1.0, 1.0
        factor = float(rope["factor"])
        original_max_positions = int(rope["original_max_position_embeddings"])
        beta_fast, beta_slow = float(rope.get("beta_fast") or 32), float(rope.get("beta_slow") or 1)

        def correction_dim(num_rotations: float) -> float:
            return dim * math.log(original_max_positions / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

        low, high = correction_dim(beta_fast), correction_dim(beta_slow)
        if rope.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(dim // 2, device=device, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        inv_freq = (1.0 / (factor * pos_freqs)) * ramp + (1.0 / pos_freqs) * (1 - ramp)
        attention_factor = rope.get("attention_factor")
        if attention_factor is None:
            mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
            if mscale and mscale_all_dim:
                attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
            else:
                attention_factor = _yarn_mscale(factor)
        return inv_freq, 1.0, float(attention_factor)

    def _rotate(self, positions: torch.Tensor, xs) -> list[torch.Tensor]:
        cos = self.cos[positions][:, None, :]  # [T, 1, R/2]
        sin = self.sin[positions][:, None, :]
        out = []
        for x in xs:  # x: [T, heads, R]
            pairs = x.float().unflatten(-1, (-1, 2))  # [T, heads, R/2, 2]
            even, odd = pairs[..., 0], pairs[..., 1]
            rotated = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1)
            out.append(rotated.flatten(-2).to(x.dtype))
        return out


def softmax_scale(config: DeepseekV2Config) -> float:
    """1/sqrt(qk_head_dim), times mscale(factor, mscale_all_dim)^2 under yarn (the cos/sin factor
    scales only q_pe.k_pe)."""
    scale = config.qk_head_dim**-0.5
    rope = config.rope
    if rope["rope_type"] != "default" and rope.get("mscale_all_dim"):
        scale *= _yarn_mscale(float(rope["factor"]), float(rope["mscale_all_dim"])) ** 2
    return scale


def layer_kv_pages(kv_pages: list[KVPages], layer_idx: int) -> KVPages:
    """Layer `layer_idx`'s half of pool layer `layer_idx // 2` (K if even, else V) as both K and V."""
    pages = kv_pages[layer_idx // 2]
    if layer_idx % 2 == 0:
        rows, scale, zero, window = pages.k, pages.k_scale, pages.k_zero, pages.window_k
    else:
        rows, scale, zero, window = pages.v, pages.v_scale, pages.v_zero, pages.window_v
    # KVPages(k, v, precision, k_scale, k_zero, v_scale, v_zero, window_k, window_v, window_row)
    return KVPages(rows, rows, pages.precision, scale, zero, scale, zero, window, window, pages.window_row)


class LatentAttention(nn.Module):
    def __init__(self, config: DeepseekV2Config, rotary: InterleavedRotary):
        super().__init__()
        self.config = config
        hidden, heads = config.hidden_size, config.num_heads
        if config.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, heads * config.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, config.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, 1e-6)
            self.q_b_proj = nn.Linear(config.q_lora_rank, heads * config.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, config.kv_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(config.kv_lora_rank, 1e-6)
        self.kv_b_proj = nn.Linear(
            config.kv_lora_rank, heads * (config.qk_nope_head_dim + config.v_head_dim), bias=False
        )
        self.o_proj = nn.Linear(heads * config.v_head_dim, hidden, bias=False)
        self.rotary = rotary
        self.scale = softmax_scale(config)

    def forward(self, h, positions, meta: AttentionMetadata, kv_pages: KVPages) -> torch.Tensor:
        c = self.config
        num_tokens = h.shape[0]
        q = self.q_proj(h) if c.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(h)))
        q = q.view(num_tokens, c.num_heads, c.qk_head_dim)  # [T, H, nope + rope]
        q_nope, q_pe = q.split([c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(h).split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)
        k_pe = k_pe.view(num_tokens, 1, c.qk_rope_head_dim)  # [T, 1, rope]
        q_pe, k_pe = self.rotary(positions, q_pe, k_pe, num_positions=meta.max_context_len)

        # W_uk [H, nope, rank] and W_uv [H, v, rank]: views of kv_b_proj's weight
        w = self.kv_b_proj.weight.view(c.num_heads, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
        w_uk, w_uv = w[:, : c.qk_nope_head_dim], w[:, c.qk_nope_head_dim :]
        q_latent = torch.einsum("thn,hnr->thr", q_nope, w_uk)  # [T, H, rank]
        q_full = torch.cat((q_latent, q_pe), dim=-1)  # [T, H, rank + rope]
        kv = torch.cat((latent.view(num_tokens, 1, c.kv_lora_rank), k_pe), dim=-1)  # [T, 1, rank + rope]
        out = paged_attention(q_full, kv, kv, kv_pages, meta, self.scale)  # [T, H, rank + rope]
        out = torch.einsum("thr,hvr->thv", out[..., : c.kv_lora_rank], w_uv)  # [T, H, v]
        return self.o_proj(out.reshape(num_tokens, -1))  # [T, H*v] -> [T, hidden]


class Router(nn.Module):
    """Softmax over routed experts, then top-k (greedy, or within the best groups)."""

    def __init__(self, config: DeepseekV2Config):
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.empty(config.num_routed_experts, config.hidden_size))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (weights [T, k] float32, expert ids [T, k])."""
        c = self.config
        scores = nn.functional.linear(x.float(), self.weight.float()).softmax(dim=-1)  # [T, E]
        if c.topk_method == "group_limited_greedy":
            grouped = scores.view(x.shape[0], c.num_groups, -1)  # [T, G, E/G]
            best_groups = grouped.max(dim=-1).values.topk(c.topk_group, dim=-1).indices  # [T, topk_group]
            is_kept = torch.zeros_like(grouped[..., 0], dtype=torch.bool).scatter_(1, best_groups, True)
            scores = grouped.masked_fill(~is_kept[..., None], 0.0).view(x.shape[0], -1)
        weights, ids = scores.topk(c.num_experts_per_tok, dim=-1)
        # As DeepSeek-V2's own code: normalized weights are not scaled, unnormalized ones are.
        if c.num_experts_per_tok > 1 and c.is_topk_normalized:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        else:
            weights = weights * c.routed_scaling_factor
        return weights, ids


class MoE(nn.Module):
    """Shared experts plus the top-k routed experts, resident (`experts`) or cached (`cache`);
    `next_layer`: (the next layer's post_attention_layernorm, its MoE) if that is cached too."""

    def __init__(self, config: DeepseekV2Config):
        super().__init__()
        self.num_experts = config.num_routed_experts
        self.gate = Router(config)
        self.experts = nn.ModuleList(
            MLP(config.hidden_size, config.moe_intermediate_size) for _ in range(config.num_routed_experts)
        )
        shared_size = config.moe_intermediate_size * config.num_shared_experts
        self.shared_experts = MLP(config.hidden_size, shared_size) if shared_size else None
        self.cache: ExpertCache | None = None
        self.next_layer: tuple[RMSNorm, MoE] | None = None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, hidden] normed, `residual` before the norm. With a cache, the next layer's router
        guesses its experts from this layer's state (which changes little: "speculative expert
        loading", as in Mixtral offloading) in this layer's one host sync, and they are copied
        after this layer's misses; a wrong guess costs only bandwidth."""
        weights, ids = self.gate(x)  # [T, k]
        counts = torch.bincount(ids.flatten(), minlength=self.num_experts)  # [E]
        next_layer = self.next_layer if self.cache is not None and residual is not None else None
        if next_layer is not None:
            norm, next_moe = next_layer
            _, guessed_ids = next_moe.gate(norm(residual))
            counts = torch.cat((counts, torch.bincount(guessed_ids.flatten(), minlength=self.num_experts)))
        # The layer's one host sync: which experts run (and move) depends on it.
        counts = counts.tolist()
        if self.cache is not None:
            out = self.cache.run(x, weights, ids, counts[: self.num_experts])
            if next_layer is not None:
                next_layer[1].cache.prefetch(counts[self.num_experts :])
        else:
            out, add = expert_adder(x, weights, ids, counts)
            for expert_id, count in enumerate(counts):
                if count:
                    add(expert_id, self.experts[expert_id])
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


class DecoderLayer(nn.Module):
    def __init__(self, config: DeepseekV2Config, layer_idx: int, rotary: InterleavedRotary):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LatentAttention(config, rotary)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MoE(config) if config.is_moe_layer(layer_idx) else MLP(config.hidden_size, config.intermediate_size)

    def forward(self, h, residual, positions, meta, kv_pages):
        """As the dense model's layer: (h, residual) -> (this layer's MLP output, the residual before it)."""
        x, residual = self.input_layernorm.add_and_norm(h, residual)
        x, residual = self.post_attention_layernorm.add_and_norm(self.self_attn(x, positions, meta, kv_pages), residual)
        return (self.mlp(x, residual) if isinstance(self.mlp, MoE) else self.mlp(x)), residual


class DeepseekV2ForCausalLM(CausalLM):
    """CausalLM over `config.num_kv_layers` KVPages; `expert_stats` counts the expert cache's work."""

    # Routing decides on the host which experts run (and move): one sync per MoE layer.
    supports_cuda_graphs = False

    def __init__(self, config: DeepseekV2Config):
        rotary = InterleavedRotary(config)
        super().__init__(config, DecoderModel(config, rotary, lambda i: DecoderLayer(config, i, rotary)))
        self.expert_stats = ExpertCacheStats()

    def forward(self, input_ids, positions, meta: AttentionMetadata, kv_pages: list[KVPages]) -> torch.Tensor:
        self.expert_stats.num_tokens += input_ids.shape[0]
        pages = [layer_kv_pages(kv_pages, i) for i in range(len(self.model.layers))]
        return super().forward(input_ids, positions, meta, pages)

    @property
    def moe_layers(self) -> list[MoE]:
        return [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, MoE)]

    @property
    def num_cached_experts(self) -> int | None:
        """Routed experts each MoE layer keeps on the device; None when all are resident."""
        caches = [moe.cache for moe in self.moe_layers if moe.cache is not None]
        return caches[0].num_slots if caches else None

    def offload_experts(self, max_cached_experts: int) -> None:
        """Move the routed experts to host memory (again), `max_cached_experts` per layer cached."""
        device = self.model.embed_tokens.weight.device
        for moe in self.moe_layers:
            if moe.cache is None:
                moe.cache = ExpertCache(list(moe.experts), max_cached_experts, device, self.expert_stats)
                moe.experts = None
            else:
                moe.cache.resize(max_cached_experts)
        for layer, following in itertools.pairwise(self.model.layers):
            if isinstance(layer.mlp, MoE) and isinstance(following.mlp, MoE):
                layer.mlp.next_layer = (following.post_attention_layernorm, following.mlp)
        self.count_weights()

    def count_weights(self) -> None:
        """As CausalLM's, cached experts counted, host-held ones not."""
        report = weight_report(self)
        kind = "int4_layer_bytes" if self.config.quantization is not None else "fp16_layer_bytes"
        cache_bytes = sum(moe.cache.device_bytes for moe in self.moe_layers if moe.cache is not None)
        setattr(report, kind, getattr(report, kind) + cache_bytes)
        self.weight_report, self.weight_bytes = report, report.total_bytes
