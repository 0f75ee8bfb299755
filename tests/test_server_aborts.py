"""Clients that go away: every aborted request must give its KV pages back."""

import asyncio
import time

import httpx
import pytest

from lowvram.engine.async_engine import AsyncLLMEngine
from lowvram.engine.engine import LLMEngine
from lowvram.server.app import create_app
from lowvram.server.cli import BackgroundServer, bind_socket

NUM_ABORTED_STREAMS = 200
NUM_AT_ONCE = 25


@pytest.fixture(scope="module")
def engine(tiny_qwen2_dir):
    return LLMEngine(str(tiny_qwen2_dir), "cpu", max_model_len=2048)


@pytest.fixture(scope="module")
def served(engine, tiny_qwen2_dir):
    async_engine = AsyncLLMEngine(engine).start()
    app = create_app(async_engine, model_name=tiny_qwen2_dir.name, max_queue=NUM_AT_ONCE * 2)
    with BackgroundServer(app, bind_socket("127.0.0.1", 0)) as server:
        yield f"http://127.0.0.1:{server.port}", app.state.lowvram
    async_engine.stop()


def _wait_until_settled(engine, state, timeout_s=20.0) -> bool:
    """True once no request is in flight and every page is free again."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (
            state.num_in_flight == 0
            and not state.generations
            and not engine.has_unfinished_requests()
            and engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
        ):
            return True
        time.sleep(0.05)
    return False


def _long_request(model, i, **extra):
    # far longer than the test lets it run: it is cut off mid-way
    return {
        "model": model,
        "prompt": f"request number {i} goes on and on",
        "max_tokens": 2000,
        "temperature": 0,
        "ignore_eos": True,
        **extra,
    }


def test_200_streams_aborted_midway_leak_no_pages_and_the_server_still_answers(served, engine, tiny_qwen2_dir):
    base_url, state = served
    model = tiny_qwen2_dir.name
    num_chunks_read = []

    async def open_and_abandon(client, i):
        body = {
            "model": model,
            "messages": [{"role": "user", "content": f"stream {i} goes on"}],
            "stream": True,
            "max_tokens": 1000,
            "temperature": 0,
            "ignore_eos": True,
        }
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            num_data = 0
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    assert line != "data: [DONE]", "the stream ended before it was aborted"
                    num_data += 1
                    if num_data == 3:  # the role chunk and two tokens
                        break
            num_chunks_read.append(num_data)
        # leaving the block closes the connection with the stream unfinished

    async def run_all():
        limits = httpx.Limits(max_connections=NUM_AT_ONCE)
        async with httpx.AsyncClient(base_url=base_url, timeout=30, limits=limits) as client:
            for start in range(0, NUM_ABORTED_STREAMS, NUM_AT_ONCE):
                await asyncio.gather(*(open_and_abandon(client, i) for i in range(start, start + NUM_AT_ONCE)))

    asyncio.run(run_all())
    assert num_chunks_read == [3] * NUM_ABORTED_STREAMS
    assert _wait_until_settled(engine, state), (
        f"{engine.block_manager.num_blocks - engine.block_manager.num_free_blocks} pages still held, "
        f"{state.num_in_flight} requests in flight"
    )
    metrics = httpx.get(f"{base_url}/metrics").text
    assert f'lowvram_requests_finished_total{{finish_reason="disconnect"}} {NUM_ABORTED_STREAMS}' in metrics
    reply = httpx.post(f"{base_url}/v1/completions", json={**_long_request(model, 0), "max_tokens": 5}, timeout=30)
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 5


def test_a_non_streaming_client_that_times_out_frees_its_pages(served, engine, tiny_qwen2_dir):
    base_url, state = served
    num_before = state.metrics.finished.value("disconnect")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{base_url}/v1/completions",
            json=_long_request(tiny_qwen2_dir.name, 1),
            timeout=httpx.Timeout(30, read=0.3),
        )
    assert _wait_until_settled(engine, state)
    assert state.metrics.finished.value("disconnect") == num_before + 1
