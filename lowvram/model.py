"""Dense decoder-only models: LlamaForCausalLM (deepseek-coder) and Qwen2ForCausalLM
(DeepSeek-R1-Distill-Qwen), as plain nn.Modules over paged KV.

Parameter names equal the Hugging Face checkpoint names, so a checkpoint loads by
name without a mapping table.
"""

from __future__ import annotations

import torch
from torch import nn

from lowvram.attention import AttentionMetadata, paged_attention
from lowvram.kv_quant import KVPages
from lowvram.model_config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in FP32: FP16 squares overflow past |x| ~ 256.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Rotary(nn.Module):
    """Non-interleaved RoPE (rotate-half), with linear position scaling."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.head_dim = config.head_dim
        self.theta = config.rope_theta
        self.position_scale = 1.0 / config.rope_factor if config.rope_type == "linear" else 1.0
        self.cos: torch.Tensor | None = None
        self.sin: torch.Tensor | None = None

    def _build(self, max_pos: int, device: torch.device) -> None:
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, self.head_dim, 2, device=device, dtype=torch.float32) / self.head_dim))
        pos = torch.arange(max_pos, device=device, dtype=torch.float32) * self.position_scale
        freqs = torch.outer(pos, inv_freq)  # [P, D/2]
        self.cos, self.sin = freqs.cos(), freqs.sin()

    def forward(self, positions: torch.Tensor, *xs: torch.Tensor) -> list[torch.Tensor]:
        max_pos = int(positions.max()) + 1 if positions.numel() else 1
        if self.cos is None or self.cos.shape[0] < max_pos or self.cos.device != positions.device:
            self._build(max(max_pos, 2 * (self.cos.shape[0] if self.cos is not None else 1024)), positions.device)
        cos = self.cos[positions][:, None, :]  # [T, 1, D/2]
        sin = self.sin[positions][:, None, :]
        out = []
        for x in xs:  # x: [T, heads, D]
            x1, x2 = x.float().chunk(2, dim=-1)
            out.append(torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype))
        return out


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, rotary: Rotary):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        bias = config.has_qkv_bias
        self.q_proj = nn.Linear(config.hidden_size, config.q_size, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, config.kv_size, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, config.kv_size, bias=bias)
        self.o_proj = nn.Linear(config.q_size, config.hidden_size, bias=False)
        self.rotary = rotary
        self.scale = self.head_dim**-0.5

    def forward(self, h, positions, meta: AttentionMetadata, kv_pages: KVPages) -> torch.Tensor:
        num_tokens = h.shape[0]
        q = self.q_proj(h).view(num_tokens, self.num_heads, self.head_dim)  # [T, H, D]
        k = self.k_proj(h).view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = self.v_proj(h).view(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(positions, q, k)
        out = paged_attention(q, k, v, kv_pages, meta, self.scale)
        return self.o_proj(out.reshape(num_tokens, -1))  # [T, H*D] -> [T, hidden]


class MLP(nn.Module):
    """SiLU-gated MLP (SwiGLU); also each expert of the MoE models."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, rotary: Rotary):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, rotary)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)

    def forward(self, h, positions, meta, kv_pages):
        h = h + self.self_attn(self.input_layernorm(h), positions, meta, kv_pages)
        return h + self.mlp(self.post_attention_layernorm(h))


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.rotary = Rotary(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, self.rotary) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module):
    """`model.*` and `lm_head` as in the checkpoint; forward returns final hidden states.

    `model` is the decoder stack (embed_tokens, layers, norm); by default the dense one.
    """

    def __init__(self, config: ModelConfig, model: nn.Module | None = None):
        super().__init__()
        self.config = config
        self.model = model if model is not None else DecoderModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, positions, meta: AttentionMetadata, kv_pages: list[KVPages]) -> torch.Tensor:
        """input_ids, positions: [T] -> hidden states [T, hidden]."""
        h = self.model.embed_tokens(input_ids)
        for layer, pages in zip(self.model.layers, kv_pages):
            h = layer(h, positions, meta, pages)
        return self.model.norm(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> FP32 logits [N, vocab]."""
        return self.lm_head(hidden).float()
