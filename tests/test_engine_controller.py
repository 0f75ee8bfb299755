"""The controller wired into the engine: real actions on real pages and sequences."""

import json

import torch

from lowvram import LLM, SamplingParams
from lowvram.config import ControllerConfig, load_profile

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PROMPTS = [f"request number {i} asks about" for i in range(6)]


def _profile(**controller):
    cfg = dict(
        memory_high_water=0.9,
        memory_low_water=0.75,
        latency_high_ms=1e5,
        latency_low_ms=5e4,
        patience_tokens=2,
        cooldown_steps=3,
    )
    cfg.update(controller)
    return load_profile("cpu").replace(controller=ControllerConfig(**cfg), max_num_seqs=4)


def _run_all(llm):
    for i, p in enumerate(PROMPTS):
        llm.engine.add_request(str(i), p, GREEDY)
    done = {}
    while llm.engine.has_unfinished_requests():
        for out in llm.engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
    return [done[str(i)] for i in range(len(PROMPTS))]


def test_memory_pressure_compresses_kv_and_shrinks_the_batch_without_losing_requests(tiny_qwen2_dir, tmp_path):
    llm = LLM(str(tiny_qwen2_dir), _profile(), timeline_path=str(tmp_path / "timeline.jsonl"))
    engine = llm.engine
    engine.memory_in_use_bytes = lambda *_: int(0.95 * engine.kv_plan.budget_bytes)  # a card near full
    outs = _run_all(llm)
    assert all(len(o.token_ids) == 24 and o.finish_reason == "length" for o in outs)
    actions = [(e.action.kind, e.action.value) for e in engine.controller_events]
    assert actions[:4] == [("kv_precision", "int8"), ("kv_precision", "int4"), ("spill", True), ("batch_limit", 2)]
    assert engine.kv_precision == "int4" and engine.kv_pool.precision == "int4"
    assert engine.snapshot().controller_mode.startswith("kv-int4+spill+batch<=")
    assert "memory 95% of budget > high water 90%" in engine.snapshot().last_decision
    lines = [json.loads(line) for line in (tmp_path / "timeline.jsonl").read_text().splitlines()]
    assert {line["type"] for line in lines} == {"step", "event"}
    assert [line["action"] for line in lines if line["type"] == "event"][:2] == ["kv_precision", "kv_precision"]


def test_relief_relaxes_in_reverse_order(tiny_qwen2_dir):
    llm = LLM(str(tiny_qwen2_dir), _profile())
    engine = llm.engine
    level = {"fraction": 0.95}
    engine.memory_in_use_bytes = lambda *_: int(level["fraction"] * engine.kv_plan.budget_bytes)
    _run_all(llm)
    level["fraction"] = 0.3
    outs = _run_all(llm)
    assert all(len(o.token_ids) == 24 for o in outs)
    kinds = [(e.action.kind, e.action.value) for e in engine.controller_events]
    raised = kinds.index(("batch_limit", 4)) if ("batch_limit", 4) in kinds else None
    assert raised is not None and ("kv_precision", "fp16") in kinds[raised:]
    assert engine.scheduler.batch_limit == 4


def test_compressing_kv_mid_generation_keeps_outputs_close(tiny_llama_dir):
    plain = _run_all(LLM(str(tiny_llama_dir), _profile()))
    squeezed = LLM(str(tiny_llama_dir), _profile())
    engine = squeezed.engine
    engine.memory_in_use_bytes = lambda *_: int(0.95 * engine.kv_plan.budget_bytes) if engine.stats.num_steps > 8 else 0
    outs = _run_all(squeezed)
    assert engine.kv_precision != "fp16" and all(len(o.token_ids) == 24 for o in outs)
    # The first four requests (the batch limit) produced their first tokens before any
    # compression, and tokens already produced never change: identical there.
    assert all(a.token_ids[:5] == b.token_ids[:5] for a, b in zip(outs[:4], plain[:4]))


def test_slow_tokens_shrink_the_batch(tiny_qwen2_dir):
    import time

    llm = LLM(str(tiny_qwen2_dir), _profile(latency_high_ms=20, latency_low_ms=5))
    run = llm.engine.runner.run

    def slow_run(batch, **kwargs):
        if not batch.is_prefill:
            time.sleep(0.03)  # an injected slow step: 30 ms per token
        return run(batch, **kwargs)

    llm.engine.runner.run = slow_run
    outs = _run_all(llm)
    assert all(len(o.token_ids) == 24 for o in outs)
    first = llm.engine.controller_events[0]
    assert (first.action.kind, first.action.value) == ("batch_limit", 2) and "token latency" in first.reason
    assert llm.engine.kv_precision == "fp16"


def test_steps_that_capture_decode_graphs_do_not_count_as_slow_tokens(tiny_qwen2_dir, monkeypatch):
    import time

    from lowvram.engine.model_runner import ModelRunner

    llm = LLM(str(tiny_qwen2_dir), _profile(latency_high_ms=20, latency_low_ms=5))
    captures = {"n": 0}
    monkeypatch.setattr(ModelRunner, "num_graph_captures", property(lambda self: captures["n"]))
    run = llm.engine.runner.run

    def capturing_run(batch, **kwargs):
        if not batch.is_prefill and captures["n"] < 12:
            captures["n"] += 1  # a new batch-size bucket every step, each capture 30 ms
            time.sleep(0.03)
        return run(batch, **kwargs)

    llm.engine.runner.run = capturing_run
    outs = _run_all(llm)
    assert all(len(o.token_ids) == 24 for o in outs)
    assert captures["n"] == 12
    assert not llm.engine.controller_events and llm.engine.scheduler.batch_limit == 4


def test_an_oom_inside_a_step_is_survived_with_a_crash_report(tiny_qwen2_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    expected = [o.token_ids for o in _run_all(LLM(str(tiny_qwen2_dir), _profile()))]
    llm = LLM(str(tiny_qwen2_dir), _profile())
    run = llm.engine.runner.run
    calls = {"n": 0}

    def failing_run(batch, **kwargs):
        calls["n"] += 1
        if calls["n"] == 5:
            raise torch.OutOfMemoryError(
                "CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity "
                "of 3.81 GiB of which 19.69 MiB is free."
            )
        return run(batch, **kwargs)

    llm.engine.runner.run = failing_run
    outs = _run_all(llm)
    assert [len(o.token_ids) for o in outs] == [24] * len(PROMPTS)
    assert llm.engine.controller_events[0].action.kind == "kv_precision"
    assert "ran out of device memory" in llm.engine.controller_events[0].reason
    report = llm.engine.last_crash_report
    assert report is not None and report.is_file() and report.parent == tmp_path / "lowvram" / "crash-reports"
    # requests that were not in the failed step, and the first tokens of those that were, are unchanged
    assert sum(o.token_ids == e for o, e in zip(outs, expected)) >= 1


def test_disabled_controller_takes_no_action(tiny_qwen2_dir):
    llm = LLM(str(tiny_qwen2_dir), _profile(is_enabled=False))
    engine = llm.engine
    engine.memory_in_use_bytes = lambda *_: engine.kv_plan.budget_bytes
    _run_all(llm)
    assert not engine.controller_events and engine.snapshot().controller_mode == "off"


def test_cached_pages_are_reported_as_reclaimable_in_the_crash_report(tiny_qwen2_dir, tmp_path, monkeypatch, capsys):
    from lowvram.cli import main

    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    llm = LLM(str(tiny_qwen2_dir), _profile())
    llm.generate(["a first request leaves its pages cached " * 4], GREEDY)
    engine = llm.engine
    assert engine.block_manager.num_cached_blocks > 0 and engine.kv_bytes_in_use() == 0
    run = engine.runner.run
    calls = {"n": 0}

    def failing_run(batch, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB.")
        return run(batch, **kwargs)

    engine.runner.run = failing_run
    llm.generate(["a second request"], GREEDY)
    report = json.loads(engine.last_crash_report.read_text())
    assert report["memory"]["kv_blocks_cached_reclaimable"] > 0
    assert main(["doctor", "--oom", str(engine.last_crash_report)]) == 0
    out = capsys.readouterr().out
    assert "cached for reuse" in out and "reclaimable" in out


def test_device_memory_growth_reaches_the_controller_though_decode_steps_read_the_allocator_seldom(
    tiny_qwen2_dir, monkeypatch
):
    """A reading of the allocator's counters costs a noticeable share of a graph-replayed
    decode step, so decode steps read them every ALLOCATOR_READ_EVERY_STEPS steps; memory
    that grows meanwhile still reaches the controller within that many steps."""
    from lowvram.engine.engine import ALLOCATOR_READ_EVERY_STEPS

    llm = LLM(str(tiny_qwen2_dir), _profile())
    engine = llm.engine
    monkeypatch.setattr(engine, "device", torch.device("cuda"))  # the allocator's path, over a fake allocator
    pool_in_allocator = 0 if engine.kv_pool.backend == "um" else engine.kv_pool.device_bytes
    allocated = {"bytes": pool_in_allocator}
    read_at_steps = []

    def read_allocated_bytes():
        read_at_steps.append(engine.stats.num_steps)
        return allocated["bytes"]

    monkeypatch.setattr(engine, "_read_allocated_bytes", read_allocated_bytes)
    engine.add_request("0", "a long answer", SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    while engine.stats.num_steps < 40:
        engine.step()
    assert read_at_steps[0] == 1  # the prefill reads at once
    assert len(read_at_steps) <= 1 + 40 // ALLOCATOR_READ_EVERY_STEPS
    assert len(read_at_steps) < 10  # most of the 40 steps go without a reading
    assert not engine.controller_events
    allocated["bytes"] += engine.memory_budget_bytes  # something else took the whole card
    grew_at = engine.stats.num_steps
    while not engine.controller_events and engine.has_unfinished_requests():
        engine.step()
    first = engine.controller_events[0]
    assert first.action.kind == "kv_precision" and "memory" in first.reason
    assert first.step - grew_at <= ALLOCATOR_READ_EVERY_STEPS + engine.profile.controller.patience_tokens
    reads = len(read_at_steps)
    engine.step()
    assert len(read_at_steps) == reads + 1  # a controller action moves memory: the next step reads afresh
