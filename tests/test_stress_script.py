"""The stress script runs end to end at a tiny scale (its GPU run is the engine issue's proof)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_stress_script_completes_every_request_in_both_modes(tiny_qwen2_dir, tmp_path):
    out = tmp_path / "stress.json"
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "stress_engine.py"),
            "--model",
            str(tiny_qwen2_dir),
            "--profile",
            "cpu",
            "--num-requests",
            "10",
            "--max-prompt-tokens",
            "200",
            "--max-output-tokens",
            "16",
            "--check-alone",
            "2",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    record = json.loads(out.read_text())
    assert [r["controller"] for r in record["results"]] == ["off", "on"]
    for r in record["results"]:
        assert (
            r["num_completed"] == 10 and r["num_refused"] == 0 and r["alone"] == {"num_checked": 2, "num_identical": 2}
        )
        lines = (tmp_path / r["timeline"]).read_text().splitlines()
        assert lines and json.loads(lines[0])["type"] == "step"
