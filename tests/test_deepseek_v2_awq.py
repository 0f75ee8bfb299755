"""DeepSeek-V2 from an AWQ INT4 checkpoint (AutoAWQ GEMM names, one tensor set per expert).

The tiny checkpoint is quantized round-to-nearest; transformers runs the same INT4
weights dequantized to float32, so the two must agree as closely as two FP32 models.
"""

import json
import shutil

import pytest
import torch
from deepseek_v2_paging import (
    MAX_REL_DIFF,
    NUM_DECODE_STEPS,
    greedy_through_pages,
    rel_diff,
    transformers_reference,
)

from lowvram.kernels.awq_format import dequantize_awq, quantize_rtn
from lowvram.models.loader import load_deepseek_v2
from lowvram.quant.awq_linear import AwqLinear

GROUP_SIZE = 32
# kept in FP16, as a checkpoint's modules_to_not_convert can say
FP16_KEPT = "model.layers.0.mlp.down_proj"


def _is_quantized(name: str) -> bool:
    is_linear = name.endswith(("proj.weight", "proj_with_mqa.weight"))
    return name.startswith("model.layers.") and is_linear and not name.startswith(FP16_KEPT)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(AWQ checkpoint, the same INT4 weights dequantized to float32)."""
    from safetensors.torch import load_file, save_file
    from tiny_models import make_tiny_deepseek_v2

    source = make_tiny_deepseek_v2(tmp_path_factory.mktemp("dsv2-fp"), seed=2)
    awq_dir, dequantized_dir = tmp_path_factory.mktemp("dsv2-awq"), tmp_path_factory.mktemp("dsv2-dequantized")
    for target in (awq_dir, dequantized_dir):
        for path in source.iterdir():
            if path.suffix != ".safetensors":
                shutil.copy(path, target / path.name)
    awq_tensors, dequantized = {}, {}
    for name, tensor in load_file(source / "model.safetensors").items():
        if not _is_quantized(name):
            awq_tensors[name] = tensor.half()
            dequantized[name] = tensor.half().float()
            continue
        q = quantize_rtn(tensor.float(), GROUP_SIZE)
        stem = name[: -len(".weight")]
        awq_tensors.update({f"{stem}.qweight": q.qweight, f"{stem}.qzeros": q.qzeros, f"{stem}.scales": q.scales})
        dequantized[name] = dequantize_awq(q.qweight, q.qzeros, q.scales, GROUP_SIZE, torch.float32).t().contiguous()
    save_file(awq_tensors, str(awq_dir / "model.safetensors"))
    save_file(dequantized, str(dequantized_dir / "model.safetensors"))
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "awq",
        "bits": 4,
        "group_size": GROUP_SIZE,
        "zero_point": True,
        "version": "gemm",
        "modules_to_not_convert": [FP16_KEPT],
    }
    (awq_dir / "config.json").write_text(json.dumps(config))
    return awq_dir, dequantized_dir


@pytest.fixture(scope="module")
def reference(checkpoints):
    return transformers_reference(checkpoints[1])


def test_awq_checkpoint_loads_int4_experts_and_attention(checkpoints):
    model, _ = load_deepseek_v2(checkpoints[0], "cpu", torch.float32)
    moe = model.model.layers[1].mlp
    assert isinstance(moe.experts[5].gate_proj, AwqLinear) and isinstance(moe.shared_experts.down_proj, AwqLinear)
    attn = model.model.layers[2].self_attn
    assert isinstance(attn.q_proj, AwqLinear) and isinstance(attn.o_proj, AwqLinear)
    assert isinstance(attn.kv_a_proj_with_mqa, AwqLinear)
    assert not isinstance(attn.kv_b_proj, AwqLinear), "absorption needs kv_b_proj dequantized"
    assert moe.gate.weight.dtype == torch.float32, "the router stays unquantized"
    assert not isinstance(model.model.layers[0].mlp.down_proj, AwqLinear)  # modules_to_not_convert


@pytest.mark.parametrize("max_cached_experts", [None, 3])
def test_awq_logits_and_greedy_tokens_match_transformers(checkpoints, reference, max_cached_experts):
    model, _ = load_deepseek_v2(checkpoints[0], "cpu", torch.float32, max_cached_experts=max_cached_experts)
    prompt = [0, 17, 230, 5, 99, 402, 64, 12, 300, 7, 41]
    tokens, logits = greedy_through_pages(model, prompt, NUM_DECODE_STEPS)
    with torch.no_grad():
        expected = reference(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 :].float()
        generated = reference.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=NUM_DECODE_STEPS,
            min_new_tokens=NUM_DECODE_STEPS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=1,
        )
    diff = rel_diff(logits, expected)
    print(f"AWQ, cached experts {max_cached_experts}: largest relative logit difference {diff:.2e}")
    assert diff <= MAX_REL_DIFF
    assert tokens == generated[0, len(prompt) :].tolist()
    if max_cached_experts is not None:
        assert model.expert_stats.num_fetches > 0


@pytest.mark.gpu
def test_offloaded_awq_experts_on_cuda_match_resident_ones(checkpoints):
    # Pinned host copies, side-stream fetches and the INT4 kernels reading experts from slots.
    prompt = [0, 17, 230, 5, 99, 402, 64, 12, 300, 7, 41]
    resident, _ = load_deepseek_v2(checkpoints[0], "cuda", torch.float16)
    tokens, expected = greedy_through_pages(resident, prompt, NUM_DECODE_STEPS)
    offloaded, _ = load_deepseek_v2(checkpoints[0], "cuda", torch.float16, max_cached_experts=2)
    _, logits = greedy_through_pages(offloaded, prompt, NUM_DECODE_STEPS, forced=tokens)
    diff = rel_diff(logits, expected)
    print(f"CUDA FP16, 2 cached experts against all resident: largest relative logit difference {diff:.2e}")
    assert diff <= 1e-2
    cache = offloaded.moe_layers[0].cache
    assert all(row.is_pinned() for row in cache.host) and cache.slots.is_cuda
    assert offloaded.expert_stats.num_fetches > 0 and offloaded.expert_stats.num_prefetches > 0
