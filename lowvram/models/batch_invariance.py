"""Batch-invariant mode (profile `batch_invariant`): a request's logits have the same bits alone or
batched, so greedy decoding gives the same text. Every choice of summation order the fast kernels
make from the batch is made from the row alone: the W4A16 kernel's 16-row form with one tiling
per layer shape, the same for dense layers (kernels/linear_invariant.py), decode attention
through the prefill kernel, whose tiles sit at absolute positions. The engine keeps the KV at
FP16 (compressed pages would change what a request reads).
"""

from __future__ import annotations

from torch import nn

from lowvram.errors import ConfigError
from lowvram.kernels.linear_invariant import invariant_linear
from lowvram.models.dense import Attention
from lowvram.quant.awq_linear import AwqLinear


class InvariantLinear(nn.Linear):
    """nn.Linear whose rows do not depend on the batch (`invariant_linear`); same parameters."""

    def forward(self, x):
        return invariant_linear(x, self.weight, self.bias, use_reference=not x.is_cuda)


def make_batch_invariant(model: nn.Module) -> int:
    """Switch every matmul and attention layer of a loaded dense model to its batch-invariant form
    in place; returns how many. ConfigError for other models (DeepSeek-V2's MLA and routing)."""
    num_switched = 0
    num_attention = 0
    for module in model.modules():
        if isinstance(module, (AwqLinear, Attention)):
            module.is_batch_invariant = True
            num_attention += isinstance(module, Attention)
        elif type(module) is nn.Linear:
            # The subclass adds no state, so the parameters (and any tying) stay as loaded.
            module.__class__ = InvariantLinear
        else:
            continue
        num_switched += 1
    if num_attention == 0:
        raise ConfigError(
            f"batch_invariant: true covers dense Llama/Qwen2-style models; {type(model).__name__} has no layer "
            f"it knows how to make batch-invariant. Set batch_invariant: false in the profile"
        )
    return num_switched
