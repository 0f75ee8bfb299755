"""AWQ (Lin et al. 2024): per-input-channel scales, then per-group clipping.

Per scale group (the Linears reading one input): s = x_mean^alpha / (w_mean^(1-alpha) + 1e-4),
alpha in 0..0.95, normalised by sqrt(max(s) min(s)); the s (or s = 1, RTN) with the lowest
block-output MSE is folded in exactly (prev's output / s, the columns * s). Then every Linear
but q/k (whose errors softmax amplifies) clips each group to 1.0..0.55 of its max |w|.
`fake_quantize` equals the written checkpoint, so the search measures its true error.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from lowvram.kernels.awq_format import MAX_QUANT_VALUE

NUM_ALPHAS = 20
CLIP_RATIOS = tuple(1.0 - 0.05 * i for i in range(10))  # 1.0 .. 0.55
MAX_CLIP_TOKENS = 512
# Partial outputs held at once by the clipping search: [K/G, tokens, outputs] elements.
MAX_CLIP_ELEMENTS = 1 << 24
NO_CLIP_LINEARS = ("self_attn.q_proj", "self_attn.k_proj")


class ScaleGroup(NamedTuple):
    """Linears reading the output of `prev` (a norm or a Linear): the input `inputs` (as
    layer.INPUT_OF names it), scored on the output of the block it feeds (LayerRunner.block)."""

    prev: str
    linears: tuple[str, ...]
    inputs: str


def layer_scale_groups(num_heads: int, num_kv_heads: int) -> list[ScaleGroup]:
    """The scale groups of one decoder layer, in search order (v -> o only without GQA)."""
    groups = [ScaleGroup("input_layernorm", tuple(f"self_attn.{p}_proj" for p in "qkv"), "attn_in")]
    if num_heads == num_kv_heads:
        groups.append(ScaleGroup("self_attn.v_proj", ("self_attn.o_proj",), "o_in"))
    groups.append(ScaleGroup("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"), "mlp_in"))
    return [*groups, ScaleGroup("mlp.up_proj", ("mlp.down_proj",), "down_in")]


def fake_quantize(weight: torch.Tensor, group_size: int, max_abs: torch.Tensor | None = None) -> torch.Tensor:
    """weight [N, K] -> the float32 weight its INT4 form stands for, each group first clipped
    to +-max_abs [N, K/G] when given; equal to dequantize_awq(quantize_rtn(...)).t()."""
    num_outputs, num_inputs = weight.shape
    weight = weight.to(torch.float32)
    if max_abs is not None:
        weight = clip_weight(weight, group_size, max_abs)
    grouped = weight.reshape(num_outputs, num_inputs // group_size, group_size)  # [N, K/G, G]
    max_val = grouped.amax(dim=-1).clamp(min=0)
    min_val = grouped.amin(dim=-1).clamp(max=0)
    # rounded up to float16 as quantize_rtn does, so the scale never shrinks a group's range
    exact = (max_val - min_val).clamp(min=1e-5) / MAX_QUANT_VALUE
    rounded = exact.to(torch.float16)
    bumped = torch.nextafter(rounded, torch.full_like(rounded, float("inf")))
    scales = torch.where(rounded.to(torch.float32) < exact, bumped, rounded).to(torch.float32)
    zeros = torch.round(-min_val / scales).clamp(0, MAX_QUANT_VALUE)
    q = (torch.round(grouped / scales[..., None]) + zeros[..., None]).clamp(0, MAX_QUANT_VALUE)
    return ((q - zeros[..., None]) * scales[..., None]).reshape(num_outputs, num_inputs)


def clip_weight(weight: torch.Tensor, group_size: int, max_abs: torch.Tensor) -> torch.Tensor:
    """weight [N, K] with each group clipped to [-max_abs, max_abs] (max_abs [N, K/G])."""
    num_outputs, num_inputs = weight.shape
    grouped = weight.reshape(num_outputs, num_inputs // group_size, group_size)  # [N, K/G, G]
    limit = max_abs.to(weight.dtype)[..., None]
    return torch.minimum(torch.maximum(grouped, -limit), limit).reshape(num_outputs, num_inputs)


def search_scales(
    x_mean: torch.Tensor, weights: list[torch.Tensor], group_size: int, loss_fn: Callable[[list[torch.Tensor]], float]
) -> tuple[torch.Tensor, float | None]:
    """(scales [K], alpha) of a group; all ones and None when no alpha beats plain RTN.

    x_mean [K]: mean |x| per input channel; weights: the group's float32 [N_i, K] weights;
    loss_fn: the block output MSE for trial weights Q(W * s) / s.
    """
    x_mean = x_mean.to(torch.float32)
    # w_mean [K]: |w| relative to its group's max, averaged over all the group's outputs
    stacked = torch.cat([w.to(torch.float32) for w in weights], dim=0)
    grouped = stacked.abs().reshape(stacked.shape[0], -1, group_size)  # [N, K/G, G]
    w_mean = (grouped / (grouped.amax(dim=-1, keepdim=True) + 1e-6)).reshape(stacked.shape).mean(dim=0)
    best_loss = loss_fn([fake_quantize(w, group_size) for w in weights])
    best = torch.ones_like(x_mean), None
    for step in range(NUM_ALPHAS):
        alpha = step / NUM_ALPHAS
        scales = (x_mean.pow(alpha) / (w_mean.pow(1 - alpha) + 1e-4)).clamp(min=1e-4)
        scales = scales / (scales.max() * scales.min()).sqrt()
        loss = loss_fn([fake_quantize(w * scales, group_size) / scales for w in weights])
        if loss < best_loss:
            best_loss, best = loss, (scales, alpha)
    return best


def fold_scales(weights: dict[str, torch.Tensor], group: ScaleGroup, scales: torch.Tensor) -> None:
    """Fold s into the layer (in place): prev's output / s, the group's weights * s (columns)."""
    prev = group.prev
    if prev.endswith("norm"):
        weights[f"{prev}.weight"] = weights[f"{prev}.weight"] / scales
    else:
        weights[f"{prev}.weight"] = weights[f"{prev}.weight"] / scales[:, None]
        if weights.get(f"{prev}.bias") is not None:
            weights[f"{prev}.bias"] = weights[f"{prev}.bias"] / scales
    for name in group.linears:
        weights[f"{name}.weight"] = weights[f"{name}.weight"] * scales


def search_clip(weight: torch.Tensor, x: torch.Tensor, group_size: int) -> torch.Tensor:
    """max_abs [N, K/G] for weight [N, K] given sampled inputs x [T, K], chosen per group and
    output on that group's partial output x_g W_g^T."""
    num_outputs, num_inputs = weight.shape
    num_groups = num_inputs // group_size
    x = x.to(device=weight.device, dtype=torch.float32)
    xg = x.reshape(-1, num_groups, group_size).transpose(0, 1)  # [K/G, T, G]
    chunk = max(1, MAX_CLIP_ELEMENTS // (num_groups * xg.shape[1]))
    best_parts = []
    for start in range(0, num_outputs, chunk):
        w = weight[start : start + chunk].to(torch.float32)
        rows = w.shape[0]
        wg = w.reshape(rows, num_groups, group_size).permute(1, 2, 0)  # [K/G, G, rows]
        reference = torch.bmm(xg, wg)  # [K/G, T, rows]
        org_max = w.reshape(rows, num_groups, group_size).abs().amax(dim=-1)  # [rows, K/G]
        best_err = torch.full_like(org_max, float("inf"))
        best_max = org_max.clone()
        for ratio in CLIP_RATIOS:
            max_abs = org_max * ratio
            trial = fake_quantize(w, group_size, max_abs).reshape(rows, num_groups, group_size).permute(1, 2, 0)
            err = (torch.bmm(xg, trial) - reference).pow(2).mean(dim=1).t()  # [rows, K/G]
            is_better = err < best_err
            best_err = torch.where(is_better, err, best_err)
            best_max = torch.where(is_better, max_abs, best_max)
        best_parts.append(best_max)
    return torch.cat(best_parts, dim=0)


def sample_tokens(x: torch.Tensor, max_tokens: int = MAX_CLIP_TOKENS) -> torch.Tensor:
    """Evenly spaced rows of x [T, K], at most max_tokens of them."""
    return x[:: max(1, x.shape[0] // max_tokens)][:max_tokens]
