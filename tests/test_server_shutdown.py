"""Graceful shutdown: stop admitting, let in-flight streams finish, end the rest cleanly."""

import json
import queue
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from lowvram.engine.async_engine import AsyncLLMEngine
from lowvram.engine.engine import LLMEngine
from lowvram.server.app import create_app
from lowvram.server.cli import BackgroundServer, bind_socket

# What `lowvram serve` runs, without depending on how the top-level CLI lists its commands.
LAUNCH_SERVE = (
    "import argparse, sys\n"
    "from lowvram.server.cli import add_serve_parser\n"
    "parser = argparse.ArgumentParser(prog='lowvram')\n"
    "add_serve_parser(parser.add_subparsers())\n"
    "args = parser.parse_args(sys.argv[1:])\n"
    "sys.exit(args.func(args))\n"
)


def _data_events(lines):
    return [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]


def _start_server_process(model_dir, *extra):
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            LAUNCH_SERVE,
            "serve",
            "--model",
            str(model_dir),
            "--profile",
            "cpu",
            "--port",
            "0",
            "--max-model-len",
            "2048",
            *extra,
        ],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
    )
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stderr], daemon=True).start()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=0.5)
        except queue.Empty:
            assert proc.poll() is None, "the server process died while starting"
            continue
        if "serving" in line and "http://" in line:
            port = int(line.split("http://")[1].split("/")[0].rsplit(":", 1)[1])
            return proc, port, lines
    proc.kill()
    raise AssertionError("the server did not start in time")


def test_sigterm_lets_the_inflight_stream_finish_refuses_new_work_and_exits_0(tiny_qwen2_dir):
    proc, port, stderr_lines = _start_server_process(tiny_qwen2_dir)
    base_url = f"http://127.0.0.1:{port}"
    try:
        body = {
            "model": tiny_qwen2_dir.name,
            "prompt": "count to a thousand:",
            "max_tokens": 300,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        with (
            httpx.Client(timeout=30) as client,
            client.stream("POST", f"{base_url}/v1/completions", json=body) as stream,
        ):
            lines = stream.iter_lines()
            seen = [next(line for line in lines if line.startswith("data: "))]
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.05)
            with httpx.Client(timeout=10) as other:
                # a new connection, while the stream drains, gets the 503 the docs describe
                refused = other.post(
                    f"{base_url}/v1/completions", json={**body, "stream": False, "stream_options": None}
                )
            seen += list(lines)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "server_shutting_down"
        events = _data_events(seen)
        assert events[-1] == "[DONE]"
        finals = [json.loads(e) for e in events[:-1]]
        assert [c["choices"][0]["finish_reason"] for c in finals if c["choices"]][-1] == "length"
        assert finals[-1]["usage"]["completion_tokens"] == 300
        assert proc.wait(timeout=30) == 0
        assert any("server stopped" in line for line in list(stderr_lines.queue))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def engine(tiny_qwen2_dir):
    return LLMEngine(str(tiny_qwen2_dir), "cpu", max_model_len=2048)


def test_ctrl_c_ends_streams_still_running_after_the_grace_period_with_an_error_event_and_done(engine, tiny_qwen2_dir):
    async_engine = AsyncLLMEngine(engine).start()
    try:
        app = create_app(async_engine, model_name=tiny_qwen2_dir.name, shutdown_grace_s=0.3)
        server = BackgroundServer(app, bind_socket("127.0.0.1", 0)).start()
        body = {
            "model": tiny_qwen2_dir.name,
            "messages": [{"role": "user", "content": "go on forever"}],
            "max_tokens": 2000,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        with httpx.stream(
            "POST", f"http://127.0.0.1:{server.port}/v1/chat/completions", json=body, timeout=30
        ) as stream:
            lines = stream.iter_lines()
            seen = [next(line for line in lines if line.startswith("data: "))]
            started = time.monotonic()
            server.server.handle_exit(signal.SIGINT, None)  # what Ctrl-C calls in the main thread
            seen += list(lines)
            elapsed_s = time.monotonic() - started
        events = _data_events(seen)
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == "server_shutting_down" and "cut short" in error["message"]
        assert 0.25 < elapsed_s < 10
        server.stop()
        assert not server.is_running
        for _ in range(100):  # the abort reaches the engine loop between steps
            if engine.block_manager.num_free_blocks == engine.block_manager.num_blocks:
                break
            time.sleep(0.02)
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
        assert not engine.has_unfinished_requests()
    finally:
        async_engine.stop()
