"""scripts/bench_kv_pool.py end to end on the CPU: the engine path it measures on the GPU
(growing one sequence through the prefix cache, timing decode, recording memory), on a tiny
checkpoint with the device backend."""

import json

import pytest
from script_modules import load_script


@pytest.fixture(scope="module")
def bench():
    return load_script("bench_kv_pool")


def test_main_path_grows_one_sequence_and_records_decode_and_memory(bench, tiny_qwen2_dir, tmp_path, capsys):
    out = tmp_path / "kv_pool.json"
    code = bench.main(
        [
            "--model",
            str(tiny_qwen2_dir),
            "--device",
            "cpu",
            "--contexts",
            "48,96",
            "--warmup-steps",
            "1",
            "--decode-steps",
            "3",
            "--json",
            str(out),
        ]
    )
    assert code == 0
    record = json.loads(out.read_text())
    assert record["command"].startswith("python scripts/bench_kv_pool.py") and record["date"]
    (run,) = record["runs"]
    assert run["run"] == "device" and run["not_fitting"] == [] and run["kv_precision_at_end"] == "fp16"
    first, second = run["contexts"]
    assert [first["context_tokens"], second["context_tokens"]] == [48, 96]
    # The longer prompt continues the shorter one: only its new pages are computed.
    assert first["num_prefill_tokens"] == 48 and second["num_prefill_tokens"] == 48
    # The tiny checkpoint: 2 layers, 2 KV heads of 16; FP16 pages hold float32 on the CPU.
    page_bytes = 2 * 2 * run["block_size"] * 2 * 16 * 4  # layers * (K, V) * tokens * heads * head_dim * 4 B
    for row in (first, second):
        assert row["is_complete"] and row["decode"]["tokens_per_s"] > 0
        memory = row["memory"]
        assert memory["pool_device_bytes"] == run["num_pool_blocks"] * page_bytes
        assert memory["is_within_budget"] and memory["peak_memory_in_use_bytes"] > memory["pool_device_bytes"]
    assert record["transfers"] == []  # host link transfers need CUDA
    assert "decode" in capsys.readouterr().out


def test_spilling_runs_need_cuda(bench, capsys):
    assert bench.main(["--device", "cpu", "--runs", "um", "--model", "unused"]) == 2
    assert "need CUDA" in capsys.readouterr().err
