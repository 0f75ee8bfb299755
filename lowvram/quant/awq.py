"""AWQ, the published algorithm (Lin et al., "AWQ: Activation-aware Weight Quantization", 2024).

Per decoder layer, the Linears that read the same input form a scale group, paired with
the operation that produces that input:

    input_layernorm          -> q_proj, k_proj, v_proj   (scored on the attention output)
    v_proj                   -> o_proj                   (only when v's outputs are o's inputs: no GQA)
    post_attention_layernorm -> gate_proj, up_proj       (scored on the MLP output)
    up_proj                  -> down_proj                (scored on the MLP output)

For each group a per-input-channel scale s is searched on calibration activations:
s = x_mean^alpha / (w_mean^(1-alpha) + 1e-4) for alpha in 0, 0.05, ..., 0.95, normalised by
sqrt(max(s) * min(s)); the group's weights become Q(W * s) / s and the s with the lowest
output MSE wins. s = 1 (plain round-to-nearest) stays a candidate too, so the search can never
end worse than RTN on the calibration loss. The winner is folded in exactly: the previous
operation's output is divided by s (the norm's weight, or the previous Linear's rows and
bias) and the group's weights are multiplied by s, so the FP16 model computes the same
function while the INT4 rounding error moves off the salient input channels.

Then, for every Linear but q and k (whose errors softmax amplifies), each group of
`group_size` weights is clipped to a shrunken max |w| (1.0, 0.95, ..., 0.55 of the original),
chosen per group to minimise the error of that group's partial output on sampled tokens.

`fake_quantize` returns exactly what `quantize_rtn` then `dequantize_awq` would give, so the
error measured during the search is the error of the checkpoint that is written.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from lowvram.kernels.awq_format import MAX_QUANT_VALUE

NUM_ALPHAS = 20
CLIP_RATIOS = tuple(1.0 - 0.05 * i for i in range(10))  # 1.0 .. 0.55
MAX_CLIP_TOKENS = 512
# Partial outputs held at once by the clipping search: [K/G, tokens, outputs] elements.
MAX_CLIP_ELEMENTS = 1 << 24
NO_CLIP_LINEARS = ("self_attn.q_proj", "self_attn.k_proj")


@dataclass(frozen=True)
class ScaleGroup:
    """Linears sharing one input and the operation (`prev`) whose output that input is.

    `prev` is a norm (its weight is divided by s) or a Linear (its rows and bias are).
    `inputs` names the input the group reads and `target` the block output it is scored on.
    """

    prev: str
    linears: tuple[str, ...]
    inputs: str
    target: str

    @property
    def is_prev_norm(self) -> bool:
        return self.prev.endswith("norm")


def layer_scale_groups(num_heads: int, num_kv_heads: int) -> list[ScaleGroup]:
    """The scale groups of one decoder layer, in the order they are searched."""
    groups = [
        ScaleGroup(
            "input_layernorm",
            ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
            inputs="attn_in",
            target="attn",
        )
    ]
    if num_heads == num_kv_heads:
        groups.append(ScaleGroup("self_attn.v_proj", ("self_attn.o_proj",), inputs="o_in", target="o"))
    groups.append(
        ScaleGroup("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"), inputs="mlp_in", target="mlp")
    )
    groups.append(ScaleGroup("mlp.up_proj", ("mlp.down_proj",), inputs="down_in", target="down"))
    return groups


def _round_up_to_float16(values: torch.Tensor) -> torch.Tensor:
    # The same rounding quantize_rtn applies, so the float16 scale never shrinks a group's range.
    rounded = values.to(torch.float16)
    bumped = torch.nextafter(rounded, torch.full_like(rounded, float("inf")))
    return torch.where(rounded.to(torch.float32) < values, bumped, rounded).to(torch.float32)


def fake_quantize(weight: torch.Tensor, group_size: int, max_abs: torch.Tensor | None = None) -> torch.Tensor:
    """weight [N, K] -> the float32 weight its INT4 form stands for.

    max_abs [N, K/G], when given, clips each group to [-max_abs, max_abs] first. Equal to
    `dequantize_awq(*quantize_rtn(clipped weight))` transposed, element for element.
    """
    num_outputs, num_inputs = weight.shape
    weight = weight.to(torch.float32)
    if max_abs is not None:
        weight = clip_weight(weight, group_size, max_abs)
    grouped = weight.reshape(num_outputs, num_inputs // group_size, group_size)  # [N, K/G, G]
    max_val = grouped.amax(dim=-1).clamp(min=0)
    min_val = grouped.amin(dim=-1).clamp(max=0)
    scales = _round_up_to_float16((max_val - min_val).clamp(min=1e-5) / MAX_QUANT_VALUE)
    zeros = torch.round(-min_val / scales).clamp(0, MAX_QUANT_VALUE)
    q = (torch.round(grouped / scales[..., None]) + zeros[..., None]).clamp(0, MAX_QUANT_VALUE)
    return ((q - zeros[..., None]) * scales[..., None]).reshape(num_outputs, num_inputs)


def clip_weight(weight: torch.Tensor, group_size: int, max_abs: torch.Tensor) -> torch.Tensor:
    """weight [N, K] with each group clipped to [-max_abs, max_abs] (max_abs [N, K/G])."""
    num_outputs, num_inputs = weight.shape
    grouped = weight.reshape(num_outputs, num_inputs // group_size, group_size)  # [N, K/G, G]
    limit = max_abs.to(weight.dtype)[..., None]
    return torch.minimum(torch.maximum(grouped, -limit), limit).reshape(num_outputs, num_inputs)


def weight_magnitude(weights: list[torch.Tensor], group_size: int) -> torch.Tensor:
    """w_mean [K]: |w| relative to its group's max, averaged over the outputs of all weights."""
    stacked = torch.cat([w.to(torch.float32) for w in weights], dim=0)
    num_outputs, num_inputs = stacked.shape
    grouped = stacked.abs().reshape(num_outputs, num_inputs // group_size, group_size)  # [N, K/G, G]
    relative = grouped / (grouped.amax(dim=-1, keepdim=True) + 1e-6)
    return relative.reshape(num_outputs, num_inputs).mean(dim=0)


@dataclass
class ScaleSearch:
    scales: torch.Tensor  # [K] float32; all ones when no alpha beat plain RTN
    alpha: float | None  # None: plain RTN won
    loss: float
    rtn_loss: float


def search_scales(
    x_mean: torch.Tensor, weights: list[torch.Tensor], group_size: int, loss_fn: Callable[[list[torch.Tensor]], float]
) -> ScaleSearch:
    """Grid-search the group's input-channel scales.

    x_mean [K]: mean |x| per input channel over the calibration tokens; weights: the group's
    float32 [N_i, K] weights; loss_fn: the block output MSE for trial weights Q(W * s) / s.
    """
    x_mean = x_mean.to(torch.float32)
    w_mean = weight_magnitude(weights, group_size)
    rtn_loss = loss_fn([fake_quantize(w, group_size) for w in weights])
    best = ScaleSearch(torch.ones_like(x_mean), None, rtn_loss, rtn_loss)
    for step in range(NUM_ALPHAS):
        alpha = step / NUM_ALPHAS
        scales = (x_mean.pow(alpha) / (w_mean.pow(1 - alpha) + 1e-4)).clamp(min=1e-4)
        scales = scales / (scales.max() * scales.min()).sqrt()
        loss = loss_fn([fake_quantize(w * scales, group_size) / scales for w in weights])
        if loss < best.loss:
            best = ScaleSearch(scales, alpha, loss, rtn_loss)
    return best


def fold_scales(weights: dict[str, torch.Tensor], group: ScaleGroup, scales: torch.Tensor) -> None:
    """Fold s into the layer (in place): prev's output / s, the group's weights * s (columns)."""
    prev_weight = f"{group.prev}.weight"
    if group.is_prev_norm:
        weights[prev_weight] = weights[prev_weight] / scales
    else:
        weights[prev_weight] = weights[prev_weight] / scales[:, None]
        prev_bias = f"{group.prev}.bias"
        if weights.get(prev_bias) is not None:
            weights[prev_bias] = weights[prev_bias] / scales
    for name in group.linears:
        weights[f"{name}.weight"] = weights[f"{name}.weight"] * scales


def search_clip(weight: torch.Tensor, x: torch.Tensor, group_size: int) -> torch.Tensor:
    """max_abs [N, K/G] for weight [N, K], given sampled inputs x [T, K].

    Each group's clip is scored on its own partial output x_g W_g^T, so groups are
    independent and the choice is per group and output.
    """
    num_outputs, num_inputs = weight.shape
    num_groups = num_inputs // group_size
    x = x.to(device=weight.device, dtype=torch.float32)
    # xg: [K/G, T, G]
    xg = x.reshape(-1, num_groups, group_size).transpose(0, 1)
    chunk = max(1, MAX_CLIP_ELEMENTS // (num_groups * xg.shape[1]))
    best_parts = []
    for start in range(0, num_outputs, chunk):
        w = weight[start : start + chunk].to(torch.float32)
        rows = w.shape[0]
        # wg: [K/G, G, rows]
        wg = w.reshape(rows, num_groups, group_size).permute(1, 2, 0)
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
    step = max(1, x.shape[0] // max_tokens)
    return x[::step][:max_tokens]
