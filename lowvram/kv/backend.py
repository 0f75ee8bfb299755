"""Which KV pool backend a profile gets on this machine and its sizes (`plan_pool`, pure),
and the pool built from that choice (`create_kv_pool`)."""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch

from lowvram.config import CHOICES, Profile
from lowvram.errors import ConfigError, KernelError
from lowvram.kv.managed_memory import INSTALL_HINT, ManagedMemory, check_managed_size
from lowvram.kv.pool import GIB, DeviceKVPool, KVPool, KVShape
from lowvram.kv.tiers import ManagedKVPool, PinnedKVPool

log = logging.getLogger("lowvram")
NO_CONCURRENT = "concurrentManagedAccess = 0, as on Windows and WSL2"


@functools.cache
def _log_once(message: str) -> None:
    log.info(message)


@dataclass(frozen=True)
class PoolPlan:
    """What `create_kv_pool` builds: the backend and its sizes, in pages."""

    backend: str
    num_blocks: int  # pages the block manager hands out
    num_device_blocks: int  # most pages resident on the device at once
    num_host_blocks: int  # pages beyond the device share (um) / pinned host slots (pinned)
    block_bytes: int  # one page of every layer
    reason: str


def plan_pool(
    *,
    backend: str,
    device_type: str,
    num_device_blocks: int,
    max_num_blocks: int,
    block_bytes: int,
    host_spill_bytes: int,
    allow_oversubscription: bool,
    has_runtime: bool,
    is_concurrent: bool | None,
    free_bytes: int | None,
) -> PoolPlan:
    """Pick the backend and size it (pure: every probe of the machine is an argument). The host
    share adds pages to the device share up to `max_num_blocks`. `auto` takes `um` where concurrent
    managed access works and the pool fits the free device memory (or may oversubscribe), else
    `pinned`; an explicit `um` that cannot work is an error with the numbers."""
    if backend not in CHOICES["kv_backend"]:
        raise ConfigError(f"kv_backend = {backend!r} is not allowed; use one of: {', '.join(CHOICES['kv_backend'])}")
    n = num_device_blocks
    if device_type != "cuda":
        note = "" if backend in ("auto", "device") else f" (kv_backend {backend!r} needs CUDA)"
        return PoolPlan("device", n, n, 0, block_bytes, f"CPU: KV pages live in host memory{note}")
    if backend == "device":
        return PoolPlan("device", n, n, 0, block_bytes, "kv_backend 'device': pages stay on the GPU, no spill")
    host_blocks = int(host_spill_bytes // block_bytes)
    num_blocks = max(n, min(n + host_blocks, max_num_blocks))
    managed_bytes = num_blocks * block_bytes
    reason = f"kv_backend {backend!r}"
    if backend == "auto":
        backend, why = "pinned", None
        if not has_runtime:
            why = "cuda-bindings is not installed or not usable"
        elif not is_concurrent:
            why = f"this GPU cannot share managed memory with the host while kernels run ({NO_CONCURRENT})"
        elif free_bytes is not None and managed_bytes > free_bytes and not allow_oversubscription:
            sizes = f"a {managed_bytes / GIB:.2f} GiB managed pool would exceed the {free_bytes / GIB:.2f} GiB"
            why = f"{sizes} free on the GPU"
        else:
            backend, why = "um", "concurrent managed access works"
        reason = f"kv_backend auto -> {backend}: {why}"
    if backend == "pinned":
        return PoolPlan("pinned", num_blocks, n, min(host_blocks, num_blocks), block_bytes, reason)
    if not has_runtime:
        raise ConfigError(INSTALL_HINT)
    if not is_concurrent:
        raise ConfigError(
            f"kv_backend 'um' needs concurrent managed access, which this GPU/OS does not offer "
            f"({NO_CONCURRENT}); use kv_backend 'pinned' or 'auto'"
        )
    budget_bytes = n * block_bytes + int(host_spill_bytes)
    free = managed_bytes if free_bytes is None else free_bytes
    check_managed_size(managed_bytes, free, budget_bytes, allow_oversubscription=allow_oversubscription)
    return PoolPlan("um", num_blocks, n, num_blocks - n, block_bytes, reason)


def create_kv_pool(
    config, profile: Profile, num_device_blocks: int, device, dtype, precision: str, *, max_model_len: int, memory=None
) -> KVPool:
    """The pool the profile asks for around the `num_device_blocks` pages the memory plan fits on
    the device; `dtype`: that of fp16 pages; `memory`: for `um` (default: cuda-bindings)."""
    # MLA (DeepSeek-V2) keeps one latent row per token and layer, so two layers share a pool
    # layer's K and V (model_deepseek_v2.layer_kv_pages); dense models have no num_kv_layers.
    num_kv_layers = getattr(config, "num_kv_layers", config.num_layers)
    shape = KVShape(num_kv_layers, profile.kv_block_size, config.num_kv_heads, config.head_dim, dtype)
    is_concurrent, free_bytes = None, None
    if device.type == "cuda" and profile.kv_backend != "device":
        try:
            memory = memory or ManagedMemory(device)
            is_concurrent = memory.is_concurrent()
            free_bytes = memory.free_bytes()
        except (ConfigError, KernelError) as exc:  # not installed, or built for another driver
            if profile.kv_backend == "um":
                raise ConfigError(f"{INSTALL_HINT} ({exc})") from None
            _log_once(f"cuda-bindings is not usable ({exc}); KV pages cannot use unified memory")
            memory = None
            free_bytes = torch.cuda.mem_get_info(device)[0]
    n, spill_bytes = num_device_blocks, int(profile.host_spill_gib * GIB)
    plan = plan_pool(
        backend=profile.kv_backend,
        device_type=device.type,
        num_device_blocks=n,
        max_num_blocks=max(n, profile.max_num_seqs * -(-max_model_len // profile.kv_block_size)),
        block_bytes=shape.block_bytes(precision),
        host_spill_bytes=spill_bytes,
        allow_oversubscription=profile.allow_oversubscription,
        has_runtime=memory is not None,
        is_concurrent=is_concurrent,
        free_bytes=free_bytes,
    )
    _log_once(f"KV pool backend: {plan.backend} ({plan.reason})")
    args = (shape, plan.num_blocks, precision, device)
    if plan.backend == "um":
        budget, allow = n * plan.block_bytes + spill_bytes, profile.allow_oversubscription
        pool: KVPool = ManagedKVPool(
            *args, max_device_blocks=n, memory=memory, budget_bytes=budget, allow_oversubscription=allow
        )
    elif plan.backend == "pinned":
        pool = PinnedKVPool(*args, max_device_blocks=n, num_host_blocks=plan.num_host_blocks)
    else:
        pool = DeviceKVPool(*args)
    log.info(
        "KV pool: %s, %d pages of %d tokens, at most %d on the device (%.1f MiB there, %.1f MiB on the host)",
        *(pool.backend, pool.num_blocks, shape.block_size, n, pool.device_bytes / 2**20, pool.host_bytes / 2**20),
    )
    return pool
