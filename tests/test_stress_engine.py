"""The stress script's main path on a card scaled down to a tiny model: the controller acts
on the pressure the workload really creates, and on a run of slow decode steps, without
losing a request or changing a greedy output.

The scaled card keeps the ratios of the 1.5B shape on the 4gb profile at 16K tokens:
weights and workspace take about half the budget and the KV share holds about 4.5
full-length sequences of the 8 that may run together.
"""

import json
import sys

import pytest
import yaml
from script_modules import load_script

MAX_PROMPT_TOKENS = 512
MAX_OUTPUT_TOKENS = 16


stress_engine = load_script("stress_engine")


@pytest.fixture(scope="module")
def scaled_card(tmp_path_factory):
    """(model dir, profile path): 8 layers of 4 KV heads x 64 (16 KiB of float32 KV per token),
    a vocabulary padded so the weights take ~40% of a 77 MiB budget."""
    from lowvram.testing import make_tiny_model

    root = tmp_path_factory.mktemp("scaled-card")
    model = make_tiny_model(
        root / "model",
        "llama",
        num_layers=8,
        head_dim=64,
        num_key_value_heads=4,
        vocab_size=57344,
        max_position_embeddings=1024,
    )
    profile = {
        "name": "scaled-4gb",
        "description": "the 4gb profile's ratios at a tiny model's size",
        "device": "cpu",
        "dtype": "float32",
        "memory_budget_gib": 0.25,
        "memory_utilization": 0.3,
        "max_model_len": MAX_PROMPT_TOKENS + MAX_OUTPUT_TOKENS,
        "max_num_seqs": 8,
        "max_num_batched_tokens": 128,
        "kv_block_size": 16,
        "kv_precision": "auto",
        "kv_backend": "auto",
        "host_spill_gib": 0.0,
        "controller": {
            "memory_high_water": 0.90,
            "memory_low_water": 0.75,
            "latency_high_ms": 120.0,
            "latency_low_ms": 60.0,
            "patience_tokens": 3,
            "cooldown_steps": 32,
        },
    }
    path = root / "scaled-4gb.yaml"
    path.write_text(yaml.safe_dump(profile))
    return model, path


def _run(scaled_card, tmp_path, *args) -> tuple[dict, dict]:
    model, profile = scaled_card
    out = tmp_path / "stress.json"
    code = stress_engine.main(
        [
            "--model",
            str(model),
            "--profile",
            str(profile),
            "--max-prompt-tokens",
            str(MAX_PROMPT_TOKENS),
            "--max-output-tokens",
            str(MAX_OUTPUT_TOKENS),
            "--json",
            str(out),
            *args,
        ]
    )
    assert code == 0
    record = json.loads(out.read_text())
    return {r["mode"]: r for r in record["results"]}, record


def _events(tmp_path, result) -> list[dict]:
    lines = (tmp_path / result["timeline"]).read_text().splitlines()
    return [json.loads(line) for line in lines if json.loads(line)["type"] == "event"]


def test_memory_pressure_from_long_prompts_makes_the_controller_act_without_changing_outputs(scaled_card, tmp_path):
    results, record = _run(
        scaled_card,
        tmp_path,
        "--num-requests",
        "24",
        "--long-share",
        "0.25",
        "--seed",
        "1",
        "--modes",
        "off,on",
        "--check-alone",
        "4",
        "--plot",
        str(tmp_path / "stress.png"),
        "--summary-md",
        str(tmp_path / "stress.md"),
    )
    off, on = results["off"], results["on"]
    # The pressure is the workload's own: nothing patched the memory reading.
    assert off["peak_memory_pressure"] > 0.9 and off["num_controller_events"] == 0
    memory_events = [e for e in _events(tmp_path, on) if "memory" in e["reason"]]
    assert memory_events and memory_events[0]["action"] in ("kv_precision", "spill", "batch_limit")
    disturbed = set(on["compressed_requests"] + on["preempted_requests"])
    assert disturbed & set(record["checked_requests"])  # the solo check covers requests the controller touched
    for r in (off, on):
        assert r["num_completed"] == 24 and r["num_refused"] == 0 and r["num_oom_steps"] == 0 and r["error"] is None
        assert r["is_within_budget"]
        assert r["alone"] == {"num_checked": 4, "num_identical": 4}, r["alone_mismatches"]
    assert (tmp_path / "stress.png").stat().st_size > 10_000
    rows = [line for line in (tmp_path / "stress.md").read_text().splitlines() if line.startswith("| o")]
    assert [row.split("|")[1].strip() for row in rows] == ["off", "on"]


@pytest.mark.parametrize("num_slow_steps, expects_event", [(4, True), (2, False)], ids=["run-of-4", "run-of-2"])
def test_a_run_of_slow_decode_steps_longer_than_the_patience_shrinks_the_batch(
    scaled_card, tmp_path, num_slow_steps, expects_event
):
    # Short prompts keep memory calm, so any event comes from the latency path.
    results, _ = _run(
        scaled_card,
        tmp_path,
        "--num-requests",
        "12",
        "--long-share",
        "0",
        "--max-prompt-tokens",
        "64",
        "--modes",
        "latency",
        "--latency-num-requests",
        "12",
        "--slow-every",
        "16",
        "--slow-steps",
        str(num_slow_steps),
        "--slow-step-ms",
        "150",
        "--check-alone",
        "3",
    )
    latency = results["latency"]
    events = _events(tmp_path, latency)
    assert latency["num_completed"] == 12 and latency["alone"] == {"num_checked": 3, "num_identical": 3}
    assert latency["p95_token_latency_ms"] > 120  # the injected steps are in the measurement
    if expects_event:
        assert events and events[0]["action"] == "batch_limit" and events[0]["value"] == 4
        assert "token latency" in events[0]["reason"] and "for 3 tokens" in events[0]["reason"]
        assert latency["num_preemptions"] > 0
    else:  # two slow tokens in a row are under the patience of three
        assert events == []


def test_a_plot_without_matplotlib_is_refused_before_the_runs(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    with pytest.raises(SystemExit) as exc:
        stress_engine.parse_args(["--plot", "out.png"])
    assert exc.value.code == 2
    assert "pip install matplotlib" in capsys.readouterr().err
