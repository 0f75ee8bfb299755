"""Concatenate a layer's projections that read the same input into one matmul.

At decode time every projection is a matrix-vector product whose cost is mostly its launch
and its ramp-up over the GPU, so q, k and v as one [K, Nq + 2 Nkv] product, and gate and up
as one [K, 2I] product, save two and one launches per layer and give each kernel a larger
N to spread over the SMs. The checkpoint keeps its names; fusion happens after loading, so
quantization, reports and saved files never see the fused modules.

Both nn.Linear and AwqLinear fuse. AWQ packs eight output columns per int32 and groups
scales along K, so concatenating qweight, qzeros and scales along N keeps every column's
nibble order and group. A residual compensation fuses too: the rank-r factors stack into
A = [A_q; A_k; A_v] and a block-diagonal B, so each output still sees only its own term.
Bias corrections are already inside the parts' biases, so AWQ parts with and without a bias
fuse, the missing biases read as zeros.
"""

from __future__ import annotations

import torch
from torch import nn

from lowvram.models.dense import MLP, Attention, DecoderLayer
from lowvram.quant.awq_linear import LORA_A, LORA_B, AwqLinear


def _cat_linear(parts: list[nn.Linear]) -> nn.Linear:
    first = parts[0]
    has_bias = first.bias is not None
    fused = nn.Linear(first.in_features, sum(p.out_features for p in parts), bias=has_bias, device="meta")
    fused.weight = nn.Parameter(torch.cat([p.weight for p in parts]), requires_grad=False)  # [N_total, K]
    if has_bias:
        fused.bias = nn.Parameter(torch.cat([p.bias for p in parts]), requires_grad=False)
    return fused


def _cat_awq(parts: list[AwqLinear]) -> AwqLinear:
    first = parts[0]
    biases = [p.bias for p in parts]
    has_bias = any(b is not None for b in biases)
    fused = AwqLinear(
        first.in_features, sum(p.out_features for p in parts), first.group_size, any(p.has_own_bias for p in parts)
    )
    fused.is_bias_corrected = any(p.is_bias_corrected for p in parts)
    for name in ("qweight", "qzeros", "scales"):
        fused.register_buffer(name, torch.cat([getattr(p, name) for p in parts], dim=1).contiguous())  # along N
    if has_bias:
        like = next(b for b in biases if b is not None)
        fused.bias = nn.Parameter(
            torch.cat(
                [
                    b if b is not None else torch.zeros(p.out_features, dtype=like.dtype, device=like.device)
                    for b, p in zip(biases, parts)
                ]
            ),
            requires_grad=False,
        )
    if any(p.lora_rank for p in parts):
        like = next(getattr(p, LORA_A) for p in parts if p.lora_rank)
        lora_a = torch.cat([getattr(p, LORA_A) for p in parts if p.lora_rank])  # [r_total, K]
        lora_b = torch.zeros(fused.out_features, lora_a.shape[0], dtype=like.dtype, device=like.device)
        row, rank = 0, 0
        for p in parts:
            if p.lora_rank:
                lora_b[row : row + p.out_features, rank : rank + p.lora_rank] = getattr(p, LORA_B)
                rank += p.lora_rank
            row += p.out_features
        fused.set_compensation(LORA_A, lora_a)
        fused.set_compensation(LORA_B, lora_b)  # [N_total, r_total], block diagonal
    return fused


def fuse(parts: list[nn.Module]) -> nn.Module | None:
    """One module computing torch.cat([p(x) for p in parts], -1), or None when they differ in kind."""
    if all(type(p) is nn.Linear for p in parts):
        if len({(p.in_features, p.weight.dtype, p.weight.device, p.bias is None) for p in parts}) == 1:
            return _cat_linear(parts)
    elif all(type(p) is AwqLinear for p in parts):
        if len({(p.in_features, p.group_size, p.qweight.device) for p in parts}) == 1:
            return _cat_awq(parts)
    return None


def fuse_projections(model: nn.Module) -> int:
    """Fuse q/k/v and gate/up of every dense decoder layer in place; returns how many blocks
    were fused. Blocks whose projections differ in kind (an FP16-kept q with an INT4 k, say)
    stay as they are, and so do other architectures' layers (MoE experts keep their own
    tensors, which the expert cache moves one by one)."""
    num_fused = 0
    for layer in model.modules():
        if type(layer) is not DecoderLayer:
            continue
        attn, mlp = layer.self_attn, layer.mlp
        if type(attn) is Attention and attn.qkv_proj is None:
            fused = fuse([attn.q_proj, attn.k_proj, attn.v_proj])
            if fused is not None:
                attn.qkv_proj = fused
                del attn.q_proj, attn.k_proj, attn.v_proj
                num_fused += 1
        if type(mlp) is MLP and mlp.gate_up_proj is None:
            fused = fuse([mlp.gate_proj, mlp.up_proj])
            if fused is not None:
                mlp.gate_up_proj = fused
                del mlp.gate_proj, mlp.up_proj
                num_fused += 1
    return num_fused
