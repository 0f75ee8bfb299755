"""`lowvram quantize`: the AWQ search, residual compensation, FP16-sensitive layers, and the
written checkpoint (AutoAWQ GEMM layout, atomic output, clear errors)."""

import argparse
import errno
import json
import shutil
from pathlib import Path

import pytest
import torch
from awq_layout import check_awq_checkpoint, reference_dequantize
from safetensors.torch import load_file, save_file
from test_awq_load import PROMPTS, prefill_logits

from lowvram.errors import ConfigError, ModelLoadError, UnsupportedModelError
from lowvram.kernels.awq_format import dequantize_awq, quantize_rtn
from lowvram.models.checkpoint import COMPENSATION_FILE
from lowvram.models.loader import load_model
from lowvram.quant.awq import clip_weight, fake_quantize, fold_scales, layer_scale_groups, search_clip, search_scales
from lowvram.quant.awq_linear import AwqLinear
from lowvram.quant.calibration import CALIBRATION_PATH, calibration_blocks, load_calibration_records
from lowvram.quant.cli import add_quantize_parser
from lowvram.quant.compensation import InputStats, fit_compensation
from lowvram.quant.quantize import quantize_model

GROUP_SIZE = 32
FAST = dict(group_size=GROUP_SIZE, num_samples=8, seq_len=64)
# Logits of an INT4 (group 32) random-weight tiny model against its FP32 original:
# mean squared difference / mean squared logit. RTN and AWQ measure about 0.03-0.06 here.
MAX_RELATIVE_LOGIT_MSE = 0.1


def relative_mse(got: torch.Tensor, reference: torch.Tensor) -> float:
    return (((got - reference) ** 2).mean() / (reference**2).mean()).item()


def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if ".partial-" in p.name or ".old-" in p.name)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def quantized(request, tmp_path_factory):
    """(source, AWQ, AWQ + FP16 layers + compensation, its report) for each tiny architecture."""
    tiny_model_dir = request.getfixturevalue(f"tiny_{request.param}_dir")
    root = tmp_path_factory.mktemp("quantized")
    plain = root / "awq"
    quantize_model(tiny_model_dir, plain, **FAST)
    full = root / "awq-fp16-comp"
    report = quantize_model(tiny_model_dir, full, fp16_budget_mib=0.02, rank=8, **FAST)
    return tiny_model_dir, plain, full, report


# -- the written checkpoint ----------------------------------------------------------------------


def test_checkpoint_follows_the_documented_layout(quantized):
    source, plain, full, report = quantized
    for out in (plain, full):
        layers = check_awq_checkpoint(out)
        config = json.loads((out / "config.json").read_text())
        assert config["quantization_config"]["group_size"] == GROUP_SIZE
        assert config["torch_dtype"] == "float16"
        skipped = config["quantization_config"]["modules_to_not_convert"]
        original = load_file(str(source / "model.safetensors"))
        written = load_file(str(out / "model.safetensors"))
        num_linears = sum(1 for name in original if name.endswith("_proj.weight"))
        assert len(layers) + sum(1 for name in written if name.endswith("_proj.weight")) == num_linears
        assert set(written) >= {"model.embed_tokens.weight", "model.norm.weight"}
        assert "lm_head.qweight" not in written
        assert (out / "tokenizer.json").is_file() and (out / "chat_template.jinja").is_file()
        if out == plain:
            assert skipped == [] and len(layers) == num_linears
    # the FP16-kept groups are listed together with the fused names vLLM uses
    skipped = json.loads((full / "config.json").read_text())["quantization_config"]["modules_to_not_convert"]
    assert skipped and [g["name"] for g in report.fp16_groups]
    for group in report.fp16_groups:
        assert group["name"] in skipped
        if group["name"].endswith(".qkv_proj"):
            assert group["name"].replace(".qkv_proj", ".q_proj") in skipped


def test_int4_weights_are_the_awq_transform_of_the_original(quantized):
    """Folding the AWQ scales back out of the written layer gives back the original weights,
    up to the INT4 step: the scales and the layout are applied consistently."""
    source, plain, _, _ = quantized
    original = load_file(str(source / "model.safetensors"))
    written = load_file(str(plain / "model.safetensors"))
    stem = "model.layers.0.mlp.gate_proj"
    weight = reference_dequantize(
        written[f"{stem}.qweight"], written[f"{stem}.qzeros"], written[f"{stem}.scales"], GROUP_SIZE
    ).t()  # [N, K], input channels scaled by s
    norm_original = original["model.layers.0.post_attention_layernorm.weight"].float()
    norm_written = written["model.layers.0.post_attention_layernorm.weight"].float()
    scales = norm_original / norm_written  # the folded s
    step = written[f"{stem}.scales"].float().repeat_interleave(GROUP_SIZE, dim=0).t() / scales
    error = (weight / scales - original[f"{stem}.weight"].float()).abs()
    within = (error <= step * 0.5 + 2e-3).float().mean().item()
    print(f"{100 * within:.1f}% of the weights lie within half an INT4 step of the original")
    assert within > 0.95  # clipping moves the few largest weights of a group further


def test_quantized_model_loads_and_its_logits_stay_close(quantized):
    source, plain, full, _ = quantized
    reference = prefill_logits(source)
    awq = relative_mse(prefill_logits(plain), reference)
    compensated = relative_mse(prefill_logits(full), reference)
    print(f"relative logit MSE vs FP32: AWQ {awq:.4f}, AWQ + FP16 layers + compensation {compensated:.4f}")
    assert awq <= MAX_RELATIVE_LOGIT_MSE
    assert compensated < awq  # fails if the compensation or the FP16 layers are not used at run time
    model, _ = load_model(full, torch.device("cpu"))
    assert model.weight_report.compensation_bytes > 0 and model.weight_report.num_fp16_layers > 0
    assert any(isinstance(m, AwqLinear) and m.lora_rank > 0 for m in model.modules())


def test_compensation_is_stored_apart_from_the_awq_tensors(quantized):
    _, plain, full, report = quantized
    assert not (plain / COMPENSATION_FILE).exists()
    extras = load_file(str(full / COMPENSATION_FILE))
    assert extras and all(name.rsplit(".", 1)[1].startswith("lowvram_") for name in extras)
    assert not set(extras) & set(load_file(str(full / "model.safetensors")))
    assert set(report.compensation) == {name.rsplit(".", 1)[0] for name in extras}
    # without the side file the checkpoint still loads, as in a loader that does not know it
    bare = full.parent / "bare"
    shutil.copytree(full, bare)
    (bare / COMPENSATION_FILE).unlink()
    model, _ = load_model(bare, torch.device("cpu"))
    assert model.weight_report.compensation_bytes == 0


def test_rtn_method_and_report_file(tiny_qwen2_dir, tmp_path):
    report = quantize_model(tiny_qwen2_dir, tmp_path / "rtn", method="rtn", **FAST)
    saved = json.loads((tmp_path / "rtn" / "lowvram_quantize.json").read_text())
    assert saved["method"] == "rtn" and saved["num_int4_linears"] == report.num_int4_linears == 14
    assert report.awq_alphas == {} and report.seconds > 0
    written = load_file(str(tmp_path / "rtn" / "model.safetensors"))
    original = load_file(str(tiny_qwen2_dir / "model.safetensors"))
    stem = "model.layers.1.self_attn.v_proj"
    expected = quantize_rtn(original[f"{stem}.weight"].float(), GROUP_SIZE)
    assert torch.equal(written[f"{stem}.qweight"], expected.qweight)
    assert torch.equal(written[f"{stem}.bias"], original[f"{stem}.bias"].half())
    assert "quantized" in report.summary() and "RTN INT4" in report.summary()


def test_cli_parser_runs_the_quantizer(tiny_llama_dir, tmp_path, capsys):
    parser = argparse.ArgumentParser(prog="lowvram")
    add_quantize_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(
        [
            "quantize",
            str(tiny_llama_dir),
            str(tmp_path / "out"),
            "--group-size",
            "64",
            "--num-samples",
            "4",
            "--seq-len",
            "32",
            "--rank",
            "4",
            "--device",
            "cpu",
        ]
    )
    assert args.quantize_head is False and args.bias_correction is False and args.fp16_budget_mib == 0
    assert args.func(args) == 0
    assert "AWQ INT4, group size 64" in capsys.readouterr().out
    assert json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]["group_size"] == 64


def test_a_head_too_large_for_the_device_is_quantized_on_the_cpu(tiny_llama_dir, tmp_path, monkeypatch):
    """On a CUDA run, a device OOM in the head's scale search retries the head in host memory."""
    from lowvram.quant.quantize import Quantizer

    quantize_model(tiny_llama_dir, tmp_path / "plain", quantize_head=True, **FAST)
    original = Quantizer._quantize_head
    devices = []

    def on(self, hs, device):
        devices.append(device.type)
        if len(devices) == 1:
            self.device = torch.device("cuda")  # what a GPU run sees; the CPU retry must not need it
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 890.00 MiB")
        self.device = torch.device("cpu")
        return original(self, hs, device)

    monkeypatch.setattr(Quantizer, "_quantize_head", on)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    quantize_model(tiny_llama_dir, tmp_path / "retried", quantize_head=True, **FAST)
    assert devices == ["cpu", "cpu"]  # the first try on the run's device, then the host
    plain = load_file(str(tmp_path / "plain" / "model.safetensors"))
    retried = load_file(str(tmp_path / "retried" / "model.safetensors"))
    for name in ("lm_head.qweight", "lm_head.qzeros", "lm_head.scales", "model.norm.weight"):
        assert torch.equal(plain[name], retried[name]), name


def test_quantize_head_writes_an_int4_head(tiny_llama_dir, tmp_path):
    quantize_model(tiny_llama_dir, tmp_path / "head", quantize_head=True, **FAST)
    written = load_file(str(tmp_path / "head" / "model.safetensors"))
    assert "lm_head.qweight" in written and "lm_head.weight" not in written
    model, _ = load_model(tmp_path / "head", torch.device("cpu"))
    assert isinstance(model.lm_head, AwqLinear)
    assert len(prefill_logits(tmp_path / "head")) == len(PROMPTS)


# -- errors leave nothing behind ------------------------------------------------------------------


def test_group_size_must_divide_the_model(tiny_qwen2_dir, tmp_path):
    with pytest.raises(
        ConfigError,
        match=r"--group-size 64 does not divide the model's intermediate_size \(160\).*"
        r"use --group-size 32",
    ):
        quantize_model(tiny_qwen2_dir, tmp_path / "out", group_size=64, num_samples=2, seq_len=32)
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_not_a_model_dir(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="has no config.json"):
        quantize_model(tmp_path / "empty", tmp_path / "out")
    with pytest.raises(ModelLoadError, match="is not a directory"):
        quantize_model(tmp_path / "missing", tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"]


def test_unsupported_architecture(tiny_llama_dir, tmp_path):
    model = tmp_path / "mixtral"
    shutil.copytree(tiny_llama_dir, model)
    config = json.loads((model / "config.json").read_text())
    config["architectures"] = ["MixtralForCausalLM"]
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="architecture 'MixtralForCausalLM' is not supported"):
        quantize_model(model, tmp_path / "out", **FAST)
    assert not (tmp_path / "out").exists()


def test_already_quantized_input_is_refused(quantized, tmp_path):
    _, plain, _, _ = quantized
    with pytest.raises(UnsupportedModelError, match="already quantized"):
        quantize_model(plain, tmp_path / "again", **FAST)
    assert not (tmp_path / "again").exists()


def test_disk_full_leaves_no_output(tiny_qwen2_dir, tmp_path, monkeypatch):
    import lowvram.quant.writer

    def full_disk(tensors, path):
        Path(path).write_bytes(b"\0" * 1024)  # a partial file, as a real failed write leaves
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(lowvram.quant.writer, "write_tensors", full_disk)
    with pytest.raises(ConfigError, match="no space left on the disk.*Nothing was written"):
        quantize_model(tiny_qwen2_dir, tmp_path / "out", **FAST)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_existing_output_needs_force(tiny_qwen2_dir, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ConfigError, match="already exists and is not empty; pass --force"):
        quantize_model(tiny_qwen2_dir, out, **FAST)
    assert (out / "keep.txt").read_text() == "mine"
    quantize_model(tiny_qwen2_dir, out, force=True, **FAST)
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").is_file()
    assert leftovers(tmp_path) == []


# -- the algorithm ----------------------------------------------------------------------------


def test_fake_quantize_is_exactly_the_written_weight():
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(24, 128, generator=gen) * 0.05
    max_abs = weight.reshape(24, 4, 32).abs().amax(-1) * 0.8
    clipped = clip_weight(weight, GROUP_SIZE, max_abs)
    packed = quantize_rtn(clipped, GROUP_SIZE)
    written = dequantize_awq(packed.qweight, packed.qzeros, packed.scales, GROUP_SIZE, dtype=torch.float32).t()
    assert torch.equal(fake_quantize(weight, GROUP_SIZE, max_abs), written)


def outlier_activations(num_tokens, num_inputs, seed, outliers=(3, 17, 40, 99), boost=40.0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, num_inputs, generator=gen)
    x[:, list(outliers)] *= boost
    return x


def test_awq_beats_rtn_when_inputs_have_outlier_channels():
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(64, 128, generator=gen) * 0.02
    x_fit, x_test = outlier_activations(512, 128, seed=1), outlier_activations(512, 128, seed=2)

    def output_mse(trial, x):
        return ((x @ trial.t() - x @ weight.t()) ** 2).mean().item()

    scales, alpha = search_scales(x_fit.abs().mean(0), [weight], GROUP_SIZE, lambda trial: output_mse(trial[0], x_fit))
    awq_weight = fake_quantize(weight * scales, GROUP_SIZE) / scales
    rtn, awq = output_mse(fake_quantize(weight, GROUP_SIZE), x_test), output_mse(awq_weight, x_test)
    print(f"held-out output MSE: RTN {rtn:.3e}, AWQ {awq:.3e} (alpha {alpha})")
    assert alpha is not None and awq < 0.5 * rtn


def test_clipping_never_hurts_the_partial_outputs():
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(32, 64, generator=gen) * 0.02
    weight[:, 5] = 0.3  # one large weight per group widens the grid for the rest
    x = torch.randn(256, 64, generator=gen)
    max_abs = search_clip(weight, x, GROUP_SIZE)
    assert (max_abs <= weight.reshape(32, 2, 32).abs().amax(-1) + 1e-7).all()
    clipped_error = ((x @ (fake_quantize(weight, GROUP_SIZE, max_abs) - weight).t()) ** 2).mean()
    plain_error = ((x @ (fake_quantize(weight, GROUP_SIZE) - weight).t()) ** 2).mean()
    assert clipped_error <= plain_error


def test_folding_keeps_the_function():
    gen = torch.Generator().manual_seed(7)
    weights = {"input_layernorm.weight": torch.rand(64, generator=gen) + 0.5}
    for name in ("q", "k", "v"):
        weights[f"self_attn.{name}_proj.weight"] = torch.randn(32, 64, generator=gen)
    x = torch.randn(10, 64, generator=gen)
    before = (x * weights["input_layernorm.weight"]) @ weights["self_attn.v_proj.weight"].t()
    group = layer_scale_groups(num_heads=4, num_kv_heads=2)[0]
    fold_scales(weights, group, torch.rand(64, generator=gen) + 0.5)
    after = (x * weights["input_layernorm.weight"]) @ weights["self_attn.v_proj.weight"].t()
    assert torch.allclose(before, after, atol=1e-5)
    assert [g.linears for g in layer_scale_groups(4, 2)][1] == ("mlp.gate_proj", "mlp.up_proj")
    assert len(layer_scale_groups(4, 4)) == 4  # v -> o only without GQA


def test_compensation_reduces_layer_output_error():
    gen = torch.Generator().manual_seed(11)
    num_inputs, num_outputs = 128, 64
    mixing = torch.randn(num_inputs, num_inputs, generator=gen) / num_inputs**0.5
    mixing[:, :8] *= 6  # a few strong directions, as real activations have

    def inputs(num_tokens):
        return torch.randn(num_tokens, num_inputs, generator=gen) @ mixing.t() + 0.3

    weight = torch.randn(num_outputs, num_inputs, generator=gen) * 0.05
    error = weight - fake_quantize(weight, GROUP_SIZE)
    stats = InputStats(num_inputs, torch.device("cpu"))
    for i in range(8):
        stats.add(inputs(256), is_fit=i % 2 == 0)
    comp = fit_compensation(error, stats, max_rank=16, use_bias=True)
    assert comp is not None and comp.rank > 0 and comp.bias_correction is not None
    x = inputs(2048)  # fresh tokens
    before = ((x @ error.t()) ** 2).sum(1).mean()
    correction = x @ comp.lora_a.t() @ comp.lora_b.t() + comp.bias_correction
    after = ((x @ error.t() - correction) ** 2).sum(1).mean()
    print(f"output error on fresh tokens: {before:.3e} -> {after:.3e} (rank {comp.rank}, scale {comp.scale})")
    assert after < 0.7 * before
    assert abs(comp.error_reduction - (1 - after / before)) < 0.15  # the held-out estimate is honest


def test_no_compensation_when_nothing_helps():
    stats = InputStats(64, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    for i in range(4):
        stats.add(torch.randn(64, 64, generator=gen), is_fit=i % 2 == 0)
    assert fit_compensation(torch.zeros(16, 64), stats, max_rank=8, use_bias=True) is None


def test_sensitivity_picks_the_layer_made_sensitive(tiny_llama_dir, tmp_path):
    """Layer 1's down_proj gets huge weights on input channels that are always zero (their
    up_proj rows are zeroed): the model computes the same function, but plain INT4 rounding
    of those groups now loses every other weight in them."""
    model = tmp_path / "sensitive"
    shutil.copytree(tiny_llama_dir, model)
    tensors = load_file(str(model / "model.safetensors"))
    dead_channels = list(range(0, tensors["model.layers.1.mlp.up_proj.weight"].shape[0], GROUP_SIZE))
    up = tensors["model.layers.1.mlp.up_proj.weight"].float()
    up[dead_channels] = 0
    down = tensors["model.layers.1.mlp.down_proj.weight"].float()
    down[:, dead_channels] = 40 * down.abs().max()
    tensors["model.layers.1.mlp.up_proj.weight"] = up.to(torch.bfloat16)
    tensors["model.layers.1.mlp.down_proj.weight"] = down.to(torch.bfloat16)
    save_file(tensors, str(model / "model.safetensors"), metadata={"format": "pt"})

    report = quantize_model(model, tmp_path / "rtn", method="rtn", fp16_budget_mib=0.02, **FAST)
    ranked = sorted(report.sensitivity, key=report.sensitivity.get, reverse=True)
    print("most sensitive:", [(n, f"{report.sensitivity[n]:.2e}") for n in ranked[:3]])
    assert ranked[0] == "model.layers.1.mlp.down_proj"
    assert report.fp16_groups[0]["name"] == "model.layers.1.mlp.down_proj"
    assert "model.layers.1.mlp.down_proj" in report.summary()
    skipped = json.loads((tmp_path / "rtn" / "config.json").read_text())["quantization_config"][
        "modules_to_not_convert"
    ]
    assert "model.layers.1.mlp.down_proj" in skipped
    written = load_file(str(tmp_path / "rtn" / "model.safetensors"))
    assert written["model.layers.1.mlp.down_proj.weight"].dtype == torch.float16
    assert torch.equal(written["model.layers.1.mlp.down_proj.weight"], down.to(torch.bfloat16).half())

    # AWQ scales the dead channels down before rounding, which removes most of the damage
    awq = quantize_model(model, tmp_path / "awq", fp16_budget_mib=0.02, **FAST)
    print(
        f"layer 1 down score: RTN {report.sensitivity['model.layers.1.mlp.down_proj']:.2e}, "
        f"AWQ {awq.sensitivity['model.layers.1.mlp.down_proj']:.2e}"
    )
    assert awq.sensitivity["model.layers.1.mlp.down_proj"] < 0.2 * report.sensitivity["model.layers.1.mlp.down_proj"]


# -- calibration ----------------------------------------------------------------------------------


def test_shipped_corpus_and_user_files(tiny_qwen2_dir, tmp_path):
    from lowvram.engine.tokenizer import Tokenizer

    assert CALIBRATION_PATH.stat().st_size <= 300_000
    records = load_calibration_records()
    assert any("messages" in r for r in records) and any("text" in r for r in records)
    tokenizer = Tokenizer(tiny_qwen2_dir).hf
    blocks = calibration_blocks(tokenizer, records, 16, 128)
    assert blocks.shape == (16, 128) and blocks.dtype == torch.long

    text = tmp_path / "mine.txt"
    text.write_text("def f(x):\n    return x + 1\n\n" * 50)
    assert calibration_blocks(tokenizer, load_calibration_records(text), 4, 32).shape == (4, 32)
    with pytest.raises(ConfigError, match="less than one --seq-len 100000 block"):
        calibration_blocks(tokenizer, load_calibration_records(text), 4, 100_000)
    with pytest.raises(ConfigError, match="no such file"):
        load_calibration_records(tmp_path / "nope.txt")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"oops": 1}\n')
    with pytest.raises(ConfigError, match=r"bad.jsonl:2: a record must be"):
        load_calibration_records(bad)


# -- GPU ------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_quantize_on_cuda_with_the_model_on_the_host(tiny_qwen2_dir, tmp_path):
    already_allocated = torch.cuda.memory_allocated()  # what earlier tests still hold
    report = quantize_model(
        tiny_qwen2_dir,
        tmp_path / "cuda",
        device="cuda",
        fp16_budget_mib=0.02,
        rank=8,
        group_size=GROUP_SIZE,
        num_samples=16,
        seq_len=128,
    )
    assert report.device.startswith("cuda") and report.peak_device_bytes is not None
    print(f"peak device memory: {(report.peak_device_bytes - already_allocated) / 2**20:.1f} MiB")
    assert report.peak_device_bytes - already_allocated < 256 * 2**20  # one tiny layer at a time
    check_awq_checkpoint(tmp_path / "cuda")
    cpu = quantize_model(
        tiny_qwen2_dir,
        tmp_path / "cpu",
        device="cpu",
        fp16_budget_mib=0.02,
        rank=8,
        group_size=GROUP_SIZE,
        num_samples=16,
        seq_len=128,
    )
    reference = prefill_logits(tiny_qwen2_dir)
    on_cuda = relative_mse(prefill_logits(tmp_path / "cuda"), reference)
    on_cpu = relative_mse(prefill_logits(tmp_path / "cpu"), reference)
    print(f"relative logit MSE: quantized on CUDA {on_cuda:.4f}, on CPU {on_cpu:.4f}")
    assert on_cuda <= max(1.5 * on_cpu, 0.02) and cpu.num_int4_linears == report.num_int4_linears


def test_quantizing_says_roughly_how_long_it_will_take():
    from lowvram.models.config import model_config_from_dict
    from lowvram.models.shapes import shape_config
    from lowvram.quant.cache import quantize_time_text

    config = model_config_from_dict(shape_config("r1-distill-qwen-1.5b"))
    on_cpu = quantize_time_text(config, 128, "cpu")
    assert on_cpu.startswith("roughly ") and on_cpu.endswith(" min on the CPU")
    assert int(on_cpu.split()[1]) > 60  # 1.8B parameters x 128 calibration blocks on two cores: hours
    assert quantize_time_text(config, 8, "cuda").endswith(" min on a small GPU")
