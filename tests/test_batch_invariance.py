"""Batch invariance of the matmul kernels: a row's result has the same bits however many
rows come with it, so a request batched with others decodes as it does alone.

Without CUDA the kernels run under the Triton interpreter on small shapes (with a small SM
count, so the split-K reduction is exercised); the `gpu` tests use the real 1.5B shapes.
"""

import pytest
import torch

from lowvram.kernels import w4a16
from lowvram.kernels.linear_invariant import invariant_linear, invariant_linear_ref
from lowvram.kernels.w4a16 import awq_linear, awq_linear_ref
from tests.test_w4a16 import DEVICE, needs_triton, random_awq, random_lora, random_x, relative_error

# Row counts of decode steps (1..16) and prefill chunks (past one 16-row tile and past one launch)
ROW_COUNTS = [1, 2, 7, 16, 17, 70]


def assert_rows_invariant(compute, x):
    """compute(x[:M]) for each M gives the first M rows of compute(x), bit for bit, and a row
    alone gives that row."""
    full = compute(x)
    for num_rows in ROW_COUNTS:
        if num_rows <= x.shape[0]:
            assert torch.equal(compute(x[:num_rows]), full[:num_rows]), f"rows differ at M = {num_rows}"
    last = x.shape[0] - 1
    assert torch.equal(compute(x[last : last + 1]), full[last : last + 1])
    return full


@needs_triton
@pytest.mark.parametrize("has_lora", [False, True], ids=["plain", "compensated"])
def test_awq_rows_do_not_depend_on_the_batch(has_lora):
    num_inputs, num_outputs, group_size = 256, 136, 64  # a column tail; K splits under 4 "SMs"
    qweight, qzeros, scales, bias = random_awq(num_inputs, num_outputs, group_size, seed=1)
    lora_a, lora_bt = random_lora(8, num_inputs, num_outputs, seed=2) if has_lora else (None, None)
    dtype = torch.float16 if DEVICE == "cuda" else torch.float32
    x = random_x(70, num_inputs, seed=3, dtype=dtype)

    def compute(rows):
        return awq_linear(
            rows, qweight, qzeros, scales, group_size, bias, lora_a=lora_a, lora_bt=lora_bt, batch_invariant=True
        )

    full = assert_rows_invariant(compute, x)
    error = relative_error(
        full, awq_linear_ref(x, qweight, qzeros, scales, group_size, bias, lora_a=lora_a, lora_bt=lora_bt)
    )
    print(f"largest relative difference against the reference: {error:.2e}")
    assert error < 2e-3


def test_awq_plain_torch_rows_do_not_depend_on_the_batch():
    qweight, qzeros, scales, bias = random_awq(256, 128, 64, seed=4, device="cpu")
    x = random_x(70, 256, seed=5, dtype=torch.float32, device="cpu")
    assert_rows_invariant(
        lambda rows: awq_linear(rows, qweight, qzeros, scales, 64, bias, use_reference=True, batch_invariant=True), x
    )


@needs_triton
@pytest.mark.parametrize("has_bias", [False, True], ids=["no-bias", "bias"])
def test_dense_rows_do_not_depend_on_the_batch(has_bias):
    num_inputs, num_outputs = 200, 150  # tails in K and N
    gen = torch.Generator().manual_seed(6)
    dtype = torch.float16 if DEVICE == "cuda" else torch.float32
    weight = (torch.randn(num_outputs, num_inputs, generator=gen) * 0.05).to(dtype).to(DEVICE)
    bias = torch.randn(num_outputs, generator=gen).to(dtype).to(DEVICE) if has_bias else None
    x = random_x(70, num_inputs, seed=7, dtype=dtype)
    full = assert_rows_invariant(lambda rows: invariant_linear(rows, weight, bias), x)
    error = relative_error(full, invariant_linear_ref(x, weight, bias))
    print(f"largest relative difference against the reference: {error:.2e}")
    assert error < 2e-3


def test_dense_plain_torch_rows_do_not_depend_on_the_batch():
    gen = torch.Generator().manual_seed(8)
    weight = torch.randn(96, 64, generator=gen)
    x = torch.randn(70, 64, generator=gen)
    full = assert_rows_invariant(lambda rows: invariant_linear(rows, weight, use_reference=True), x)
    assert torch.allclose(full, invariant_linear_ref(x, weight), atol=1e-5)


@needs_triton
def test_dense_kernel_splits_k_on_a_small_gpu():
    # Under the interpreter's 4 "SMs" a 150-column layer has 3 column blocks, so K is split:
    # the ordered split reduction is part of what the invariance tests above check.
    from lowvram.kernels.linear_invariant import invariant_split_k

    assert invariant_split_k(150, 200, w4a16.num_sms(torch.device(DEVICE))) > 1 or DEVICE == "cuda"


def test_invariant_linear_rejects_mismatched_shapes():
    from lowvram.errors import KernelError

    with pytest.raises(KernelError, match="do not multiply"):
        invariant_linear(torch.zeros(2, 5), torch.zeros(4, 6))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("num_inputs, num_outputs", [(1536, 2048), (1536, 1536), (1536, 17920), (8960, 1536)])
def test_awq_rows_do_not_depend_on_the_batch_at_real_shapes(num_inputs, num_outputs):
    qweight, qzeros, scales, bias = random_awq(num_inputs, num_outputs, 128, seed=9)
    lora_a, lora_bt = random_lora(16, num_inputs, num_outputs, seed=10, dtype=torch.float16)
    x = random_x(70, num_inputs, seed=11)
    full = assert_rows_invariant(
        lambda rows: awq_linear(
            rows, qweight, qzeros, scales, 128, bias, lora_a=lora_a, lora_bt=lora_bt, batch_invariant=True
        ),
        x,
    )
    error = relative_error(full, awq_linear_ref(x, qweight, qzeros, scales, 128, bias, lora_a=lora_a, lora_bt=lora_bt))
    print(f"K={num_inputs} N={num_outputs}: largest relative difference {error:.2e}")
    assert error < 2e-3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_dense_head_rows_do_not_depend_on_the_batch_at_the_real_shape():
    gen = torch.Generator().manual_seed(12)
    weight = (torch.randn(151936, 1536, generator=gen) * 0.02).half().cuda()
    x = random_x(20, 1536, seed=13)
    full = assert_rows_invariant(lambda rows: invariant_linear(rows, weight), x)
    error = relative_error(full, invariant_linear_ref(x, weight))
    print(f"lm_head shape: largest relative difference {error:.2e}")
    assert error < 2e-3


# ---------------------------------------------------------------- the engine


def _record_logits(engine, monkeypatch):
    """Each request's logits row at every sampled position: {(request id, position): [V]}."""
    recorded = {}
    run = engine.runner.run

    def recording_run(batch, **kwargs):
        # Rows that sample, keyed by the index of the token they sample: a queued step runs
        # before the sequences hold the token of the step before it.
        logits = run(batch, **kwargs)
        for row, (seq, start, num_new) in enumerate(zip(batch.seqs, batch.positions, batch.num_new_tokens)):
            if not batch.is_prefill or start + num_new == seq.num_tokens:
                key = (seq.request_id, start + num_new - len(seq.prompt_token_ids))
                recorded[key] = logits[row].detach().cpu().clone()
        return logits

    monkeypatch.setattr(engine.runner, "run", recording_run)
    return recorded


def _prompt_ids(engine, lengths):
    vocab = engine.config.vocab_size
    return [[(11 * i + 5 * n) % (vocab - 10) + 5 for i in range(n)] for n in lengths]


def _run(engine, prompts, max_tokens, ids, preempt_at_step=None):
    """Generate greedily. With `preempt_at_step`, at the first step from that one on where two
    requests are decoding, the batch limit drops to one (the newer one is preempted, to be
    recomputed) and rises again four steps later."""
    from lowvram.core.sampling_params import SamplingParams

    for request_id, prompt in zip(ids, prompts):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        engine.add_request(request_id, None, params, prompt_token_ids=prompt)
    done, num_steps, num_preempted, preempted_at = {}, 0, 0, None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        num_steps += 1
        decoding = [seq for seq in engine.scheduler.running if len(seq.output_token_ids) >= 2]
        if preempt_at_step is not None and preempted_at is None and num_steps >= preempt_at_step and len(decoding) >= 2:
            num_preempted, preempted_at = len(engine.scheduler.set_batch_limit(1)), num_steps
        elif preempted_at is not None and num_steps == preempted_at + 4:
            engine.scheduler.set_batch_limit(engine.profile.max_num_seqs)
    if preempt_at_step is not None:
        assert num_preempted > 0, "nothing was running to preempt"
    return done


def _pipelined(engine, is_pipelined):
    """Pipelined decode on or off (None: as on the engine's device)."""
    if is_pipelined is not None:
        engine.pipelines_decode = engine.runner.is_pipelined = is_pipelined
        engine.runner.samples_on_device = is_pipelined or engine.device.type == "cuda"
        engine.scheduler.num_lookahead_tokens = int(is_pipelined)
    return engine


def check_requests_decode_as_alone(
    model_dir, profile, monkeypatch, lengths, max_tokens, preempt_at_step=None, is_pipelined=None
):
    """Batched (chunked prefill under a small token budget, decode batches that shrink, and
    with `preempt_at_step` requests preempted and recomputed) against one request at a time
    on a fresh engine: the same tokens and the same logits, bit for bit. `is_pipelined`
    turns pipelined decode on or off in both engines (None: as on their device)."""
    from lowvram.engine.engine import LLMEngine

    batched = _pipelined(LLMEngine(str(model_dir), profile), is_pipelined)
    prompts = _prompt_ids(batched, lengths)
    ids = [f"r{i}" for i in range(len(prompts))]
    batched_logits = _record_logits(batched, monkeypatch)
    batched_tokens = _run(batched, prompts, max_tokens, ids, preempt_at_step)
    monkeypatch.undo()

    alone = _pipelined(LLMEngine(str(model_dir), profile), is_pipelined)
    alone_logits = _record_logits(alone, monkeypatch)
    alone_tokens = {}
    for request_id, prompt in zip(ids, prompts):
        alone_tokens.update(_run(alone, [prompt], max_tokens, [request_id]))
    assert alone_tokens == batched_tokens
    assert alone_logits.keys() == batched_logits.keys()
    different = [key for key in alone_logits if not torch.equal(alone_logits[key], batched_logits[key])]
    largest = max((float((alone_logits[k] - batched_logits[k]).abs().max()) for k in different), default=0.0)
    print(f"{len(different)} of {len(alone_logits)} logit rows differ (largest {largest:.3g})")
    assert not different


@pytest.mark.parametrize("is_pipelined", [False, True], ids=["steps", "pipelined"])
@pytest.mark.parametrize("preempt_at_step", [None, 1], ids=["batched", "preempted"])
def test_requests_decode_as_they_do_alone_on_the_cpu(tiny_qwen2_dir, monkeypatch, preempt_at_step, is_pipelined):
    # Pipelined: a preemption between steps drops the preempted request's row of the queued step.
    from lowvram.config import load_profile

    profile = load_profile("cpu").replace(batch_invariant=True, max_num_seqs=4, max_num_batched_tokens=32)
    check_requests_decode_as_alone(
        tiny_qwen2_dir,
        profile,
        monkeypatch,
        lengths=[5, 40, 23, 61],
        max_tokens=8,
        preempt_at_step=preempt_at_step,
        is_pipelined=is_pipelined,
    )


def test_under_memory_pressure_batch_invariance_spills_instead_of_compressing(tiny_qwen2_dir, monkeypatch):
    from lowvram.config import ControllerConfig, load_profile
    from lowvram.engine.engine import LLMEngine

    controller = ControllerConfig(
        memory_high_water=0.9,
        memory_low_water=0.75,
        latency_high_ms=1e5,
        latency_low_ms=5e4,
        patience_tokens=2,
        cooldown_steps=3,
    )
    profile = load_profile("cpu").replace(batch_invariant=True, controller=controller, max_num_seqs=4)
    engine = LLMEngine(str(tiny_qwen2_dir), profile)
    engine.memory_in_use_bytes = lambda *_: int(0.95 * engine.kv_plan.budget_bytes)  # a card near full
    outputs = _run(engine, _prompt_ids(engine, [9, 30, 17, 44, 5]), 16, [f"r{i}" for i in range(5)])
    actions = [event.action.kind for event in engine.controller_events]
    assert len(outputs) == 5 and actions[:2] == ["spill", "batch_limit"]
    assert "kv_precision" not in actions and engine.kv_pool.precision == "fp16"


def test_batch_invariance_refuses_deepseek_v2(tmp_path):
    from tiny_models import make_tiny_deepseek_v2

    from lowvram.config import load_profile
    from lowvram.engine.engine import LLMEngine
    from lowvram.errors import ConfigError

    model_dir = make_tiny_deepseek_v2(tmp_path / "v2")
    with pytest.raises(ConfigError, match="batch_invariant"):
        LLMEngine(str(model_dir), load_profile("cpu").replace(batch_invariant=True))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    "cuda_graphs, preempt_at_step",
    [(False, None), (True, None), (True, 1)],
    ids=["eager", "graphs", "graphs-preempted"],
)
def test_requests_decode_as_they_do_alone_on_the_gpu(tiny_qwen2_dir, monkeypatch, cuda_graphs, preempt_at_step):
    from lowvram.config import load_profile

    profile = load_profile("4gb").replace(
        batch_invariant=True,
        enable_cuda_graphs=cuda_graphs,
        max_num_seqs=4,
        max_num_batched_tokens=256,
        max_model_len=4096,
        emulate_vram_gib=4.0,
    )
    check_requests_decode_as_alone(
        tiny_qwen2_dir, profile, monkeypatch, lengths=[5, 300, 97, 1100], max_tokens=24, preempt_at_step=preempt_at_step
    )
