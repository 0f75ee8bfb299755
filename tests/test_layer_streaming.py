"""Weight offload: decoder layers streamed from host memory compute exactly what resident
ones do, the plan keeps as many layers on the device as fit, and a budget that cannot hold
even one streamed layer is a clear error."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import finished_token_ids

from lowvram.config import load_profile, profile_from_dict
from lowvram.core.sampling_params import SamplingParams
from lowvram.engine.engine import LLMEngine
from lowvram.errors import ConfigError, OutOfMemoryError
from lowvram.kernels.awq_format import quantize_rtn
from lowvram.memory import plan as mp
from lowvram.memory.doctor import plan_memory
from lowvram.memory.render import weight_rows
from lowvram.models.config import model_config_from_dict
from lowvram.models.layer_streaming import HostComputed, HostEmbedding
from lowvram.models.loader import QUANTIZABLE_LINEARS
from lowvram.models.shapes import shape_config

NUM_LAYERS = 4
GROUP_SIZE = 32
AWQ_CONFIG = {"quant_method": "awq", "bits": 4, "group_size": GROUP_SIZE, "zero_point": True, "version": "gemm"}


def _write_awq(src, dst):
    """`src` with every decoder Linear in AutoAWQ GEMM form (round-to-nearest INT4)."""
    shutil.copytree(src, dst)
    tensors = {}
    for name, tensor in load_file(str(src / "model.safetensors")).items():
        stem, _, attr = name.rpartition(".")
        if attr == "weight" and stem.endswith(QUANTIZABLE_LINEARS):
            packed = quantize_rtn(tensor.float(), GROUP_SIZE)
            tensors.update(
                {f"{stem}.qweight": packed.qweight, f"{stem}.qzeros": packed.qzeros, f"{stem}.scales": packed.scales}
            )
        else:
            tensors[name] = tensor.to(torch.float16)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, "quantization_config": AWQ_CONFIG}))
    return dst


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Four-layer tiny checkpoints: llama and qwen2 in BF16, and qwen2 in AWQ INT4."""
    from lowvram.testing import make_tiny_model

    root = tmp_path_factory.mktemp("streaming")
    dirs = {arch: make_tiny_model(root / arch, arch, num_layers=NUM_LAYERS) for arch in ("llama", "qwen2")}
    dirs["qwen2-awq"] = _write_awq(dirs["qwen2"], root / "qwen2-awq")
    return dirs


def _engine(model_dir, profile="cpu", **changes):
    # A small token budget makes a long text prefill in chunks that read earlier chunks' KV.
    profile = load_profile(profile).replace(**{"max_num_batched_tokens": 32, "max_model_len": 256, **changes})
    return LLMEngine(str(model_dir), profile)


def _token_ids(engine, num_tokens, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, engine.config.vocab_size, (num_tokens,), generator=gen).tolist()


def _greedy(engine, prompts):
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{i}", prompt_token_ids=ids, params=params)
    done = finished_token_ids(engine)
    return [done[f"r{i}"] for i in range(len(prompts))]


# ---------------------------------------------------------------- same results


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen2-awq"])
def test_streamed_layers_score_and_generate_exactly_like_resident_ones(checkpoints, kind):
    resident = _engine(checkpoints[kind])
    streamed = _engine(checkpoints[kind], weight_offload="stream", max_resident_layers=1)
    streamer = streamed.model.layer_streamer
    assert streamer.num_streamed_layers == NUM_LAYERS - 1 and streamer.is_streaming
    assert isinstance(streamed.model.model.embed_tokens, HostEmbedding)

    text = _token_ids(resident, 90)
    copied_before = streamer.stats.copied_bytes
    assert streamed.score(text) == resident.score(text)  # bit for bit, chunked prefill included
    num_passes = -(-len(text) // 32)
    assert streamer.stats.copied_bytes - copied_before >= num_passes * streamer.plan.copied_bytes_per_pass * 0.5

    prompts = [_token_ids(resident, 7, seed=1), _token_ids(resident, 20, seed=2)]
    assert _greedy(streamed, prompts) == _greedy(resident, prompts)
    assert streamer.stats.num_missed_prefetches == 0

    # Between passes every weight reads as the real one, not whatever a staging buffer holds.
    expected = resident.model.state_dict()
    for name, tensor in streamed.model.state_dict().items():
        assert torch.equal(tensor, expected[name]), name


def test_cpu_strategy_runs_streamed_mlps_on_the_host_and_scores_like_resident(checkpoints):
    resident = _engine(checkpoints["qwen2-awq"])
    offloaded = _engine(checkpoints["qwen2-awq"], weight_offload="cpu", max_resident_layers=2)
    layers = offloaded.model.model.layers
    assert [isinstance(layer.mlp, HostComputed) for layer in layers] == [False, False, True, True]
    # Only the attention part of a streamed layer is copied: less than a whole layer.
    plan = offloaded.model.layer_streamer.plan
    assert 0 < plan.staging_buffer_bytes < plan.resident_layer_bytes / 2
    text = _token_ids(resident, 60)
    got, want = torch.tensor(offloaded.score(text)), torch.tensor(resident.score(text))
    diff = (got - want).abs().max().item()
    print(f"cpu strategy: largest log-prob difference {diff:.2e}")
    assert diff < 1e-4  # float32 dequantized weights vs the INT4 path's float32 dequantization


def test_auto_keeps_every_weight_on_the_device_when_the_model_fits(checkpoints):
    engine = _engine(checkpoints["qwen2"], weight_offload="auto")
    assert getattr(engine.model, "layer_streamer", None) is None
    assert engine.model.supports_cuda_graphs


# ---------------------------------------------------------------- the plan


def test_plan_keeps_as_many_leading_layers_as_fit_beside_kv_and_workspace():
    plan = mp.plan_offload(
        [100] * 10,
        [100] * 10,
        fixed_bytes=50,
        host_embedding_bytes=300,
        budget_bytes=1000,
        workspace_bytes=100,
        kv_bytes=150,
    )
    # room for layers and staging: 1000 - 100 - 150 - 50 = 700 = 5 layers + 2 staging buffers
    assert (plan.num_resident_layers, plan.num_streamed_layers, plan.num_staging_buffers) == (5, 5, 2)
    assert plan.device_weight_bytes == 50 + 500 + 200 and plan.copied_bytes_per_pass == 500 and plan.fits
    assert plan.host_weight_bytes == 500 + 300

    cpu = mp.plan_offload(
        [100] * 10,
        [20] * 10,
        fixed_bytes=50,
        host_embedding_bytes=0,
        budget_bytes=1000,
        workspace_bytes=100,
        kv_bytes=150,
        strategy="cpu",
    )
    assert cpu.num_resident_layers == 6  # 600 + 2 x 20 staged <= 700
    capped = mp.plan_offload(
        [100] * 10,
        [100] * 10,
        fixed_bytes=50,
        host_embedding_bytes=0,
        budget_bytes=1000,
        workspace_bytes=100,
        kv_bytes=150,
        max_resident_layers=2,
    )
    assert capped.num_resident_layers == 2
    one_left = mp.plan_offload(
        [100] * 3,
        [20] * 3,
        fixed_bytes=0,
        host_embedding_bytes=0,
        budget_bytes=230,
        workspace_bytes=0,
        kv_bytes=0,
        strategy="cpu",
    )
    assert (one_left.num_resident_layers, one_left.num_staging_buffers) == (2, 1)


def _seven_b(tmp_path):
    raw = dict(shape_config("r1-distill-qwen-7b"), quantization_config={**AWQ_CONFIG, "group_size": 128})
    return model_config_from_dict(raw)


def test_the_7b_shape_in_awq_streams_on_the_4gb_profile_and_as_many_layers_as_fit_stay(tmp_path):
    config = _seven_b(tmp_path)
    profile = load_profile("4gb")
    weights = mp.weight_bytes_by_kind(config, 2)
    assert (
        len(weights.layer_bytes) == 28
        and sum(weights.layer_bytes) + weights.embedding_bytes + weights.head_bytes + config.hidden_size * 2
        == weights.all_bytes
    )
    plan = mp.plan_weight_offload(config, profile, weights, 2, 16384, device_type="cuda")
    assert plan is not None and plan.strategy == mp.DEFAULT_OFFLOAD_STRATEGY and plan.fits
    assert plan.is_embedding_on_host and 0 < plan.num_resident_layers < 28
    # one more resident layer would not fit
    more = plan.device_weight_bytes + weights.layer_bytes[plan.num_resident_layers]
    if plan.num_streamed_layers <= 2:
        more -= plan.staging_buffer_bytes
    assert more + plan.workspace_bytes + plan.kv_bytes + plan.reserve_bytes > plan.budget_bytes
    assert plan.kv_bytes == 16384 * mp.kv_bytes_per_token(config, "fp16", 2)

    small = dict(shape_config("r1-distill-qwen-1.5b"), quantization_config={**AWQ_CONFIG, "group_size": 128})
    small_config = model_config_from_dict(small)
    assert (
        mp.plan_weight_offload(
            small_config,
            profile,
            mp.weight_bytes_by_kind(small_config, 2),
            2,
            16384,
            device_type="cuda",
        )
        is None
    )
    assert (
        mp.plan_weight_offload(config, profile.replace(weight_offload="off"), weights, 2, 16384, device_type="cuda")
        is None
    )


def test_doctor_plans_the_7b_shape_on_4gb_with_layers_in_host_memory(tmp_path):
    config = _seven_b(tmp_path)
    plan = plan_memory(config, load_profile("4gb"), context_len=16384, device="cuda")
    offload = plan.weights.offload
    assert plan.fits and offload is not None
    assert plan.weights.total_bytes == offload.device_weight_bytes < plan.weights.all_bytes
    labels = [label for label, _ in weight_rows(plan.weights)]
    assert f"held in host memory ({offload.num_streamed_layers} of 28 layers stream, embeddings)" in labels
    assert any(f"{offload.num_resident_layers} of 28 decoder layers on the device" in note for note in plan.notes)
    off = plan_memory(config, load_profile("4gb").replace(weight_offload="off"), context_len=16384, device="cuda")
    assert not off.fits and off.weights.offload is None


def test_a_budget_that_cannot_hold_one_streamed_layer_is_a_clear_error(checkpoints):
    plan = mp.plan_offload(
        [100] * 4,
        [100] * 4,
        fixed_bytes=400,
        host_embedding_bytes=0,
        budget_bytes=700,
        workspace_bytes=100,
        kv_bytes=50,
        max_model_len=2048,
    )
    assert plan.num_resident_layers == 0 and not plan.fits
    with pytest.raises(OutOfMemoryError, match="even with every decoder layer streamed"):
        plan.check("4gb")

    with pytest.raises(OutOfMemoryError) as info:
        # the plain-torch attention scores of a 2048-token step alone outgrow the 0.07 GiB budget
        _engine(
            checkpoints["qwen2"],
            weight_offload="stream",
            memory_budget_gib=0.25,
            memory_utilization=0.3,
            max_num_batched_tokens=2048,
            max_model_len=2048,
        )
    message = str(info.value)
    assert "2 staging buffers" in message and "but the budget 0.07 GiB leaves -0." in message
    assert "Lower max_model_len" in message and "lowvram doctor --profile cpu --context 2048" in message


def test_weight_offload_settings_are_validated():
    assert load_profile("4gb").weight_offload == "auto" and load_profile("cpu").weight_offload == "off"
    assert profile_from_dict({"weight_offload": False}).weight_offload == "off"  # YAML's bare off
    with pytest.raises(ConfigError, match="weight_offload = 'gpu' is not allowed; use one of: auto, off, stream, cpu"):
        profile_from_dict({"weight_offload": "gpu"})
    with pytest.raises(ConfigError, match="max_resident_layers"):
        profile_from_dict({"max_resident_layers": -1})


# ---------------------------------------------------------------- on the GPU


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["qwen2", "qwen2-awq"])
@pytest.mark.parametrize("num_resident", [2, 1], ids=["2-of-4-streamed", "3-of-4-streamed"])
def test_streamed_layers_match_resident_ones_on_cuda(checkpoints, kind, num_resident):
    # With 3 streamed layers and 2 staging buffers every pass re-copies layers on the side stream.
    resident = _engine(checkpoints[kind], "4gb", device="cuda")
    streamed = _engine(
        checkpoints[kind], "4gb", device="cuda", weight_offload="stream", max_resident_layers=num_resident
    )
    streamer = streamed.model.layer_streamer
    assert streamer.num_streamed_layers == NUM_LAYERS - num_resident and streamer.layers[0].host.is_pinned()
    assert not streamed.model.supports_cuda_graphs
    text = _token_ids(resident, 90)
    got, want = torch.tensor(streamed.score(text)), torch.tensor(resident.score(text))
    print(f"{kind}: largest log-prob difference streamed vs resident {(got - want).abs().max().item():.2e}")
    assert torch.equal(got, want)
    prompts = [_token_ids(resident, 7, seed=1), _token_ids(resident, 40, seed=2)]
    assert _greedy(streamed, prompts) == _greedy(resident, prompts)
    assert streamer.stats.num_missed_prefetches == 0 and streamer.stats.copied_bytes > 0


# ---------------------------------------------------------------- preparing on the host


@pytest.mark.parametrize("kind", ["llama", "qwen2-awq"])
def test_place_on_device_moves_every_tensor_once_and_keeps_ties(checkpoints, kind):
    from lowvram.models.fusion import fuse_projections
    from lowvram.models.layer_streaming import place_on_device
    from lowvram.models.loader import load_model

    model, _ = load_model(checkpoints[kind], torch.device("cpu"), torch.float32)
    assert fuse_projections(model) > 0
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    for module in model.modules():  # no tensor outside the parameters and buffers, which nothing would move
        loose = [k for k, v in vars(module).items() if isinstance(v, torch.Tensor) and not k.startswith("_")]
        assert not loose, f"{type(module).__name__} holds {loose} outside its parameters and buffers"
    place_on_device(model, torch.device("meta"))
    assert all(t.device.type == "meta" for t in model.parameters())
    assert all(t.device.type == "meta" for t in model.buffers())
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
