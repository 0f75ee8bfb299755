"""`GET /v1/status`: what a running server holds and does, as a small JSON object (`lowvram ps` prints it).

`engine_status` reads the engine, so it runs in the engine loop's thread (AsyncLLMEngine.call),
between steps, where the scheduler's queues and the KV pool are not changing under it.
"""

from __future__ import annotations


def engine_status(engine) -> dict:
    """Model, weight format, where weights and KV live, the context in use, the controller and the queues."""
    snap = engine.snapshot()
    model, quant, pool = engine.model, engine.config.quantization, engine.kv_pool
    streamer = getattr(model, "layer_streamer", None)
    host_weight_bytes = streamer.plan.host_weight_bytes if streamer is not None else 0
    for moe in getattr(model, "moe_layers", []):  # DeepSeek-V2's routed experts held in host memory
        if moe.cache is not None:
            host_weight_bytes += moe.cache.num_experts * moe.cache.expert_bytes
    return {
        "model_dir": str(engine.model_dir),
        "architecture": engine.config.architecture,
        "weight_format": f"awq-int4-g{quant.group_size}" if quant else str(engine.dtype).removeprefix("torch."),
        "profile": engine.profile.name,
        "device": snap.device,
        "weights": {"device_bytes": int(model.weight_bytes), "host_bytes": int(host_weight_bytes)},
        "kv_cache": {
            "precision": snap.kv_precision,
            "backend": pool.backend,
            "device_bytes": int(pool.device_bytes),
            "host_bytes": int(pool.host_bytes),
            "num_blocks": snap.num_kv_blocks,
            "num_blocks_used": snap.num_kv_blocks_used,
            "num_blocks_on_host": snap.num_kv_blocks_on_host,
            "block_size": snap.kv_block_size,
        },
        "context": {
            "max_model_len": engine.max_model_len,
            "num_tokens_in_use": sum(seq.num_tokens for seq in engine.scheduler.running),
        },
        "controller": {"mode": snap.controller_mode, "last_decision": snap.last_decision},
        "requests": {"running": snap.num_running, "waiting": snap.num_waiting},
        "memory": {"used_bytes": snap.memory_used_bytes, "budget_bytes": snap.memory_budget_bytes},
    }
