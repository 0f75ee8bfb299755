"""Bad input, overload and the operational endpoints, over raw HTTP against a live server."""

import json
import re
import time

import httpx
import pytest

from lowvram.engine.engine import LLMEngine
from lowvram.server.app import create_app
from lowvram.server.cli import BackgroundServer, bind_socket

MAX_MODEL_LEN = 512
MAX_BODY_BYTES = 16 * 1024


@pytest.fixture(scope="module")
def engine(tiny_qwen2_dir):
    return LLMEngine(str(tiny_qwen2_dir), "cpu", max_model_len=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def model(tiny_qwen2_dir):
    return tiny_qwen2_dir.name


@pytest.fixture(scope="module")
def http(async_engine, model):
    app = create_app(async_engine, model_name=model, max_body_bytes=MAX_BODY_BYTES, default_max_tokens=4)
    with BackgroundServer(app, bind_socket("127.0.0.1", 0)) as server:
        with httpx.Client(base_url=f"http://127.0.0.1:{server.port}", timeout=30) as client:
            yield client


def _ok_chat(model, **extra):
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra}


def _ok_completion(model, **extra):
    return {"model": model, "prompt": "hi", "max_tokens": 2, **extra}


def _assert_error(response, status, *words, param=None, code=None):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    for word in words:
        assert word in error["message"], error["message"]
    if param is not None:
        assert error["param"] == param
    if code is not None:
        assert error["code"] == code
    return error


# (what is wrong, endpoint, body as text, status, words the message must contain, param)
BAD_REQUESTS = [
    ("malformed JSON", "chat", '{"model": ', 400, ["not valid JSON"], None),
    ("not an object", "chat", "[1, 2]", 400, ["JSON object"], None),
    ("empty body", "chat", "", 400, ["empty"], None),
    ("NaN is not JSON", "completion", '{"model": "M", "prompt": "x", "temperature": NaN}', 400, ["NaN"], None),
    ("deeply nested", "completion", "[" * 8000 + "]" * 8000, 400, ["nested too deeply"], None),
    (
        "missing model",
        "chat",
        json.dumps({"messages": [{"role": "user", "content": "hi"}]}),
        400,
        ["'model' is required"],
        "model",
    ),
    ("missing messages", "chat", json.dumps({"model": "M"}), 400, ["'messages' is required"], "messages"),
    ("max_tokens as a string", "chat", 'OK_CHAT max_tokens="5"', 400, ["max_tokens", "integer"], "max_tokens"),
    ("stream as an int", "chat", "OK_CHAT stream=1", 400, ["stream", "boolean"], "stream"),
    ("temperature too high", "chat", "OK_CHAT temperature=2.5", 400, ["temperature", "2"], "temperature"),
    ("top_p of zero", "completion", "OK_COMPLETION top_p=0", 400, ["top_p"], "top_p"),
    ("negative max_tokens", "completion", "OK_COMPLETION max_tokens=-1", 400, ["max_tokens"], "max_tokens"),
    ("unknown parameter", "chat", "OK_CHAT temprature=0.5", 400, ["unknown parameter 'temprature'"], "temprature"),
    (
        "bad role",
        "chat",
        json.dumps({"model": "M", "messages": [{"role": "tool", "content": "x"}]}),
        400,
        ["role"],
        "messages[0].role",
    ),
    (
        "image content",
        "chat",
        json.dumps(
            {
                "model": "M",
                "messages": [
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}]}
                ],
            }
        ),
        400,
        ["text"],
        "messages[0].content",
    ),
    ("empty messages", "chat", json.dumps({"model": "M", "messages": []}), 400, ["messages"], "messages"),
    ("stop of the wrong type", "completion", "OK_COMPLETION stop=5", 400, ["string or a list of strings"], "stop"),
    ("empty stop string", "completion", 'OK_COMPLETION stop=""', 400, ["stop"], None),
    ("n = 0", "chat", "OK_CHAT n=0", 400, ["'n'", "greater than or equal to 1"], "n"),
    ("n beyond the limit", "completion", "OK_COMPLETION n=17", 400, ["'n'", "16"], "n"),
    ("n = true", "chat", "OK_CHAT n=true", 400, ["'n'", "integer"], "n"),
    ("best_of other than n", "completion", "OK_COMPLETION best_of=2", 400, ["best_of", "not supported"], "best_of"),
    ("top_logprobs beyond 20", "chat", "OK_CHAT top_logprobs=21", 400, ["top_logprobs", "20"], "top_logprobs"),
    ("top_logprobs alone", "chat", "OK_CHAT top_logprobs=2", 400, ["top_logprobs", "logprobs"], "top_logprobs"),
    ("logprobs as a count", "chat", "OK_CHAT logprobs=3", 400, ["logprobs", "boolean"], "logprobs"),
    ("completion logprobs beyond 5", "completion", "OK_COMPLETION logprobs=6", 400, ["logprobs", "5"], "logprobs"),
    ("negative logprobs", "completion", "OK_COMPLETION logprobs=-1", 400, ["logprobs"], "logprobs"),
    ("max_tokens 0 without echo", "completion", "OK_COMPLETION max_tokens=0", 400, ["echo"], "max_tokens"),
    ("echo in chat", "chat", "OK_CHAT echo=true", 400, ["unknown parameter 'echo'"], "echo"),
    (
        "tools",
        "chat",
        'OK_CHAT tools=[{"type": "function", "function": {"name": "f"}}]',
        400,
        ["tool", "not supported"],
        "tools",
    ),
    (
        "unknown output format",
        "chat",
        'OK_CHAT response_format={"type": "xml"}',
        400,
        ["response_format.type", "json_schema"],
        "response_format.type",
    ),
    ("batched prompts", "completion", json.dumps({"model": "M", "prompt": ["a", "b"]}), 400, ["one prompt"], None),
    (
        "token id out of range",
        "completion",
        json.dumps({"model": "M", "prompt": [1, 10**9]}),
        400,
        ["token ids"],
        "prompt",
    ),
    (
        "stream_options without stream",
        "chat",
        'OK_CHAT stream_options={"include_usage": true}',
        400,
        ["stream_options"],
        "stream_options",
    ),
    (
        "prompt longer than max_model_len",
        "completion",
        json.dumps({"model": "M", "prompt": "word " * 600}),
        400,
        ["maximum context length is 512"],
        "prompt",
    ),
    (
        "max_tokens beyond the context",
        "chat",
        "OK_CHAT max_tokens=1000",
        400,
        ["maximum context length", "1000"],
        "max_tokens",
    ),
    (
        "truncate_prompt_tokens beyond the context",
        "chat",
        "OK_CHAT truncate_prompt_tokens=513",
        400,
        ["truncate_prompt_tokens = 513", "context of 512 tokens"],
        "truncate_prompt_tokens",
    ),
    (
        "truncate_prompt_tokens zero",
        "completion",
        "OK_COMPLETION truncate_prompt_tokens=0",
        400,
        ["truncate_prompt_tokens"],
        "truncate_prompt_tokens",
    ),
    (
        "truncate_prompt_tokens not an integer",
        "completion",
        'OK_COMPLETION truncate_prompt_tokens="8"',
        400,
        ["truncate_prompt_tokens"],
        "truncate_prompt_tokens",
    ),
    ("both max_tokens names", "chat", "OK_CHAT max_completion_tokens=3", 400, ["max_completion_tokens"], None),
    ("seed beyond 64 bits", "completion", "OK_COMPLETION seed=18446744073709551616", 400, ["seed"], "seed"),
    ("unpaired surrogate", "completion", '{"model": "M", "prompt": "\\ud800"}', 400, ["surrogate"], "prompt"),
    ("surrogate in a key", "completion", '{"model": "M", "prompt": "x", "\\udfff": 1}', 400, ["surrogate"], None),
]


def _body(template: str, model: str) -> str:
    """Bodies are written against a placeholder model "M"; 'OK_CHAT k=v' adds k=v to a valid request."""
    if template.startswith(("OK_CHAT", "OK_COMPLETION")):
        kind, _, assignment = template.partition(" ")
        key, _, value = assignment.partition("=")
        body = (_ok_chat if kind == "OK_CHAT" else _ok_completion)(model)
        return json.dumps(body)[:-1] + f', "{key}": {value}}}'
    return template.replace('"M"', json.dumps(model))


@pytest.mark.parametrize("what,endpoint,template,status,words,param", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_requests_get_a_4xx_error_object_that_says_what_is_wrong(
    http, model, what, endpoint, template, status, words, param
):
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    response = http.post(path, content=_body(template, model), headers={"Content-Type": "application/json"})
    _assert_error(response, status, *words, param=param)


def test_the_server_still_answers_after_every_bad_request(http, model, engine):
    for what, endpoint, template, *_ in BAD_REQUESTS:
        path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
        assert http.post(path, content=_body(template, model)).status_code < 500, what
    reply = http.post("/v1/chat/completions", json=_ok_chat(model))
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] >= 1
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(http, model, async_engine, engine):
    """vLLM's left truncation: a prompt past the context is answered from its last N tokens."""
    from lowvram.server.schemas import ChatCompletionRequest, CompletionRequest

    state = create_app(async_engine, model_name=model).state.lowvram
    ids = engine.tokenizer.encode("word " * 600)
    assert len(ids) > MAX_MODEL_LEN
    assert state.encode(CompletionRequest(model=model, prompt=ids, truncate_prompt_tokens=100)) == ids[-100:]
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "word " * 600}]
    chat = ChatCompletionRequest(model=model, messages=messages, truncate_prompt_tokens=300)
    assert state.encode(chat) == engine.tokenizer.apply_chat_template(messages)[-300:]
    greedy = {"max_tokens": 4, "temperature": 0}
    truncated = http.post(
        "/v1/completions", json=_ok_completion(model, prompt=ids, truncate_prompt_tokens=100, **greedy)
    )
    direct = http.post("/v1/completions", json=_ok_completion(model, prompt=ids[-100:], **greedy))
    assert truncated.status_code == 200, truncated.text
    assert truncated.json()["usage"]["prompt_tokens"] == 100
    assert truncated.json()["choices"][0]["text"] == direct.json()["choices"][0]["text"]
    # without it, the same prompt is OpenAI's 400 naming the numbers
    error = _assert_error(http.post("/v1/completions", json=_ok_completion(model, prompt=ids)), 400, str(len(ids)))
    assert error["code"] == "context_length_exceeded" and str(MAX_MODEL_LEN) in error["message"]


def test_unknown_model_is_404_model_not_found(http):
    response = http.post("/v1/completions", json={"model": "/etc/passwd", "prompt": "hi"})
    _assert_error(response, 404, "does not exist", param="model", code="model_not_found")
    _assert_error(http.get("/v1/models/other-model"), 404, code="model_not_found")


def test_oversized_bodies_get_413_whether_declared_or_streamed(http, model):
    big = json.dumps(_ok_completion(model, prompt="x" * (MAX_BODY_BYTES + 10)))
    _assert_error(http.post("/v1/completions", content=big), 413, str(MAX_BODY_BYTES))

    def chunked():  # no Content-Length: the limit must hold while reading
        for i in range(0, len(big), 4096):
            yield big[i : i + 4096].encode()

    _assert_error(http.post("/v1/completions", content=chunked()), 413)


def test_unknown_paths_and_methods_get_error_objects(http):
    _assert_error(http.get("/v1/engines"), 404, "no such endpoint", code="not_found")
    _assert_error(http.get("/v1/chat/completions"), 405, "GET")
    _assert_error(http.delete("/v1/models"), 405)


def test_queue_full_answers_429_with_retry_after_and_recovers(async_engine, model):
    app = create_app(async_engine, model_name=model, max_queue=2)
    state = app.state.lowvram
    # long enough that neither stream can finish while the test looks
    hold = _ok_completion(model, prompt="hold the line", max_tokens=480, stream=True, ignore_eos=True)
    with (
        BackgroundServer(app, bind_socket("127.0.0.1", 0)) as server,
        httpx.Client(base_url=f"http://127.0.0.1:{server.port}", timeout=30) as client,
    ):
        with (
            client.stream("POST", "/v1/completions", json=hold) as first,
            client.stream("POST", "/v1/completions", json=hold) as second,
        ):
            assert first.status_code == second.status_code == 200
            third = client.post("/v1/completions", json=_ok_completion(model))
            _assert_error(third, 429, "max_queue = 2", code="server_overloaded")
            assert int(third.headers["Retry-After"]) >= 1
            assert 'lowvram_requests_rejected_total{reason="queue_full"} 1' in client.get("/metrics").text
        # closing the streams gives both slots back
        for _ in range(200):
            if state.num_in_flight == 0:
                break
            time.sleep(0.02)
        assert state.num_in_flight == 0
        assert client.post("/v1/completions", json=_ok_completion(model)).status_code == 200


def test_draining_server_answers_503_with_retry_after(async_engine, model):
    app = create_app(async_engine, model_name=model)
    with (
        BackgroundServer(app, bind_socket("127.0.0.1", 0)) as server,
        httpx.Client(base_url=f"http://127.0.0.1:{server.port}", timeout=30) as client,
    ):
        app.state.lowvram.begin_shutdown()
        response = client.post("/v1/chat/completions", json=_ok_chat(model))
        _assert_error(response, 503, "shutting down", code="server_shutting_down")
        assert int(response.headers["Retry-After"]) >= 1
        assert client.get("/health").status_code == 503


def _metric(text: str, name: str, labels: str = "") -> float:
    match = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.MULTILINE)
    assert match, f"{name}{labels} missing from /metrics"
    return float(match.group(1))


def test_metrics_follow_the_requests(http, model):
    before = http.get("/metrics")
    assert before.headers["content-type"].startswith("text/plain; version=0.0.4")
    done_before = (
        _metric(before.text, "lowvram_http_requests_total", '{endpoint="/v1/chat/completions",status="200"}')
        if '/v1/chat/completions",status="200"' in before.text
        else 0
    )
    tokens_before = _metric(before.text, "lowvram_generation_tokens_total")
    for _ in range(3):
        assert (
            http.post("/v1/chat/completions", json=_ok_chat(model, temperature=0, ignore_eos=True)).status_code == 200
        )
    text = http.get("/metrics").text
    assert (
        _metric(text, "lowvram_http_requests_total", '{endpoint="/v1/chat/completions",status="200"}')
        == done_before + 3
    )
    assert _metric(text, "lowvram_generation_tokens_total") == tokens_before + 6
    assert _metric(text, "lowvram_time_to_first_token_seconds_count") >= 3
    assert _metric(text, "lowvram_inter_token_latency_seconds_count") >= 3
    assert _metric(text, "lowvram_time_to_first_token_seconds_bucket", '{le="+Inf"}') == _metric(
        text, "lowvram_time_to_first_token_seconds_count"
    )
    # the engine's gauges are as of its last step, which may end just after the answer was sent
    for _ in range(100):
        if _metric(text, "lowvram_kv_pages", '{location="device"}') == 0:
            break
        time.sleep(0.02)
        text = http.get("/metrics").text
    assert _metric(text, "lowvram_kv_pages", '{location="device"}') == 0  # nothing in flight holds pages
    assert _metric(text, "lowvram_kv_pages", '{location="host"}') == 0
    assert _metric(text, "lowvram_kv_pages_capacity") > 0
    assert _metric(text, "lowvram_kv_precision_info", '{precision="fp16"}') == 1
    assert _metric(text, "lowvram_controller_mode_info", '{mode="normal"}') == 1  # the controller is on, idle
    for name in (
        "lowvram_queue_depth",
        "lowvram_batch_size",
        "lowvram_decode_tokens_per_second",
        "lowvram_requests_in_flight",
    ):
        _metric(text, name)
    assert "# TYPE lowvram_controller_events_total counter" in text
    # every sample line is "name{labels} number"
    samples = [line for line in text.splitlines() if line and not line.startswith("#")]
    assert all(re.fullmatch(r'[a-z_]+(\{[a-z_]+="[^"]*"(,[a-z_]+="[^"]*")*\})? [-+0-9.eInf]+', s) for s in samples)


def test_health_reports_ok(http, model):
    response = http.get("/health")
    assert response.status_code == 200
    assert response.json()["status"] == "ok" and response.json()["model"] == model
