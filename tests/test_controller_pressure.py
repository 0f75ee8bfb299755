"""What the controller watches: live KV pages count wherever they are.

A um pool hands out more pages than its device share; the pages beyond the share wait
on the host. The device then never holds more KV than the share, so a reading of
resident pages alone stays under the high-water mark however far the live pages
outgrow the card. These tests run that pool on the CPU (managed memory faked).
"""

from test_kv_pool import FakeManagedMemory
from tiny_models import finished_token_ids

from lowvram.config import ControllerConfig, load_profile
from lowvram.core.block_manager import BlockManager
from lowvram.core.sampling_params import SamplingParams
from lowvram.core.scheduler import Scheduler
from lowvram.engine.engine import LLMEngine
from lowvram.engine.model_runner import ModelRunner
from lowvram.kv.pool import KVShape
from lowvram.kv.tiers import ManagedKVPool

NUM_DEVICE_PAGES = 4
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _um_engine(model_dir, **controller) -> LLMEngine:
    """The tiny model over a 40-page um pool of which 4 pages fit the device."""
    cfg = {
        "memory_high_water": 0.9,
        "memory_low_water": 0.75,
        "latency_high_ms": 1e5,
        "latency_low_ms": 5e4,
        "patience_tokens": 2,
        "cooldown_steps": 1000,
    }
    cfg.update(controller)
    profile = load_profile("cpu").replace(controller=ControllerConfig(**cfg), max_num_seqs=4)
    engine = LLMEngine(str(model_dir), profile, max_model_len=256)
    c = engine.config
    shape = KVShape(c.num_layers, profile.kv_block_size, c.num_kv_heads, c.head_dim, engine.dtype)
    pool = ManagedKVPool(
        shape,
        40,
        "fp16",
        "cpu",
        max_device_blocks=NUM_DEVICE_PAGES,
        memory=FakeManagedMemory(page_bytes=shape.code_block_bytes("fp16")),
        budget_bytes=2**30,
    )
    engine.kv_pool = pool
    engine.block_manager = BlockManager(pool.num_blocks, pool.block_size, enable_prefix_caching=True)
    engine.scheduler = Scheduler(engine.block_manager, profile.max_num_seqs, profile.max_num_batched_tokens)
    engine.runner = ModelRunner(engine.model, pool)
    return engine


def _add_requests(engine: LLMEngine, num: int = 3) -> None:
    for i in range(num):  # 40 distinct tokens each: 3 pages of prompt, a 4th while decoding
        engine.add_request(str(i), prompt_token_ids=[5 + 40 * i + t for t in range(40)], params=GREEDY)


def _page_bytes(engine: LLMEngine) -> int:
    return engine.kv_pool.shape.block_bytes(engine.kv_pool.precision)


def test_live_pages_waiting_on_the_host_count_as_pressure_but_not_as_device_memory(tiny_qwen2_dir):
    engine = _um_engine(tiny_qwen2_dir, is_enabled=False)
    outside_kv = engine.memory_in_use_bytes()  # weights and workspace, no pages yet
    _add_requests(engine)
    while engine.num_kv_blocks_on_host() == 0:
        engine.step()
    on_host = engine.num_kv_blocks_on_host()
    in_use = engine.memory_in_use_bytes()
    assert in_use - outside_kv <= NUM_DEVICE_PAGES * _page_bytes(engine)  # the device holds its share at most
    assert engine.memory_pressure_bytes() - in_use == on_host * _page_bytes(engine)
    assert engine.memory_pressure_bytes() == outside_kv + engine.block_manager.num_used_blocks * _page_bytes(engine)
    assert engine.snapshot().memory_pressure_bytes == engine.memory_pressure_bytes()


def test_the_controller_compresses_when_live_pages_outgrow_the_device_share(tiny_qwen2_dir, tmp_path):
    engine = _um_engine(tiny_qwen2_dir)
    engine.timeline_path = str(tmp_path / "timeline.jsonl")
    page = _page_bytes(engine)
    outside_kv = engine.memory_in_use_bytes()
    # A budget the 4 resident pages can never push past 90%, but 8 live pages do.
    engine.kv_plan.budget_bytes = int((outside_kv + 8 * page) / 0.9)
    assert (outside_kv + NUM_DEVICE_PAGES * page) / engine.kv_plan.budget_bytes < 0.9
    _add_requests(engine)
    done = finished_token_ids(engine)
    assert sorted(done) == ["0", "1", "2"] and all(len(ids) == 24 for ids in done.values())
    first = engine.controller_events[0]
    assert (first.action.kind, first.action.value) == ("kv_precision", "int8") and "memory" in first.reason
    assert engine.kv_pool.precision != "fp16"
    lines = (tmp_path / "timeline.jsonl").read_text().splitlines()
    steps = [line for line in lines if '"type": "step"' in line]
    assert any('"device_memory_bytes"' in line for line in steps)
