"""The dense runtime on a CUDA GPU in FP16 (skipped without CUDA)."""

import pytest
import torch
from tiny_models import finished_token_ids

from lowvram import LLM, SamplingParams
from lowvram.engine.engine import LLMEngine

pytestmark = pytest.mark.gpu
PROMPTS = ["Hello world, this is a test of", "def add(a, b):\n    return", "The quick brown fox", "x"]


def test_bf16_checkpoint_computes_in_fp16_on_cuda(tiny_qwen2_dir):
    engine = LLMEngine(str(tiny_qwen2_dir), "4gb", emulate_vram_gib=4.0)
    assert engine.device.type == "cuda"
    table = engine.model.model.embed_tokens.weight
    assert all(p.dtype == torch.float16 for p in engine.model.parameters())
    # The 4gb profile keeps the embedding table in host memory (embeddings_on_host); the rest is on the card.
    assert table.device.type == "cpu" and all(p.is_cuda for p in engine.model.parameters() if p is not table)
    assert engine.kv_pool.pages[0].k.dtype == torch.float16


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen2_dir"])
def test_fp16_logits_close_to_transformers_fp32(fixture, request):
    from transformers import AutoModelForCausalLM

    model_dir = request.getfixturevalue(fixture)
    engine = LLMEngine(str(model_dir), "4gb", emulate_vram_gib=4.0)
    recorded = {}
    run = engine.runner.run

    def recording_run(batch, **kwargs):
        logits = run(batch, **kwargs)
        for row, seq in enumerate(batch.seqs):
            recorded.setdefault(seq.request_id, []).append(logits[row].cpu())
        return logits

    engine.runner.run = recording_run
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), p, params)
    outputs = finished_token_ids(engine)
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    worst = 0.0
    for i, p in enumerate(PROMPTS):
        ids = engine.tokenizer.encode(p)
        with torch.no_grad():
            ref = hf(torch.tensor([ids + outputs[str(i)]])).logits[0]
        ours = torch.stack(recorded[str(i)])
        expected = ref[len(ids) - 1 : len(ids) - 1 + 32]
        worst = max(worst, ((ours - expected).abs().max() / expected.abs().max()).item())
    print(f"{fixture}: FP16 on CUDA vs FP32 transformers, largest relative logit difference {worst:.2e}")
    assert worst <= 2e-2


def test_emulated_card_caps_torch_allocations(tiny_qwen2_dir):
    LLM(str(tiny_qwen2_dir), "4gb", emulate_vram_gib=4.0)
    with pytest.raises(torch.OutOfMemoryError):
        torch.empty(5 * 2**30, dtype=torch.uint8, device="cuda")


def test_generate_on_cuda_matches_batched_and_alone(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), "4gb", emulate_vram_gib=4.0)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    batched = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    alone = [llm.generate(p, params)[0].outputs[0].token_ids for p in PROMPTS]
    # FP16 on a GPU: batch shape may change the last bits; demand agreement on most prompts.
    assert sum(a == b for a, b in zip(batched, alone)) >= len(PROMPTS) - 1


def test_a_dropped_engine_leaves_the_next_one_its_whole_budget(tiny_qwen2_dir):
    # `del engine` then a new engine in the same process (a notebook, a benchmark): the old engine's
    # memory is collected, not counted as held by the process.
    import gc

    gc.collect()
    before = torch.cuda.memory_allocated()
    first = LLMEngine(str(tiny_qwen2_dir), "4gb", emulate_vram_gib=4)
    assert torch.cuda.memory_allocated() > before
    del first
    second = LLMEngine(str(tiny_qwen2_dir), "4gb", emulate_vram_gib=4)
    assert second.held_bytes <= before + (64 << 10)
