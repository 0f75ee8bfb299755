"""The workspace of one step: the largest set of tensors alive at once, modelled phase by
phase from what the running code allocates."""

from __future__ import annotations

import math
from dataclasses import dataclass

from lowvram.config import Profile
from lowvram.engine.cuda_graphs import MAX_PREFILL_GRAPH_TOKENS
from lowvram.kernels import paged_attention
from lowvram.kernels.w4a16 import DEQUANT_MATMUL_MIN_M
from lowvram.models.config import ModelConfig

MIB = 2**20
FP16_BYTES = 2
# cuBLAS and cuBLASLt workspaces, allocated through torch's allocator once per handle and stream.
CUBLAS_WORKSPACE_BYTES = 33 * MIB
# Rotary's float32 cos/sin tables start at this many positions and double as contexts grow.
ROPE_MIN_POSITIONS = 2048
# Top-p / top-k sampling keeps a few float32 [vocab] tensors and an int64 sort order per row.
SAMPLING_BYTES_PER_VOCAB_ENTRY = 32
# From this many rows the Triton path dequantizes an AWQ weight to fp16 and uses cuBLAS.
AWQ_DEQUANT_MATMUL_MIN_TOKENS = DEQUANT_MATMUL_MIN_M
# The plain-torch AWQ path dequantizes in float32 through about five [K, N] temporaries.
AWQ_TORCH_DEQUANT_BYTES_PER_ELEMENT = 20
# The Triton decode kernel splits a context into partitions of at least this many tokens.
MIN_DECODE_PARTITION_TOKENS = 128


def is_mla(config) -> bool:
    """DeepSeek-V2: multi-head latent attention and MoE layers."""
    from lowvram.models.deepseek_v2 import DeepseekV2Config

    return isinstance(config, DeepseekV2Config)


def uses_attention_kernels(device_type: str, head_dim: int) -> bool:
    """Whether a step runs the Triton attention kernels, as attention._is_kernel_path."""
    if device_type != "cuda" or head_dim < 16:
        return False
    return paged_attention.HAS_TRITON and not paged_attention.FORCE_REFERENCE


def int4_scratch_bytes(max_int4_elements: int, num_tokens: int, uses_kernels: bool) -> int:
    """The dequantized copy of the largest INT4 layer (K * N elements) a step may hold."""
    if not uses_kernels:
        return AWQ_TORCH_DEQUANT_BYTES_PER_ELEMENT * max_int4_elements
    if num_tokens >= AWQ_DEQUANT_MATMUL_MIN_TOKENS:
        return FP16_BYTES * max_int4_elements
    return 0  # the Triton GEMM/GEMV kernels read INT4 directly


@dataclass
class Workspace:
    """Peak bytes of each phase of a step; the step's peak is the largest phase plus what
    stays allocated across steps (RoPE tables, step metadata, graph buffers, cuBLAS)."""

    phases: dict[str, int]
    rope_bytes: int
    metadata_bytes: int
    num_tokens: int
    num_seqs: int
    context_len: int
    uses_kernels: bool
    graph_bytes: int = 0
    cublas_bytes: int = 0

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.phases.get)

    @property
    def peak_bytes(self) -> int:
        kept = self.rope_bytes + self.metadata_bytes + self.graph_bytes + self.cublas_bytes
        return self.phases[self.peak_phase] + kept


def step_workspace(
    config: ModelConfig,
    num_tokens: int,
    num_seqs: int,
    context_len: int,
    element_bytes: int,
    uses_kernels: bool,
    block_size: int = 16,
    int4_scratch: int = 0,
) -> Workspace:
    """Peak workspace of any step of at most `num_tokens` tokens and `num_seqs` sequences
    over contexts of at most `context_len`. Every phase keeps the layer's input and running
    sum ([T, hidden] each).

    - mlp: the normed input and silu(gate), up and their product [T, intermediate]; an INT4
      layer's dequantized weight replaces one of them at most.
    - rotary: q, k, v, and float32 copies and halves of q (about 12 bytes per element), or
      of k while q's result is kept.
    - attention: the kernels' [T, H, D] output (decode: also float32 partials per context
      partition); plain torch gathers float32 K/V, repeats them per query head and keeps two
      float32 scores [H, Q, L] for the longest prefill chunk (Q = min(T, L)).
    - logits: float32 logits of every sequence plus one sampling row.
    """
    e, t, s, ctx = element_bytes, num_tokens, min(num_seqs, num_tokens), context_len
    hidden, inter = config.hidden_size, config.intermediate_size
    q, kv, heads, d = config.q_size, config.kv_size, config.num_heads, config.head_dim
    residual = 2 * t * hidden * e
    qkv = t * (q + 2 * kv) * e
    rotary = max(12 * t * q, t * q * e + max(4 * t * q + 4 * t * kv, 12 * t * kv))
    if uses_kernels:
        decode_partials = s * heads * max(1, math.ceil(ctx / MIN_DECODE_PARTITION_TOKENS)) * (d + 1) * 4
        attention = max(t * q * e + t * hidden * e, decode_partials)
    else:
        q_len = min(t, ctx)
        gathered = 2 * ctx * kv * 4 + 2 * ctx * q * 4
        scores = 2 * heads * q_len * ctx * 4 + q_len * ctx  # and the causal mask
        attention = t * q * 4 + q_len * q * 4 + gathered + scores
    logits = s * hidden * e + s * config.vocab_size * (e + 4) + SAMPLING_BYTES_PER_VOCAB_ENTRY * config.vocab_size
    phases = {
        "mlp": residual + t * hidden * e + max(3 * t * inter * e, 2 * t * inter * e + int4_scratch),
        "rotary": residual + qkv + 2 * t * (d // 2) * 4 + rotary,
        "attention": residual + qkv + attention,
        "logits": residual + logits,
    }
    # Rotary's float32 cos and sin tables, doubling from ROPE_MIN_POSITIONS until they cover ctx.
    positions = max(ROPE_MIN_POSITIONS, 1 << (ctx - 1).bit_length())
    rope = 2 * positions * ((config.qk_rope_head_dim if is_mla(config) else d) // 2) * 4
    # input ids, positions and slots (int64 [T]) and the int32 block table [S, blocks]
    metadata = 3 * t * 8 + s * -(-ctx // block_size) * 4
    return Workspace(phases, rope, metadata, t, num_seqs, ctx, uses_kernels)


def profile_workspace(
    config: ModelConfig,
    profile: Profile,
    max_model_len: int,
    element_bytes: int,
    device_type: str,
    max_int4_elements: int = 0,
) -> Workspace:
    """The workspace the engine reserves for a profile: its largest step, the cuBLAS
    workspace of its stream (CUDA), and what CUDA graphs keep allocated where the profile
    replays them (CUDA, dense models). `max_int4_elements`: WeightBytes.max_int4_layer_elements."""
    kernels = uses_attention_kernels(device_type, config.head_dim)

    def step(num_tokens: int, num_seqs: int) -> Workspace:
        scratch = int4_scratch_bytes(max_int4_elements, num_tokens, kernels)
        block_size = profile.kv_block_size
        return step_workspace(config, num_tokens, num_seqs, max_model_len, element_bytes, kernels, block_size, scratch)

    max_tokens = min(profile.max_num_batched_tokens, profile.max_num_seqs * max_model_len)
    workspace = step(max_tokens, profile.max_num_seqs)
    if device_type != "cuda":
        return workspace
    workspace.cublas_bytes = CUBLAS_WORKSPACE_BYTES
    if profile.enable_cuda_graphs and not is_mla(config):
        # Decode graphs keep their static inputs, the float32 logits of the largest batch and
        # their capture stream's cuBLAS workspace; a step's activations live in their pool.
        seqs = profile.max_num_seqs
        inputs = seqs * (3 * 8 + 4) + seqs * -(-max_model_len // profile.kv_block_size) * 4
        workspace.graph_bytes = inputs + seqs * config.vocab_size * 4 + CUBLAS_WORKSPACE_BYTES
        if profile.enable_prefill_graphs:
            # The prefill graphs' pool keeps the largest bucket's activations, which eager steps cannot reuse.
            prefill = step(min(MAX_PREFILL_GRAPH_TOKENS, max_tokens), 2)
            workspace.graph_bytes += prefill.phases[prefill.peak_phase]
    return workspace
