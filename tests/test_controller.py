"""The controller on synthetic observation traces."""

from lowvram.config import ControllerConfig
from lowvram.core.controller import ControllerState, Observation, decide

CFG = ControllerConfig(
    memory_high_water=0.9,
    memory_low_water=0.75,
    latency_high_ms=100,
    latency_low_ms=50,
    patience_tokens=3,
    cooldown_steps=5,
)
BUDGET = 1000


def run(trace, state=None, cfg=CFG, max_num_seqs=8):
    """trace: list of (memory fraction, latency ms or None). Returns final state and all events."""
    state = state or ControllerState()
    events = []
    for step, (mem, latency) in enumerate(trace):
        state, new = decide(
            state, Observation(step, int(mem * BUDGET), BUDGET, latency), cfg, max_num_seqs=max_num_seqs
        )
        events += new
    return state, events


def kinds(events):
    return [(e.action.kind, e.action.value) for e in events]


def test_memory_pressure_escalates_in_order_one_rung_per_patience():
    state, events = run([(0.95, 40.0)] * 18)
    assert kinds(events) == [
        ("kv_precision", "int8"),
        ("kv_precision", "int4"),
        ("spill", True),
        ("batch_limit", 4),
        ("batch_limit", 2),
        ("batch_limit", 1),
    ]
    assert [e.step for e in events] == [2, 5, 8, 11, 14, 17]  # patience 3: act on the 3rd high observation
    assert state.mode == "kv-int4+spill+batch<=1"
    state, more = run([(0.95, 40.0)] * 6, state)
    assert kinds(more) == [("throttle", True)]  # the top of the ladder; then nothing further
    assert "memory 95% of budget > high water 90%" in events[0].reason


def test_patience_is_respected():
    # two high observations then one normal: the streak restarts, no action
    _, events = run([(0.95, None), (0.95, None), (0.8, None)] * 4)
    assert events == []


def test_no_action_inside_the_hysteresis_band():
    state, events = run([(0.95, 40.0)] * 3)
    assert kinds(events) == [("kv_precision", "int8")]
    # between low (0.75) and high (0.9) water: neither escalate nor relax, however long
    state, events = run([(0.85, 70.0)] * 100, state)
    assert events == [] and state.kv_precision == "int8"


def test_recovery_relaxes_in_reverse_order_after_cooldown():
    state, _ = run([(0.95, 40.0)] * 12)  # int8, int4, spill, batch 4
    state, events = run([(0.5, 20.0)] * 20, state)
    assert kinds(events) == [("batch_limit", 8), ("spill", False), ("kv_precision", "int8"), ("kv_precision", "fp16")]
    assert [e.step for e in events] == [4, 9, 14, 19]  # one rung per cooldown of 5 calm steps
    assert state.mode == "normal" and state.batch_limit == 0


def test_latency_pressure_shrinks_the_batch_then_throttles():
    state, events = run([(0.5, 150.0)] * 15, max_num_seqs=4)
    assert kinds(events) == [("batch_limit", 2), ("batch_limit", 1), ("throttle", True)]
    assert "token latency 150.0 ms > 100.0 ms" in events[0].reason
    assert state.kv_precision == "fp16"  # latency never touches KV precision


def test_prefill_steps_do_not_break_a_latency_streak():
    trace = [(0.5, 150.0), (0.5, None), (0.5, 150.0), (0.5, None), (0.5, 150.0)]
    _, events = run(trace)
    assert kinds(events) == [("batch_limit", 4)]


def test_constant_overload_causes_a_bounded_number_of_switches():
    _, events = run([(0.97, 200.0)] * 10_000)
    assert len(events) <= 8  # the ladder's height, not the trace's length


def test_oscillating_load_around_one_mark_does_not_flap():
    trace = [(0.92, None), (0.88, None)] * 500  # dips under high water but never under low water
    _, events = run(trace)
    assert events == []


def test_disabled_controller_never_acts():
    cfg = ControllerConfig(is_enabled=False)
    _, events = run([(0.99, 999.0)] * 50, cfg=cfg)
    assert events == []


def test_a_prefill_step_after_the_ladder_is_exhausted_is_harmless():
    state, events = run([(0.5, 150.0)] * 30, max_num_seqs=2)
    assert kinds(events) == [("batch_limit", 1), ("throttle", True)]
    state, more = run([(0.5, None), (0.5, 150.0), (0.5, None)], state, max_num_seqs=2)
    assert more == []


def test_kv_precision_is_relaxed_only_when_the_larger_pages_would_still_fit():
    state, _ = run([(0.95, 40.0)] * 3)
    assert state.kv_precision == "int8"
    # Calm at INT8 (60% of the budget), but the same live pages at FP16 would be 90%.
    held = Observation(0, 600, BUDGET, 20.0, kv_bytes_by_precision={"fp16": 600, "int8": 300, "int4": 160})
    for step in range(50):
        state, events = decide(state, held, CFG, max_num_seqs=8)
        assert events == [], step
    # The load drains: at FP16 the live pages would make 70%, under the 75% low-water mark.
    drained = Observation(51, 500, BUDGET, 20.0, kv_bytes_by_precision={"fp16": 400, "int8": 200, "int4": 110})
    state, events = decide(state, drained, CFG, max_num_seqs=8)
    assert kinds(events) == [("kv_precision", "fp16")]


def test_the_state_after_each_observation_of_a_mixed_trace():
    # memory fraction, latency: a decode, a prefill, a slow decode, a calm decode, ...
    trace = [(0.95, 40.0), (0.95, None), (0.5, 120.0), (0.5, 20.0), (0.95, 130.0), (0.8, None), (0.5, 10.0)]
    state = ControllerState()
    seen = []
    for step, (mem, latency) in enumerate(trace):
        state, events = decide(state, Observation(step, int(mem * BUDGET), BUDGET, latency), CFG, max_num_seqs=8)
        seen.append((state.memory_streak, state.latency_streak, state.calm_streak, len(events)))
    assert seen == [
        (1, 0, 0, 0),
        (2, 0, 0, 0),  # a prefill step adds no latency and keeps the latency streak
        (0, 1, 0, 0),
        (0, 0, 1, 0),
        (1, 1, 0, 0),
        (0, 1, 0, 0),
        (0, 0, 1, 0),
    ]
