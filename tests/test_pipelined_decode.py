"""Pipelined decode: step N + 1 queued from step N's tokens on the device before the host reads them.

On the CPU a queued step runs at once, so these tests turn the pipeline on by hand to check
its bookkeeping (the queued step used or dropped, page commits, finishing, seeds) against
the engine without it; tests/test_cuda_graphs.py checks it on a GPU with graphs."""

import pytest

from lowvram import SamplingParams
from lowvram.engine.engine import LLMEngine


def pipelined(engine: LLMEngine) -> LLMEngine:
    """Turn pipelined decode on as a CUDA engine has it."""
    engine.pipelines_decode = engine.runner.is_pipelined = engine.runner.samples_on_device = True
    engine.scheduler.num_lookahead_tokens = 1
    return engine


@pytest.fixture(scope="module")
def engines(tiny_qwen2_dir):
    plain = LLMEngine(str(tiny_qwen2_dir), "cpu")
    piped = pipelined(LLMEngine(str(tiny_qwen2_dir), "cpu"))
    return plain, piped


def run(engine, requests, abort_after=None):
    """requests: id -> (prompt ids, params); returns id -> (token ids, finish reason, text)."""
    for request_id, (ids, params) in requests.items():
        engine.add_request(request_id, prompt_token_ids=ids, params=params)
    results, steps = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                results[out.request_id] = (out.outputs[0].token_ids, out.outputs[0].finish_reason, out.outputs[0].text)
        steps += 1
        if abort_after and steps == abort_after[1]:
            engine.abort_request(abort_after[0])
    return results


def test_the_same_tokens_text_and_finishes_as_without(engines):
    plain, piped = engines
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    free = run(plain, {"probe": ([5, 6, 7], greedy)})["probe"]
    requests = {
        "long": ([5, 6, 7], greedy),
        "short": ([9, 10, 11, 12] * 5, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)),
        # ends on a token the pipeline had already queued a step after
        "eos": ([5, 6, 7], SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[free[0][17]])),
        "stop": ([5, 6, 7], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[free[2][4:7]])),
        "pages": (list(range(20, 50)), SamplingParams(temperature=0, max_tokens=37, ignore_eos=True)),
    }
    before = piped.stats.num_pipelined_steps
    expected = run(plain, requests)
    got = run(piped, requests)
    assert got == expected
    assert got["eos"][1] == "stop" and len(got["eos"][0]) == free[0].index(free[0][17]) + 1
    assert got["stop"][1] == "stop" and got["long"][1] == "length"
    assert piped.stats.num_pipelined_steps - before > 30
    assert plain.stats.num_pipelined_steps == 0


def test_committed_pages_hold_the_real_tokens(engines):
    """Full pages are committed with the sampled ids, not placeholders: a later prompt that
    repeats a generated text reuses them and decodes as it does from scratch."""
    plain, piped = engines
    greedy = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    prompt = list(range(60, 75))
    first = run(piped, {"a": (prompt, greedy)})["a"][0]
    again = prompt + first[:40]
    cached = piped.block_manager.match_prefix(again).num_tokens
    assert cached >= 48  # the prompt's page and pages filled with generated tokens
    follow = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    assert run(piped, {"b": (again, follow)}) == run(plain, {"b": (again, follow)})


def test_an_abort_and_a_precision_change_lose_nothing(engines):
    plain, piped = engines
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    requests = {"x": ([3, 4, 5], greedy), "y": ([8, 9], greedy)}
    expected = run(plain, requests)
    # abort "y" between steps while a step holding it is queued
    got = run(piped, requests, abort_after=("y", 12))
    assert got["x"] == expected["x"] and "y" not in got
    # a precision change while a step is queued drops that step (its tokens are computed again)
    for request_id, (ids, params) in requests.items():
        piped.add_request(request_id + "2", prompt_token_ids=ids, params=params)
    tokens = {"x2": [], "y2": []}
    for _ in range(10):
        for out in piped.step():
            tokens[out.request_id] = out.outputs[0].token_ids
    assert piped.runner._queued is not None
    piped.set_kv_precision("int8")
    assert piped.runner._queued is None
    assert {out.request_id for out in piped.step()} == {"x2", "y2"}
    while piped.has_unfinished_requests():
        for out in piped.step():
            tokens[out.request_id] = out.outputs[0].token_ids
    piped.set_kv_precision("fp16")
    assert tokens["x2"][:10] == expected["x"][0][:10] and tokens["y2"][:10] == expected["y"][0][:10]
    assert len(tokens["x2"]) == len(tokens["y2"]) == 30


def test_an_unexpected_schedule_runs_the_step_alone(engines, monkeypatch):
    """Should the scheduler give the step after a queued one fewer sequences than were queued,
    the queued step serves the ones that are there, and the tokens are the same."""
    plain, piped = engines
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    requests = {"a": ([5, 6, 7], greedy), "b": ([9, 10], greedy)}
    expected = run(plain, requests)
    schedule = piped.scheduler.schedule
    calls = {"n": 0}

    def odd_schedule():
        batch = schedule()
        calls["n"] += 1
        if calls["n"] in (6, 9) and len(batch.seqs) == 2:
            batch.seqs, batch.num_new_tokens = batch.seqs[:1], batch.num_new_tokens[:1]
        return batch

    monkeypatch.setattr(piped.scheduler, "schedule", odd_schedule)
    before = piped.stats.num_pipelined_steps
    assert run(piped, requests) == expected
    assert calls["n"] > 9 and piped.stats.num_pipelined_steps - before > 5


def test_a_request_waiting_for_a_full_batch_does_not_stop_the_pipeline(tiny_qwen2_dir):
    """Two places, three requests: the third waits while the first two decode pipelined, and
    comes in (a prefill, which runs alone) when one of them finishes."""
    from lowvram.config import load_profile

    profile = load_profile("cpu").replace(max_num_seqs=2)
    plain = LLMEngine(str(tiny_qwen2_dir), profile)
    piped = pipelined(LLMEngine(str(tiny_qwen2_dir), profile))
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    requests = {
        "a": ([5, 6, 7], greedy),
        "b": ([9, 10], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)),
        "c": ([3, 4], greedy),
    }
    expected = run(plain, requests)
    for request_id, (ids, params) in requests.items():
        piped.add_request(request_id, prompt_token_ids=ids, params=params)
    pipelined_while_waiting, got = 0, {}
    while piped.has_unfinished_requests():
        before, waiting = piped.stats.num_pipelined_steps, bool(piped.scheduler.waiting)
        got.update(
            {
                o.request_id: (o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].text)
                for o in piped.step()
                if o.finished
            }
        )
        pipelined_while_waiting += waiting and piped.stats.num_pipelined_steps > before
    assert got == expected
    assert pipelined_while_waiting > 5


def test_steps_read_right_after_the_one_before_show_the_controller_no_latency(engines, monkeypatch):
    """When the pipeline breaks (a request finishes, another waits to come in), the queued
    step is read right after the step before it: its short latency is not the card's."""
    plain, piped = engines
    seen = []
    control = piped._control

    def recording_control(latency, is_plain_decode):
        seen.append((piped.runner.is_tail, is_plain_decode, latency))
        control(latency, is_plain_decode)

    monkeypatch.setattr(piped, "_control", recording_control)
    requests = {
        f"r{i}": ([5 + i, 6, 7], SamplingParams(temperature=0, max_tokens=6 + 5 * i, ignore_eos=True)) for i in range(3)
    }
    run(piped, requests)
    tails = [latency for is_tail, _, latency in seen if is_tail]
    steady = [latency for is_tail, is_plain_decode, latency in seen if not is_tail and is_plain_decode]
    assert len(tails) >= 2 and all(latency is None for latency in tails)
    assert steady and all(latency is not None for latency in steady)


def test_running_out_of_memory_while_queueing_a_step_loses_nothing(engines, monkeypatch):
    """The step before keeps its tokens and the next step runs on its own."""
    import torch

    plain, piped = engines
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    requests = {"a": ([5, 6, 7], greedy), "b": ([9, 10], greedy)}
    expected = run(plain, requests)
    run_step = piped.runner.run
    calls = {"queued": 0}

    def failing_run(batch, **kwargs):
        if kwargs.get("input_ids") is not None:
            calls["queued"] += 1
            if calls["queued"] == 4:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB.")
        return run_step(batch, **kwargs)

    monkeypatch.setattr(piped.runner, "run", failing_run)
    before = piped.stats.num_pipelined_steps
    assert run(piped, requests) == expected
    assert calls["queued"] > 4 and piped.stats.num_pipelined_steps - before == calls["queued"] - 1


def test_sampled_requests_are_pipelined_and_their_seeds_hold(engines):
    """Sampling on the device (Gumbel-max): a seeded request draws the same tokens alone,
    batched with others and preempted while a step of it is queued (the dropped row gives
    its draw back); top_k = 1 is greedy; a request with penalties samples on the host and
    is not pipelined."""
    plain, piped = engines
    seeded = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=24, seed=11, ignore_eos=True)
    prompt = [5, 6, 7, 8]
    before = piped.stats.num_pipelined_steps
    alone = run(piped, {"s": (prompt, seeded)})["s"][0]
    assert piped.stats.num_pipelined_steps - before > 15
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    top3 = SamplingParams(temperature=1.5, top_k=3, max_tokens=20, ignore_eos=True)
    batched = run(piped, {"g": ([9, 10], greedy), "s": (prompt, seeded), "k": ([3, 4], top3)})
    assert batched["s"][0] == alone
    # preempted between steps (the batch limit drops to one for four steps), then recomputed
    for request_id, ids, params in (("g", [9, 10], greedy), ("s", prompt, seeded)):
        piped.add_request(request_id, prompt_token_ids=ids, params=params)
    done, num_steps = {}, 0
    while piped.has_unfinished_requests():
        done.update({o.request_id: o.outputs[0].token_ids for o in piped.step() if o.finished})
        num_steps += 1
        if num_steps == 4:
            assert piped.scheduler.set_batch_limit(1)
        elif num_steps == 8:
            piped.scheduler.set_batch_limit(piped.profile.max_num_seqs)
    assert done["s"] == alone and done["g"] == batched["g"][0]
    assert batched["g"][0] == run(plain, {"g": ([9, 10], greedy)})["g"][0]
    one = SamplingParams(temperature=1.2, top_k=1, max_tokens=12, seed=3, ignore_eos=True)
    assert run(piped, {"o": ([9, 10], one)})["o"][0] == batched["g"][0][:12]
    assert len(batched["k"][0]) == 20 and len(set(batched["k"][0])) > 3  # top_k = 3 at temperature 1.5 varies
    penalized = SamplingParams(temperature=0.7, repetition_penalty=1.3, max_tokens=10, seed=5, ignore_eos=True)
    before = piped.stats.num_pipelined_steps
    out = run(piped, {"p": (prompt, penalized)})["p"]
    assert len(out[0]) == 10 and piped.stats.num_pipelined_steps == before


def test_device_sampling_without_the_pipeline(tiny_qwen2_dir):
    """On a GPU with pipelined decode off, rows still sample on the device (a seeded draw on
    the host would copy its probabilities there) but no step is queued ahead: a seeded
    request then draws what the pipelined engine draws, one step at a time."""
    sampled = SamplingParams(temperature=1.0, seed=7, max_tokens=24, ignore_eos=True)
    piped = pipelined(LLMEngine(str(tiny_qwen2_dir), "cpu"))
    expected = run(piped, {"a": ([5, 6, 7], sampled)})
    alone = LLMEngine(str(tiny_qwen2_dir), "cpu")
    assert not alone.pipelines_decode
    alone.runner.samples_on_device = True
    assert run(alone, {"a": ([5, 6, 7], sampled)}) == expected
    assert alone.stats.num_pipelined_steps == 0 and piped.stats.num_pipelined_steps > 10
