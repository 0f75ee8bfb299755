"""The generation API as a user sees it: sampling options, stops, streaming, chat, abort."""

import pytest
import torch

from lowvram import LLM, SamplingParams
from lowvram.errors import RequestError


@pytest.fixture(scope="module")
def llm(tiny_qwen2_dir):
    return LLM(str(tiny_qwen2_dir), profile="cpu")


def test_output_shape_like_vllm(llm):
    out = llm.generate(["hello", "def f"], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert [o.prompt for o in out] == ["hello", "def f"]
    first = out[0].outputs[0]
    assert len(first.token_ids) == 5 and first.finish_reason == "length" and isinstance(first.text, str)
    assert first.text == llm.get_tokenizer().decode(first.token_ids, skip_special_tokens=True)


def test_same_seed_same_text_regardless_of_batch(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=20, seed=1234, ignore_eos=True)
    alone = llm.generate("The weather", params)[0].outputs[0].token_ids
    other = SamplingParams(temperature=1.0, max_tokens=20, seed=99, ignore_eos=True)
    batched = llm.generate(["once upon", "The weather", "import os"], [other, params, other])[1].outputs[0].token_ids
    assert alone == batched
    different = llm.generate("The weather", SamplingParams(temperature=1.0, max_tokens=20, seed=1235, ignore_eos=True))
    assert different[0].outputs[0].token_ids != alone


def test_stop_string_ends_generation_and_is_not_returned(llm):
    free = llm.generate("a b c", SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0].outputs[0].text
    assert len(free) > 6
    stop = free[3:6]
    cut = llm.generate("a b c", SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop]))[0].outputs[
        0
    ]
    assert cut.finish_reason == "stop"
    assert cut.text == free[: free.index(stop)]


def test_eos_ends_generation(llm):
    greedy = llm.generate("hi", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].outputs[0].token_ids
    # Make the third greedy token count as EOS: generation must stop there with reason "stop".
    out = llm.generate("hi", SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[greedy[2]]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids == greedy[:3]


def test_top_k_one_is_greedy(llm):
    greedy = llm.generate("xyz", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].outputs[0].token_ids
    topk = llm.generate("xyz", SamplingParams(temperature=1.5, top_k=1, max_tokens=12, seed=3, ignore_eos=True))
    assert topk[0].outputs[0].token_ids == greedy


def test_streaming_yields_the_same_text_and_tokens(llm):
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    whole = llm.generate("stream me", params)[0].outputs[0]
    chunks = list(llm.stream("stream me", params))
    assert chunks[-1].finished and not any(c.finished for c in chunks[:-1])
    assert "".join(c.text_delta for c in chunks) == whole.text
    assert chunks[-1].outputs[0].token_ids == whole.token_ids


def test_closing_a_stream_aborts_and_frees_pages(llm):
    free_before = llm.engine.block_manager.num_free_blocks
    stream = llm.stream("abort me", SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
    next(stream)
    next(stream)
    assert llm.engine.block_manager.num_free_blocks < free_before
    stream.close()
    assert llm.engine.block_manager.num_free_blocks == free_before
    assert not llm.engine.has_unfinished_requests()


def test_chat_uses_the_chat_template(llm):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    expected = llm.get_tokenizer().apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert llm.get_tokenizer().decode(out.prompt_token_ids) == expected
    assert out.prompt_token_ids.count(llm.get_tokenizer().bos_token_id) == 1


def test_repetition_penalty_changes_a_repetitive_greedy_output(llm):
    plain = llm.generate("la la la la", SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0].outputs[0]
    penalised = llm.generate(
        "la la la la", SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, repetition_penalty=1.8)
    )[0].outputs[0]
    assert len(set(penalised.token_ids)) >= len(set(plain.token_ids))
    assert penalised.token_ids != plain.token_ids


def test_prompt_longer_than_context_is_refused(tiny_qwen2_dir):
    llm = LLM(str(tiny_qwen2_dir), profile="cpu", max_model_len=32)
    with pytest.raises(RequestError, match="max_model_len"):
        llm.generate("word " * 40)
    out = llm.generate("hi", SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))[0]
    assert out.outputs[0].finish_reason == "length" and len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 32


@pytest.mark.parametrize(
    "bad",
    [
        dict(temperature=-1),
        dict(top_p=0),
        dict(max_tokens=0),
        dict(top_k=-5),
        dict(min_p=2),
        dict(stop=[""]),
        dict(temperature=float("nan")),
        dict(temperature=1e-300),
        dict(seed=2**64),
    ],
)
def test_bad_sampling_values_are_rejected_by_name(bad):
    with pytest.raises(RequestError, match=next(iter(bad))):
        SamplingParams(**bad)


def test_filters_keep_the_right_tokens():
    from lowvram.engine.sampler import filter_logits

    logits = torch.log(torch.tensor([0.5, 0.25, 0.15, 0.1]))
    keep = lambda p: (filter_logits(logits.clone(), p) > float("-inf")).tolist()  # noqa: E731
    assert keep(SamplingParams(top_k=2)) == [True, True, False, False]
    assert keep(SamplingParams(top_p=0.7)) == [True, True, False, False]
    assert keep(SamplingParams(top_p=0.76)) == [True, True, True, False]
    assert keep(SamplingParams(min_p=0.4)) == [True, True, False, False]


def test_a_batch_samples_the_tokens_each_row_would_alone():
    from types import SimpleNamespace

    from lowvram.engine.sampler import sample_token, sample_tokens

    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(3))
    logits[4, 7] = logits[4, 9] = logits[4].max() + 1  # a tie: the lower id wins in both paths
    prompt, output = [1, 2, 3], [4, 5]

    def seq(**params):
        return SimpleNamespace(
            params=SamplingParams(**params),
            prompt_token_ids=prompt,
            output_token_ids=output,
            generator=torch.Generator().manual_seed(11),
        )

    # Row 1 is a chunked prefill that samples nothing; greedy rows with and without a penalty, a random one.
    seqs = [seq(temperature=0), seq(temperature=0, repetition_penalty=1.3), seq(temperature=0.8), seq(temperature=0)]
    rows = [0, 2, 3, 4]
    alone = [
        sample_token(logits[r], s.params, torch.Generator().manual_seed(11), prompt, output) for r, s in zip(rows, seqs)
    ]
    assert sample_tokens(logits, rows, seqs) == alone
    assert alone[3] == 7
    assert sample_tokens(logits[:1], [0], seqs[:1]) == [int(torch.argmax(logits[0]))]


def test_tokenizer_follows_tokenizer_json_exactly():
    """The ids must be those of the pipeline the model was trained with (tokenizer.json)."""
    from tokenizers import Tokenizer as RawTokenizer

    from lowvram.demo import demo_model_path
    from lowvram.demo.corpus import heldout_text
    from lowvram.engine.tokenizer import Tokenizer

    model_dir = demo_model_path()
    text = heldout_text(4000)
    raw = RawTokenizer.from_file(str(model_dir / "tokenizer.json")).encode(text, add_special_tokens=False).ids
    assert list(Tokenizer(model_dir).hf.encode(text, add_special_tokens=False)) == raw


def test_fast_decode_gives_the_text_of_transformers_decode(tiny_qwen2_dir):
    """Tokenizer.decode goes to the tokenizers library directly when no clean-up is configured;
    any ids, special ones and partial multi-byte characters included, decode as transformers does."""
    import random

    from lowvram.engine.tokenizer import Tokenizer

    tokenizer = Tokenizer(tiny_qwen2_dir)
    assert tokenizer._backend is not None  # the test tokenizer has clean_up_tokenization_spaces False
    rng = random.Random(0)
    vocab = tokenizer.hf.vocab_size + len(tokenizer.hf.get_added_vocab())
    for length in (0, 1, 2, 5, 40):
        for _ in range(20):
            ids = [rng.randrange(vocab) for _ in range(length)]
            assert tokenizer.decode(ids) == tokenizer.hf.decode(ids, skip_special_tokens=True), ids
