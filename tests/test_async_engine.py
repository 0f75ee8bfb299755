import asyncio

import pytest

from lowvram import LLM, SamplingParams
from lowvram.engine.async_engine import AsyncLLMEngine
from lowvram.errors import RequestError

PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_qwen2_dir):
    return LLM(str(tiny_qwen2_dir), profile="cpu")


@pytest.fixture
def engine(llm):
    eng = AsyncLLMEngine(llm.engine).start()
    yield eng
    eng.stop()


async def _collect(engine, request_id, prompt):
    text, last = "", None
    async for out in engine.generate(request_id, prompt, PARAMS):
        text += out.text_delta
        last = out
    return text, last.outputs[0].token_ids


def test_concurrent_streams_equal_sequential_outputs(llm):
    prompts = [f"prompt number {i} says" for i in range(10)]
    # Computed before the loop thread owns the engine: an engine is driven by one thread only.
    expected = [o.outputs[0].token_ids for o in (llm.generate(p, PARAMS)[0] for p in prompts)]
    engine = AsyncLLMEngine(llm.engine).start()

    async def main():
        return await asyncio.gather(*(_collect(engine, f"r{i}", p) for i, p in enumerate(prompts)))

    try:
        results = asyncio.run(main())
    finally:
        engine.stop()
    assert [ids for _, ids in results] == expected
    assert all(text for text, _ in results)


def test_cancelling_a_stream_aborts_and_frees_pages(llm, engine):
    total = llm.engine.block_manager.num_blocks

    async def main():
        async def consume():
            async for _ in engine.generate(
                "c", "cancel me", SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)
            ):
                pass

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(50):  # the abort is applied by the loop thread between steps
            if llm.engine.block_manager.num_free_blocks == total and not llm.engine.has_unfinished_requests():
                return True
            await asyncio.sleep(0.05)
        return False

    assert asyncio.run(main())


def test_bad_request_raises_to_the_caller_and_the_loop_keeps_serving(engine):
    async def main():
        with pytest.raises(RequestError):
            async for _ in engine.generate("bad", "x", SamplingParams(max_tokens=4), prompt_token_ids=[-5]):
                pass
        return await _collect(engine, "good", "still alive")

    text, ids = asyncio.run(main())
    assert len(ids) == 12


def test_an_unexpected_error_in_a_request_fails_only_that_request(engine, monkeypatch):
    real_add = engine.engine.add_request

    def flaky_add(request_id, *args, **kwargs):
        if request_id == "boom":
            raise OverflowError("simulated")
        return real_add(request_id, *args, **kwargs)

    monkeypatch.setattr(engine.engine, "add_request", flaky_add)

    async def main():
        with pytest.raises(OverflowError):
            async for _ in engine.generate("boom", "x", PARAMS):
                pass
        return await _collect(engine, "fine", "after the failure")

    _, ids = asyncio.run(main())
    assert len(ids) == 12 and engine.is_running
