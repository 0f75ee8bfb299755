"""Test-only checkpoint builders and helpers, beside lowvram.testing's tiny Llama/Qwen2 ones."""

from __future__ import annotations

from pathlib import Path

import torch

from lowvram.demo.tokenizer import BOS, EOS
from lowvram.testing import random_model, save_weights, train_tiny_tokenizer, write_config, write_json

# DeepSeek-V2-Lite's shape in miniature: no query LoRA, a latent KV of kv_lora_rank
# plus one shared RoPE key, a dense first layer, then MoE layers with shared experts,
# and yarn RoPE whose mscale changes the softmax scale.
_DEEPSEEK_V2_CONFIG = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": None,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "moe_intermediate_size": 32,
    "first_k_dense_replace": 1,
    "topk_method": "greedy",
    "norm_topk_prob": False,
    "routed_scaling_factor": 1.0,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 256,
    "initializer_range": 0.08,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "rope_parameters": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 64,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
    },
}


def make_tiny_deepseek_v2(out_dir: str | Path, *, seed: int = 0, num_layers: int = 3, **overrides) -> Path:
    """Write a random-weight DeepseekV2ForCausalLM checkpoint directory and return its path.

    Routed experts are saved one tensor per expert and projection
    (`mlp.experts.{e}.gate_proj.weight`, ...) as published DeepSeek-V2 checkpoints
    are, not in transformers 5's fused in-memory layout; transformers converts them
    back when it loads the directory. `overrides` are DeepseekV2Config fields.
    """
    from tokenizers import Tokenizer
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    out_dir = Path(out_dir)
    train_tiny_tokenizer(out_dir)
    tokenizer = Tokenizer.from_file(str(out_dir / "tokenizer.json"))
    fields = {
        **_DEEPSEEK_V2_CONFIG,
        "num_hidden_layers": num_layers,
        "vocab_size": tokenizer.get_vocab_size(with_added_tokens=True),
        "bos_token_id": tokenizer.token_to_id(BOS),
        "eos_token_id": tokenizer.token_to_id(EOS),
    }
    fields.update(overrides)
    config = DeepseekV2Config(**fields)
    model = random_model(DeepseekV2ForCausalLM, config, seed)
    state_dict = {}
    for name, tensor in model.state_dict().items():
        tensor = tensor.detach().to(torch.bfloat16)
        stem, _, attr = name.rpartition(".")
        if stem.endswith("mlp.experts") and attr == "gate_up_proj":
            for expert, fused in enumerate(tensor):  # fused: [2 * moe_intermediate, hidden]
                gate, up = fused.chunk(2, dim=0)
                state_dict[f"{stem}.{expert}.gate_proj.weight"] = gate.contiguous()
                state_dict[f"{stem}.{expert}.up_proj.weight"] = up.contiguous()
        elif stem.endswith("mlp.experts") and attr == "down_proj":
            for expert, down in enumerate(tensor):
                state_dict[f"{stem}.{expert}.down_proj.weight"] = down.contiguous()
        else:
            state_dict[name] = tensor.contiguous()
    save_weights(out_dir, state_dict, sharded=False)

    write_config(out_dir, config)
    write_json(
        out_dir / "generation_config.json",
        {"bos_token_id": fields["bos_token_id"], "eos_token_id": fields["eos_token_id"]},
    )
    return out_dir


def finished_token_ids(engine) -> dict[str, list[int]]:
    """Step `engine` until no request is left; the generated token ids of each request
    that finished meanwhile, by request id."""
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return done
