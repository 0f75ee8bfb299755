"""Fuzzing the request schema: whatever the body, the answer is < 500 and the server lives on.

Bodies are mostly well-formed requests with some fields replaced by arbitrary
JSON, so that the fuzzer reaches the sampler and the engine, not only the
validator. The @example cases are inputs that once crashed or confused the
server; they stay as regression tests.
"""

import json

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from lowvram.engine.async_engine import AsyncLLMEngine
from lowvram.engine.engine import LLMEngine
from lowvram.server.app import create_app
from lowvram.server.cli import BackgroundServer, bind_socket

MODEL = "fuzz-model"
FUZZ = settings(
    max_examples=80,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

json_leaf = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
)
json_any = st.recursive(
    json_leaf,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)


def _maybe(valid):
    """Mostly a plausible value, sometimes any JSON at all."""
    return st.one_of(valid, valid, json_any)


text = st.text(max_size=24)  # includes unpaired surrogates, NULs and other oddities
small_count = st.integers(-2, 6) | st.integers(10**3, 10**20)
unit_float = st.floats(-0.5, 2.5, allow_nan=False)

COMMON = {
    "max_tokens": _maybe(small_count),
    "temperature": _maybe(unit_float),
    "top_p": _maybe(unit_float),
    "stop": _maybe(text | st.lists(text, max_size=3)),
    "seed": _maybe(st.integers(-(2**65), 2**65)),
    "presence_penalty": _maybe(st.floats(-3, 3)),
    "frequency_penalty": _maybe(st.floats(-3, 3)),
    "stream": _maybe(st.booleans()),
    "stream_options": _maybe(st.fixed_dictionaries({"include_usage": st.booleans()})),
    "n": _maybe(st.integers(0, 3)),
    "logprobs": _maybe(st.booleans() | st.integers(-1, 7)),
    "top_logprobs": _maybe(st.integers(-1, 22)),
    "top_k": _maybe(st.integers(-3, 50)),
    "min_p": _maybe(unit_float),
    "repetition_penalty": _maybe(st.floats(0, 3)),
    "ignore_eos": _maybe(st.booleans()),
    "user": _maybe(text),
    "response_format": _maybe(st.just({"type": "text"})),
}

message = st.fixed_dictionaries(
    {
        "role": _maybe(st.sampled_from(["system", "developer", "user", "assistant", "tool"])),
        "content": _maybe(text | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": text}), max_size=2)),
    }
)

chat_body = st.fixed_dictionaries(
    {"model": _maybe(st.just(MODEL)), "messages": _maybe(st.lists(message, max_size=3))},
    optional={**COMMON, "max_completion_tokens": _maybe(small_count)},
)
completion_body = st.fixed_dictionaries(
    {
        "model": _maybe(st.just(MODEL)),
        "prompt": _maybe(text | st.lists(text, max_size=2) | st.lists(st.integers(-5, 600), max_size=6)),
    },
    optional={**COMMON, "echo": _maybe(st.booleans()), "best_of": _maybe(st.integers(0, 3))},
)
extra_keys = st.dictionaries(st.text(max_size=8), json_any, max_size=2)


@pytest.fixture(scope="module")
def engine(tiny_qwen2_dir):
    return LLMEngine(str(tiny_qwen2_dir), "cpu", max_model_len=128)


@pytest.fixture(scope="module")
def http(engine):
    async_engine = AsyncLLMEngine(engine).start()
    app = create_app(async_engine, model_name=MODEL, default_max_tokens=4, max_body_bytes=64 * 1024)
    with BackgroundServer(app, bind_socket("127.0.0.1", 0)) as server:
        with httpx.Client(base_url=f"http://127.0.0.1:{server.port}", timeout=60) as client:
            yield client
    async_engine.stop()


def _post(http, path: str, body) -> httpx.Response:
    # json.dumps keeps unpaired surrogates as \ud800 escapes, as a careless client would send them
    content = body if isinstance(body, bytes) else json.dumps(body)
    return http.post(path, content=content, headers={"Content-Type": "application/json"})


def _check_answer(response: httpx.Response) -> None:
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        error = response.json()["error"]
        assert isinstance(error["message"], str) and error["message"]
        return
    if response.headers["content-type"].startswith("text/event-stream"):
        events = [line for line in response.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        for event in events[:-1]:
            assert "error" not in json.loads(event.removeprefix("data: ")), event
    else:
        assert response.json()["choices"][0]["finish_reason"] in ("stop", "length")


def _merge(body: dict, extra: dict) -> dict:
    return {**extra, **body}


@FUZZ
@given(body=chat_body, extra=extra_keys)
@example(body={"model": MODEL, "messages": [{"role": "user", "content": "\ud800"}]}, extra={})  # unpaired surrogate
@example(body={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}, extra={"\udfff": 0})  # ... in a key
@example(
    body={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "seed": 2**64}, extra={}
)  # overflows torch
@example(body={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": True}, extra={})  # True == 1
@example(body={"model": MODEL, "messages": [{"role": "assistant", "content": ""}], "stop": ["\x00"]}, extra={})
def test_fuzzed_chat_requests_never_get_a_5xx(http, body, extra):
    _check_answer(_post(http, "/v1/chat/completions", _merge(body, extra)))


@FUZZ
@given(body=completion_body, extra=extra_keys)
@example(body={"model": MODEL, "prompt": [[1, 2]]}, extra={})  # a list of token-id lists
@example(body={"model": MODEL, "prompt": []}, extra={})
@example(body={"model": MODEL, "prompt": "x", "max_tokens": 10**20}, extra={})
@example(body={"model": MODEL, "prompt": "x", "temperature": 1e-300}, extra={})  # greedy in all but name
def test_fuzzed_completion_requests_never_get_a_5xx(http, body, extra):
    _check_answer(_post(http, "/v1/completions", _merge(body, extra)))


@settings(FUZZ, max_examples=40)
@given(raw=st.binary(max_size=200) | st.text(max_size=200).map(lambda t: t.encode("utf-8", "surrogatepass")))
@example(raw=b"[" * 5000 + b"]" * 5000)  # recursion in the JSON parser
@example(raw=b'{"model": "fuzz-model", "prompt": "x", "max_tokens": 1e999}')  # float overflow to infinity
def test_fuzzed_raw_bodies_never_get_a_5xx(http, raw):
    _check_answer(_post(http, "/v1/completions", raw))


def test_after_fuzzing_the_server_answers_and_holds_no_pages(http, engine):
    response = http.post(
        "/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 3,
            "temperature": 0,
            "ignore_eos": True,
        },
    )
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 3
    assert http.get("/health").json()["requests_in_flight"] == 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
