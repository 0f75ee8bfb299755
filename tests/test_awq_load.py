"""Loading AutoAWQ GEMM checkpoints: packed tensors kept as on disk, outputs equal to
dequantize-then-matmul, FP16 layers honoured, unsupported formats refused clearly.

The checkpoints here are made by hand from `quantize_rtn`, the way AutoAWQ lays them out,
so these tests do not depend on `lowvram quantize`.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from lowvram.config import load_profile
from lowvram.core.sampling_params import SamplingParams
from lowvram.engine.engine import LLMEngine
from lowvram.errors import ModelLoadError, UnsupportedModelError
from lowvram.kernels.awq_format import dequantize_awq, quantize_rtn
from lowvram.models.checkpoint import COMPENSATION_FILE
from lowvram.models.config import load_model_config
from lowvram.models.loader import QUANTIZABLE_LINEARS, load_model
from lowvram.quant.awq_linear import BIAS_CORRECTION, LORA_A, LORA_B, AwqLinear

GROUP_SIZE = 32
PROMPTS = ["Hello world, this is a test of", "def add(a, b):\n    return", "The quick brown fox"]
AWQ_CONFIG = {
    "quant_method": "awq",
    "bits": 4,
    "group_size": GROUP_SIZE,
    "zero_point": True,
    "version": "gemm",
    "modules_to_not_convert": None,
}


def write_awq_checkpoint(
    src: Path,
    dst: Path,
    *,
    keep_fp16: tuple[str, ...] = (),
    dequantized: bool = False,
    quant_config: dict | None = None,
    legacy: bool = False,
) -> dict:
    """Copy `src` with its decoder Linears in AutoAWQ GEMM form (or, with dequantized=True, the
    same INT4 weights dequantized into plain FP32 `.weight` tensors). Returns the written tensors."""
    dst.mkdir(parents=True)
    for path in src.iterdir():
        if path.suffix != ".safetensors" and path.name != "config.json":
            shutil.copy2(path, dst / path.name)
    original = load_file(str(src / "model.safetensors"))
    out = {}
    for name, tensor in original.items():
        stem, _, attr = name.rpartition(".")
        is_linear = attr == "weight" and stem.endswith(QUANTIZABLE_LINEARS)
        if not is_linear or any(fragment in stem for fragment in keep_fp16):
            out[name] = tensor.to(torch.float16)
            continue
        packed = quantize_rtn(tensor.float(), GROUP_SIZE)
        if dequantized:
            out[name] = (
                dequantize_awq(packed.qweight, packed.qzeros, packed.scales, GROUP_SIZE, dtype=torch.float32)
                .t()
                .contiguous()
            )
        else:
            out.update(
                {f"{stem}.qweight": packed.qweight, f"{stem}.qzeros": packed.qzeros, f"{stem}.scales": packed.scales}
            )
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    if not dequantized:
        quant = {**AWQ_CONFIG, "modules_to_not_convert": list(keep_fp16) or None, **(quant_config or {})}
        if legacy:
            legacy_config = {"zero_point": True, "q_group_size": GROUP_SIZE, "w_bit": 4, "version": "GEMM"}
            (dst / "quant_config.json").write_text(json.dumps(legacy_config))
        else:
            config["quantization_config"] = quant
    (dst / "config.json").write_text(json.dumps(config))
    return out


def prefill_logits(model_dir: Path, device: str = "cpu") -> torch.Tensor:
    """Logits of the next token after each prompt, [num_prompts, vocab]."""
    engine = LLMEngine(str(model_dir), "cpu" if device == "cpu" else "4gb", device=device)
    recorded = {}
    run = engine.runner.run

    def recording_run(batch, *args, **kwargs):
        logits = run(batch, *args, **kwargs)
        for row, seq in enumerate(batch.seqs):
            recorded.setdefault(seq.request_id, logits[row].float().cpu().clone())
        return logits

    engine.runner.run = recording_run
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
    return torch.stack([recorded[str(i)] for i in range(len(PROMPTS))])


@pytest.fixture(scope="module")
def awq_qwen2_dir(tiny_qwen2_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("awq") / "qwen2-awq"
    write_awq_checkpoint(tiny_qwen2_dir, path)
    return path


def test_packed_tensors_load_unchanged(awq_qwen2_dir):
    on_disk = load_file(str(awq_qwen2_dir / "model.safetensors"))
    model, config = load_model(awq_qwen2_dir, torch.device("cpu"))
    assert config.quantization.group_size == GROUP_SIZE
    num_checked = 0
    for name, module in model.named_modules():
        if isinstance(module, AwqLinear):
            for attr in ("qweight", "qzeros", "scales"):
                loaded, stored = getattr(module, attr), on_disk[f"{name}.{attr}"]
                assert loaded.dtype == stored.dtype and torch.equal(loaded, stored), f"{name}.{attr}"
            num_checked += 1
    assert num_checked == config.num_layers * len(QUANTIZABLE_LINEARS)
    assert isinstance(model.lm_head, torch.nn.Linear)  # AutoAWQ never quantizes the head


def test_weight_report_counts_packed_bytes(awq_qwen2_dir):
    on_disk = load_file(str(awq_qwen2_dir / "model.safetensors"))
    model, config = load_model(awq_qwen2_dir, torch.device("cpu"))
    report = model.weight_report
    packed_bytes = sum(
        t.numel() * t.element_size() for n, t in on_disk.items() if n.endswith((".qweight", ".qzeros", ".scales"))
    )
    bias_bytes = sum(p.numel() * 4 for n, p in model.named_parameters() if n.endswith("_proj.bias"))
    assert report.int4_layer_bytes == packed_bytes + bias_bytes
    assert report.num_int4_layers == config.num_layers * len(QUANTIZABLE_LINEARS)
    assert report.fp16_layer_bytes == 0 and report.compensation_bytes == 0
    assert report.embedding_bytes == config.vocab_size * config.hidden_size * 4  # float32 on the CPU
    assert model.weight_bytes == report.total_bytes
    print(f"weights: {report.summary()}")


def test_output_equals_dequantize_then_matmul(tiny_model_dir, tmp_path):
    write_awq_checkpoint(tiny_model_dir, tmp_path / "awq")
    write_awq_checkpoint(tiny_model_dir, tmp_path / "dequantized", dequantized=True)
    awq = prefill_logits(tmp_path / "awq")
    reference = prefill_logits(tmp_path / "dequantized")
    rel = ((awq - reference).abs().max() / reference.abs().max()).item()
    print(f"largest relative logit difference, AWQ vs dequantized FP32: {rel:.2e}")
    assert rel <= 1e-4


def test_layer_output_equals_dequantize_then_matmul():
    gen = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(48, 128, generator=gen), torch.randn(48, generator=gen)
    packed = quantize_rtn(weight, 64)
    layer = AwqLinear(128, 48, 64, has_bias=True)
    layer.qweight, layer.qzeros, layer.scales = packed.qweight, packed.qzeros, packed.scales
    layer.bias = torch.nn.Parameter(bias, requires_grad=False)
    x = torch.randn(5, 128, generator=gen)
    dense = x @ dequantize_awq(packed.qweight, packed.qzeros, packed.scales, 64, dtype=torch.float32) + bias
    assert torch.allclose(layer(x), dense, rtol=1e-4, atol=1e-4)
    lora_a, lora_b, correction = torch.randn(4, 128, generator=gen), torch.randn(48, 4, generator=gen), torch.randn(48)
    layer.set_compensation(LORA_A, lora_a)
    layer.set_compensation(LORA_B, lora_b)
    layer.set_compensation(BIAS_CORRECTION, correction)
    assert torch.allclose(layer(x), dense + x @ lora_a.t() @ lora_b.t() + correction, rtol=1e-4, atol=1e-3)
    with pytest.raises(ValueError, match="lowvram_lora_a has shape"):
        layer.set_compensation(LORA_A, torch.zeros(4, 64))


def test_modules_to_not_convert_stay_fp16(tiny_qwen2_dir, tmp_path):
    keep = ("model.layers.1.mlp.down_proj", "model.layers.0.self_attn")
    written = write_awq_checkpoint(tiny_qwen2_dir, tmp_path / "awq", keep_fp16=keep)
    model, _ = load_model(tmp_path / "awq", torch.device("cpu"))
    for name, module in model.named_modules():
        if name.endswith(QUANTIZABLE_LINEARS):
            is_kept = any(fragment in name for fragment in keep)
            assert isinstance(module, torch.nn.Linear) == is_kept, name
            assert isinstance(module, AwqLinear) != is_kept, name
    down = model.get_submodule("model.layers.1.mlp.down_proj")
    assert torch.equal(down.weight, written["model.layers.1.mlp.down_proj.weight"].float())
    assert model.weight_report.num_fp16_layers == 5 and model.weight_report.num_int4_layers == 9
    assert len(prefill_logits(tmp_path / "awq")) == len(PROMPTS)


def test_legacy_quant_config_json_is_read(tiny_llama_dir, tmp_path):
    write_awq_checkpoint(tiny_llama_dir, tmp_path / "legacy", legacy=True)
    config, _ = load_model_config(tmp_path / "legacy")
    assert config.quantization is not None and config.quantization.group_size == GROUP_SIZE
    model, _ = load_model(tmp_path / "legacy", torch.device("cpu"))
    assert isinstance(model.get_submodule("model.layers.0.mlp.up_proj"), AwqLinear)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"version": "gemv"}, "AWQ version 'gemv' is not supported"),
        ({"version": "gemv_fast"}, "AWQ version 'gemv_fast' is not supported"),
        ({"quant_method": "gptq"}, "quant_method 'gptq' is not supported"),
        ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes' is not supported"),
        ({"bits": 8}, "AWQ with 8 bits is not supported"),
        ({"group_size": 256}, "group_size 256 is not supported"),
        ({"zero_point": False}, "without zero points"),
    ],
)
def test_unsupported_quantization_is_refused_clearly(awq_qwen2_dir, tmp_path, change, message):
    bad = tmp_path / "bad"
    shutil.copytree(awq_qwen2_dir, bad)
    config = json.loads((bad / "config.json").read_text())
    config["quantization_config"].update(change)
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match=message) as info:
        LLMEngine(str(bad), "cpu")
    assert "Supported: AWQ INT4 in the AutoAWQ GEMM layout" in str(info.value)


def test_mismatched_skip_list_names_the_layer(awq_qwen2_dir, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(awq_qwen2_dir, bad)
    config = json.loads((bad / "config.json").read_text())
    config["quantization_config"]["modules_to_not_convert"] = ["model.layers.0.mlp.up_proj"]
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="model.layers.0.mlp.up_proj is listed in quantization_config"):
        load_model(bad, torch.device("cpu"))


def test_fp16_layer_missing_from_skip_list_names_the_layer(tiny_qwen2_dir, tmp_path):
    write_awq_checkpoint(tiny_qwen2_dir, tmp_path / "bad", keep_fp16=("model.layers.1.mlp.down_proj",))
    config = json.loads((tmp_path / "bad" / "config.json").read_text())
    config["quantization_config"]["modules_to_not_convert"] = []
    (tmp_path / "bad" / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ModelLoadError, match="model.layers.1.mlp.down_proj is listed as INT4 but the checkpoint holds it in FP16"
    ):
        load_model(tmp_path / "bad", torch.device("cpu"))


def test_compensation_file_is_invisible_to_awq_only_loaders(awq_qwen2_dir, tmp_path):
    """A loader that knows only the AutoAWQ names (as vLLM does, failing on unknown ones) reads
    the *.safetensors files; the compensation tensors must not be among them."""
    checkpoint = tmp_path / "compensated"
    shutil.copytree(awq_qwen2_dir, checkpoint)
    extras = {
        "model.layers.0.mlp.down_proj." + LORA_A: torch.zeros(2, 160, dtype=torch.float16),
        "model.layers.0.mlp.down_proj." + LORA_B: torch.zeros(64, 2, dtype=torch.float16),
        "model.layers.0.mlp.down_proj." + BIAS_CORRECTION: torch.full((64,), 0.5, dtype=torch.float16),
    }
    save_file(extras, str(checkpoint / COMPENSATION_FILE), metadata={"format": "pt"})

    awq_suffixes = (".qweight", ".qzeros", ".scales", ".bias", ".weight")
    for path in checkpoint.glob("*.safetensors"):
        for name in load_file(str(path)):
            assert name.endswith(awq_suffixes), f"{path.name} holds {name}, unknown to AWQ loaders"
    assert not COMPENSATION_FILE.endswith(".safetensors")
    assert all(not name.endswith(awq_suffixes) for name in extras)

    model, _ = load_model(checkpoint, torch.device("cpu"))
    down = model.get_submodule("model.layers.0.mlp.down_proj")
    assert down.lora_rank == 2 and model.weight_report.compensation_bytes > 0
    shifted = prefill_logits(checkpoint)
    plain = prefill_logits(awq_qwen2_dir)
    assert not torch.allclose(shifted, plain)  # the bias correction is applied at run time


def test_generate_end_to_end_on_cpu(awq_qwen2_dir):
    from lowvram import LLM

    llm = LLM(str(awq_qwen2_dir), profile="cpu")
    out = llm.generate(["def add(a, b):"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 8


@pytest.mark.gpu
def test_triton_path_on_cuda_agrees_with_cpu(awq_qwen2_dir):
    from lowvram.kernels import dispatch

    is_triton, reason = dispatch.triton_path("cuda", torch.cuda.current_device())
    assert is_triton, f"the AWQ layers would not use the Triton kernels here: {reason}"
    gpu = prefill_logits(awq_qwen2_dir, device="cuda")
    cpu = prefill_logits(awq_qwen2_dir, device="cpu")
    rel = ((gpu - cpu).abs().max() / cpu.abs().max()).item()
    print(f"largest relative logit difference, CUDA (FP16, Triton) vs CPU (FP32): {rel:.2e}")
    assert rel <= 2e-2
    assert torch.equal(gpu.argmax(-1), cpu.argmax(-1))


def random_compensation(seed: int) -> dict[str, torch.Tensor]:
    """Compensation for tiny qwen2 (hidden 64, intermediate 160, kv 32) that moves the logits:
    ranks differ between q, k and v (fused, R = 4 + 8 = 12 over a block-diagonal B), corrections
    land on biased layers (q) and bias-free ones (gate, down), and up has none beside gate."""
    gen = torch.Generator().manual_seed(seed)
    shapes = {
        "self_attn.q_proj": (4, 64, 64, True),
        "self_attn.v_proj": (8, 64, 32, False),
        "mlp.gate_proj": (16, 64, 160, True),
        "mlp.down_proj": (6, 160, 64, True),
    }
    tensors = {}
    for layer in (0, 1):
        for name, (rank, k, n, has_correction) in shapes.items():
            prefix = f"model.layers.{layer}.{name}"
            tensors[f"{prefix}.{LORA_A}"] = (torch.randn(rank, k, generator=gen) * 0.1).half()
            tensors[f"{prefix}.{LORA_B}"] = (torch.randn(n, rank, generator=gen) * 0.1).half()
            if has_correction:
                tensors[f"{prefix}.{BIAS_CORRECTION}"] = (torch.randn(n, generator=gen) * 0.1).half()
    return tensors


def generated_logits(engine: LLMEngine, prompts: list[str], max_tokens: int) -> torch.Tensor:
    """The logits of every step of greedy generation, [num_prompts, max_tokens, vocab]."""
    recorded: dict[str, list[torch.Tensor]] = {}
    run = engine.runner.run

    def recording_run(batch, *args, **kwargs):
        logits = run(batch, *args, **kwargs)
        for row, seq in enumerate(batch.seqs):
            recorded.setdefault(seq.request_id, []).append(logits[row].float().cpu().clone())
        return logits

    engine.runner.run = recording_run
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
    return torch.stack([torch.stack(recorded[str(i)]) for i in range(len(prompts))])


def test_compensation_in_the_kernels_matches_the_unfused_torch_terms(awq_qwen2_dir, tmp_path, monkeypatch):
    """Loaded, fused and run through the Triton kernels (interpreted), a compensated model gives
    the logits of the INT4 layers followed by the two torch matmuls and the correction add."""
    from lowvram.kernels import dispatch, w4a16

    if not dispatch.triton_path("cpu", None)[0]:
        pytest.skip("the Triton interpreter is not available")
    checkpoint = tmp_path / "compensated"
    shutil.copytree(awq_qwen2_dir, checkpoint)
    compensation = random_compensation(seed=3)
    save_file(compensation, str(checkpoint / COMPENSATION_FILE), metadata={"format": "pt"})
    # 3 prompts: prefill through the GEMM path plus one addmm, decode at 3 rows; 1 prompt: the row kernel
    cases = [(PROMPTS, 3), (PROMPTS[:1], 3)]

    import lowvram.models.loader
    import lowvram.quant.awq_linear

    with monkeypatch.context() as patch:

        def kernels_only(*args, **kwargs):
            return w4a16.awq_linear(*args, **{**kwargs, "use_reference": False})

        patch.setattr(lowvram.quant.awq_linear, "awq_linear", kernels_only)
        # the kernels, not the float32 copy the CPU unpacks once
        patch.setattr(lowvram.quant.awq_linear.AwqLinear, "_cpu_weight_fits", lambda self: False)
        rows_with_lora = set()

        def counting(launch):
            def counted(x, *args):
                if isinstance(args[-1], torch.Tensor):  # lora_bt, given to the kernel
                    rows_with_lora.add(x.shape[0])
                return launch(x, *args)

            return counted

        for name in ("launch_row", "launch_tiled"):
            patch.setattr(w4a16.w4a16_gemv, name, counting(getattr(w4a16.w4a16_gemv, name)))
        engine = LLMEngine(str(checkpoint), "cpu")
        qkv = engine.model.model.layers[0].self_attn.qkv_proj
        assert qkv is not None and qkv.lora_rank == 12 and qkv.is_bias_corrected
        fused = [generated_logits(engine, prompts, max_tokens) for prompts, max_tokens in cases]
        assert {1, 3} <= rows_with_lora, rows_with_lora

    monkeypatch.setattr(lowvram.models.loader, "fuse_projections", lambda model: 0)
    engine = LLMEngine(str(awq_qwen2_dir), "cpu")

    def unfused(layer: AwqLinear, lora_a, lora_b, correction):
        def forward(x):  # the forward pass before the fusion: INT4, then the terms in plain torch
            y = w4a16.awq_linear(
                x, layer.qweight, layer.qzeros, layer.scales, layer.group_size, layer.bias, use_reference=True
            )
            y = y + (x @ lora_a.t().to(x.dtype)) @ lora_b.t().to(x.dtype)
            return y if correction is None else y + correction.to(y.dtype)

        return forward

    for name, module in engine.model.named_modules():
        if f"{name}.{LORA_A}" in compensation:
            module.forward = unfused(
                module,
                compensation[f"{name}.{LORA_A}"],
                compensation[f"{name}.{LORA_B}"],
                compensation.get(f"{name}.{BIAS_CORRECTION}"),
            )
    plain = prefill_logits(awq_qwen2_dir)
    for (prompts, max_tokens), got in zip(cases, fused):
        expected = generated_logits(engine, prompts, max_tokens)
        rel = ((got - expected).abs().max() / expected.abs().max()).item()
        moved = ((expected[:, 0] - plain[: len(prompts)]).abs().max() / expected.abs().max()).item()
        print(
            f"{len(prompts)} prompts x {max_tokens} steps: largest relative logit difference, kernels vs "
            f"unfused torch terms {rel:.2e} (the compensation moves them by {moved:.2e})"
        )
        assert rel <= 1e-4 < moved


def test_bias_correction_is_added_into_the_bias():
    with torch.device("meta"):  # as the loader builds it
        layer = AwqLinear(64, 16, 32, has_bias=True)
    with pytest.raises(ValueError, match="before the bias was loaded"):
        layer.set_compensation(BIAS_CORRECTION, torch.ones(16))
    layer.bias = torch.nn.Parameter(torch.arange(16.0), requires_grad=False)
    layer.set_compensation(BIAS_CORRECTION, torch.full((16,), 0.5))
    assert torch.equal(layer.bias, torch.arange(16.0) + 0.5) and layer.has_compensation
    bare = AwqLinear(64, 16, 32)
    bare.set_compensation(BIAS_CORRECTION, torch.full((16,), 0.25, dtype=torch.float16))
    assert torch.equal(bare.bias, torch.full((16,), 0.25, dtype=torch.float16))
    assert "bias_correction=True" in repr(bare) and not bare.has_own_bias
    bare.set_compensation(LORA_B, torch.randn(16, 4))
    assert bare.lora_bt.is_contiguous() and bare.lora_bt.shape == (4, 16)


@pytest.mark.gpu
def test_decode_with_rope_and_the_kv_store_inside_the_qkv_kernel_matches_the_separate_kernel(
    awq_qwen2_dir, monkeypatch
):
    """One sequence decoding on the GPU rotates q and k and stores k and v inside the fused
    q/k/v projection's kernel (Attention.fused_rope_kv); its logits equal, within the GEMV's
    own rounding (its column blocks and K splits change), those of rotary_write_kv after it."""
    import lowvram.models.dense

    taken = []
    fused_rope_kv = lowvram.models.dense.Attention.fused_rope_kv

    def counting(self, *args):
        rope_kv = fused_rope_kv(self, *args)
        taken.append(rope_kv is not None)
        return rope_kv

    monkeypatch.setattr(lowvram.models.dense.Attention, "fused_rope_kv", counting)
    for use_graphs in (False, True):
        profile = load_profile("4gb").replace(enable_cuda_graphs=use_graphs, device="cuda")
        fused = generated_logits(LLMEngine(str(awq_qwen2_dir), profile), PROMPTS[:1], 6)
        assert any(taken) and not all(taken), "decode steps fuse, prefills do not"
        with monkeypatch.context() as patch:
            patch.setattr(lowvram.models.dense.Attention, "fused_rope_kv", lambda *args: None)
            separate = generated_logits(LLMEngine(str(awq_qwen2_dir), profile), PROMPTS[:1], 6)
        worst = ((fused - separate).abs().max() / separate.abs().max()).item()
        print(
            f"graphs={use_graphs}: RoPE and KV store in the q/k/v kernel vs separate, largest relative "
            f"difference of the logits {worst:.2e}"
        )
        assert worst <= 1e-3
        assert torch.equal(fused.argmax(-1), separate.argmax(-1))
        taken.clear()


@pytest.mark.gpu
def test_decode_with_norms_and_activation_inside_the_int4_kernels_matches_the_separate_kernels(
    awq_qwen2_dir, tmp_path, monkeypatch
):
    """One sequence decoding on the GPU runs both norms and the activation inside the INT4
    kernels (model.fuses_input); every step's logits equal those of the separate kernels."""
    import lowvram.models.dense

    checkpoint = tmp_path / "compensated"
    shutil.copytree(awq_qwen2_dir, checkpoint)
    save_file(random_compensation(seed=5), str(checkpoint / COMPENSATION_FILE), metadata={"format": "pt"})
    fused_calls = []
    forward_normed = AwqLinear.forward_normed

    def counting(self, *args, **kwargs):
        fused_calls.append(1)
        return forward_normed(self, *args, **kwargs)

    monkeypatch.setattr(AwqLinear, "forward_normed", counting)
    for use_graphs in (False, True):
        profile = load_profile("4gb").replace(enable_cuda_graphs=use_graphs, device="cuda")
        fused = generated_logits(LLMEngine(str(checkpoint), profile), PROMPTS[:1], 6)
        assert fused_calls, "no layer took the fused path"
        with monkeypatch.context() as patch:
            patch.setattr(lowvram.models.dense, "fuses_input", lambda *args: False)
            separate = generated_logits(LLMEngine(str(checkpoint), profile), PROMPTS[:1], 6)
        worst = ((fused - separate).abs().max() / separate.abs().max()).item()
        print(
            f"graphs={use_graphs}: fused vs separate decode logits, largest relative difference {worst:.2e}, "
            f"bit-identical: {torch.equal(fused, separate)}"
        )
        assert worst <= 1e-3
        assert torch.equal(fused.argmax(-1), separate.argmax(-1))
        fused_calls.clear()
