"""Fused q/k/v and gate/up projections give the unfused model's results (FP32, CPU)."""

import pytest
import torch

import lowvram.models.loader
from lowvram.engine.engine import LLMEngine
from lowvram.models.fusion import fuse_projections
from lowvram.models.loader import load_model
from lowvram.quant.awq_linear import AwqLinear
from lowvram.quant.quantize import quantize_model

FAST = dict(group_size=32, num_samples=4, seq_len=32)


@pytest.fixture(scope="module")
def checkpoints(tiny_qwen2_dir, tiny_llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("fusion")
    quantize_model(tiny_qwen2_dir, root / "awq", **FAST)
    quantize_model(tiny_llama_dir, root / "awq-comp", rank=8, **FAST)
    return {
        "fp32 qwen2": tiny_qwen2_dir,
        "fp32 llama": tiny_llama_dir,
        "awq qwen2": root / "awq",
        "awq + compensation llama": root / "awq-comp",
    }


@pytest.mark.parametrize("name", ["fp32 qwen2", "fp32 llama", "awq qwen2", "awq + compensation llama"])
def test_fused_model_scores_text_like_the_unfused_one(name, checkpoints, monkeypatch):
    fused = LLMEngine(str(checkpoints[name]), "cpu")
    monkeypatch.setattr(lowvram.models.loader, "fuse_projections", lambda model: 0)
    unfused = LLMEngine(str(checkpoints[name]), "cpu")
    layer = fused.model.model.layers[0]
    assert layer.self_attn.qkv_proj is not None and layer.mlp.gate_up_proj is not None
    assert unfused.model.model.layers[0].self_attn.qkv_proj is None
    ids = [(7 * i) % (fused.config.vocab_size - 3) + 2 for i in range(40)]
    got, expected = torch.tensor(fused.score(ids)), torch.tensor(unfused.score(ids))
    print(f"{name}: largest log-probability difference {(got - expected).abs().max():.2e}")
    assert torch.allclose(got, expected, atol=1e-4, rtol=0)


def test_compensation_stays_with_its_own_outputs(checkpoints):
    """The fused rank-r term is block diagonal: q's correction never leaks into k or v."""
    engine = LLMEngine(str(checkpoints["awq + compensation llama"]), "cpu")
    qkv = engine.model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, AwqLinear) and qkv.lora_rank == 24
    lora_b = qkv.lowvram_lora_b  # [N_total, 3 * 8]
    q_size = engine.config.q_size
    assert lora_b[:q_size, 8:].abs().max() == 0 and lora_b[q_size:, :8].abs().max() == 0


def test_projections_of_different_kinds_stay_apart(tiny_llama_dir):
    model, _ = load_model(tiny_llama_dir, torch.device("cpu"))
    attn = model.model.layers[0].self_attn
    attn.k_proj = AwqLinear(attn.k_proj.in_features, attn.k_proj.out_features, 32)  # an INT4 k beside FP32 q, v
    assert fuse_projections(model) == 2 * len(model.model.layers) - 1
    assert attn.qkv_proj is None and model.model.layers[0].mlp.gate_up_proj is not None
