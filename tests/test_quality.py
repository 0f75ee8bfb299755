"""The quality bench on a slice of the held-out data: generation and the template must keep working."""

import json
import subprocess
import sys

from lowvram.bench.quality import run_quality_bench, to_markdown


def test_fp16_numbers_reproduce_on_a_slice():
    report = run_quality_bench(variant_names=["fp16", "kv-int8"], num_per_kind=5, max_chars=12_000)
    fp16, int8 = report.rows
    assert fp16.num_tasks == 40
    assert fp16.accuracy >= 0.9, fp16.by_kind  # the model scores 99.5% on all 800 held-out tasks
    assert 1.0 < fp16.perplexity < 150.0  # ~80 on this slice
    assert int8.agreement_with_fp16 >= 0.9 and abs(int8.perplexity - fp16.perplexity) / fp16.perplexity < 0.02
    table = to_markdown(report)
    assert "| fp16 | " in table and "| kv-int8 | " in table


def test_cli_writes_markdown_and_json(tmp_path):
    out, js = tmp_path / "quality.md", tmp_path / "quality.json"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "lowvram",
            "bench",
            "quality",
            "--variants",
            "fp16",
            "--limit",
            "1",
            "--max-chars",
            "3000",
            "--output",
            str(out),
            "--json",
            str(js),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert out.read_text().startswith("# Quality of lowvram's weight and KV formats")
    data = json.loads(js.read_text())
    assert data["rows"][0]["variant"] == "fp16" and data["rows"][0]["num_tasks"] == 8


def test_unknown_variant_is_a_clear_error():
    result = subprocess.run(
        [sys.executable, "-m", "lowvram", "bench", "quality", "--variants", "fp8"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2 and "unknown quality variant 'fp8'" in result.stderr
