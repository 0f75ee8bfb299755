"""Batch-invariant mode (profile `batch_invariant`): each request's logits have the same bits
whether it runs alone or batched with others, so greedy decoding gives the same text.

Floating-point sums depend on their order, and the fast kernels choose their order from the
batch: cuBLAS picks a tiling from the matrix sizes, the W4A16 decode kernel has a one-row
form and a multi-row form, decode attention splits a context into more partitions when
fewer sequences run, and prefill chunk boundaries move with the token budget. Each choice
is right for speed and changes a row's last bits, and a last-bit change in the logits of a
random-weight or uncertain model flips a greedy token sooner or later. The mode fixes every
such choice to depend on the row alone:
- INT4 layers: the W4A16 decode kernel's 16-row tl.dot form for every row count, one tiling
  per layer shape (`w4a16_gemv.invariant_gemv_config`), prefill chunks included;
- dense layers, the FP16 head included: the same scheme in `kernels/linear_invariant.py`;
- attention: decode rows go through the prefill kernel, whose query and K/V tiles sit at
  absolute positions, so a token's bits depend neither on the chunking of its prompt nor
  on whether a decode step or the recompute after a preemption computes it; on the
  plain-torch path, one row at a time over its causal prefix.
Norms, RoPE, the activation and the KV write already work one row at a time.

The engine also keeps the KV at FP16 in this mode (the controller's ladder starts at
spilling): compressed pages would change what a request reads. What it costs: prefill runs
through the decode-style matmul kernels (no cuBLAS), a one-request decode step uses the
multi-row GEMV, and decode attention has no context partitions; docs/performance.md has
the measured speeds.
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
    """Switch every matmul and attention layer of a loaded dense model to its batch-invariant
    form, in place; returns the number of layers switched. Raises ConfigError for a model
    with another attention (DeepSeek-V2's MLA and MoE routing are not covered)."""
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
