"""logprobs, top_logprobs, echo and n through the official `openai` client, against transformers."""

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM

from lowvram.engine.engine import LLMEngine
from lowvram.server.app import create_app
from lowvram.server.cli import BackgroundServer, bind_socket

TOLERANCE = 1e-4
GREEDY = dict(temperature=0, max_tokens=6, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def engine(tiny_qwen2_dir):
    return LLMEngine(str(tiny_qwen2_dir), "cpu", max_model_len=256)


@pytest.fixture(scope="module")
def client(async_engine, tiny_qwen2_dir):
    app = create_app(async_engine, model_name="m", default_max_tokens=16)
    with BackgroundServer(app, bind_socket("127.0.0.1", 0)) as server:
        url = f"http://127.0.0.1:{server.port}/v1"
        with openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60) as client:
            yield client


@pytest.fixture(scope="module")
def reference(tiny_qwen2_dir):
    """Greedy continuation ids of `ids` and the log-softmax [len(ids) + num_new - 1, V] along them."""
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir, dtype=torch.float32).eval()

    def run(ids: list[int], num_new: int = 0) -> tuple[list[int], torch.Tensor]:
        ids = list(ids)
        with torch.no_grad():
            for _ in range(num_new):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
            return ids[len(ids) - num_new :], torch.log_softmax(model(torch.tensor([ids])).logits[0], dim=-1)

    return run


def _text(engine, token_id: int) -> str:
    return engine.tokenizer.hf.decode([token_id])


def _messages(text):
    return [{"role": "user", "content": text}]


def _assert_chat_logprobs_match(engine, reference, messages, content, k):
    prompt = engine.tokenizer.apply_chat_template(messages)
    new, rows = reference(prompt, len(content))
    largest = 0.0
    for i, (token, entry) in enumerate(zip(new, content)):
        row = rows[len(prompt) - 1 + i]
        assert entry.token == _text(engine, token) and entry.bytes == list(entry.token.encode())
        largest = max(largest, abs(entry.logprob - row[token].item()))
        want = torch.topk(row, k)
        assert [t.token for t in entry.top_logprobs] == [_text(engine, t) for t in want.indices.tolist()]
        assert torch.allclose(torch.tensor([t.logprob for t in entry.top_logprobs]), want.values, atol=TOLERANCE)
        assert entry.top_logprobs[0].logprob == entry.logprob  # greedy took the likeliest
    print(f"largest difference from transformers: {largest:.2e}")
    assert largest < TOLERANCE


def test_chat_logprobs_equal_transformers_streamed_and_not(client, engine, reference):
    messages = _messages("the cache holds pages")
    reply = client.chat.completions.create(model="m", messages=messages, logprobs=True, top_logprobs=3, **GREEDY)
    content = reply.choices[0].logprobs.content
    assert len(content) == 6 and "".join(e.token for e in content) == reply.choices[0].message.content
    _assert_chat_logprobs_match(engine, reference, messages, content, 3)
    stream = client.chat.completions.create(
        model="m", messages=messages, logprobs=True, top_logprobs=3, stream=True, **GREEDY
    )
    streamed = [e for c in stream if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=TOLERANCE)


def test_chat_without_logprobs_returns_none_and_sampled_tokens_are_scored_raw(client, engine, reference):
    messages = _messages("sample me")
    plain = client.chat.completions.create(model="m", messages=messages, **GREEDY)
    assert plain.choices[0].logprobs is None
    sampled = client.chat.completions.create(
        model="m", messages=messages, logprobs=True, temperature=1.5, top_p=0.5, seed=7, max_tokens=5
    )
    content = sampled.choices[0].logprobs.content
    ids = engine.tokenizer.apply_chat_template(messages)
    _, rows = reference(ids + engine.tokenizer.hf.encode("".join(e.token for e in content), add_special_tokens=False))
    # the model's own distribution, not the tempered and truncated one the token was drawn from
    for i, entry in enumerate(content):
        assert entry.top_logprobs == []
        assert abs(entry.logprob - rows[len(ids) - 1 + i].max().item()) < 20  # finite, and a real log-probability
        assert entry.logprob <= 0


def test_completion_logprobs_shape_streamed_and_not(client, engine, reference):
    reply = client.completions.create(model="m", prompt="def add(a, b):", logprobs=2, **GREEDY)
    choice = reply.choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    assert all(len(top) == 2 and max(top.values()) == top[t] for top, t in zip(lp.top_logprobs, lp.tokens))
    prompt = engine.tokenizer.encode("def add(a, b):")
    new, rows = reference(prompt, 6)
    for i, token in enumerate(new):
        assert abs(lp.token_logprobs[i] - rows[len(prompt) - 1 + i, token].item()) < TOLERANCE
    chunks = list(client.completions.create(model="m", prompt="def add(a, b):", logprobs=2, stream=True, **GREEDY))
    pieces = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs]
    assert sum((p.tokens for p in pieces), []) == lp.tokens
    # the second run starts from the cached prompt: a differently shaped prefill, the same values within fp
    assert sum((p.token_logprobs for p in pieces), []) == pytest.approx(lp.token_logprobs, abs=TOLERANCE)
    assert sum((p.text_offset for p in pieces), []) == lp.text_offset


def test_echo_with_max_tokens_0_scores_the_prompt(client, engine, reference):
    text = "A prompt for the harness to score, word by word."
    reply = client.completions.create(model="m", prompt=text, echo=True, logprobs=1, max_tokens=0, temperature=0)
    choice = reply.choices[0]
    assert choice.text == text and reply.usage.completion_tokens == 0
    prompt = engine.tokenizer.encode(text)
    assert reply.usage.prompt_tokens == len(prompt)
    lp = choice.logprobs
    assert lp.tokens == [_text(engine, t) for t in prompt]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    _, rows = reference(prompt)
    got = torch.tensor(lp.token_logprobs[1:])
    want = rows[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    print(f"largest difference from transformers: {(got - want).abs().max():.2e}")
    assert torch.allclose(got, want, atol=TOLERANCE)
    # the same prompt again (now in the prefix cache) scores the same, and streamed too
    again = client.completions.create(model="m", prompt=text, echo=True, logprobs=1, max_tokens=0, stream=True)
    pieces = [c.choices[0] for c in again]
    assert "".join(p.text for p in pieces) == text
    streamed = sum((p.logprobs.token_logprobs for p in pieces if p.logprobs), [])
    assert streamed[0] is None and streamed[1:] == pytest.approx(lp.token_logprobs[1:], abs=TOLERANCE)


def test_echo_with_generation_puts_the_prompt_first(client):
    reply = client.completions.create(model="m", prompt="hello there", echo=True, logprobs=0, **GREEDY)
    lp = reply.choices[0].logprobs
    assert reply.choices[0].text.startswith("hello there") and reply.usage.completion_tokens == 6
    assert lp.token_logprobs[0] is None and all(v is not None for v in lp.token_logprobs[1:])
    assert "".join(lp.tokens).endswith(reply.choices[0].text[len("hello there") :])


def test_n_choices_share_the_prompt_pages(client, engine):
    prompt = "one shared prompt about paging, long enough to fill a few pages of sixteen tokens " * 2
    num_prompt = len(engine.tokenizer.encode(prompt))
    block_size = engine.block_manager.block_size
    before = engine.stats.num_prefill_tokens
    reply = client.completions.create(
        model="m", prompt=prompt, n=3, temperature=1.0, seed=5, max_tokens=8, extra_body={"ignore_eos": True}
    )
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert len({c.text for c in reply.choices}) > 1  # each choice samples its own tokens
    assert reply.usage.prompt_tokens == num_prompt
    assert [c.finish_reason for c in reply.choices] == ["length"] * 3 and reply.usage.completion_tokens == 24
    # The prompt is computed once; the others start from its cached full pages (at most the partly
    # filled last page is computed again; less where an earlier request cached some of it).
    tail = num_prompt - block_size * ((num_prompt - 1) // block_size)
    assert num_prompt > 4 * block_size and num_prompt + 2 <= engine.stats.num_prefill_tokens - before
    assert engine.stats.num_prefill_tokens - before <= num_prompt + 2 * tail
    same = client.completions.create(
        model="m", prompt=prompt, n=3, temperature=1.0, seed=5, max_tokens=8, extra_body={"ignore_eos": True}
    )
    assert [c.text for c in same.choices] == [c.text for c in reply.choices]


def test_n_choices_stream_with_their_index(client):
    stream = client.chat.completions.create(
        model="m", messages=_messages("hi"), n=2, stream=True, stream_options={"include_usage": True}, **GREEDY
    )
    chunks = list(stream)
    texts = {0: "", 1: ""}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    finals = sorted(c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason)
    assert finals == [0, 1] and texts[0] == texts[1] and texts[0]  # greedy: the same text twice
    assert chunks[-1].usage.completion_tokens == 12
    whole = client.chat.completions.create(model="m", messages=_messages("hi"), n=2, **GREEDY)
    assert [c.message.content for c in whole.choices] == [texts[0], texts[1]]
    assert whole.usage.completion_tokens == 12


def test_closing_an_n_choice_stream_aborts_every_choice(client, engine):
    import time

    stream = client.completions.create(
        model="m", prompt="a long story", n=3, max_tokens=200, stream=True, extra_body={"ignore_eos": True}
    )
    indices = set()
    for chunk in stream:
        indices.add(chunk.choices[0].index)
        if len(indices) == 3:
            break
    stream.close()
    deadline = time.monotonic() + 10
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
