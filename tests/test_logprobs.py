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


def test_pipelined_decode_draws_the_same_tokens_with_logprobs(tiny_qwen2_dir, reference):
    """A request asking for logprobs samples as on the device and is read at once (never queued
    ahead); its seeded tokens and the tokens of requests batched with it stay the same."""
    from tests.test_pipelined_decode import pipelined, run

    piped = pipelined(LLMEngine(str(tiny_qwen2_dir), "cpu"))
    seeded = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=12, seed=11, ignore_eos=True)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompt = [5, 6, 7, 8]
    without = run(piped, {"s": (prompt, seeded), "g": ([9, 10], greedy)})
    assert piped.stats.num_pipelined_steps > 5
    before = piped.stats.num_pipelined_steps
    asking = SamplingParams(**{**seeded.__dict__, "logprobs": 1})
    piped.add_request("s", prompt_token_ids=prompt, params=asking)
    piped.add_request("g", prompt_token_ids=[9, 10], params=greedy)
    done = {}
    while piped.has_unfinished_requests():
        done.update({o.request_id: o.outputs[0] for o in piped.step() if o.finished})
    assert done["s"].token_ids == without["s"][0] and done["g"].token_ids == without["g"][0]
    assert piped.stats.num_pipelined_steps == before and done["g"].logprobs is None
    rows = reference(prompt + done["s"].token_ids)
    for i, entry in enumerate(done["s"].logprobs):
        _check_entry(entry, rows[len(prompt) - 1 + i], done["s"].token_ids[i], 1)
