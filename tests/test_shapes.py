import pytest
import torch

from lowvram.errors import ConfigError
from lowvram.models.config import load_model_config
from lowvram.models.shapes import SHAPES, shape_config, write_random_checkpoint


def test_random_checkpoint_of_a_real_shape_loads_and_generates(tmp_path):
    from lowvram import LLM, SamplingParams

    model_dir = write_random_checkpoint(tmp_path / "m", "deepseek-coder-1.3b", num_layers=1)
    config, _ = load_model_config(model_dir)
    assert (config.hidden_size, config.num_heads, config.num_kv_heads, config.vocab_size) == (2048, 16, 16, 32256)
    assert config.rope_type == "linear" and config.rope_factor == 4.0
    assert (model_dir / "model.safetensors.index.json").is_file()  # 2 x 132 MB embedding/head: sharded
    out = LLM(str(model_dir), "cpu", max_model_len=64).generate("hi", SamplingParams(temperature=0, max_tokens=3))
    assert len(out[0].outputs[0].token_ids) == 3


def test_the_published_dimensions():
    c = shape_config("r1-distill-qwen-1.5b")
    assert (
        c["hidden_size"],
        c["intermediate_size"],
        c["num_hidden_layers"],
        c["num_attention_heads"],
        c["num_key_value_heads"],
        c["vocab_size"],
    ) == (1536, 8960, 28, 12, 2, 151936)
    assert set(SHAPES) == {"r1-distill-qwen-1.5b", "r1-distill-qwen-7b", "deepseek-coder-1.3b"}
    with pytest.raises(ConfigError, match="known shapes"):
        shape_config("gpt-5")


def test_cached_checkpoints_are_made_once_per_key(tmp_path, monkeypatch):
    from lowvram.models.shapes import BENCH_CACHE_ENV, cached_checkpoint

    calls = []

    def make(path):
        calls.append(path)
        path.mkdir()
        (path / "config.json").write_text("{}")

    monkeypatch.delenv(BENCH_CACHE_ENV, raising=False)
    first = cached_checkpoint("tiny-bf16", make, tmp_path / "a")
    second = cached_checkpoint("tiny-bf16", make, tmp_path / "b")
    assert len(calls) == 2 and first != second  # no cache: each run makes its own

    monkeypatch.setenv(BENCH_CACHE_ENV, str(tmp_path / "cache"))
    calls.clear()
    one = cached_checkpoint("tiny-bf16", make, tmp_path / "c")
    two = cached_checkpoint("tiny-bf16", make, tmp_path / "d")
    other = cached_checkpoint("tiny-awq", make, tmp_path / "d")
    assert one == two == tmp_path / "cache" / "tiny-bf16" and (one / "config.json").is_file()
    assert len(calls) == 2 and other == tmp_path / "cache" / "tiny-awq"

    def interrupted(path):
        path.mkdir()
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        cached_checkpoint("broken", interrupted, tmp_path / "e")
    assert not (tmp_path / "cache" / "broken").exists()
    calls.clear()
    assert cached_checkpoint("broken", make, tmp_path / "e").is_dir() and len(calls) == 1


def test_random_awq_tensors_have_the_layout_the_kernels_take():
    from script_modules import load_script

    from lowvram.kernels.awq_format import dequantize_awq

    random_awq_tensors = load_script("lab_shapes").random_awq_tensors

    generator = torch.Generator().manual_seed(0)
    qweight, qzeros, scales = random_awq_tensors(256, 64, 128, generator=generator)
    assert (qweight.shape, qzeros.shape, scales.shape) == ((256, 8), (2, 8), (2, 64))
    assert qweight.dtype == qzeros.dtype == torch.int32 and scales.dtype == torch.float16
    assert (scales > 0).all()
    weight = dequantize_awq(qweight, qzeros, scales, 128, dtype=torch.float32)  # codes over the whole 0..15 range
    assert weight.abs().max() > 10 * scales.float().min()
    again = random_awq_tensors(256, 64, 128, generator=torch.Generator().manual_seed(0))
    assert all(torch.equal(a, b) for a, b in zip((qweight, qzeros, scales), again))
