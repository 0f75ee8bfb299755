"""The 7B streaming benchmark runs end to end on a small shape on the CPU (its GPU run
with the 7B shape under a 4 GiB card is the weight-offload issue's proof)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_streaming_bench_measures_both_strategies_on_a_tiny_shape(tmp_path):
    out = tmp_path / "bench.json"
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "bench_7b_streaming.py"),
            "--shape",
            "tiny",
            "--profile",
            "cpu",
            "--max-resident-layers",
            "1",
            "--prompt-tokens",
            "48",
            "--decode-tokens",
            "4",
            "--cpu-decode-tokens",
            "4",
            "--work-dir",
            str(tmp_path),
            "--json",
            str(out),
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    record = json.loads(out.read_text())
    assert record["command"].startswith("bench_7b_streaming.py --shape tiny") and record["date"]
    assert [r["strategy"] for r in record["results"]] == ["stream", "cpu"]
    for row in record["results"]:
        assert (row["num_resident_layers"], row["num_streamed_layers"]) == (1, 3) and row["is_embedding_on_host"]
        assert row["prompt_tokens"] == 48 and row["decode_tokens"] == 4 and row["decode_tokens_per_s"] > 0
        assert row["h2d_bytes_per_decode_token"] > 0 and row["num_missed_prefetches"] == 0
    stream, cpu = record["results"]
    assert cpu["h2d_bytes_per_decode_token"] < stream["h2d_bytes_per_decode_token"]  # MLPs stay on the host
    assert record["winner"]["default"] == "stream"
    assert not (tmp_path / "tiny-awq").exists()  # the checkpoint is removed unless --keep
