"""Structured output (response_format) and fill-in-the-middle (suffix): the engine's token masks
and the server through the official `openai` client. The tiny models are random, so only the
grammar makes their output valid JSON."""

import asyncio
import json

import openai
import pytest
import torch

from lowvram import SamplingParams
from lowvram.engine.engine import LLMEngine
from lowvram.engine.sampler import apply_token_masks
from lowvram.engine.tokenizer import Tokenizer
from lowvram.server.app import create_app
from lowvram.server.cli import BackgroundServer, bind_socket

# Nested objects, enums, arrays; bounded so a random model ends well inside MAX_TOKENS.
PET = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "kind": {"enum": ["cat", "dog", "fish"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "owner": {
            "type": "object",
            "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120}, "is_home": {"type": "boolean"}},
            "required": ["age", "is_home"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "kind", "tags", "owner"],
    "additionalProperties": False,
}
# A reply cut by max_tokens is not valid JSON: this is ample for PET (replies take 60 to 110 tokens).
MAX_TOKENS = 400
FIM_MARKS = ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>")


def assert_is_pet(text: str) -> None:
    pet = json.loads(text)
    assert set(pet) == {"name", "kind", "tags", "owner"}
    assert isinstance(pet["name"], str) and len(pet["name"]) <= 12
    assert pet["kind"] in ("cat", "dog", "fish")
    assert isinstance(pet["tags"], list) and len(pet["tags"]) <= 3
    assert all(isinstance(tag, str) and len(tag) <= 6 for tag in pet["tags"])
    assert set(pet["owner"]) == {"age", "is_home"} and isinstance(pet["owner"]["is_home"], bool)
    age = pet["owner"]["age"]
    assert isinstance(age, int) and not isinstance(age, bool) and 0 <= age <= 120


def run(engine, requests):
    """requests: id -> params, all on one prompt and batched; returns id -> (text, finish reason)."""
    for request_id, params in requests.items():
        engine.add_request(request_id, "A pet:", params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = (out.outputs[0].text, out.outputs[0].finish_reason)
    return done


@pytest.fixture(scope="module")
def engine(tiny_qwen2_dir):
    return LLMEngine(str(tiny_qwen2_dir), "cpu", max_model_len=1024)


@pytest.mark.parametrize("is_pipelined", [False, True], ids=["plain", "pipelined"])
def test_schema_output_validates_at_temperature_one_and_leaves_the_batch_alone(engine, is_pipelined, monkeypatch):
    if is_pipelined:  # as a CUDA engine runs: queued steps, sampling on the device
        for obj, name in ((engine, "pipelines_decode"), (engine.runner, "is_pipelined")):
            monkeypatch.setattr(obj, name, True)
        monkeypatch.setattr(engine.runner, "samples_on_device", True)
        monkeypatch.setattr(engine.scheduler, "num_lookahead_tokens", 1)
    free = SamplingParams(temperature=1.0, seed=7, max_tokens=150, ignore_eos=True)
    alone = run(engine, {"free": free})["free"]
    pet = dict(max_tokens=MAX_TOKENS, json_schema=PET)
    constrained = {f"pet{seed}": SamplingParams(temperature=1.0, seed=seed, **pet) for seed in range(5)}
    constrained["greedy"] = SamplingParams(temperature=0.0, **pet)
    num_pipelined = engine.stats.num_pipelined_steps
    got = run(engine, {**constrained, "free": free})
    assert got["free"] == alone  # an unconstrained row is not touched by its neighbours' masks
    # Steps queue again once the constrained requests are done (they end well before "free").
    assert (engine.stats.num_pipelined_steps > num_pipelined) == is_pipelined
    for request_id in constrained:
        text, finish_reason = got[request_id]
        assert finish_reason == "stop", (request_id, text)
        assert_is_pet(text)


def test_masks_touch_only_constrained_rows(engine):
    logits = torch.randn(3, engine.config.vocab_size)
    plain = SamplingParams()
    seqs = [type("Seq", (), {"matcher": None, "params": plain})() for _ in range(3)]
    assert apply_token_masks(logits, [0, 1, 2], seqs) is logits  # no copy, no work
    seqs[1].matcher = engine.grammars.matcher({"enum": ["cat"]})
    masked = apply_token_masks(logits, [0, 1, 2], seqs)
    assert torch.equal(masked[[0, 2]], logits[[0, 2]])
    allowed = torch.isfinite(masked[1]).nonzero().flatten().tolist()
    assert allowed and all(engine.tokenizer.decode([t]) in '"cat"' for t in allowed)
    assert engine.tokenizer.decode([int(masked[1].argmax())]).startswith('"')


def test_a_bad_schema_is_refused_when_added(engine):
    with pytest.raises(Exception, match="Invalid type: nothing"):
        engine.add_request("bad", "A pet:", SamplingParams(json_schema={"type": "nothing"}))
    assert "bad" not in engine.requests


# -- the server, through the openai client ------------------------------------------


@pytest.fixture(scope="module")
def fim_model_dir(tmp_path_factory):
    """A tiny deepseek-coder-shaped checkpoint whose tokenizer has deepseek-coder's FIM tokens."""
    from transformers import PreTrainedTokenizerFast

    from lowvram.testing import make_tiny_model

    out = make_tiny_model(tmp_path_factory.mktemp("tiny-fim"), "llama", vocab_size=640)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(out))
    tokenizer.add_special_tokens({"additional_special_tokens": list(FIM_MARKS)})
    tokenizer.save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def client(async_engine, tiny_qwen2_dir):
    app = create_app(async_engine, model_name="tiny", default_max_tokens=16)
    with BackgroundServer(app, bind_socket("127.0.0.1", 0)) as server:
        url = f"http://127.0.0.1:{server.port}/v1"
        with openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60) as client:
            yield client


def _json_schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "pet", "schema": schema, "strict": True}}


def test_chat_json_schema_replies_validate_for_every_seed(client):
    messages = [{"role": "user", "content": "Describe a pet as JSON."}]
    for seed in range(4):
        reply = client.chat.completions.create(
            model="tiny",
            messages=messages,
            temperature=1.0,
            seed=seed,
            max_tokens=MAX_TOKENS,
            response_format=_json_schema_format(PET),
        )
        assert reply.choices[0].finish_reason == "stop"
        assert_is_pet(reply.choices[0].message.content)


def test_streamed_and_completion_replies_validate_too(client):
    stream = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "A pet?"}],
        temperature=1.0,
        seed=11,
        max_tokens=MAX_TOKENS,
        response_format=_json_schema_format(PET),
        stream=True,
    )
    chunks = [c.choices[0] for c in stream if c.choices]
    assert chunks[-1].finish_reason == "stop"
    assert_is_pet("".join(c.delta.content or "" for c in chunks))
    reply = client.completions.create(
        model="tiny",
        prompt="pet =",
        temperature=1.0,
        seed=3,
        max_tokens=MAX_TOKENS,
        extra_body={"response_format": _json_schema_format(PET)},
    )
    assert reply.choices[0].finish_reason == "stop"
    assert_is_pet(reply.choices[0].text)


def test_json_object_replies_are_json_objects(client):
    """Any JSON object may run on past max_tokens (a random model writes long strings): those
    that finish must parse, and with these seeds some do."""
    finished = []
    for seed, temperature in [(0, 0.0), (5, 1.0), (7, 1.0), (8, 1.0)]:
        reply = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "JSON please"}],
            temperature=temperature,
            seed=seed,
            max_tokens=MAX_TOKENS,
            response_format={"type": "json_object"},
        )
        choice = reply.choices[0]
        assert choice.message.content.startswith("{")
        if choice.finish_reason == "stop":
            finished.append(json.loads(choice.message.content))
    assert finished and all(isinstance(value, dict) for value in finished)


@pytest.mark.parametrize(
    ("response_format", "expected"),
    [
        (_json_schema_format({"type": "nothing"}), "Invalid type: nothing"),
        (_json_schema_format({"type": "string", "pattern": "(("}), "unclosed group"),
        ({"type": "json_schema"}, "'response_format.json_schema' is required"),
        ({"type": "xml"}, "response_format.type"),
    ],
)
def test_a_bad_response_format_is_a_400_naming_the_problem(client, response_format, expected):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], response_format=response_format
        )
    assert expected in caught.value.body["message"]
    assert caught.value.body["param"].startswith("response_format")


def test_constrained_and_plain_requests_run_together(client):
    async def both():
        async with openai.AsyncOpenAI(base_url=str(client.base_url), api_key="unused", max_retries=0) as aclient:
            common = dict(model="tiny", messages=[{"role": "user", "content": "A pet?"}], temperature=1.0)
            return await asyncio.gather(
                aclient.chat.completions.create(
                    **common, seed=5, max_tokens=MAX_TOKENS, response_format=_json_schema_format(PET)
                ),
                aclient.chat.completions.create(**common, seed=6, max_tokens=40, extra_body={"ignore_eos": True}),
            )

    pet, plain = asyncio.run(both())
    assert pet.choices[0].finish_reason == "stop"
    assert_is_pet(pet.choices[0].message.content)
    assert plain.choices[0].finish_reason == "length" and plain.usage.completion_tokens == 40


def test_suffix_without_fim_tokens_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="tiny", prompt="def add(a, b):\n", suffix="\n    return c\n")
    assert "no fill-in-the-middle tokens" in caught.value.body["message"]
    assert caught.value.body["param"] == "suffix"


def test_fim_prompt_is_begin_prefix_hole_suffix_end(fim_model_dir):
    tokenizer = Tokenizer(fim_model_dir)
    prefix, suffix = "def add(a, b):\n    ", "\n    return c\n"
    begin, hole, end = (tokenizer.hf.convert_tokens_to_ids(mark) for mark in FIM_MARKS)
    plain = tokenizer.hf.encode
    expected = [tokenizer.hf.bos_token_id, begin, *plain(prefix, add_special_tokens=False), hole]
    expected += [*plain(suffix, add_special_tokens=False), end]
    assert tokenizer.encode_fill_in_middle(prefix, suffix) == expected
    # the same ids as the whole prompt written out, as deepseek-coder's model card does
    assert expected == tokenizer.encode(f"{FIM_MARKS[0]}{prefix}{FIM_MARKS[1]}{suffix}{FIM_MARKS[2]}")


def test_suffix_completes_the_middle_through_the_server(fim_model_dir):
    fim_engine = LLMEngine(str(fim_model_dir), "cpu", max_model_len=256)
    from lowvram.engine.async_engine import AsyncLLMEngine

    running = AsyncLLMEngine(fim_engine).start()
    try:
        app = create_app(running, model_name="coder", default_max_tokens=8)
        with BackgroundServer(app, bind_socket("127.0.0.1", 0)) as server:
            url = f"http://127.0.0.1:{server.port}/v1"
            with openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60) as fim_client:
                prefix, suffix = "def add(a, b):\n", "\n    return c\n"
                greedy = dict(model="coder", temperature=0, max_tokens=8, extra_body={"ignore_eos": True})
                reply = fim_client.completions.create(prompt=prefix, suffix=suffix, **greedy)
                ids = fim_engine.tokenizer.encode_fill_in_middle(prefix, suffix)
                assert reply.usage.prompt_tokens == len(ids)
                assert reply.choices[0].text == fim_client.completions.create(prompt=ids, **greedy).choices[0].text
                with pytest.raises(openai.BadRequestError, match="needs the prompt as text"):
                    fim_client.completions.create(prompt=ids, suffix=suffix, **greedy)
    finally:
        running.stop()


def test_the_benchmark_keeps_every_request_to_max_tokens(tiny_qwen2_dir, tmp_path):
    from script_modules import load_script

    out = tmp_path / "record.json"
    args = ["--model", str(tiny_qwen2_dir), "--batch", "2", "--max-tokens", "12", "--json", str(out)]
    record = load_script("bench_json_schema").main(args)
    assert record["plain"]["output_tokens"] == record["json_schema"]["output_tokens"] == 24
    assert record["json_schema_speed_ratio"] > 0 and json.loads(out.read_text())["batch"] == 2
