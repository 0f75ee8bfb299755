"""scripts/bench_deepseek_v2.py end to end at a tiny shape on the CPU (its GPU run uses the full V2-Lite shape)."""

import json
import subprocess
import sys
from pathlib import Path

from safetensors import safe_open

ROOT = Path(__file__).resolve().parents[1]


def test_bench_writes_an_awq_checkpoint_and_reports_the_expert_cache(tmp_path):
    model_dir, out = tmp_path / "dsv2", tmp_path / "bench.json"
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "bench_deepseek_v2.py"),
            "--model-dir",
            str(model_dir),
            "--tiny",
            "--group-size",
            "32",
            "--profile",
            "cpu",
            "--max-model-len",
            "128",
            "--prompt-tokens",
            "24",
            "--output-tokens",
            "6",
            "--max-cached-experts",
            "3",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    record = json.loads(out.read_text())
    assert record["is_oom_free"] and record["num_cached_experts"] == 3 < record["num_routed_experts"] == 8
    assert record["kv_bytes_per_token"] == 2 * 2 * (32 + 8) * 4  # float32 latent rows, 3 layers in 2 pool layers
    for batch in ("1", "4"):
        assert record["decode_tokens_per_s"][batch] > 0
        assert 0 < record["decode_expert_hit_rate"][batch] <= 1
        assert record["runs"][f"batch_{batch}"]["num_decode_tokens"] == int(batch) * 5
    assert record["decode_bytes_moved_per_token"]["4"] > 0, "3 of 8 experts cached: batch-4 decoding must fetch some"

    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    names = set(index["weight_map"])
    expert = "model.layers.1.mlp.experts.7.down_proj"
    assert {f"{expert}.qweight", f"{expert}.qzeros", f"{expert}.scales"} <= names
    assert "model.layers.1.mlp.gate.weight" in names and "model.layers.1.mlp.gate.qweight" not in names
    with safe_open(str(model_dir / index["weight_map"][f"{expert}.qweight"]), "pt") as f:
        assert tuple(f.get_tensor(f"{expert}.qweight").shape) == (32, 64 // 8)  # [K, N / 8]: 32 -> 64
