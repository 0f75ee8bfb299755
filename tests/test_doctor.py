"""The memory plan: hand-computed sizes for the target models, agreement with what
the loader and the engine really allocate, verdicts, and the `lowvram doctor` command."""

import json
import weakref

import pytest
import torch

from lowvram.config import load_profile
from lowvram.errors import OutOfMemoryError
from lowvram.memory import plan as mp
from lowvram.memory import workspace as mw
from lowvram.memory.doctor import plan_memory
from lowvram.memory.environment import Environment, GpuInfo, find_problems
from lowvram.memory.render import weight_rows
from lowvram.models.config import load_model_config, model_config_from_dict

GIB = 2**30

R1_DISTILL_QWEN_1_5B = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 1536,
    "intermediate_size": 8960,
    "num_hidden_layers": 28,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "tie_word_embeddings": False,
    "max_position_embeddings": 131072,
    "rope_theta": 10000,
    "rms_norm_eps": 1e-6,
    "torch_dtype": "bfloat16",
    "bos_token_id": 151646,
    "eos_token_id": 151643,
}
R1_DISTILL_QWEN_1_5B_AWQ = {
    **R1_DISTILL_QWEN_1_5B,
    "quantization_config": {
        "quant_method": "awq",
        "bits": 4,
        "group_size": 128,
        "zero_point": True,
        "version": "gemm",
        "modules_to_not_convert": None,
    },
}
DEEPSEEK_CODER_1_3B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 2048,
    "intermediate_size": 5504,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "vocab_size": 32256,
    "tie_word_embeddings": False,
    "max_position_embeddings": 16384,
    "rope_theta": 100000,
    "rope_scaling": {"type": "linear", "factor": 4.0},
    "rms_norm_eps": 1e-6,
    "torch_dtype": "bfloat16",
}
# The whole-card check uses overheads that are calibrated on GPUs; tests that pin
# engine-side numbers give the card room so only the engine budget binds.
HUGE_CARD = (1 << 50, "test card")


def _config(raw):
    return model_config_from_dict(raw)


# ---------------------------------------------------------------- weights


def test_fp16_weights_of_r1_distill_1_5b_by_hand():
    weights = mp.weight_bytes_by_kind(_config(R1_DISTILL_QWEN_1_5B), element_bytes=2)
    # per layer: q 1536x1536 + k, v 1536x256 + o 1536x1536 = 5,505,024; q/k/v bias 2,048;
    # MLP 3 x 1536x8960 = 41,287,680  ->  46,794,752 linear params; x 28 layers x 2 bytes
    assert weights.fp16_linear_bytes == 28 * 46_794_752 * 2 == 2_620_506_112
    assert weights.embedding_bytes == weights.head_bytes == 151936 * 1536 * 2 == 466_747_392
    assert weights.norm_bytes == (2 * 28 + 1) * 1536 * 2 == 175_104
    assert weights.total_bytes == 3_554_176_000  # 1,777,088,000 parameters
    assert weights.int4_bytes == weights.compensation_bytes == 0


def test_awq_g128_weights_of_r1_distill_1_5b_by_hand():
    weights = mp.weight_bytes_by_kind(_config(R1_DISTILL_QWEN_1_5B_AWQ), element_bytes=2)
    # K -> N: qweight K*N/2, qzeros (K/128)*(N/8)*4, scales (K/128)*N*2, bias N*2
    q = 1_179_648 + 9_216 + 36_864 + 3_072  # 1536 -> 1536, with bias
    kv = 196_608 + 1_536 + 6_144 + 512  # 1536 -> 256, with bias
    o = 1_179_648 + 9_216 + 36_864  # 1536 -> 1536
    gate = 6_881_280 + 53_760 + 215_040  # 1536 -> 8960 (up the same)
    down = 6_881_280 + 53_760 + 215_040  # 8960 -> 1536: 70 groups x 192 packed columns
    per_layer = q + 2 * kv + o + 2 * gate + down
    assert per_layer == 24_314_368
    assert weights.int4_bytes == 28 * per_layer == 680_802_304
    assert weights.num_int4_layers == 196 and weights.num_fp16_layers == 0
    assert weights.total_bytes == 680_802_304 + 2 * 466_747_392 + 175_104 == 1_614_472_192
    # gate and up run as one fused 1536 x 17920 INT4 linear: the largest dequantized weight
    assert weights.max_int4_layer_elements == 1536 * 2 * 8960


def _write_compensation(model_dir, layers):
    """A compensation side file as `lowvram quantize` writes it: {layer: (rank, K, N, has_bias_correction)}."""
    from safetensors.torch import save_file

    from lowvram.models.checkpoint import COMPENSATION_FILE
    from lowvram.quant.awq_linear import BIAS_CORRECTION, LORA_A, LORA_B

    tensors = {}
    for name, (rank, k, n, has_correction) in layers.items():
        tensors[f"{name}.{LORA_A}"] = torch.zeros(rank, k, dtype=torch.float16)
        tensors[f"{name}.{LORA_B}"] = torch.zeros(n, rank, dtype=torch.float16)
        if has_correction:
            tensors[f"{name}.{BIAS_CORRECTION}"] = torch.zeros(n, dtype=torch.float16)
    save_file(tensors, str(model_dir / COMPENSATION_FILE), metadata={"format": "pt"})


def test_fp16_kept_layers_and_compensation_terms(tmp_path):
    raw = json.loads(json.dumps(R1_DISTILL_QWEN_1_5B_AWQ))
    raw["quantization_config"]["modules_to_not_convert"] = ["down_proj"]
    _write_compensation(
        tmp_path,
        {
            "model.layers.0.self_attn.q_proj": (32, 1536, 1536, True),
            "model.layers.5.mlp.gate_proj": (8, 1536, 8960, False),
        },
    )
    weights = mp.weight_bytes_by_kind(_config(raw), element_bytes=2, model_dir=tmp_path)
    assert weights.num_fp16_layers == 28 and weights.num_int4_layers == 168
    assert weights.fp16_linear_bytes == 28 * 8960 * 1536 * 2
    assert weights.int4_bytes == 28 * (24_314_368 - 7_150_080)
    # low-rank A [r, K] + B [N, r], in the compute dtype; q_proj's bias correction is added
    # into its bias at load and takes no bytes of its own
    assert weights.compensation_bytes == 32 * (1536 + 1536) * 2 + 8 * (1536 + 8960) * 2
    assert mp.weight_bytes_by_kind(_config(raw), element_bytes=2).compensation_bytes == 0


def test_fp16_weights_of_deepseek_coder_1_3b_by_hand():
    weights = mp.weight_bytes_by_kind(_config(DEEPSEEK_CODER_1_3B), element_bytes=2)
    # per layer 4 x 2048^2 + 3 x 2048x5504 = 50,593,792 linear params, no bias
    assert weights.fp16_linear_bytes == 24 * 50_593_792 * 2
    assert weights.total_bytes == 2_692_943_872  # 1,346,471,936 parameters


def _write_awq_copy(src, dst, keep_fp16=()):
    """`src` with its decoder Linears as AutoAWQ GEMM tensors (round-to-nearest INT4, group 32)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from lowvram.kernels.awq_format import quantize_rtn

    shutil.copytree(src, dst)
    tensors = {}
    for name, tensor in load_file(str(src / "model.safetensors")).items():
        stem = name[: -len(".weight")]
        is_linear = name.endswith("_proj.weight") and ".layers." in name
        if not is_linear or any(fragment in stem for fragment in keep_fp16):
            tensors[name] = tensor.to(torch.float16)
            continue
        packed = quantize_rtn(tensor.float(), 32)
        tensors.update(
            {f"{stem}.qweight": packed.qweight, f"{stem}.qzeros": packed.qzeros, f"{stem}.scales": packed.scales}
        )
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "awq",
        "bits": 4,
        "group_size": 32,
        "zero_point": True,
        "version": "gemm",
        "modules_to_not_convert": list(keep_fp16),
    }
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_from_config_weights_equal_what_the_loader_loads(
    tiny_llama_dir, tiny_qwen2_dir, tiny_qwen2_sharded_dir, tmp_path
):
    from lowvram.models.loader import load_model
    from lowvram.testing import make_tiny_model

    tied_dir = make_tiny_model(tmp_path / "tied", "qwen2", tie_word_embeddings=True)
    awq_dir = _write_awq_copy(tiny_qwen2_dir, tmp_path / "awq", keep_fp16=("layers.1.mlp.down_proj",))
    # tiny qwen2: hidden 64, intermediate 160, kv heads 2 x head_dim 16
    _write_compensation(
        awq_dir,
        {"model.layers.0.mlp.up_proj": (4, 64, 160, True), "model.layers.1.self_attn.k_proj": (2, 64, 32, False)},
    )
    for model_dir in (tiny_llama_dir, tiny_qwen2_dir, tiny_qwen2_sharded_dir, tied_dir, awq_dir):
        config, raw = load_model_config(model_dir)
        for dtype in (torch.float32, torch.bfloat16):
            model, _ = load_model(model_dir, torch.device("cpu"), dtype)
            element_bytes = torch.finfo(dtype).bits // 8
            planned = mp.weight_bytes_by_kind(config, element_bytes, model_dir=model_dir)
            assert planned.total_bytes == model.weight_bytes, (model_dir, dtype)
    report = load_model(awq_dir, torch.device("cpu"), torch.float32)[0].weight_report
    planned = mp.weight_bytes_by_kind(load_model_config(awq_dir)[0], 4, model_dir=awq_dir)
    assert (planned.int4_bytes, planned.compensation_bytes) == (report.int4_layer_bytes, report.compensation_bytes)
    assert planned.num_int4_layers == report.num_int4_layers == 13 and planned.num_fp16_layers == 1


# ---------------------------------------------------------------- KV and workspace


def test_kv_bytes_per_token_by_hand():
    qwen, coder = _config(R1_DISTILL_QWEN_1_5B), _config(DEEPSEEK_CODER_1_3B)
    # 2 (K and V) x layers x kv heads x (head_dim x bytes | head_dim + 4 | head_dim/2 + 4)
    assert mp.kv_bytes_per_token(qwen, "fp16") == 2 * 28 * 2 * 128 * 2 == 28_672
    assert mp.kv_bytes_per_token(qwen, "int8") == 2 * 28 * 2 * 132 == 14_784
    assert mp.kv_bytes_per_token(qwen, "int4") == 2 * 28 * 2 * 68 == 7_616
    assert mp.kv_bytes_per_token(qwen, "fp16", element_bytes=4) == 57_344
    assert mp.kv_bytes_per_token(coder, "fp16") == 196_608  # 192 KiB: MHA
    assert mp.kv_bytes_per_token(coder, "int8") == 101_376
    assert mp.kv_bytes_per_token(coder, "int4") == 52_224


def test_workspace_on_the_kernel_path_by_hand():
    ws = mw.step_workspace(
        _config(R1_DISTILL_QWEN_1_5B),
        num_tokens=2048,
        num_seqs=8,
        context_len=16384,
        element_bytes=2,
        uses_kernels=True,
    )
    # MLP: layer input + running sum + normed input [2048, 1536] fp16, and
    # silu(gate), up, their product [2048, 8960] fp16 alive at once
    assert ws.phases["mlp"] == 3 * 2048 * 1536 * 2 + 3 * 2048 * 8960 * 2 == 128_974_848
    # RoPE on q: two [T, hidden] residuals, q/k/v, float32 cos/sin [T, 64], 12 bytes per q element
    assert ws.phases["rotary"] == 12_582_912 + 8_388_608 + 1_048_576 + 37_748_736
    assert ws.rope_bytes == 2 * 16384 * 64 * 4
    assert ws.metadata_bytes == 3 * 2048 * 8 + 8 * 1024 * 4
    assert ws.peak_phase == "mlp"
    assert ws.peak_bytes == 128_974_848 + 8_388_608 + 81_920

    coder = mw.step_workspace(
        _config(DEEPSEEK_CODER_1_3B), num_tokens=2048, num_seqs=8, context_len=16384, element_bytes=2, uses_kernels=True
    )
    # MHA: RoPE of k (while q's fp16 result is kept) is the peak, not the MLP
    assert coder.phases["mlp"] == 92_798_976
    assert coder.phases["rotary"] == 16_777_216 + 25_165_824 + 1_048_576 + 8_388_608 + 50_331_648
    assert coder.peak_phase == "rotary"


def test_workspace_on_the_plain_torch_path_counts_float32_scores():
    ws = mw.step_workspace(
        _config(R1_DISTILL_QWEN_1_5B),
        num_tokens=2048,
        num_seqs=1,
        context_len=16384,
        element_bytes=2,
        uses_kernels=False,
    )
    residual_qkv = 12_582_912 + 8_388_608
    out_and_q = 2048 * 1536 * 4 * 2
    gathered = 2 * 16384 * 256 * 4 + 2 * 16384 * 1536 * 4
    scores = 2 * 12 * 2048 * 16384 * 4 + 2048 * 16384
    assert ws.phases["attention"] == residual_qkv + out_and_q + gathered + scores
    assert ws.peak_phase == "attention" and ws.peak_bytes > 3 * GIB


def test_awq_prefill_counts_the_dequantized_weight():
    weights = mp.weight_bytes_by_kind(_config(R1_DISTILL_QWEN_1_5B_AWQ), 2)
    threshold = mw.AWQ_DEQUANT_MATMUL_MIN_TOKENS
    assert (
        mw.int4_scratch_bytes(weights.max_int4_layer_elements, threshold, uses_kernels=True) == 2 * 1536 * 17920
    )  # fused gate_up
    assert mw.int4_scratch_bytes(weights.max_int4_layer_elements, threshold - 1, uses_kernels=True) == 0
    assert mw.int4_scratch_bytes(weights.max_int4_layer_elements, 16, uses_kernels=False) == 20 * 1536 * 17920


class _LiveBytes(torch.utils._python_dispatch.TorchDispatchMode):
    """Peak bytes of tensor storages created while active and still referenced."""

    def __init__(self):
        super().__init__()
        self.storages = {}  # data_ptr -> [nbytes, {id(weakref): weakref}]
        self.live = self.peak = 0

    def _release(self, ptr, ref):
        entry = self.storages.get(ptr)
        if entry is not None:
            entry[1].pop(id(ref), None)
            if not entry[1]:
                self.live -= entry[0]
                del self.storages[ptr]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in torch.utils._pytree.tree_flatten(out)[0]:
            if not isinstance(tensor, torch.Tensor):
                continue
            ptr = tensor.untyped_storage().data_ptr()
            entry = self.storages.get(ptr)
            if entry is None:
                # views and in-place results alias storage born before (weights, KV pages)
                if ptr == 0 or any(r.alias_info is not None for r in func._schema.returns):
                    continue
                entry = self.storages[ptr] = [tensor.untyped_storage().nbytes(), {}]
                self.live += entry[0]
                self.peak = max(self.peak, self.live)
            ref = weakref.ref(tensor, lambda r, p=ptr: self._release(p, r))
            entry[1][id(ref)] = ref
        return out


def test_workspace_matches_the_live_tensor_peak_of_a_real_run(tmp_path):
    """Every tensor a CPU run allocates is tracked; the predicted workspace must match
    the peak within 10% (it counts what the code allocates, not a rule of thumb)."""
    from lowvram.core.sampling_params import SamplingParams
    from lowvram.engine.engine import LLMEngine
    from lowvram.testing import make_tiny_model

    model_dir = make_tiny_model(
        tmp_path / "m", "qwen2", hidden_size=128, intermediate_size=352, num_attention_heads=4, head_dim=32
    )
    profile = load_profile("cpu").replace(max_num_batched_tokens=128, max_model_len=512, max_num_seqs=2)
    engine = LLMEngine(str(model_dir), profile)
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=3, ignore_eos=True, seed=0)
    for i in range(2):
        engine.add_request(str(i), None, params, prompt_token_ids=[10 + (i + t) % 400 for t in range(500)])
    tracker = _LiveBytes()
    with tracker:
        while engine.has_unfinished_requests():
            engine.step()
    predicted = engine.kv_plan.workspace.peak_bytes
    print(
        f"workspace: predicted {predicted} B, measured live peak {tracker.peak} B, ratio {predicted / tracker.peak:.3f}"
    )
    assert 0.9 <= predicted / tracker.peak <= 1.1


# ---------------------------------------------------------------- plans and verdicts


# The hand-computed plans keep the embedding table on the device; test_embeddings_on_host_by_hand
# takes it off.
# The hand computations below count the decode graphs; the 4gb profile's prefill graphs have
# their own test (test_prefill_graphs_hold_a_512_token_step_by_hand).
PROFILE_4GB = load_profile("4gb").replace(enable_prefill_graphs=False)
ON_DEVICE_4GB = PROFILE_4GB.replace(embeddings_on_host=False)


def test_r1_distill_fp16_on_the_4gb_profile_does_not_fit_by_hand():
    plan = plan_memory(_config(R1_DISTILL_QWEN_1_5B), ON_DEVICE_4GB, device="cuda", capacity=HUGE_CARD)
    assert plan.context_len == 16384 and plan.num_seqs == 1 and plan.kv_precision == "fp16"
    assert plan.kv_bytes == 1024 * 16 * 28_672 == 469_762_048
    # MLP peak of a 2048-token step + RoPE tables for 16384 positions + metadata for one sequence
    # + the decode graphs: inputs, the float32 logits of one sequence, the capture stream's cuBLAS workspace
    # + the cuBLAS workspace of the engine's own stream
    graphs = (28 + 1024 * 4) + 151_936 * 4 + mw.CUBLAS_WORKSPACE_BYTES
    assert graphs == 35_214_876 == plan.workspace.graph_bytes
    assert plan.workspace.cublas_bytes == mw.CUBLAS_WORKSPACE_BYTES == 34_603_008
    assert plan.workspace.peak_bytes == 128_974_848 + 8_388_608 + (3 * 2048 * 8 + 1024 * 4) + graphs + 34_603_008
    assert plan.engine_need_bytes == 3_554_176_000 + 207_234_588 + 469_762_048 == 4_231_172_636
    assert plan.budget_bytes == int(4 * 0.9 * GIB) == 3_865_470_566
    assert not plan.fits and plan.engine_margin_bytes == -365_702_070
    # (3,865,470,566 - 3,554,176,000 - 200,936,860 workspace at 3840 tokens) // 28,672 = 3848 -> 3840 in pages
    assert plan.max_context["fp16"] == 3840
    # int8: (311,294,566 - 203,035,748 workspace at 7312 tokens, RoPE tables for 8192) // 14,784 = 7322 -> 7312
    assert plan.max_context["int8"] == 7312


def test_r1_distill_awq_on_the_4gb_profile_fits_by_hand():
    plan = plan_memory(_config(R1_DISTILL_QWEN_1_5B_AWQ), ON_DEVICE_4GB, device="cuda", capacity=HUGE_CARD)
    # a 2048-token AWQ step dequantizes the fused 1536 x 17920 gate_up weight (55,050,240 B) beside
    # gate_up's [T, 17920] output: residual 12,582,912 + normed 6,291,456 + 73,400,320 + 55,050,240
    assert plan.workspace.phases["mlp"] == 147_324_928
    assert plan.workspace.peak_bytes == 147_324_928 + 8_388_608 + 53_248 + 35_214_876 + 34_603_008 == 225_584_668
    assert plan.engine_need_bytes == 1_614_472_192 + 225_584_668 + 469_762_048
    assert plan.fits and plan.engine_margin_bytes == 3_865_470_566 - 2_309_818_908


def test_prefill_graphs_hold_a_512_token_step_by_hand():
    config = _config(R1_DISTILL_QWEN_1_5B)
    off = mw.profile_workspace(config, PROFILE_4GB, 16384, 2, "cuda")
    on = mw.profile_workspace(config, PROFILE_4GB.replace(enable_prefill_graphs=True), 16384, 2, "cuda")
    # The MLP phase of a 512-token step: input and running sum, the normed input, three [512, 8960]
    assert on.graph_bytes - off.graph_bytes == 2 * 512 * 1536 * 2 + 512 * 1536 * 2 + 3 * 512 * 8960 * 2 == 32_243_712
    assert (
        mw.profile_workspace(
            config, PROFILE_4GB.replace(enable_prefill_graphs=True, enable_cuda_graphs=False), 16384, 2, "cuda"
        ).graph_bytes
        == 0
    )


def test_embeddings_on_host_by_hand():
    # The 4gb profile keeps the untied embedding table (151,936 x 1536 FP16) in host memory: FP16
    # weights at a 16K context now fit, by what the table took.
    table = 151_936 * 1536 * 2
    on_host = plan_memory(_config(R1_DISTILL_QWEN_1_5B), PROFILE_4GB, device="cuda", capacity=HUGE_CARD)
    on_device = plan_memory(_config(R1_DISTILL_QWEN_1_5B), ON_DEVICE_4GB, device="cuda", capacity=HUGE_CARD)
    assert on_host.weights.total_bytes == on_device.weights.total_bytes - table == 3_554_176_000 - 466_747_392
    assert ("embeddings held in host memory (embeddings_on_host)", -table) in weight_rows(on_host.weights)
    assert on_host.fits and on_host.engine_margin_bytes == -365_702_070 + table == 101_045_322
    # A tied head reads the table on the device; the CPU has no device to save.
    tied = dict(R1_DISTILL_QWEN_1_5B, tie_word_embeddings=True)
    assert not plan_memory(_config(tied), PROFILE_4GB, device="cuda").weights.is_embedding_on_host
    assert not plan_memory(_config(R1_DISTILL_QWEN_1_5B), PROFILE_4GB, device="cpu").weights.is_embedding_on_host


def test_deepseek_coder_plan_by_hand():
    plan = plan_memory(
        _config(DEEPSEEK_CODER_1_3B),
        ON_DEVICE_4GB,
        device="cuda",
        context_len=4096,
        num_seqs=2,
        capacity=HUGE_CARD,
    )
    assert plan.kv_bytes == 2 * 4096 * 196_608
    # RoPE of k is the peak for MHA; tables for 4096 positions; metadata for 2 x 256 pages
    # + the decode graphs: inputs, float32 logits of 2 sequences (vocab 32,256), the cuBLAS workspace
    # + the cuBLAS workspace of the engine's stream
    graphs = 2 * 28 + 2 * 256 * 4 + 2 * 32_256 * 4 + mw.CUBLAS_WORKSPACE_BYTES
    assert plan.workspace.peak_bytes == (
        101_711_872 + 2 * 4096 * 64 * 4 + 3 * 2048 * 8 + 2 * 256 * 4 + graphs + mw.CUBLAS_WORKSPACE_BYTES
    )
    assert plan.engine_need_bytes == 2_692_943_872 + 173_326_392 + 1_610_612_736
    assert not plan.fits
    longest = plan_memory(_config(DEEPSEEK_CODER_1_3B), ON_DEVICE_4GB, device="cuda", capacity=HUGE_CARD).max_context
    # fp16: (3,865,470,566 - 2,692,943,872 - 175,292,932 workspace at 5072 tokens) // 196,608 = 5072
    assert longest["fp16"] == 5072
    # int4: 16384 x 52,224 B of KV fits beside the weights: the model's whole window
    assert longest["int4"] == 16384


def test_largest_context_is_the_edge_of_fitting():
    profile = PROFILE_4GB
    plan = plan_memory(_config(R1_DISTILL_QWEN_1_5B), profile, device="cuda")
    for precision, longest in plan.max_context.items():
        assert longest > 0
        at = plan_memory(
            _config(R1_DISTILL_QWEN_1_5B),
            profile.replace(kv_precision=precision),
            device="cuda",
            context_len=longest,
        )
        past = plan_memory(
            _config(R1_DISTILL_QWEN_1_5B),
            profile.replace(kv_precision=precision),
            device="cuda",
            context_len=longest + 16,
        )
        assert at.fits and not past.fits, precision
    assert plan.max_context["fp16"] < plan.max_context["int8"] < plan.max_context["int4"]


def test_device_total_adds_context_and_fragmentation():
    plan = plan_memory(_config(R1_DISTILL_QWEN_1_5B_AWQ), PROFILE_4GB, device="cuda")
    fragmentation = int(mp.FRAGMENTATION_RESERVE_FRACTION * (plan.kv_bytes + plan.workspace.peak_bytes))
    # The cuBLAS workspace is in the engine's own total (its workspace), which sizes the KV pool.
    assert plan.workspace.cublas_bytes == mw.CUBLAS_WORKSPACE_BYTES
    assert plan.device_need_bytes == plan.engine_need_bytes + fragmentation + mp.CUDA_CONTEXT_BYTES
    assert plan.device_capacity_bytes == 4 * GIB
    emulated = plan_memory(
        _config(R1_DISTILL_QWEN_1_5B_AWQ),
        PROFILE_4GB.replace(emulate_vram_gib=3.0),
        device="cuda",
    )
    # torch's allocator cap leaves the CUDA context out
    assert emulated.device_need_bytes == emulated.peak_allocated_bytes + emulated.fragmentation_bytes
    assert emulated.device_capacity_bytes == 3 * GIB


def test_recommendations_are_ranked_and_their_verdicts_hold():
    profile = ON_DEVICE_4GB
    config = _config(R1_DISTILL_QWEN_1_5B)
    plan = plan_memory(config, profile, device="cuda")
    assert not plan.fits
    freed = [r.freed_bytes for r in plan.recommendations]
    assert freed == sorted(freed, reverse=True) and freed[-1] > 0
    fields = {r.field: r for r in plan.recommendations}
    assert {"kv_precision", "max_model_len", "weight_format"} <= set(fields)
    assert fields["weight_format"].value == "awq" and fields["weight_format"].is_sufficient
    for rec in plan.recommendations:
        if rec.field == "weight_format":
            continue  # needs another checkpoint, checked above
        changed = profile.replace(**{rec.field: rec.value})
        context = rec.value if rec.field == "max_model_len" else None
        again = plan_memory(config, changed, device="cuda", context_len=context)
        assert again.fits == rec.is_sufficient, rec.setting


def test_plan_kv_and_the_doctor_agree_with_the_engine(tiny_qwen2_dir):
    from lowvram.engine.engine import LLMEngine

    engine = LLMEngine(str(tiny_qwen2_dir), "cpu")
    config, raw = load_model_config(tiny_qwen2_dir)
    plan = plan_memory(
        config,
        engine.profile,
        context_len=engine.max_model_len,
        num_seqs=engine.profile.max_num_seqs,
        device="cpu",
        capacity=HUGE_CARD,
    )
    assert plan.weights.total_bytes == engine.model.weight_bytes
    assert plan.workspace.peak_bytes == engine.kv_plan.activation_bytes
    assert plan.kv_bytes == engine.kv_plan.kv_bytes
    assert plan.budget_bytes == engine.kv_plan.budget_bytes


def test_plan_kv_error_names_the_numbers_and_the_doctor():
    from lowvram.memory.oom import parse_oom_message

    config = _config(R1_DISTILL_QWEN_1_5B)
    with pytest.raises(OutOfMemoryError) as info:
        mp.plan_kv(config, PROFILE_4GB, 3_554_176_000, 2, 16384, device_type="cuda")
    message = str(info.value)
    assert "lowvram doctor --profile 4gb --context 16384" in message
    assert "--max-model-len 3696" in message
    facts = parse_oom_message(f"lowvram: error: {message}")
    assert facts.source == "lowvram-plan" and facts.plan["context_len"] == 16384


def test_memory_the_process_already_holds_comes_out_of_the_pool():
    # A second engine in one process (or a caller's own tensors) must not plan the whole budget again.
    config, profile = _config(R1_DISTILL_QWEN_1_5B), PROFILE_4GB.replace(max_model_len=4096)
    alone = mp.plan_kv(config, profile, 3_000_000_000, 2, 4096, device_type="cuda")
    assert alone.num_blocks < 8 * 4096 // 16  # the budget binds, not max_num_seqs
    held = 64 * 2**20
    shared = mp.plan_kv(config, profile, 3_000_000_000, 2, 4096, device_type="cuda", held_bytes=held)
    assert shared.budget_bytes == alone.budget_bytes - held
    block_bytes = 16 * 28_672
    assert alone.num_blocks - shared.num_blocks in (held // block_bytes, held // block_bytes + 1)
    with pytest.raises(OutOfMemoryError, match=r"after 3\.00 GiB this process already held"):
        mp.plan_kv(config, profile, 3_000_000_000, 2, 4096, device_type="cuda", held_bytes=3 * GIB)


def test_a_unified_memory_pool_may_hold_a_sequence_longer_than_its_device_share():
    config, profile = _config(R1_DISTILL_QWEN_1_5B), PROFILE_4GB
    with pytest.raises(OutOfMemoryError):
        mp.plan_kv(config, profile, 3_554_176_000, 2, 16384, device_type="cuda")
    # 8 GiB of host spill at 28,672 B per token: 299,593 tokens, 18,724 pages of 16
    host_blocks = mp.host_kv_blocks(config, profile, 2, "cuda")
    assert host_blocks == 8 * GIB // (28_672 * 16) == 18_724
    plan = mp.plan_kv(config, profile, 3_554_176_000, 2, 16384, device_type="cuda", host_blocks=host_blocks)
    assert 0 < plan.num_blocks < 16384 // 16  # the device share; the rest of the sequence waits on the host
    # longer than the device share and the host spill together: the error names the spill
    with pytest.raises(OutOfMemoryError, match=r"host_spill_gib 0\.1\) holds only \d+ tokens beyond it"):
        mp.plan_kv(
            config,
            profile.replace(host_spill_gib=0.1),
            3_554_176_000,
            2,
            16384,
            device_type="cuda",
            host_blocks=mp.host_kv_blocks(config, profile.replace(host_spill_gib=0.1), 2, "cuda"),
        )
    # pinned and device pools read only device pages, and the CPU has no spill
    assert mp.host_kv_blocks(config, profile.replace(kv_backend="pinned"), 2, "cuda") == 0
    assert mp.host_kv_blocks(config, profile.replace(kv_backend="device"), 2, "cuda") == 0
    assert mp.host_kv_blocks(config, profile, 4, "cpu") == 0
    # The doctor's verdict stays device-only, and says the engine runs it with unified memory.
    plan = plan_memory(config, ON_DEVICE_4GB, device="cuda", capacity=HUGE_CARD)
    assert not plan.fits
    assert any("the engine still runs a 16384-token context" in note for note in plan.notes)
    short = plan_memory(config, ON_DEVICE_4GB, device="cuda", capacity=HUGE_CARD, context_len=1024)
    assert short.fits and not any("the engine still runs" in note for note in short.notes)


# ---------------------------------------------------------------- environment problems


def _env(**changes):
    env = Environment(
        platform="Linux 6.1 x86_64",
        python_version="3.11",
        torch_version="2.11.0",
        torch_cuda_version="12.6",
        cuda_available=True,
        driver_version="560.35",
        driver_cuda_version="12.6",
        num_nvml_gpus=1,
        triton_version="3.6.0",
        triton_status="runs",
        has_cuda_bindings=True,
        host_total_bytes=32 * GIB,
        host_available_bytes=24 * GIB,
        gpus=[GpuInfo(0, "NVIDIA GeForce GTX 1650", (7, 5), 4 * GIB, int(3.8 * GIB), 14, True, True, "cuda-bindings")],
    )
    for key, value in changes.items():
        setattr(env, key, value)
    return env


def test_a_healthy_machine_has_no_problems():
    assert find_problems(_env(), PROFILE_4GB, "cuda") == []


def test_problems_come_with_concrete_fixes():
    profile = PROFILE_4GB
    cpu_build = _env(cuda_available=False, torch_cuda_version=None, gpus=[])
    problem = find_problems(cpu_build, profile, "cuda")[0]
    assert problem.severity == "error" and "download.pytorch.org/whl/cu" in problem.fix

    wsl = _env(is_wsl=True)
    wsl.gpus[0].concurrent_managed_access = False
    assert any(p.fix.startswith("kv_backend: pinned") for p in find_problems(wsl, profile, "cuda"))

    small_card = _env()
    small_card.gpus[0].total_bytes = 2 * GIB
    problem = find_problems(small_card, profile, "cuda")[0]
    assert problem.severity == "error" and "--profile 2gb" in problem.fix

    busy = _env()
    busy.gpus[0].free_bytes = 1 * GIB
    assert any("memory_budget_gib: 0.9" in p.fix for p in find_problems(busy, profile, "cuda"))

    old_driver = _env(driver_cuda_version="11.8")
    assert "update the NVIDIA driver" in find_problems(old_driver, profile, "cuda")[0].fix

    no_triton = _env(triton_status="missing", triton_version=None)
    assert any(p.fix == "pip install triton" for p in find_problems(no_triton, profile, "cuda"))

    low_ram = _env(host_available_bytes=2 * GIB)
    assert any(p.fix == "host_spill_gib: 1.0" for p in find_problems(low_ram, profile, "cuda"))


# ---------------------------------------------------------------- the command


def _run(argv):
    from lowvram import cli

    return cli.main(["doctor", *argv])


def test_cli_prints_environment_and_plan_and_exits_0_when_it_fits(tiny_llama_dir, capsys):
    code = _run(["--model", str(tiny_llama_dir), "--profile", "cpu", "--quick"])
    out = capsys.readouterr().out
    assert code == 0
    assert "environment" in out and "memory plan" in out and "verdict: fits" in out
    assert "KV per token" in out and "largest context that fits" in out


def test_cli_exits_1_with_recommendations_when_it_does_not_fit(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(R1_DISTILL_QWEN_1_5B))
    code = _run(
        ["--model", str(tmp_path / "config.json"), "--profile", "4gb", "--device", "cuda", "--quick", "--batch", "2"]
    )
    out = capsys.readouterr().out
    assert code == 1
    assert "verdict: does not fit" in out and "weight_format: awq" in out and "max_model_len:" in out


def test_cli_json_is_one_object_with_the_plan(tiny_qwen2_dir, capsys):
    code = _run(
        ["--model", str(tiny_qwen2_dir), "--profile", "cpu", "--json", "--quick", "--context", "512", "--batch", "2"]
    )
    data = json.loads(capsys.readouterr().out)
    assert code == 0 and data["plan"]["fits"] is True
    assert data["plan"]["context_len"] == 512 and data["plan"]["num_seqs"] == 2
    assert data["plan"]["weights"]["total_bytes"] > 0 and "problems" in data and "environment" in data


def test_cli_missing_model_is_a_clean_error(tmp_path, capsys):
    code = _run(["--model", str(tmp_path / "nope"), "--quick"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("lowvram: error: ") and "does not exist" in err


@pytest.mark.gpu
def test_predicted_peak_matches_a_real_gpu_run(tmp_path):
    """A short version of scripts/bench_doctor_accuracy.py: the 1.5B shape with 4 layers,
    a 1024-token context, FP16; the predicted peak allocation must be within 10%."""
    from script_modules import load_script

    bench = load_script("bench_doctor_accuracy")
    model_dir = bench.write_checkpoint(tmp_path, num_layers=4)
    row = bench.run_row(model_dir, load_profile("8gb"), 1024, 2, "fp16", 4, context_bytes=0)
    print(
        f"predicted {row['predicted_peak_allocated_bytes']} B, measured {row['measured_peak_allocated_bytes']} B "
        f"({row['error']:+.1%}); beyond weights {row['predicted_beyond_weights_bytes']} vs "
        f"{row['measured_beyond_weights_bytes']} B"
    )
    # The engine plans from what loading really allocated (a few MiB more than the tensors here).
    assert 0 <= row["measured_weight_bytes"] - row["predicted_weight_bytes"] <= 0.005 * row["predicted_weight_bytes"]
    assert abs(row["error"]) <= 0.10
