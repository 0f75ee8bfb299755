"""Concatenate a layer's projections that read the same input into one matmul, after loading: at
decode each is a matrix-vector product whose cost is mostly its launch. AWQ parts concatenate
along N (eight columns per int32, scales grouped along K); compensation as A = [A_q; A_k; A_v]
and a block-diagonal B. Bias corrections are already in the biases (a missing bias reads as 0).
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
    fused = AwqLinear(
        first.in_features, sum(p.out_features for p in parts), first.group_size, any(p.has_own_bias for p in parts)
    )
    fused.is_bias_corrected = any(p.is_bias_corrected for p in parts)
    for name in ("qweight", "qzeros", "scales"):
        fused.register_buffer(name, torch.cat([getattr(p, name) for p in parts], dim=1).contiguous())  # along N
    like = next((p.bias for p in parts if p.bias is not None), None)
    if like is not None:
        bias = torch.cat([like.new_zeros(p.out_features) if p.bias is None else p.bias for p in parts])
        fused.bias = nn.Parameter(bias, requires_grad=False)
    like = next((getattr(p, LORA_B) for p in parts if p.lora_rank), None)
    if like is not None:
        fused.set_compensation(LORA_A, torch.cat([getattr(p, LORA_A) for p in parts if p.lora_rank]))  # [r_total, K]
        blocks = [getattr(p, LORA_B) if p.lora_rank else like.new_zeros(p.out_features, 0) for p in parts]
        fused.set_compensation(LORA_B, torch.block_diag(*blocks))  # [N_total, r_total], block diagonal
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
    """Fuse q/k/v and gate/up of every dense decoder layer in place where the parts are of one kind
    (not an FP16-kept q with an INT4 k); returns how many blocks were fused."""
    num_fused = 0
    for layer in model.modules():
        if type(layer) is not DecoderLayer:
            continue
        for module, kind, names, attr in (
            (layer.self_attn, Attention, ("q_proj", "k_proj", "v_proj"), "qkv_proj"),
            (layer.mlp, MLP, ("gate_proj", "up_proj"), "gate_up_proj"),
        ):
            if type(module) is kind and getattr(module, attr) is None:
                fused = fuse([getattr(module, name) for name in names])
                if fused is not None:
                    setattr(module, attr, fused)
                    for name in names:
                        delattr(module, name)
                    num_fused += 1
    return num_fused
