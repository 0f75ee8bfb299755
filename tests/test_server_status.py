"""GET /v1/status and `lowvram ps`, against a live server on loopback."""

import json
import socket
import time

import httpx
import pytest

from lowvram.cli import main
from lowvram.core.sampling_params import SamplingParams
from lowvram.engine.engine import LLMEngine
from lowvram.server.app import create_app
from lowvram.server.cli import BackgroundServer, bind_socket
from lowvram.server.status import engine_status

API_KEY = "sekrit"


@pytest.fixture(scope="module")
def engine(tiny_qwen2_dir):
    return LLMEngine(str(tiny_qwen2_dir), "cpu", max_model_len=256)


@pytest.fixture(scope="module")
def url(async_engine):
    app = create_app(async_engine, model_name="tiny", api_key=API_KEY, default_max_tokens=4)
    with BackgroundServer(app, bind_socket("127.0.0.1", 0)) as server:
        yield f"http://127.0.0.1:{server.port}"


@pytest.fixture
def http(url):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=url, headers=headers, timeout=30) as client:
        yield client


def test_status_says_what_the_server_holds(http, engine):
    status = http.get("/v1/status").json()
    assert status["model"] == "tiny" and status["status"] == "ok"
    assert status["architecture"] == "Qwen2ForCausalLM" and status["weight_format"] == "float32"
    assert status["device"] == "cpu" and status["profile"] == "cpu"
    assert status["weights"] == {"device_bytes": engine.model.weight_bytes, "host_bytes": 0}
    kv = status["kv_cache"]
    assert kv["precision"] == engine.kv_precision and kv["num_blocks"] == engine.block_manager.num_blocks
    assert kv["device_bytes"] == engine.kv_pool.device_bytes > 0
    assert status["context"] == {"max_model_len": 256, "num_tokens_in_use": 0}
    assert status["controller"] == {"mode": engine.snapshot().controller_mode, "last_decision": None}
    assert status["requests"] == {"running": 0, "waiting": 0, "in_flight": 0, "max_queue": 64}
    assert len(json.dumps(status)) < 2000  # a small object


def test_status_counts_a_running_request_and_its_context(tiny_qwen2_dir):
    engine = LLMEngine(str(tiny_qwen2_dir), "cpu", max_model_len=256)  # driven here, step by step
    engine.add_request("a", None, SamplingParams(max_tokens=50, ignore_eos=True), prompt_token_ids=[5] * 20)
    engine.add_request("b", None, SamplingParams(max_tokens=50, ignore_eos=True), prompt_token_ids=[6] * 7)
    engine.step()
    status = engine_status(engine)
    assert status["requests"] == {"running": 2, "waiting": 0}
    assert status["context"]["num_tokens_in_use"] == sum(seq.num_tokens for seq in engine.scheduler.running) >= 27
    assert status["kv_cache"]["num_blocks_used"] >= 2


def test_status_needs_the_api_key(url):
    response = httpx.get(f"{url}/v1/status")
    assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"


def test_ps_prints_the_status(url, monkeypatch, capsys):
    monkeypatch.setenv("LOWVRAM_API_KEY", API_KEY)
    assert main(["ps", "--url", url]) == 0
    out = capsys.readouterr().out
    assert "tiny (Qwen2ForCausalLM, float32)" in out and "0 running, 0 waiting" in out
    assert "MiB on the device" in out and "tokens in use (at most 256 a request)" in out
    assert main(["ps", "--url", f"{url}/v1", "--api-key", API_KEY, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model"] == "tiny"


def test_ps_with_a_wrong_key_says_so(url, capsys):
    assert main(["ps", "--url", url, "--api-key", "wrong"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lowvram: error: the server at ") and "401" in err and "--api-key" in err
    assert err.count("\n") == 1


def test_ps_without_a_server_is_one_clear_line(capsys):
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    assert main(["ps", "--url", f"http://127.0.0.1:{port}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"lowvram: error: no lowvram server answers at http://127.0.0.1:{port}")
    assert "lowvram serve" in err and err.count("\n") == 1


def test_status_answers_while_a_request_streams(http, engine, monkeypatch):
    step = engine.step
    monkeypatch.setattr(engine, "step", lambda: time.sleep(0.02) or step())  # the tiny model is done in a blink
    body = {"model": "tiny", "prompt": "one two three", "max_tokens": 200, "stream": True, "ignore_eos": True}
    with http.stream("POST", "/v1/completions", json=body) as response:
        lines = response.iter_lines()
        next(lines)  # the request is running now
        status = http.get("/v1/status").json()
    assert status["requests"]["running"] == 1 and status["requests"]["in_flight"] == 1
    assert 4 <= status["context"]["num_tokens_in_use"] <= 203


def test_status_counts_streamed_layers_as_weights_in_host_memory(tiny_qwen2_dir):
    from lowvram.config import load_profile

    profile = load_profile("cpu").replace(weight_offload="stream", max_resident_layers=1, max_model_len=256)
    engine = LLMEngine(str(tiny_qwen2_dir), profile)
    weights = engine_status(engine)["weights"]
    assert weights["host_bytes"] == engine.model.layer_streamer.plan.host_weight_bytes > 0
    assert weights["device_bytes"] == engine.model.weight_bytes
