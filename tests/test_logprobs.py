"""Log-probabilities out of the sampler and the prefill, against transformers' log-softmax."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from lowvram.config import load_profile
from lowvram.core.sampling_params import SamplingParams
from lowvram.engine.engine import LLMEngine
from lowvram.errors import RequestError

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def engine(tiny_qwen2_dir):
    return LLMEngine(str(tiny_qwen2_dir), "cpu", max_model_len=256)


@pytest.fixture(scope="module")
def reference(tiny_qwen2_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir, dtype=torch.float32).eval()

    def logprobs(ids: list[int]) -> torch.Tensor:  # [len(ids), V]: row i predicts token i + 1
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)

    return logprobs


def _run(engine, prompt_ids, params):
    engine.add_request("r", prompt_token_ids=prompt_ids, params=params)
    out = None
    while engine.has_unfinished_requests():
        out = next((o for o in engine.step() if o.request_id == "r"), out)
    return out


def _check_entry(entry, row: torch.Tensor, token: int, k: int):
    logprob, top = entry
    print(f"largest difference: {abs(logprob - row[token].item()):.2e}")
    assert abs(logprob - row[token].item()) < TOLERANCE
    assert len(top) == k and [lp for _, lp in top] == sorted((lp for _, lp in top), reverse=True)
    want = torch.topk(row, k)
    assert [i for i, _ in top] == want.indices.tolist()
    assert torch.allclose(torch.tensor([lp for _, lp in top]), want.values, atol=TOLERANCE)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_sampled_tokens_logprobs_equal_transformers(engine, reference, temperature):
    prompt = engine.tokenizer.encode("The pages of a cache")
    params = SamplingParams(temperature=temperature, top_k=5, seed=3, max_tokens=6, ignore_eos=True, logprobs=4)
    out = _run(engine, prompt, params).outputs[0]
    assert len(out.logprobs) == len(out.token_ids) == 6
    rows = reference(prompt + out.token_ids)
    for i, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        # raw log-probabilities: not those of the temperature / top-k distribution that sampled
        _check_entry(entry, rows[len(prompt) - 1 + i], token, 4)
        if temperature == 0.0:
            assert entry[1][0][0] == token  # greedy picks the likeliest


def test_logprobs_off_by_default_and_zero_gives_only_the_token(engine):
    prompt = engine.tokenizer.encode("hello")
    assert _run(engine, prompt, SamplingParams(temperature=0, max_tokens=2)).outputs[0].logprobs is None
    out = _run(engine, prompt, SamplingParams(temperature=0, max_tokens=2, logprobs=0)).outputs[0]
    assert [top for _, top in out.logprobs] == [[], []]


def test_prompt_logprobs_score_every_prompt_token_even_when_cached(tiny_qwen2_dir, reference):
    # Small chunks: the prompt is scored across several prefill steps.
    profile = load_profile("cpu").replace(max_num_batched_tokens=16)
    engine = LLMEngine(str(tiny_qwen2_dir), profile, max_model_len=256)
    prompt = engine.tokenizer.encode("one two three four five six seven eight nine ten " * 4)
    assert len(prompt) > 40
    _run(engine, prompt, SamplingParams(max_tokens=1))  # leaves the prompt's pages cached
    out = _run(engine, prompt, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2))
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    rows = reference(prompt)
    for i in range(1, len(prompt)):
        _check_entry(out.prompt_logprobs[i], rows[i - 1], prompt[i], 2)


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
@pytest.mark.parametrize("value", [-1, 21, True, 1.5])
def test_out_of_range_counts_are_refused(field, value):
    with pytest.raises(RequestError, match=field):
        SamplingParams(**{field: value})
