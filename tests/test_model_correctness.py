"""Our runtime against transformers' own implementation on the same checkpoint."""

import pytest
import torch
from tiny_models import finished_token_ids

from lowvram.core.sampling_params import SamplingParams
from lowvram.engine.engine import LLMEngine

PROMPTS = ["Hello world, this is a test of", "def add(a, b):\n    return", "The quick brown fox", "x"]
NUM_DECODE_STEPS = 32


def _record_logits(engine: LLMEngine) -> dict[str, list[torch.Tensor]]:
    """Wrap the runner so every sampled row's logits are kept per request."""
    per_request: dict[str, list[torch.Tensor]] = {}
    run = engine.runner.run

    def recording_run(batch, **kwargs):
        logits = run(batch, **kwargs)
        for row, seq in enumerate(batch.seqs):
            per_request.setdefault(seq.request_id, []).append(logits[row].clone())
        return logits

    engine.runner.run = recording_run
    return per_request


def _generate_batched(engine, prompts, max_tokens):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    final = finished_token_ids(engine)
    return [final[str(i)] for i in range(len(prompts))]


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen2_dir", "tiny_qwen2_sharded_dir"])
def test_logits_and_greedy_match_transformers(fixture, request):
    from transformers import AutoModelForCausalLM

    model_dir = request.getfixturevalue(fixture)
    engine = LLMEngine(str(model_dir), "cpu")
    logits = _record_logits(engine)
    outputs = _generate_batched(engine, PROMPTS, NUM_DECODE_STEPS)

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    worst = 0.0
    for i, prompt in enumerate(PROMPTS):
        prompt_ids = engine.tokenizer.encode(prompt)
        full = torch.tensor([prompt_ids + outputs[i]])
        with torch.no_grad():
            ref = hf(full).logits[0].float()  # [L, V]
        # step j sampled output token j from the logits at position len(prompt) - 1 + j
        ours = torch.stack(logits[str(i)])  # [NUM_DECODE_STEPS, V]
        expected = ref[len(prompt_ids) - 1 : len(prompt_ids) - 1 + NUM_DECODE_STEPS]
        rel = ((ours - expected).abs().max() / expected.abs().max()).item()
        worst = max(worst, rel)
        greedy = hf.generate(
            torch.tensor([prompt_ids]),
            max_new_tokens=NUM_DECODE_STEPS,
            min_new_tokens=NUM_DECODE_STEPS,
            do_sample=False,
        )[0, len(prompt_ids) :].tolist()
        assert outputs[i] == greedy, f"prompt {i}: greedy continuation differs from transformers"
    print(f"{fixture}: largest relative logit difference {worst:.2e}")
    assert worst <= 1e-4


def test_sharded_and_single_file_give_the_same_logits(tiny_qwen2_dir, tiny_qwen2_sharded_dir):
    single = LLMEngine(str(tiny_qwen2_dir), "cpu")
    sharded = LLMEngine(str(tiny_qwen2_sharded_dir), "cpu")
    for name, p in single.model.named_parameters():
        assert torch.equal(p, sharded.model.get_parameter(name)), name


def test_batched_equals_one_at_a_time(tiny_model_dir):
    engine = LLMEngine(str(tiny_model_dir), "cpu")
    batched = _generate_batched(engine, PROMPTS, 24)
    alone = [_generate_batched(engine, [p], 24)[0] for p in PROMPTS]
    assert batched == alone


def test_chunked_prefill_equals_whole_prefill(tiny_qwen2_dir):
    from lowvram.config import load_profile

    long_prompt = "one two three four five six seven eight nine ten " * 12
    whole = LLMEngine(str(tiny_qwen2_dir), "cpu")
    chunked = LLMEngine(str(tiny_qwen2_dir), load_profile("cpu").replace(max_num_batched_tokens=16, max_num_seqs=2))
    assert len(whole.tokenizer.encode(long_prompt)) > 48  # at least three chunks
    assert _generate_batched(whole, [long_prompt], 16) == _generate_batched(chunked, [long_prompt], 16)


def test_bf16_checkpoint_runs_in_bfloat16_on_cpu(tiny_qwen2_dir):
    engine = LLMEngine(str(tiny_qwen2_dir), "cpu", dtype="bfloat16")
    assert engine.model.lm_head.weight.dtype == torch.bfloat16
    out = _generate_batched(engine, ["hello"], 4)[0]
    assert len(out) == 4


def test_score_equals_transformers_log_probs_across_chunks(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    from lowvram.config import load_profile

    engine = LLMEngine(str(tiny_llama_dir), load_profile("cpu").replace(max_num_batched_tokens=16, max_num_seqs=1))
    ids = engine.tokenizer.encode("score this text in several chunks of sixteen tokens each " * 3)
    ours = torch.tensor(engine.score(ids))
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0, :-1], -1).gather(1, torch.tensor(ids[1:])[:, None])[
            :, 0
        ]
    assert len(ids) > 48 and ours.shape == ref.shape
    assert (ours - ref).abs().max() < 1e-4
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
