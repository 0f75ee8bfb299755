"""The residual add after each MLP is done by the next norm (add_and_norm); the output must
be bit for bit what the model gave when every layer did that add itself in torch.

Both orders do one rounding of the same sum (x + residual equals residual + x in IEEE
arithmetic), so nothing may differ, in float32 or bfloat16 on the CPU or float16 on the GPU.
"""

import pytest
import torch
from deepseek_v2_paging import greedy_through_pages
from dense_paging import hidden_states_through_pages

from lowvram.models.deepseek_v2 import DeepseekV2ForCausalLM, MoE, layer_kv_pages
from lowvram.models.dense import CausalLM


def _dense_forward_with_adds_in_the_layers(self, input_ids, positions, meta, kv_pages):
    """CausalLM.forward as it was: each layer adds its MLP output to the residual stream."""
    h = self.model.embed_tokens(input_ids)
    for layer, pages in zip(self.model.layers, kv_pages):
        attn = layer.self_attn(layer.input_layernorm(h), positions, meta, pages)
        normed, h = layer.post_attention_layernorm.add_and_norm(attn, h)
        h = h + layer.mlp(normed)
    return self.model.norm(h)


def _deepseek_v2_forward_with_adds_in_the_layers(self, input_ids, positions, meta, kv_pages):
    """DeepseekV2ForCausalLM.forward as it was: both residual adds in torch, in each layer."""
    h = self.model.embed_tokens(input_ids)
    for i, layer in enumerate(self.model.layers):
        h = h + layer.self_attn(layer.input_layernorm(h), positions, meta, layer_kv_pages(kv_pages, i))
        x = layer.post_attention_layernorm(h)
        h = h + (layer.mlp(x, h) if isinstance(layer.mlp, MoE) else layer.mlp(x))
    self.expert_stats.num_tokens += input_ids.shape[0]
    return self.model.norm(h)


def _check_dense_model(model_dir, device, dtype, monkeypatch):
    from lowvram.models.loader import load_model

    model, _ = load_model(model_dir, torch.device(device), dtype)
    prompt, decoded = [1, 17, 5, 33, 2, 9, 60, 4, 12], [7, 3, 21, 8, 40]
    fused = hidden_states_through_pages(model, prompt, decoded)
    monkeypatch.setattr(CausalLM, "forward", _dense_forward_with_adds_in_the_layers)
    separate = hidden_states_through_pages(model, prompt, decoded)
    num_diff = sum(int((a != b).sum()) for a, b in zip(fused, separate))
    print(f"{model_dir.name} {dtype}: {num_diff} hidden values differ over prefill + {len(decoded)} decode steps")
    assert num_diff == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_model_output_is_unchanged_by_the_residual_add_moving_into_the_next_norm(
    tiny_model_dir, dtype, monkeypatch
):
    _check_dense_model(tiny_model_dir, "cpu", dtype, monkeypatch)


@pytest.mark.gpu
def test_dense_model_output_is_unchanged_by_the_residual_add_moving_into_the_next_norm_gpu(tiny_qwen2_dir, monkeypatch):
    _check_dense_model(tiny_qwen2_dir, "cuda", torch.float16, monkeypatch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_deepseek_v2_output_is_unchanged_by_the_residual_add_moving_into_the_next_norm(tmp_path, dtype, monkeypatch):
    from tiny_models import make_tiny_deepseek_v2

    from lowvram.models.loader import load_deepseek_v2

    model, _ = load_deepseek_v2(make_tiny_deepseek_v2(tmp_path, seed=0), "cpu", dtype)
    prompt, decoded = [0, 17, 230, 5, 99, 402, 64], [3, 250, 48, 111]
    _, fused = greedy_through_pages(model, prompt, len(decoded), forced=decoded)
    monkeypatch.setattr(DeepseekV2ForCausalLM, "forward", _deepseek_v2_forward_with_adds_in_the_layers)
    _, separate = greedy_through_pages(model, prompt, len(decoded), forced=decoded)
    num_diff = int((fused != separate).sum())
    print(f"DeepSeek-V2 {dtype}: {num_diff} logits differ over prefill + {len(decoded)} decode steps")
    assert num_diff == 0


def test_add_and_norm_writes_over_its_inputs():
    # The caller still holds both inputs while a layer runs: new tensors here would keep two
    # more [T, hidden] alive in every phase than lowvram.memory.plan counts.
    from lowvram.models.dense import RMSNorm

    norm = RMSNorm(8, 1e-6)
    x, residual = torch.randn(3, 8), torch.randn(3, 8)
    expected_sum = x + residual
    normed, total = norm.add_and_norm(x, residual)
    assert normed.data_ptr() == x.data_ptr() and total.data_ptr() == residual.data_ptr()
    assert torch.equal(total, expected_sum)
    first, stream = norm.add_and_norm(x, None)  # the first layer: the input is the residual stream
    assert stream is x and first.data_ptr() != x.data_ptr()
