"""`lowvram bench speed` end to end on the tiny shape (CPU), and its errors. No timed assertions:
speeds only have to be measured (positive), and the bytes behind GB/s have to add up."""

import json

import pytest
import torch

from lowvram.bench.speed import run_speed_bench, write_markdown
from lowvram.cli import main
from lowvram.errors import ConfigError, ModelLoadError

CONTEXTS = (16, 40)
BATCHES = (1, 4, 8)
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-speed")
    argv = [
        "bench",
        "speed",
        "--shape",
        "tiny",
        "--device",
        "cpu",
        "--profile",
        "cpu",
        "--context-lens",
        ",".join(map(str, CONTEXTS)),
        "--batch-sizes",
        ",".join(map(str, BATCHES)),
        "--max-tokens",
        str(MAX_TOKENS),
        "--json",
        str(out / "speed.json"),
        "--output",
        str(out / "speed.md"),
    ]
    assert main(argv) == 0
    return out, json.loads((out / "speed.json").read_text())


def test_the_record_says_where_and_what_it_measured(cli_run):
    _, record = cli_run
    for key in (
        "command",
        "date",
        "git_commit",
        "gpu",
        "versions",
        "device",
        "copy_bandwidth_gbps",
        "model",
        "profile",
        "kv_bytes_per_token",
        "prefill",
        "decode",
        "memory",
        "one_request",
        "elapsed_s",
    ):
        assert key in record, key
    assert record["command"].startswith("lowvram bench speed")
    assert record["device"] == "cpu" and record["gpu"] is None
    assert record["versions"]["torch"] == torch.__version__
    assert record["copy_bandwidth_gbps"] > 0
    assert record["model"]["shape"] == "tiny" and record["model"]["weight_format"] == "fp32"
    assert record["profile"]["name"] == "cpu"


def test_prefill_and_decode_are_measured_at_every_context_and_batch(cli_run):
    _, record = cli_run
    assert [r["prompt_tokens"] for r in record["prefill"]] == list(CONTEXTS)
    assert all(r["ttft_ms"] > 0 and r["prefill_tokens_per_s"] > 0 for r in record["prefill"])
    measured = {(r["context_tokens"], r["batch_size"]): r for r in record["decode"]}
    assert set(measured) == {(c, b) for c in CONTEXTS for b in BATCHES}
    for (_, batch), row in measured.items():
        assert row["decode_tokens_per_s"] > 0 and row["achieved_gbps"] > 0
        # Every request decodes max_tokens - 1 tokens after its prefill token; nothing was preempted.
        assert row["num_decode_tokens"] == batch * (MAX_TOKENS - 1)
        assert row["num_preemptions"] == 0


def test_one_request_runs_on_a_pool_sized_for_it_alone(cli_run):
    out, record = cli_run
    one = record["one_request"]
    assert one["context_tokens"] == CONTEXTS[-1] and one["new_tokens"] == MAX_TOKENS
    assert one["max_num_seqs"] == 1 and one["max_model_len"] == CONTEXTS[-1] + MAX_TOKENS
    block_size = record["profile"]["kv_block_size"]
    assert one["kv_pool_blocks"] == -(-(CONTEXTS[-1] + MAX_TOKENS) // block_size)
    assert one["decode_tokens_per_s"] > 0
    assert "One request of 40 + 6 tokens with the KV pool sized for it alone" in (out / "speed.md").read_text()


def test_bytes_per_step_are_weights_without_the_embedding_plus_the_kv_read(cli_run):
    _, record = cli_run
    weights = record["model"]["weight_bytes"]
    assert record["model"]["weight_bytes_read_per_step"] == weights["total_bytes"] - weights["embedding_bytes"]
    for row in record["decode"]:
        mean_context = row["context_tokens"] + MAX_TOKENS / 2
        kv = row["batch_size"] * mean_context * record["kv_bytes_per_token"]
        assert row["bytes_per_step"] == int(record["model"]["weight_bytes_read_per_step"] + kv)
        # Both figures are rounded to hundredths: on a slow CPU the rate is a few tenths of a GB/s,
        # where the rounding alone is a 2% difference.
        assert row["achieved_gbps"] == pytest.approx(row["bytes_per_step"] / row["step_ms"] / 1e6, rel=0.02, abs=0.01)
        # What the cards lowvram is for would reach if a step only read its bytes at full bandwidth
        projected = row["projected_tokens_per_s"]
        assert projected["GTX 1650"] == pytest.approx(row["batch_size"] * 128e9 / row["bytes_per_step"], rel=1e-3)
        assert projected["RTX 3050 laptop"] == pytest.approx(
            row["batch_size"] * 192e9 / row["bytes_per_step"], rel=1e-3
        )


def test_markdown_has_a_row_per_measurement(cli_run):
    out, record = cli_run
    markdown = (out / "speed.md").read_text()
    assert markdown == write_markdown(record)
    for context in CONTEXTS:
        assert sum(line.startswith(f"| {context} | ") for line in markdown.splitlines()) == len(BATCHES) + 1
        for batch in BATCHES:
            assert f"| {context} | {batch} | " in markdown
    assert "GTX 1650 (128 GB/s) tokens/s, projected" in markdown
    assert "RTX 3050 laptop (192 GB/s) tokens/s, projected" in markdown


def test_quantize_measures_awq_int4_weights():
    record = run_speed_bench(
        shape="tiny",
        quantize=True,
        calib_samples=2,
        profile="cpu",
        device="cpu",
        batch_sizes=(2,),
        context_lens=(16,),
        max_tokens=4,
    )
    model = record["model"]
    assert model["weight_format"].startswith("awq-int4")
    assert model["quantization"]["num_samples"] == 2
    assert model["weight_bytes"]["int4_layer_bytes"] > 0
    assert record["decode"][0]["decode_tokens_per_s"] > 0


def test_rank_and_fp16_budget_replace_the_profiles():
    """--rank / --fp16-budget-mib: the cpu profile quantizes without compensation; rank 4 adds it."""
    record = run_speed_bench(
        shape="tiny",
        quantize=True,
        calib_samples=2,
        profile="cpu",
        device="cpu",
        rank=4,
        fp16_budget_mib=0,
        batch_sizes=(1,),
        context_lens=(16,),
        max_tokens=2,
    )
    assert record["model"]["quantization"]["rank"] == 4
    assert record["model"]["weight_bytes"]["compensation_bytes"] > 0
    assert record["model"]["weight_bytes"]["num_fp16_layers"] == 0
    assert "compensation rank 4, lm_head FP16" in write_markdown(record)


def test_an_unknown_shape_names_the_known_ones(capsys):
    with pytest.raises(ConfigError, match="known shapes: .*r1-distill-qwen-1.5b.*tiny"):
        run_speed_bench(shape="gpt-5", device="cpu")
    assert main(["bench", "speed", "--shape", "gpt-5", "--device", "cpu"]) == 2
    assert "unknown shape 'gpt-5'" in capsys.readouterr().err


def test_a_missing_model_directory_is_a_clear_error(tmp_path, capsys):
    with pytest.raises(ModelLoadError, match="does not exist"):
        run_speed_bench(str(tmp_path / "missing"), device="cpu")
    assert main(["bench", "speed", "--model", str(tmp_path / "missing"), "--device", "cpu"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_a_context_longer_than_the_model_allows_is_refused_before_measuring():
    # The tiny shape has 2048 positions.
    with pytest.raises(ConfigError, match="2048"):
        run_speed_bench(shape="tiny", device="cpu", context_lens=(4096,), max_tokens=4)


@pytest.mark.gpu
def test_on_cuda_the_record_has_peak_device_memory_and_the_copy_bandwidth():
    record = run_speed_bench(
        shape="tiny", profile="4gb", device="cuda", batch_sizes=(1, 2), context_lens=(32,), max_tokens=4
    )
    memory = record["memory"]
    assert memory["peak_device_bytes"] >= record["model"]["weight_bytes"]["total_bytes"]
    one = record["one_request"]
    assert record["model"]["weight_bytes"]["total_bytes"] <= one["peak_device_bytes"] <= memory["peak_device_bytes"]
    assert memory["torch_max_reserved_bytes"] >= memory["torch_max_allocated_bytes"]
    assert record["gpu"] and record["copy_bandwidth_gbps"] > 0


def test_a_named_shape_is_written_and_quantized_once_per_cache(tmp_path, monkeypatch):
    from lowvram.models import shapes

    # A small shape under a real shape's rules (Qwen2 layout, vocabulary the tokenizer covers).
    monkeypatch.setitem(
        shapes.SHAPES,
        "small-qwen2",
        dict(
            shapes.SHAPES["r1-distill-qwen-1.5b"],
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=512,
            max_position_embeddings=512,
        ),
    )
    monkeypatch.setenv(shapes.BENCH_CACHE_ENV, str(tmp_path / "cache"))

    def run():
        return run_speed_bench(
            shape="small-qwen2",
            quantize=True,
            calib_samples=2,
            profile="cpu",
            device="cpu",
            batch_sizes=(1,),
            context_lens=(16,),
            max_tokens=3,
        )

    runs = [run()]
    made = {p.parent.name: p.stat().st_mtime_ns for p in (tmp_path / "cache").glob("*/.complete")}
    runs.append(run())
    assert {p.parent.name: p.stat().st_mtime_ns for p in (tmp_path / "cache").glob("*/.complete")} == made
    from lowvram.config import load_profile

    profile = load_profile("cpu")
    budget, rank = profile.fp16_budget_mib, profile.compensation_rank
    cached = sorted(p.name for p in (tmp_path / "cache").iterdir())
    assert cached == [f"small-qwen2-awq-n2-g128-f{budget:g}-r{rank}", "small-qwen2-bf16"]
    for record in runs:
        assert record["model"]["weight_format"].startswith("awq-int4")
        assert record["model"]["quantization"] == {
            "num_samples": 2,
            "group_size": 128,
            "fp16_budget_mib": budget,
            "rank": rank,
        }


def test_the_default_contexts_are_those_that_fit_the_model():
    # the tiny model has 2,048 positions: 512 fits, 4096 does not
    record = run_speed_bench(shape="tiny", device="cpu", profile="cpu", batch_sizes=[1], max_tokens=4)
    assert [row["context_tokens"] for row in record["decode"]] == [512]


def test_emulating_a_card_on_the_cpu_says_it_is_ignored(caplog):
    from lowvram.config import load_profile
    from lowvram.memory.device import apply_emulation

    apply_emulation(load_profile("cpu").replace(emulate_vram_gib=4), torch.device("cpu"))
    assert "--emulate-vram-gib 4 is ignored" in caplog.text
