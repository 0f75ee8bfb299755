"""Dense decoder-only models over paged KV: LlamaForCausalLM (deepseek-coder) and Qwen2ForCausalLM
(DeepSeek-R1-Distill-Qwen), with the checkpoint's parameter names."""

from __future__ import annotations

import torch
from torch import nn

from lowvram.kernels.activation import silu_and_mul
from lowvram.kernels.kv_quant import KVPages
from lowvram.kernels.rms_norm import rms_norm
from lowvram.kernels.rotary import apply_rotary_ref
from lowvram.kernels.w4a16 import RopeKVWrite
from lowvram.kv.attention import AttentionMetadata, Rope, paged_attention
from lowvram.models.checkpoint import weight_report
from lowvram.models.config import ModelConfig
from lowvram.quant.awq_linear import AwqLinear


def fuses_input(proj: nn.Module | None, x: torch.Tensor, norm: RMSNorm | None = None) -> bool:
    """Whether `proj` can take the norm (or the gate's activation) before it into its own kernel:
    one float16 row into an INT4 projection on the GPU, outside the batch-invariant mode."""
    return isinstance(proj, AwqLinear) and proj.can_fuse_input(x) and (norm is None or norm.weight.dtype == x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in FP32 (inside the kernel too): FP16 squares overflow past |x| ~ 256.
        return rms_norm(x, self.weight, self.eps, use_reference=not x.is_cuda)[0]

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual), written over x and residual: new tensors would keep two
        more [T, hidden] alive than the memory plan counts. With no residual yet, (norm(x), x)."""
        if residual is None:
            return self.forward(x), x
        # Only norm weights of another dtype than the activations (none we load) need a new tensor.
        out = x if torch.promote_types(x.dtype, self.weight.dtype) == x.dtype else None
        return rms_norm(x, self.weight, self.eps, residual, out=out, sum_out=residual, use_reference=not x.is_cuda)

    def add_norm_project(
        self, proj: nn.Module, x: torch.Tensor, residual: torch.Tensor | None, rope_kv: RopeKVWrite | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(proj(norm(x + residual)), x + residual), in one kernel where proj fuses_input; `rope_kv`
        adds RoPE and the KV store to a q/k/v projection's."""
        if rope_kv is not None or fuses_input(proj, x, self):
            return proj.forward_normed(x, residual, self.weight, self.eps, rope_kv=rope_kv)
        normed, residual = self.add_and_norm(x, residual)
        return proj(normed), residual


class Rotary(nn.Module):
    """Rotate-half RoPE with linear position scaling. Its cos/sin tables [P, D/2] double as contexts
    grow, replacing the tensors: a CUDA graph must reserve its longest context first."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.cos: torch.Tensor | None = None
        self.sin: torch.Tensor | None = None

    def _frequencies(self, device: torch.device) -> tuple[torch.Tensor, float, float]:
        """(inverse frequencies [D/2], position scale, factor on cos and sin)."""
        c = self.config
        exponents = torch.arange(0, c.head_dim, 2, device=device, dtype=torch.float32) / c.head_dim
        return 1.0 / (c.rope_theta**exponents), (1.0 / c.rope_factor if c.rope_type == "linear" else 1.0), 1.0

    def reserve(self, num_positions: int, device: torch.device) -> None:
        """Make the tables cover `num_positions`."""
        if self.cos is None or self.cos.shape[0] < num_positions or self.cos.device != device:
            max_pos = max(num_positions, 2 * (self.cos.shape[0] if self.cos is not None else 1024))
            inv_freq, position_scale, factor = self._frequencies(device)
            pos = torch.arange(max_pos, device=device, dtype=torch.float32) * position_scale
            freqs = torch.outer(pos, inv_freq)  # [P, D/2]
            self.cos, self.sin = freqs.cos().mul_(factor), freqs.sin().mul_(factor)

    def forward(self, positions: torch.Tensor, *xs: torch.Tensor, num_positions: int | None = None) -> list:
        """Rotate each x [T, heads, D] by its token's position. `num_positions` bounds the positions,
        sparing a read from the device (a stall, impossible inside a CUDA graph capture)."""
        if num_positions is None:
            num_positions = int(positions.max()) + 1 if positions.numel() else 1
        self.reserve(num_positions, positions.device)
        return self._rotate(positions, xs)

    def _rotate(self, positions: torch.Tensor, xs) -> list[torch.Tensor]:
        return [apply_rotary_ref(x, positions, self.cos, self.sin) for x in xs]

    def rope(self, positions: torch.Tensor, num_positions: int) -> Rope:
        """The rotation of tokens at `positions` [T], for paged_attention to apply as it stores k."""
        self.reserve(num_positions, positions.device)
        return Rope(positions, self.cos, self.sin)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, rotary: Rotary):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        bias = config.has_qkv_bias
        self.q_proj = nn.Linear(config.hidden_size, config.q_size, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, config.kv_size, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, config.kv_size, bias=bias)
        self.o_proj = nn.Linear(config.q_size, config.hidden_size, bias=False)
        self.qkv_proj: nn.Module | None = None  # q, k and v in one matmul, set by lowvram.models.fusion
        self.rotary = rotary
        self.scale = self.head_dim**-0.5
        self.is_batch_invariant = False  # set by lowvram.models.batch_invariance

    def forward(self, h, positions, meta: AttentionMetadata, kv_pages: KVPages) -> torch.Tensor:
        if self.qkv_proj is not None:
            return self.attend(self.qkv_proj(h), positions, meta, kv_pages)
        return self._attend_heads(self.q_proj(h), self.k_proj(h), self.v_proj(h), positions, meta, kv_pages)

    def fused_rope_kv(
        self, x: torch.Tensor, norm: RMSNorm, positions: torch.Tensor, meta: AttentionMetadata, kv_pages: KVPages
    ) -> RopeKVWrite | None:
        """RoPE and the KV store for the fused q/k/v kernel to run: for a one-token decode step whose
        projection fuses_input, with heads of a power-of-two size from 16 up; else None."""
        fits = x.shape[0] == 1 and self.head_dim >= 16 and not self.head_dim & (self.head_dim - 1)
        if meta.is_prefill or self.is_batch_invariant or not fits or not fuses_input(self.qkv_proj, x, norm):
            return None
        rope = self.rotary.rope(positions, meta.max_context_len)
        return RopeKVWrite(self.num_heads, rope.positions, rope.cos, rope.sin, meta.slot_mapping, kv_pages)

    def attend(
        self, qkv, positions, meta: AttentionMetadata, kv_pages: KVPages, *, is_stored: bool = False
    ) -> torch.Tensor:
        """qkv [T, q_size + 2 * kv_size] -> [T, hidden]; `is_stored`: rotated and stored (fused_rope_kv)."""
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split((q_size, kv_size, kv_size), dim=-1)
        return self._attend_heads(q, k, v, positions, meta, kv_pages, is_stored)

    def _attend_heads(self, q, k, v, positions, meta, kv_pages, is_stored=False) -> torch.Tensor:
        num_tokens = q.shape[0]
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # [T, H, D], a view into qkv
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        rope = None if is_stored else self.rotary.rope(positions, meta.max_context_len)
        # rotates q and k in place first, unless the projection did
        out = paged_attention(
            q, k, v, kv_pages, meta, self.scale, rope, batch_invariant=self.is_batch_invariant, is_stored=is_stored
        )
        return self.o_proj(out.reshape(num_tokens, -1))  # [T, H*D] -> [T, hidden]


class MLP(nn.Module):
    """SiLU-gated MLP (SwiGLU); also each expert of the MoE models."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.gate_up_proj: nn.Module | None = None  # gate and up in one matmul, set by lowvram.models.fusion

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            return self.activate_and_down(self.gate_up_proj(x))
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))

    def activate_and_down(self, gate_up: torch.Tensor) -> torch.Tensor:
        """down(silu(gate) * up) of gate_up [T, 2I]; for one INT4 row inside the down projection's kernel."""
        if fuses_input(self.down_proj, gate_up):
            return self.down_proj.forward_gated(gate_up)
        return self.down_proj(silu_and_mul(gate_up, use_reference=not gate_up.is_cuda))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, rotary: Rotary):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, rotary)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)

    def forward(self, h, residual, positions, meta, kv_pages):
        """(h, residual) -> (this layer's MLP output, the residual stream before it): the next norm
        adds them. One-row INT4 decode runs the norms and the activation inside the projections'
        kernels: six launches a layer instead of nine."""
        attn, mlp = self.self_attn, self.mlp  # either may be a stand-in (layer_streaming.HostComputed)
        qkv_proj, gate_up_proj = getattr(attn, "qkv_proj", None), getattr(mlp, "gate_up_proj", None)
        if qkv_proj is not None:
            rope_kv = attn.fused_rope_kv(h, self.input_layernorm, positions, meta, kv_pages)
            qkv, residual = self.input_layernorm.add_norm_project(qkv_proj, h, residual, rope_kv)
            h = attn.attend(qkv, positions, meta, kv_pages, is_stored=rope_kv is not None)
        else:
            x, residual = self.input_layernorm.add_and_norm(h, residual)
            h = attn(x, positions, meta, kv_pages)
        if gate_up_proj is not None:
            gate_up, residual = self.post_attention_layernorm.add_norm_project(gate_up_proj, h, residual)
            return mlp.activate_and_down(gate_up), residual
        # The attention output is not kept past the add: the MLP runs without it.
        x, residual = self.post_attention_layernorm.add_and_norm(h, residual)
        return mlp(x), residual


class DecoderModel(nn.Module):
    """The decoder stack; `make_layer(index)` builds each layer, all sharing `rotary`."""

    def __init__(self, config: ModelConfig, rotary: Rotary, make_layer):
        super().__init__()
        self.rotary = rotary
        # Given its (empty) weight, the embedding skips a random init that on the meta device
        # imports torch's compiler, a second at every start.
        weight = torch.empty(config.vocab_size, config.hidden_size)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=weight)
        self.layers = nn.ModuleList(make_layer(i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module):
    """`model` (embed_tokens, layers, norm; dense by default) and `lm_head` as in the checkpoint."""

    # The decode step holds no host syncs and no data-dependent shapes, so it can be captured.
    supports_cuda_graphs = True

    def __init__(self, config: ModelConfig, model: nn.Module | None = None):
        super().__init__()
        self.config = config
        if model is None:
            rotary = Rotary(config)
            model = DecoderModel(config, rotary, lambda _: DecoderLayer(config, rotary))
        self.model = model
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, positions, meta: AttentionMetadata, kv_pages: list[KVPages]) -> torch.Tensor:
        """input_ids, positions: [T] -> hidden states [T, hidden]."""
        h, residual = self.model.embed_tokens(input_ids), None
        for layer, pages in zip(self.model.layers, kv_pages):
            h, residual = layer(h, residual, positions, meta, pages)
        return self.model.norm.add_and_norm(h, residual)[0]

    def reserve_positions(self, num_positions: int, device: torch.device) -> None:
        """Build the position tables for contexts up to `num_positions` now, not mid-step."""
        self.model.rotary.reserve(num_positions, device)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> FP32 logits [N, vocab]."""
        return self.lm_head(hidden).float()

    def count_weights(self) -> None:
        self.weight_report = weight_report(self)
        self.weight_bytes = self.weight_report.total_bytes
