"""The projection shapes of the real models' decoder layers and random AWQ tensors of them,
for the kernel experiments here (scripts/lab)."""

import torch

from lowvram.models.shapes import shape_config

# A decoder layer's projections, q/k/v and gate/up fused as the engine loads them.
PROJECTIONS = ("qkv", "o", "gate_up", "down")


def layer_projection_shapes(hidden: int, intermediate: int, q_size: int, kv_size: int) -> dict[str, tuple[int, int]]:
    """(K, N) of each of PROJECTIONS."""
    shapes = ((hidden, q_size + 2 * kv_size), (q_size, hidden), (hidden, 2 * intermediate), (intermediate, hidden))
    return dict(zip(PROJECTIONS, shapes))


def fused_projection_parts(intermediate: int, q_size: int, kv_size: int) -> dict[str, tuple[int, ...]]:
    """The output sizes of the parts lowvram.models.fusion joins into each fused projection, in order."""
    return {"qkv": (q_size, kv_size, kv_size), "gate_up": (intermediate, intermediate)}


def attention_sizes(c: dict) -> tuple[int, int]:
    """(q_size, kv_size) of a shape's config (shape_config)."""
    head_dim = c["hidden_size"] // c["num_attention_heads"]
    return c["num_attention_heads"] * head_dim, c["num_key_value_heads"] * head_dim


def projection_shapes(name: str) -> dict[str, tuple[int, int]]:
    """layer_projection_shapes of a named shape."""
    c = shape_config(name)
    return layer_projection_shapes(c["hidden_size"], c["intermediate_size"], *attention_sizes(c))


def random_awq_tensors(
    num_inputs: int,
    num_outputs: int,
    group_size: int,
    *,
    device: str | torch.device = "cpu",
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(qweight [K, N/8], qzeros [K/G, N/8], float16 scales [K/G, N]) of one AWQ layer with
    uniformly random codes and zeros and small positive scales: what the kernel benchmarks
    time and check against the reference."""
    words = dict(dtype=torch.int32, device=device, generator=generator)
    qweight = torch.randint(-(2**31), 2**31 - 1, (num_inputs, num_outputs // 8), **words)
    qzeros = torch.randint(-(2**31), 2**31 - 1, (num_inputs // group_size, num_outputs // 8), **words)
    scales = torch.rand(num_inputs // group_size, num_outputs, device=device, generator=generator) * 0.02 + 1e-3
    return qweight, qzeros, scales.half()
