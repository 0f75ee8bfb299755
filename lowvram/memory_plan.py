"""How many KV pages fit: the one formula the engine sizes its pool with.

The doctor prints the same numbers, so a plan and a run cannot disagree.
"""

from __future__ import annotations

from dataclasses import dataclass

from lowvram.config import Profile
from lowvram.errors import OutOfMemoryError
from lowvram.model_config import ModelConfig

GIB = 2**30


def kv_bytes_per_token(config: ModelConfig, element_bytes: int) -> int:
    """K and V of every layer for one token."""
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * element_bytes


def activation_bytes(config: ModelConfig, profile: Profile, element_bytes: int) -> int:
    """Workspace of one step at the profile's token budget (the largest live tensors)."""
    tokens = profile.max_num_batched_tokens
    per_token = (config.hidden_size * 4 + config.q_size + 2 * config.kv_size + 2 * config.intermediate_size) * element_bytes
    logits = profile.max_num_seqs * config.vocab_size * 4 * 2
    return tokens * per_token + logits


@dataclass
class KVPlan:
    num_blocks: int
    block_size: int
    bytes_per_token: int
    budget_bytes: int
    weight_bytes: int
    activation_bytes: int

    @property
    def kv_bytes(self) -> int:
        return self.num_blocks * self.block_size * self.bytes_per_token

    @property
    def max_tokens(self) -> int:
        return self.num_blocks * self.block_size


def plan_kv(config: ModelConfig, profile: Profile, weight_bytes: int, element_bytes: int, max_model_len: int) -> KVPlan:
    """Pages for what is left of the budget after weights and workspace.

    Never more than max_num_seqs full-length sequences need; never fewer than one
    full-length sequence needs (that is an OutOfMemoryError with the numbers).
    """
    block_size = profile.kv_block_size
    per_token = kv_bytes_per_token(config, element_bytes)
    workspace = activation_bytes(config, profile, element_bytes)
    budget = profile.memory_budget_bytes
    if profile.emulate_vram_gib is not None:
        budget = min(budget, int(profile.emulate_vram_gib * profile.memory_utilization * GIB))
    free = budget - weight_bytes - workspace
    blocks_per_seq = -(-max_model_len // block_size)
    num_blocks = min(free // (per_token * block_size), profile.max_num_seqs * blocks_per_seq)
    if num_blocks < blocks_per_seq:
        need = weight_bytes + workspace + blocks_per_seq * block_size * per_token
        raise OutOfMemoryError(
            f"a {max_model_len}-token context does not fit: weights {weight_bytes / GIB:.2f} GiB + workspace "
            f"{workspace / GIB:.2f} GiB + KV {blocks_per_seq * block_size * per_token / GIB:.2f} GiB = {need / GIB:.2f} GiB "
            f"> budget {budget / GIB:.2f} GiB. Lower max_model_len (e.g. --max-model-len "
            f"{max(block_size, (max(free, 0) // per_token) // block_size * block_size)}), lower max_num_batched_tokens, "
            f"or use a larger profile; run `lowvram doctor` for a plan"
        )
    return KVPlan(int(num_blocks), block_size, per_token, budget, weight_bytes, workspace)
