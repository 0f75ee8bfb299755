"""DeepseekV2ForCausalLM (DeepSeek-V2 / V2-Lite, DeepSeek-Coder-V2) as a plain nn.Module over paged KV.

Multi-head latent attention keeps per token and layer only the normalized KV latent
(`kv_lora_rank`) and the one RoPE key shared by all heads (`qk_rope_head_dim`), as a
single "KV head" of `kv_lora_rank + qk_rope_head_dim` values in the K pages. The
up-projection `kv_b_proj` is never applied to the cache; it is absorbed instead:

    score_h = q_nope_h . (W_uk_h c) + q_pe_h . k_pe = [W_uk_h^T q_nope_h | q_pe_h] . [c | k_pe]
    out_h   = sum_t p_t W_uv_h c_t = W_uv_h (sum_t p_t c_t)

so attention is ordinary multi-query attention with one KV head of the latent size,
where values are the first `kv_lora_rank` entries of the keys. The existing paged
attention runs it unchanged when the V pages are the K pages themselves (same
tensor), which is why `latent_pages` aliases them: the cache costs one copy.

Parameter names equal the checkpoint names (routed experts one Linear each, as
published), so a checkpoint loads by name.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from lowvram.attention import AttentionMetadata, paged_attention
from lowvram.errors import ConfigError, ModelLoadError, UnsupportedModelError
from lowvram.kv_quant import KVPages, allocate_pages
from lowvram.model import MLP, CausalLM, RMSNorm

ARCHITECTURE = "DeepseekV2ForCausalLM"


@dataclass
class DeepseekV2Config:
    """The config.json fields the model reads, with DeepSeek-V2's meanings."""

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

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_head_dim(self) -> int:
        """Values per token and layer in the KV pages (one KV head)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @classmethod
    def from_dict(cls, raw: dict) -> DeepseekV2Config:
        try:
            # transformers 5 writes rope_parameters; published checkpoints carry rope_theta/rope_scaling.
            rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
            rope_theta = float(rope.pop("rope_theta", raw.get("rope_theta", 10000.0)))
            rope["rope_type"] = rope.pop("rope_type", None) or rope.pop("type", None) or "default"
            rope.pop("type", None)
            config = cls(
                vocab_size=int(raw["vocab_size"]),
                hidden_size=int(raw["hidden_size"]),
                intermediate_size=int(raw["intermediate_size"]),
                num_layers=int(raw["num_hidden_layers"]),
                num_heads=int(raw["num_attention_heads"]),
                q_lora_rank=raw.get("q_lora_rank"),
                kv_lora_rank=int(raw["kv_lora_rank"]),
                qk_nope_head_dim=int(raw["qk_nope_head_dim"]),
                qk_rope_head_dim=int(raw["qk_rope_head_dim"]),
                v_head_dim=int(raw["v_head_dim"]),
                num_routed_experts=int(raw.get("n_routed_experts") or 0),
                num_experts_per_tok=int(raw.get("num_experts_per_tok") or 0),
                num_shared_experts=int(raw.get("n_shared_experts") or 0),
                moe_intermediate_size=int(raw.get("moe_intermediate_size") or 0),
                first_k_dense_replace=int(raw.get("first_k_dense_replace") or 0),
                topk_method=raw.get("topk_method") or "greedy",
                num_groups=raw.get("n_group"),
                topk_group=raw.get("topk_group"),
                routed_scaling_factor=float(raw.get("routed_scaling_factor") or 1.0),
                is_topk_normalized=bool(raw.get("norm_topk_prob")),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=rope_theta,
                rope=rope,
                is_tied_head=bool(raw.get("tie_word_embeddings", False)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"config.json of a {ARCHITECTURE} is missing or has a bad field ({exc!r})") from None
        if config.rope["rope_type"] not in ("default", "yarn"):
            raise UnsupportedModelError(
                f"rope type {config.rope['rope_type']!r} is not supported for {ARCHITECTURE}; supported: default, yarn")
        if config.topk_method not in ("greedy", "group_limited_greedy"):
            raise UnsupportedModelError(
                f"topk_method {config.topk_method!r} is not supported; supported: greedy, group_limited_greedy")
        if config.qk_rope_head_dim % 2:
            raise ConfigError(f"qk_rope_head_dim={config.qk_rope_head_dim} must be even")
        return config


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


class InterleavedRotary(nn.Module):
    """RoPE over adjacent pairs (x[2i], x[2i+1]), as DeepSeek-V2 was trained, with yarn scaling.

    Yarn interpolates low frequencies by `factor`, keeps high ones, ramps between, and
    multiplies cos/sin by mscale(factor, mscale) / mscale(factor, mscale_all_dim).
    """

    def __init__(self, config: DeepseekV2Config):
        super().__init__()
        self.config = config
        self.cos: torch.Tensor | None = None
        self.sin: torch.Tensor | None = None

    def _inv_freq(self, device: torch.device) -> tuple[torch.Tensor, float]:
        dim, base, rope = self.config.qk_rope_head_dim, self.config.rope_theta, self.config.rope
        pos_freqs = base ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim)
        if rope["rope_type"] == "default":
            return 1.0 / pos_freqs, 1.0
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
        return inv_freq, float(attention_factor)

    def _build(self, max_pos: int, device: torch.device) -> None:
        inv_freq, attention_factor = self._inv_freq(device)
        freqs = torch.outer(torch.arange(max_pos, device=device, dtype=torch.float32), inv_freq)  # [P, R/2]
        self.cos, self.sin = freqs.cos() * attention_factor, freqs.sin() * attention_factor

    def forward(self, positions: torch.Tensor, *xs: torch.Tensor) -> list[torch.Tensor]:
        max_pos = int(positions.max()) + 1 if positions.numel() else 1
        if self.cos is None or self.cos.shape[0] < max_pos or self.cos.device != positions.device:
            self._build(max(max_pos, 2 * (self.cos.shape[0] if self.cos is not None else 1024)), positions.device)
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
    """1/sqrt(qk_head_dim), times mscale(factor, mscale_all_dim)^2 under yarn.

    Yarn's attention factor is folded into cos/sin, which scales q_pe.k_pe but not
    q_nope.k_nope; DeepSeek-V2 corrects the whole score with the squared mscale here.
    """
    scale = config.qk_head_dim**-0.5
    rope = config.rope
    if rope["rope_type"] != "default" and rope.get("mscale_all_dim"):
        scale *= _yarn_mscale(float(rope["factor"]), float(rope["mscale_all_dim"])) ** 2
    return scale


def latent_pages(pages: KVPages) -> KVPages:
    """The same K pages viewed as both K and V: MLA's values are a prefix of its keys."""
    return KVPages(k=pages.k, v=pages.k, precision=pages.precision, k_scale=pages.k_scale, k_zero=pages.k_zero,
                   v_scale=pages.k_scale, v_zero=pages.k_zero)


def allocate_latent_pages(config: DeepseekV2Config, num_blocks: int, block_size: int, precision: str,
                          dtype: torch.dtype = torch.float16, device: torch.device | str = "cpu") -> KVPages:
    """One layer's cache: one KV head of `kv_head_dim` values per token, V aliased to K (no second copy)."""
    pages = allocate_pages(num_blocks, block_size, 1, config.kv_head_dim, precision, dtype, device)
    return latent_pages(pages)


class LatentAttention(nn.Module):
    def __init__(self, config: DeepseekV2Config, rotary: InterleavedRotary):
        super().__init__()
        self.config = config
        self.num_heads = config.num_heads
        hidden, heads = config.hidden_size, config.num_heads
        if config.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, heads * config.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, config.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, 1e-6)
            self.q_b_proj = nn.Linear(config.q_lora_rank, heads * config.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, config.kv_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(config.kv_lora_rank, 1e-6)
        self.kv_b_proj = nn.Linear(config.kv_lora_rank, heads * (config.qk_nope_head_dim + config.v_head_dim),
                                   bias=False)
        self.o_proj = nn.Linear(heads * config.v_head_dim, hidden, bias=False)
        self.rotary = rotary
        self.scale = softmax_scale(config)

    def _up_projections(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_uk [H, nope, rank] and W_uv [H, v, rank], views of kv_b_proj's weight."""
        c = self.config
        w = self.kv_b_proj.weight.view(self.num_heads, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
        return w[:, : c.qk_nope_head_dim], w[:, c.qk_nope_head_dim :]

    def forward(self, h, positions, meta: AttentionMetadata, kv_pages: KVPages) -> torch.Tensor:
        c = self.config
        num_tokens = h.shape[0]
        q = self.q_proj(h) if c.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(h)))
        q = q.view(num_tokens, self.num_heads, c.qk_head_dim)  # [T, H, nope + rope]
        q_nope, q_pe = q.split([c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(h).split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)
        k_pe = k_pe.view(num_tokens, 1, c.qk_rope_head_dim)  # [T, 1, rope]
        q_pe, k_pe = self.rotary(positions, q_pe, k_pe)

        w_uk, w_uv = self._up_projections()
        q_latent = torch.einsum("thn,hnr->thr", q_nope, w_uk)  # [T, H, rank]
        q_full = torch.cat((q_latent, q_pe), dim=-1)  # [T, H, rank + rope]
        kv = torch.cat((latent.view(num_tokens, 1, c.kv_lora_rank), k_pe), dim=-1)  # [T, 1, rank + rope]
        out = paged_attention(q_full, kv, kv, latent_pages(kv_pages), meta, self.scale)  # [T, H, rank + rope]
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
    def __init__(self, config: DeepseekV2Config):
        super().__init__()
        self.gate = Router(config)
        self.experts = nn.ModuleList(
            MLP(config.hidden_size, config.moe_intermediate_size) for _ in range(config.num_routed_experts))
        if config.num_shared_experts:
            self.shared_experts = MLP(config.hidden_size, config.moe_intermediate_size * config.num_shared_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)  # [T, k]
        out = torch.zeros_like(x)
        # Loop over the experts some token chose, not over tokens: each expert's weights are read once.
        for expert_id in ids.unique().tolist():
            token_idx, slot = torch.where(ids == expert_id)
            y = self.experts[expert_id](x[token_idx]) * weights[token_idx, slot, None].to(x.dtype)
            out.index_add_(0, token_idx, y)
        if hasattr(self, "shared_experts"):
            out = out + self.shared_experts(x)
        return out


class DecoderLayer(nn.Module):
    def __init__(self, config: DeepseekV2Config, layer_idx: int, rotary: InterleavedRotary):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LatentAttention(config, rotary)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        is_moe = config.num_routed_experts > 0 and layer_idx >= config.first_k_dense_replace
        self.mlp = MoE(config) if is_moe else MLP(config.hidden_size, config.intermediate_size)

    def forward(self, h, positions, meta, kv_pages):
        h = h + self.self_attn(self.input_layernorm(h), positions, meta, kv_pages)
        return h + self.mlp(self.post_attention_layernorm(h))


class DeepseekV2Model(nn.Module):
    def __init__(self, config: DeepseekV2Config):
        super().__init__()
        self.rotary = InterleavedRotary(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i, self.rotary) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class DeepseekV2ForCausalLM(CausalLM):
    """`model.*` and `lm_head` as in the checkpoint; the forward and compute_logits of CausalLM.

    kv_pages: one KVPages per layer with one KV head of `config.kv_head_dim` values
    (see `allocate_latent_pages`); only their K tensors are read and written.
    """

    def __init__(self, config: DeepseekV2Config):
        super().__init__(config, DeepseekV2Model(config))


def load_deepseek_v2(model_dir: str | Path, device: torch.device | str,
                     dtype: torch.dtype | None = None) -> tuple[DeepseekV2ForCausalLM, dict]:
    """Build on the meta device from config.json and assign the safetensors tensors by name.

    Returns the model (with `.dtype` set) and the raw config.json dict. The router
    weights (`mlp.gate.weight`) stay FP32 as DeepSeek keeps them: routing on rounded
    scores flips expert choices between near-tied experts.
    """
    from safetensors import SafetensorError, safe_open

    from lowvram.loader import weight_files

    model_dir, device = Path(model_dir), torch.device(device)
    try:
        raw = json.loads((model_dir / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {model_dir / 'config.json'} ({exc})") from None
    if raw.get("quantization_config"):
        raise UnsupportedModelError(f"quantized {ARCHITECTURE} checkpoints are not supported yet; use the FP16/BF16 one")
    config = DeepseekV2Config.from_dict(raw)
    if dtype is None:
        dtype = torch.float16 if device.type == "cuda" else torch.float32
    with torch.device("meta"):
        model = DeepseekV2ForCausalLM(config)
    expected = dict(model.named_parameters())
    loaded: set[str] = set()
    for path in weight_files(model_dir):
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():
                    if name not in expected:
                        continue
                    tensor = f.get_tensor(name)
                    if tuple(tensor.shape) != tuple(expected[name].shape):
                        raise ModelLoadError(f"tensor {name} has shape {tuple(tensor.shape)} but config.json implies "
                                             f"{tuple(expected[name].shape)}")
                    target_dtype = torch.float32 if name.endswith("mlp.gate.weight") else dtype
                    module_name, _, attr = name.rpartition(".")
                    setattr(model.get_submodule(module_name), attr,
                            nn.Parameter(tensor.to(device=device, dtype=target_dtype), requires_grad=False))
                    loaded.add(name)
        except (SafetensorError, OSError, RuntimeError, ValueError) as exc:
            raise ModelLoadError(f"{path} is corrupt or unreadable ({exc}); re-download this shard") from None
    if config.is_tied_head and "lm_head.weight" not in loaded:
        model.lm_head.weight = model.model.embed_tokens.weight
        loaded.add("lm_head.weight")
    missing = sorted(set(expected) - loaded)
    if missing:
        raise ModelLoadError(f"the checkpoint lacks {len(missing)} tensors the config needs, e.g. {missing[0]}; it is "
                             "incomplete or does not match config.json")
    model.dtype = dtype
    model.eval()
    return model, raw
