"""One decoder layer run densely over whole calibration samples, for `lowvram quantize`, its
weights read tensor by tensor from the (memory-mapped) source checkpoint."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from lowvram.errors import ModelLoadError
from lowvram.models.checkpoint import weight_files
from lowvram.models.config import ModelConfig
from lowvram.models.dense import Rotary

# Every quantized Linear -> the input it reads, as LayerRunner.inputs names it.
INPUT_OF = dict.fromkeys([f"self_attn.{p}_proj" for p in "qkv"], "attn_in") | {"self_attn.o_proj": "o_in"}
INPUT_OF |= {"mlp.gate_proj": "mlp_in", "mlp.up_proj": "mlp_in", "mlp.down_proj": "down_in"}
NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight")


class SourceCheckpoint:
    """The input checkpoint's tensors, read one at a time from its (memory-mapped) shards."""

    def __init__(self, model_dir: Path):
        from safetensors import safe_open

        self._where = {}
        for path in weight_files(model_dir):
            try:
                handle = safe_open(str(path), framework="pt", device="cpu")
            except Exception as exc:  # safetensors raises its own error types and OSError
                raise ModelLoadError(f"{path} is corrupt or unreadable ({exc}); re-download this shard") from None
            self._where.update(dict.fromkeys(handle.keys(), handle))

    def get(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise ModelLoadError(f"the checkpoint lacks {name}; it is incomplete or does not match config.json")
        return self._where[name].get_tensor(name)

    def layer(self, config: ModelConfig, index: int, device: torch.device) -> dict:
        """Float32 weights of one decoder layer on the device, keyed by name within the layer."""
        names = [*NORMS, *(f"{linear}.weight" for linear in INPUT_OF)]
        if config.has_qkv_bias:
            names += [f"self_attn.{p}_proj.bias" for p in "qkv"]
        return {name: self.get(f"model.layers.{index}.{name}").to(device, torch.float32) for name in names}


class LayerRunner:
    """One decoder layer's forward over samples [b, L, hidden] without a KV cache; the weights
    come as a dict (name within the layer -> tensor), so a search can swap in trial weights."""

    def __init__(self, config: ModelConfig, seq_len: int, device: torch.device):
        self.config = config
        self.rotary = Rotary(config)
        self.positions = torch.arange(seq_len, device=device)

    @staticmethod
    def linear(weights: dict, name: str, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, weights[f"{name}.weight"], weights.get(f"{name}.bias"))

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps)
        return weight * xf.to(x.dtype)

    def attention_context(self, weights: dict, x: torch.Tensor) -> torch.Tensor:
        """x [b, L, hidden] (normed) -> context before o_proj [b, L, heads * head_dim]."""
        batch, length, _ = x.shape
        num_heads, num_kv_heads, head_dim = self.config.num_heads, self.config.num_kv_heads, self.config.head_dim
        q = self.linear(weights, "self_attn.q_proj", x).reshape(batch * length, num_heads, head_dim)
        k = self.linear(weights, "self_attn.k_proj", x).reshape(batch * length, num_kv_heads, head_dim)
        v = self.linear(weights, "self_attn.v_proj", x)
        q, k = self.rotary(self.positions[:length].repeat(batch), q, k)
        group = num_heads // num_kv_heads
        # q: [b, H, L, D]; k, v: [b, Hkv, L, D] repeated to [b, H, L, D]
        q = q.reshape(batch, length, num_heads, head_dim).transpose(1, 2)
        k = k.reshape(batch, length, num_kv_heads, head_dim).transpose(1, 2).repeat_interleave(group, dim=1)
        v = v.reshape(batch, length, num_kv_heads, head_dim).transpose(1, 2).repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=head_dim**-0.5)
        return out.transpose(1, 2).reshape(batch, length, num_heads * head_dim)

    def attention(self, weights: dict, x: torch.Tensor) -> torch.Tensor:
        return self.linear(weights, "self_attn.o_proj", self.attention_context(weights, x))

    def mlp_hidden(self, weights: dict, x: torch.Tensor) -> torch.Tensor:
        return F.silu(self.linear(weights, "mlp.gate_proj", x)) * self.linear(weights, "mlp.up_proj", x)

    def mlp(self, weights: dict, x: torch.Tensor) -> torch.Tensor:
        return self.linear(weights, "mlp.down_proj", self.mlp_hidden(weights, x))

    def blocks(self, weights: dict, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(attention output, MLP output, layer output) for the layer's input h."""
        attn = self.attention(weights, self.rms_norm(h, weights["input_layernorm.weight"]))
        mlp = self.mlp(weights, self.rms_norm(h + attn, weights["post_attention_layernorm.weight"]))
        return attn, mlp, h + attn + mlp

    def block(self, kind: str, weights: dict, x: torch.Tensor) -> torch.Tensor:
        """The output of the block that input x of `kind` (a value of INPUT_OF) feeds."""
        if kind == "attn_in":
            return self.attention(weights, x)
        if kind == "mlp_in":
            return self.mlp(weights, x)
        return self.linear(weights, "self_attn.o_proj" if kind == "o_in" else "mlp.down_proj", x)

    def inputs(self, weights: dict, h: torch.Tensor, attn: torch.Tensor | None, kinds) -> dict[str, torch.Tensor]:
        """The Linears' inputs of `kinds` (values of INPUT_OF) from the layer's input h and its
        attention output attn (which the MLP's inputs depend on)."""
        found = {"attn_in": self.rms_norm(h, weights["input_layernorm.weight"])}
        if "o_in" in kinds:
            found["o_in"] = self.attention_context(weights, found["attn_in"])
        if "mlp_in" in kinds or "down_in" in kinds:
            found["mlp_in"] = self.rms_norm(h + attn, weights["post_attention_layernorm.weight"])
            found["down_in"] = self.mlp_hidden(weights, found["mlp_in"]) if "down_in" in kinds else None
        return {kind: found[kind] for kind in kinds}
