"""The engine over each pool on the CPU: the same greedy output whether pages stay put,
spill through a small device share, or change precision while requests run."""

import pytest
from test_kv_pool import FakeManagedMemory
from tiny_models import finished_token_ids

from lowvram.config import load_profile
from lowvram.core.block_manager import BlockManager
from lowvram.core.sampling_params import SamplingParams
from lowvram.core.scheduler import Scheduler
from lowvram.engine.engine import LLMEngine
from lowvram.engine.model_runner import ModelRunner
from lowvram.kv.pool import DeviceKVPool, KVShape, recent_window_blocks
from lowvram.kv.tiers import ManagedKVPool, PinnedKVPool

PROMPTS = ["Hello world, this is a test of", "def add(a, b):\n    return", "The quick brown fox"]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _engine(model_dir, **changes) -> LLMEngine:
    return LLMEngine(str(model_dir), load_profile("cpu").replace(max_model_len=256, **changes))


def _use_pool(engine: LLMEngine, pool) -> None:
    """Rebuild the engine's page bookkeeping around another pool."""
    engine.kv_pool = pool
    engine.block_manager = BlockManager(
        pool.num_blocks, pool.block_size, enable_prefix_caching=engine.profile.enable_prefix_caching
    )
    engine.scheduler = Scheduler(
        engine.block_manager, engine.profile.max_num_seqs, engine.profile.max_num_batched_tokens
    )
    engine.runner = ModelRunner(engine.model, pool)


def _shape(engine: LLMEngine) -> KVShape:
    c = engine.config
    return KVShape(c.num_layers, engine.profile.kv_block_size, c.num_kv_heads, c.head_dim, engine.dtype)


def _generate(engine: LLMEngine, prompts=PROMPTS, params=GREEDY) -> list[list[int]]:
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    final = finished_token_ids(engine)
    return [final[str(i)] for i in range(len(prompts))]


def test_default_cpu_engine_uses_the_device_pool(tiny_qwen2_dir):
    engine = _engine(tiny_qwen2_dir)
    assert isinstance(engine.kv_pool, DeviceKVPool) and not engine.kv_pool.is_translated
    assert engine.block_manager.num_blocks == engine.kv_pool.num_blocks == engine.kv_plan.num_blocks
    assert engine.snapshot().num_kv_blocks_on_host == 0


@pytest.mark.parametrize("backend", ["pinned", "um"])
def test_spilling_pools_give_the_device_pools_greedy_output(tiny_qwen2_dir, backend):
    engine = _engine(tiny_qwen2_dir)
    expected = _generate(engine)
    again = _generate(engine)  # second round: prompt pages come from the prefix cache
    assert again == expected
    shape = _shape(engine)
    if backend == "pinned":
        # 4 device slots for 3 sequences of 3 pages each: every step runs in parts.
        pool = PinnedKVPool(shape, 40, "fp16", "cpu", max_device_blocks=4, num_host_blocks=36)
    else:
        pool = ManagedKVPool(
            shape,
            40,
            "fp16",
            "cpu",
            max_device_blocks=4,
            memory=FakeManagedMemory(page_bytes=shape.code_block_bytes("fp16")),
            budget_bytes=2**30,
        )
    _use_pool(engine, pool)
    split_sizes = []
    split = engine.runner._split

    def recording_split(batch, tables):
        parts = split(batch, tables)
        split_sizes.append(len(parts))
        return parts

    engine.runner._split = recording_split
    assert _generate(engine) == expected
    assert _generate(engine) == expected  # through the prefix cache and its page copies
    assert pool.spilled_bytes > 0 and pool.fetched_bytes > 0 and pool.num_page_misses > 0
    if backend == "pinned":
        assert max(split_sizes) == 3
        assert engine.kv_pool.is_translated  # block ids are slots only after translation
    else:
        assert max(split_sizes) == 1  # kernels read host pages in place: no parts needed


@pytest.mark.parametrize("num_window_tokens", [0, 20])
def test_precision_changes_while_requests_run_free_the_expected_bytes(tiny_qwen2_dir, num_window_tokens):
    reference = _engine(tiny_qwen2_dir)
    expected = _generate(reference, PROMPTS[:2])
    engine = _engine(tiny_qwen2_dir, kv_recent_fp16_tokens=num_window_tokens)
    for i, prompt in enumerate(PROMPTS[:2]):
        engine.add_request(str(i), prompt, GREEDY)
    outputs: dict[str, list[int]] = {}
    num_blocks, c, bs = engine.kv_pool.num_blocks, engine.config, engine.profile.kv_block_size
    per_token = {
        "fp16": 2 * c.num_kv_heads * c.head_dim * 4,  # float32 on the CPU
        "int8": 2 * c.num_kv_heads * (c.head_dim + 4),
        "int4": 2 * c.num_kv_heads * (c.head_dim // 2 + 4),
    }
    fp16_page_bytes = bs * c.num_layers * per_token["fp16"]
    freed = {}
    num_steps = 0
    while engine.has_unfinished_requests():
        num_steps += 1
        if num_steps in (6, 14):
            precision = "int8" if num_steps == 6 else "int4"
            before, num_window_before = engine.kv_pool.precision, len(engine.kv_pool.window_block_ids)
            running = [
                (engine.block_manager.block_table(s.seq_id), s.num_computed_tokens) for s in engine.scheduler.running
            ]
            freed[precision] = engine.set_kv_precision(precision)
            # Each running sequence keeps the pages of its last `num_window_tokens` tokens in FP16.
            window = engine.kv_pool.window_block_ids
            assert window == recent_window_blocks(running, num_window_tokens, bs)
            assert len(window) >= 2 * bool(num_window_tokens)
            expected_freed = (
                num_blocks * bs * c.num_layers * (per_token[before] - per_token[precision])
                - (len(window) - num_window_before) * fp16_page_bytes
            )
            assert freed[precision] == expected_freed
            assert engine.snapshot().kv_precision == precision
        for out in engine.step():
            outputs[out.request_id] = out.outputs[0].token_ids
    got = [outputs[str(i)] for i in range(2)]
    assert [len(g) for g in got] == [24, 24]  # nothing lost or restarted
    assert engine.stats.num_preemptions == 0
    # Tokens before the switch are unchanged; after it, quantized KV may differ a little.
    for g, e in zip(got, expected):
        assert g[:4] == e[:4]
        assert sum(a == b for a, b in zip(g, e)) >= 12
    assert freed["int8"] > freed["int4"] > 0
