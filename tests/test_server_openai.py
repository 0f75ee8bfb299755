"""The server through the official `openai` client, against a live server on loopback."""

import asyncio
from pathlib import Path

import httpx
import openai
import pytest

from lowvram.engine.async_engine import AsyncLLMEngine
from lowvram.engine.engine import LLMEngine
from lowvram.server.app import create_app
from lowvram.server.cli import BackgroundServer, bind_socket

GREEDY = dict(temperature=0, max_tokens=8, extra_body={"ignore_eos": True})
BUNDLED_WEIGHTS = Path(__file__).resolve().parents[1] / "lowvram" / "demo_model" / "model.safetensors"


@pytest.fixture(scope="module")
def engine(tiny_qwen2_dir):
    return LLMEngine(str(tiny_qwen2_dir), "cpu", max_model_len=256)


@pytest.fixture(scope="module")
def base_url(async_engine, tiny_qwen2_dir):
    app = create_app(async_engine, model_name=tiny_qwen2_dir.name, default_max_tokens=16)
    with BackgroundServer(app, bind_socket("127.0.0.1", 0)) as server:
        yield f"http://127.0.0.1:{server.port}/v1"


@pytest.fixture(scope="module")
def model(tiny_qwen2_dir):
    return tiny_qwen2_dir.name


@pytest.fixture
def client(base_url):
    with openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=30) as client:
        yield client


def _chat(text):
    return [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}]


def test_models_lists_the_served_model(client, model):
    ids = [m.id for m in client.models.list().data]
    assert ids == [model]
    assert client.models.retrieve(model).id == model


def test_chat_completion_counts_usage_and_respects_max_tokens(client, model, engine):
    messages = _chat("hello there")
    reply = client.chat.completions.create(model=model, messages=messages, **GREEDY)
    choice = reply.choices[0]
    assert reply.object == "chat.completion" and reply.model == model
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length"
    assert reply.usage.prompt_tokens == len(engine.tokenizer.apply_chat_template(messages))
    assert reply.usage.completion_tokens == 8
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 8


def test_chat_stream_has_openai_chunks_and_equals_the_non_streamed_text(client, model):
    messages = _chat("tell me about pages")
    whole = client.chat.completions.create(model=model, messages=messages, **GREEDY)
    chunks = list(
        client.chat.completions.create(
            model=model, messages=messages, stream=True, stream_options={"include_usage": True}, **GREEDY
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    # the usage chunk comes last and has no choices
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_stream_equals_non_streamed_and_token_id_prompts_work(client, model, engine):
    prompt = "def add(a, b):"
    whole = client.completions.create(model=model, prompt=prompt, **GREEDY)
    assert whole.object == "text_completion" and whole.usage.completion_tokens == 8
    streamed = "".join(
        c.choices[0].text for c in client.completions.create(model=model, prompt=prompt, stream=True, **GREEDY)
    )
    assert streamed == whole.choices[0].text
    by_ids = client.completions.create(model=model, prompt=engine.tokenizer.encode(prompt), **GREEDY)
    assert by_ids.choices[0].text == whole.choices[0].text
    assert by_ids.usage.prompt_tokens == whole.usage.prompt_tokens


def test_stop_string_ends_the_text_before_it(client, model):
    prompt = "The quick brown fox"
    full = (
        client.completions.create(
            model=model, prompt=prompt, temperature=0, max_tokens=16, extra_body={"ignore_eos": True}
        )
        .choices[0]
        .text
    )
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    assert stop.strip(), f"need a visible stop string from {full!r}"
    reply = client.completions.create(
        model=model, prompt=prompt, temperature=0, max_tokens=16, stop=[stop], extra_body={"ignore_eos": True}
    )
    assert reply.choices[0].finish_reason == "stop"
    assert reply.choices[0].text == full[: full.index(stop)]


def test_seed_makes_sampling_repeatable(client, model):
    def sample(seed):
        return (
            client.completions.create(
                model=model,
                prompt="Once upon a time",
                temperature=1.0,
                top_p=0.95,
                max_tokens=12,
                seed=seed,
                extra_body={"ignore_eos": True},
            )
            .choices[0]
            .text
        )

    assert sample(7) == sample(7)
    assert len({sample(seed) for seed in range(4)}) > 1


def test_default_max_tokens_is_the_server_cap(client, model):
    reply = client.completions.create(model=model, prompt="x", temperature=0, extra_body={"ignore_eos": True})
    assert reply.usage.completion_tokens == 16 and reply.choices[0].finish_reason == "length"


def test_unknown_model_is_model_not_found(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="../../etc/passwd", messages=_chat("hi"), max_tokens=2)
    assert info.value.code == "model_not_found"
    assert "does not exist" in info.value.message


def test_unsupported_parameter_is_a_clear_bad_request(client, model):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model, prompt="hi", max_tokens=2, n=2, best_of=3)
    assert "'best_of'" in info.value.message and "not supported" in info.value.message


def test_32_concurrent_streams_equal_the_sequential_greedy_outputs(client, base_url, model):
    prompts = [f"request {i}: the answer is" for i in range(32)]
    sequential = [client.completions.create(model=model, prompt=p, **GREEDY).choices[0].text for p in prompts]

    async def stream(aclient, prompt):
        text = ""
        async for chunk in await aclient.completions.create(model=model, prompt=prompt, stream=True, **GREEDY):
            text += chunk.choices[0].text
        return text

    async def run_all():
        async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60) as aclient:
            return await asyncio.gather(*(stream(aclient, p) for p in prompts))

    concurrent = asyncio.run(run_all())
    assert concurrent == sequential
    assert len(set(sequential)) > 1  # the prompts really differ in their outputs


def test_api_key_is_required_when_set(async_engine, model):
    app = create_app(async_engine, model_name=model, api_key="s3cret")
    with BackgroundServer(app, bind_socket("127.0.0.1", 0)) as server:
        base_url = f"http://127.0.0.1:{server.port}/v1"
        with openai.OpenAI(base_url=base_url, api_key="wrong", max_retries=0) as wrong:
            with pytest.raises(openai.AuthenticationError):
                wrong.models.list()
            with pytest.raises(openai.AuthenticationError):
                wrong.completions.create(model=model, prompt="hi", max_tokens=2)
        with openai.OpenAI(base_url=base_url, api_key="s3cret", max_retries=0) as right:
            assert right.completions.create(model=model, prompt="hi", max_tokens=2).usage.completion_tokens >= 1
        # liveness probes need no key; metrics do
        assert httpx.get(f"http://127.0.0.1:{server.port}/health").status_code == 200
        assert httpx.get(f"http://127.0.0.1:{server.port}/metrics").status_code == 401


@pytest.mark.skipif(
    not BUNDLED_WEIGHTS.is_file(), reason="the bundled demo model has not been trained into the package yet"
)
def test_bundled_model_is_served_when_no_model_is_given_and_answers():
    engine = LLMEngine(None, "cpu")
    async_engine = AsyncLLMEngine(engine).start()
    question = [{"role": "user", "content": "What is 123 + 45?"}]
    try:
        app = create_app(async_engine, model_name=engine.model_dir.name)
        with BackgroundServer(app, bind_socket("127.0.0.1", 0)) as server:
            with openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused", max_retries=0) as c:
                name = c.models.list().data[0].id
                reply = c.chat.completions.create(model=name, messages=question, temperature=0, max_tokens=16)
                streamed = "".join(
                    chunk.choices[0].delta.content or ""
                    for chunk in c.chat.completions.create(
                        model=name, messages=question, temperature=0, max_tokens=16, stream=True
                    )
                )
        assert name == "demo_model"
        assert reply.choices[0].message.content.strip() == "168"
        assert reply.choices[0].finish_reason == "stop"  # the model ends its answer itself
        assert streamed == reply.choices[0].message.content
    finally:
        async_engine.stop()
