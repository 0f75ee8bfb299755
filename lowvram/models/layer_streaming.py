"""Decoder layers beyond the device budget run from host memory (split by memory.plan.plan_offload;
an untied embedding table moves to host memory too). "stream": each streamed layer's tensors are
packed into one pinned host buffer and copied into one of two device staging buffers that take
turns: layer k+2's copy starts on a side stream once layer k's kernels are done (CUDA events
order the streams; the CPU never waits), and forward hooks point the layer's tensors at the
buffer, then back at the host copy. "cpu": attention is staged the same way and the streamed
layers' MLPs (87% of their bytes) run on the CPU in float32; slower than streaming on PCIe 4.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

from lowvram.config import Profile
from lowvram.errors import ConfigError
from lowvram.kernels.awq_format import dequantize_awq
from lowvram.memory.plan import (
    NUM_STAGING_BUFFERS,
    keeps_embeddings_on_host,
    plan_offload,
    plan_weight_offload,
    weight_bytes_by_kind,
)
from lowvram.models.batch_invariance import InvariantLinear
from lowvram.models.checkpoint import read_raw_config
from lowvram.models.config import ModelConfig, load_model_config
from lowvram.models.deepseek_v2 import is_deepseek_v2
from lowvram.models.dense import CausalLM
from lowvram.models.expert_offload import packed_offsets, view_like
from lowvram.models.loader import load_deepseek_v2, load_model
from lowvram.quant.awq_linear import LORA_A, LORA_B, AwqLinear

log = logging.getLogger("lowvram")

# The "cpu" strategy dequantizes INT4 weights in slices of this many elements (bounded scratch).
DEQUANT_CHUNK_ELEMENTS = 1 << 24

# Where a tensor is registered: (a module's _parameters or _buffers, name), each place it is.
Bindings = list[tuple[dict, str]]
Registrations = dict[int, tuple[torch.Tensor, Bindings]]


def _registrations(root: nn.Module, skip: Collection[int] = ()) -> Registrations:
    """Every parameter and buffer under `root` by tensor id, with its bindings; modules whose id is
    in `skip`, and host-computed ones, are not entered."""
    found: Registrations = {}
    seen = set(skip)
    stack = [root]
    while stack:
        module = stack.pop()
        if id(module) in seen or isinstance(module, HostComputed):
            continue
        seen.add(id(module))
        for table in (module._parameters, module._buffers):
            for name, tensor in table.items():
                if tensor is not None:
                    found.setdefault(id(tensor), (tensor, []))[1].append((table, name))
        stack.extend(reversed([m for m in module._modules.values() if m is not None]))
    return found


def _registered(tensor: torch.Tensor, as_parameter: bool) -> torch.Tensor:
    if as_parameter and not isinstance(tensor, nn.Parameter):
        return nn.Parameter(tensor, requires_grad=False)
    return tensor


def _bind(bound: list[tuple[Bindings, torch.Tensor]]) -> None:
    for bindings, tensor in bound:
        for table, name in bindings:
            table[name] = tensor


def place_on_device(model: nn.Module, device: torch.device, kept: Collection[int] = ()) -> None:
    """Move every tensor of `model` but the `kept` ones (ids) to `device`, each once (ties stay)."""
    for tensor_id, (tensor, bindings) in _registrations(model).items():
        if tensor_id not in kept:
            _bind([(bindings, _registered(tensor.to(device), isinstance(tensor, nn.Parameter)))])


def _inventory(model: CausalLM, strategy: str) -> tuple[list[Registrations], list[Registrations], int, int]:
    """Per layer the tensors only it holds and those a streamed copy carries (not its MLP's under
    "cpu"); the bytes that stay on the device whatever the split; those of a movable embedding table."""
    layers = list(model.model.layers)
    per_layer = [_registrations(layer) for layer in layers]
    outside = _registrations(model, skip={id(layer) for layer in layers})
    counts = Counter(tensor_id for regs in per_layer for tensor_id in regs)
    own = [{i: entry for i, entry in regs.items() if counts[i] == 1 and i not in outside} for regs in per_layer]
    staged = own
    if strategy == "cpu":  # the MLPs stay on the host
        mlps = [_registrations(layer.mlp) for layer in layers]
        staged = [{i: entry for i, entry in regs.items() if i not in mlp} for regs, mlp in zip(own, mlps)]
    shared = {i: entry for regs in per_layer for i, entry in regs.items() if counts[i] > 1 and i not in outside}
    embed = model.model.embed_tokens
    is_movable = all(table is embed._parameters for table, _ in outside[id(embed.weight)][1])
    host_embedding = embed.weight.nbytes if is_movable else 0
    fixed = sum(t.nbytes for t, _ in {**outside, **shared}.values()) - host_embedding
    return own, staged, fixed, host_embedding


class HostEmbedding(nn.Module):
    """An embedding table in host memory (still named `weight`): only [T, hidden] rows cross the bus.
    On CUDA the GPU gathers rows from the pinned table itself (`device_view`), so a CUDA graph can
    capture it; where the driver cannot map it, graphs copy rows that `stage` gathered on the host."""

    def __init__(self, weight: torch.Tensor, device: torch.device):
        super().__init__()
        self.device = torch.device(device)
        self.device_view: torch.Tensor | None = None  # [V, hidden] on the device, reading host memory
        if self.device.type == "cuda":
            with torch.inference_mode(False):
                pinned = torch.empty(weight.shape, dtype=weight.dtype, pin_memory=True)  # contiguous
                pinned.copy_(weight)
            weight = pinned
            # With unified addressing the GPU reads pinned memory at its host address: a CUDA tensor over
            # it via the CUDA array interface (which has no bfloat16: two-byte dtypes go as int16).
            typestr = {1: "|u1", 2: "<i2", 4: "<i4", 8: "<i8"}[weight.element_size()]
            shape, data = tuple(weight.shape), (weight.data_ptr(), False)
            interface = dict(shape=shape, typestr=typestr, data=data, strides=None, version=3)
            try:
                array = SimpleNamespace(host=weight, __cuda_array_interface__=interface)
                self.device_view = torch.as_tensor(array, device=self.device).view(weight.dtype)
            except (RuntimeError, TypeError) as exc:  # no unified addressing, or an unmapped allocation
                log.info("pinned host memory is not readable from %s (%s); rows are copied instead", self.device, exc)
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.num_embeddings, self.embedding_dim = weight.shape
        self._rows: torch.Tensor | None = None  # pinned [T, hidden], reused by every step
        self._copied = torch.cuda.Event() if self.device.type == "cuda" else None
        self._graph_rows: torch.Tensor | None = None  # pinned [max batch, hidden], what graphs copy from

    def stage(self, token_ids: list[int], capacity: int) -> None:
        """Gather the rows of `token_ids` (a graph's padded batch) for the next replay into a buffer
        made once for `capacity` rows (graphs keep its address), which no replay may still read."""
        if self._graph_rows is None:
            with torch.inference_mode(False):
                self._graph_rows = torch.empty(capacity, self.embedding_dim, dtype=self.weight.dtype, pin_memory=True)
        ids = torch.tensor(token_ids, dtype=torch.long)
        torch.index_select(self.weight, 0, ids, out=self._graph_rows[: len(token_ids)])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.device_view is not None:
            return torch.nn.functional.embedding(input_ids.to(self.device), self.device_view)
        if self._graph_rows is not None and torch.cuda.is_current_stream_capturing():
            # [B, hidden]: the replay copies what `stage` gathered; input_ids are not read.
            return self._graph_rows[: input_ids.shape[0]].to(self.device, non_blocking=True)
        ids = input_ids.to("cpu")  # [T]
        if self._copied is None:
            return self.weight.index_select(0, ids).to(self.device)
        num_tokens = ids.numel()
        if self._rows is None or self._rows.shape[0] < num_tokens:
            with torch.inference_mode(False):  # an ordinary tensor, writable inside and outside inference mode
                self._rows = torch.empty(num_tokens, self.embedding_dim, dtype=self.weight.dtype, pin_memory=True)
        else:
            self._copied.synchronize()  # the previous step's copy may still be reading the rows
        rows = self._rows[:num_tokens]
        torch.index_select(self.weight, 0, ids, out=rows)
        out = rows.to(self.device, non_blocking=True)
        self._copied.record()
        return out


class HostComputed(nn.Module):
    """A module computed on the CPU in float32 inside a model on another device."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x.to("cpu", torch.float32)).to(x.device, x.dtype)


def dense_linear(awq: AwqLinear, compute_device: torch.device) -> nn.Linear:
    """The float32 host nn.Linear an AwqLinear computes (dequantized in slices on `compute_device`,
    low-rank compensation folded in; the bias already holds any bias correction)."""
    k, n, g = awq.in_features, awq.out_features, awq.group_size
    weight = torch.empty(n, k, dtype=torch.float32)  # nn.Linear layout [N, K]
    cols = max(8, DEQUANT_CHUNK_ELEMENTS // k // 8 * 8)  # whole int32 words of 8 columns
    for start in range(0, n, cols):
        end = min(n, start + cols)
        words = slice(start // 8, end // 8)
        packed = (awq.qweight[:, words], awq.qzeros[:, words], awq.scales[:, start:end])
        part = dequantize_awq(*(t.to(compute_device) for t in packed), g, dtype=torch.float32)  # [K, cols]
        weight[start:end] = part.t().contiguous().cpu()
    lora_a, lora_b = getattr(awq, LORA_A), getattr(awq, LORA_B)
    if lora_a is not None and lora_b is not None:
        weight += lora_b.float().cpu() @ lora_a.float().cpu()  # [N, r] @ [r, K]: x A^T B^T = x (B A)^T
    kind = InvariantLinear if awq.is_batch_invariant else nn.Linear  # the model was built batch-invariant
    linear = kind(k, n, bias=awq.bias is not None, device="meta")
    linear.weight = nn.Parameter(weight, requires_grad=False)
    if awq.bias is not None:
        linear.bias = nn.Parameter(awq.bias.float().cpu(), requires_grad=False)
    return linear


def compute_on_host(module: nn.Module, compute_device: torch.device) -> HostComputed:
    """`module` in float32 on the CPU (its AwqLinears made dense), wrapped to run there."""
    for name, child in list(module.named_modules()):
        if isinstance(child, AwqLinear):
            parent_name, _, attr = name.rpartition(".")
            setattr(module.get_submodule(parent_name), attr, dense_linear(child, compute_device))
    return HostComputed(module.to("cpu", torch.float32))


class _PackedLayer:
    """One streamed layer's tensors packed into one host buffer (pinned on CUDA)."""

    def __init__(self, registrations: Registrations, is_pinned: bool):
        tensors = [tensor for tensor, _ in registrations.values()]
        self.offsets, self.num_bytes = packed_offsets(tensors)
        self.host = torch.empty(self.num_bytes, dtype=torch.uint8, pin_memory=is_pinned)
        self.bindings = [bindings for _, bindings in registrations.values()]
        self.is_parameter = [isinstance(tensor, nn.Parameter) for tensor in tensors]
        self.likes = [view_like(self.host, offset, tensor) for offset, tensor in zip(self.offsets, tensors)]
        for view, tensor in zip(self.likes, tensors):
            view.copy_(tensor)
        self.host_bound = self.bound(self.host)
        self.staging_bound: list[list[tuple[Bindings, torch.Tensor]]] = []
        _bind(self.host_bound)  # the unpacked originals are freed once the caller drops them

    def bound(self, storage: torch.Tensor) -> list[tuple[Bindings, torch.Tensor]]:
        views = (view_like(storage, offset, like) for offset, like in zip(self.offsets, self.likes))
        return [(b, _registered(v, p)) for b, v, p in zip(self.bindings, views, self.is_parameter)]


@dataclass
class StreamingStats:
    copied_bytes: int = 0  # host-to-device copies of layers
    num_missed_prefetches: int = 0  # layers whose copy had not been queued ahead (an interrupted pass)


class LayerStreamer:
    """Splits a model loaded in host memory as `plan` says and runs its streamed layers. Sets
    `model.layer_streamer`, `model.weight_bytes` (what the device holds) and, while anything
    streams, `model.supports_cuda_graphs` off: a graph would replay stale weights."""

    def __init__(self, model: CausalLM, device: torch.device | str, plan):
        self.plan = plan
        self.device = torch.device(device)
        self.is_cuda = self.device.type == "cuda"
        self.stats = StreamingStats()
        first = plan.num_resident_layers
        streamed = list(model.model.layers)[first:]
        with torch.no_grad():
            if plan.strategy == "cpu":
                for layer in streamed:
                    layer.mlp = compute_on_host(layer.mlp, self.device)
            _, staged, _, host_embedding_bytes = _inventory(model, plan.strategy)
            self.has_host_embedding = plan.is_embedding_on_host and host_embedding_bytes > 0
            embedding = model.model.embed_tokens.weight if self.has_host_embedding else None
            kept = {i for regs in staged[first:] for i in regs} | ({id(embedding)} if embedding is not None else set())
            place_on_device(model, self.device, kept)
            self.layers = [_PackedLayer(regs, self.is_cuda) for regs in staged[first:]]
            if embedding is not None:
                model.model.embed_tokens = HostEmbedding(embedding, self.device)
            buffer_bytes = max((layer.num_bytes for layer in self.layers), default=0)
            num_buffers = min(NUM_STAGING_BUFFERS, len(self.layers))
            self.storage = [
                torch.empty(buffer_bytes, dtype=torch.uint8, device=self.device) for _ in range(num_buffers)
            ]
            for layer in self.layers:
                layer.staging_bound = [layer.bound(buffer) for buffer in self.storage]
        # Per staging buffer: the streamed layer it holds; events: copy done, last compute from it done.
        self.holds: list[int | None] = [None] * num_buffers
        self.copied = [torch.cuda.Event() if self.is_cuda else None for _ in range(num_buffers)]
        self.computed = [torch.cuda.Event() if self.is_cuda else None for _ in range(num_buffers)]
        self.last_used: int | None = None
        self.copy_stream = torch.cuda.Stream(device=self.device) if self.is_cuda else None
        for k, layer in enumerate(streamed):
            layer.register_forward_pre_hook(partial(self._before_layer, k))
            layer.register_forward_hook(partial(self._after_layer, k))
        for k in range(num_buffers):
            self._load(k, k)
        model.layer_streamer = self
        model.weight_bytes = plan.device_weight_bytes
        if self.is_streaming:
            model.supports_cuda_graphs = False
        log.info("weight offload (%s): %s", plan.strategy, plan.summary())

    @property
    def is_streaming(self) -> bool:
        """Whether a forward pass copies weights or activations between host and device."""
        return bool(self.layers) or self.has_host_embedding

    @property
    def num_streamed_layers(self) -> int:
        return len(self.layers)

    def _load(self, k: int, b: int) -> None:
        """Copy streamed layer k into buffer b once the layer computing from b is done."""
        layer = self.layers[k]
        target = self.storage[b][: layer.num_bytes]
        if self.is_cuda:
            with torch.cuda.stream(self.copy_stream):
                self.copy_stream.wait_event(self.computed[b])
                target.copy_(layer.host, non_blocking=True)
                self.copied[b].record(self.copy_stream)
        else:
            target.copy_(layer.host)
        self.holds[b] = k
        self.stats.copied_bytes += layer.num_bytes

    def _before_layer(self, k: int, module: nn.Module, args) -> None:
        if k not in self.holds:  # a pass that stopped part-way left the schedule behind
            self.stats.num_missed_prefetches += 1
            self._load(k, 0 if len(self.storage) == 1 or self.last_used != 0 else 1)
        b = self.holds.index(k)
        if self.is_cuda:
            torch.cuda.current_stream(self.device).wait_event(self.copied[b])
        _bind(self.layers[k].staging_bound[b])
        self.last_used = b

    def _after_layer(self, k: int, module: nn.Module, args, output) -> None:
        b = self.last_used
        _bind(self.layers[k].host_bound)
        if self.is_cuda:
            self.computed[b].record(torch.cuda.current_stream(self.device))
        upcoming = (k + len(self.storage)) % len(self.layers)
        if upcoming not in self.holds:
            self._load(upcoming, b)


def load_model_for_profile(
    model_dir: Path, profile: Profile, device: torch.device, dtype: torch.dtype, held_bytes: int = 0
) -> tuple[CausalLM, ModelConfig]:
    """Load a checkpoint for `profile`: projections fused, batch-invariant if asked, and split by a
    LayerStreamer (planned again from the real tensors) where `weight_offload` calls for it.
    `held_bytes`: device memory the process already holds. OutOfMemoryError where nothing fits."""
    if is_deepseek_v2(read_raw_config(model_dir) or {}):
        if profile.batch_invariant:
            raise ConfigError(
                f"batch_invariant: true is not available for DeepSeek-V2 models ({model_dir}): its MLA "
                f"attention and expert routing have no batch-invariant kernels; set batch_invariant: false "
                f"in profile '{profile.name}'"
            )
        return load_deepseek_v2(model_dir, device, dtype, profile=profile, held_bytes=held_bytes)
    config, _ = load_model_config(model_dir)
    element_bytes = torch.finfo(dtype).bits // 8
    max_model_len = min(profile.max_model_len, config.max_position_embeddings)
    predicted = None
    is_embedding_on_host = keeps_embeddings_on_host(config, profile, device.type)
    if profile.weight_offload != "off":
        weights = weight_bytes_by_kind(
            config, element_bytes, model_dir=model_dir, is_embedding_on_host=is_embedding_on_host
        )
        predicted = plan_weight_offload(
            config, profile, weights, element_bytes, max_model_len, device_type=device.type, held_bytes=held_bytes
        )
    # Fused tensors replace others, leaving holes the allocator keeps on the device (1.7 GiB for the
    # 1.5B shape in FP16): on CUDA the model is built in host memory and placed after.
    on_host = predicted is not None or device.type == "cuda" or is_embedding_on_host
    load_device = torch.device("cpu") if on_host else device
    model, config = load_model(model_dir, load_device, dtype, fuse=True, batch_invariant=profile.batch_invariant)
    if predicted is None:
        if is_embedding_on_host:  # everything on the device but the (untied) embedding table
            embedding = model.model.embed_tokens.weight
            place_on_device(model, device, kept={id(embedding)})
            model.model.embed_tokens = HostEmbedding(embedding, device)
            model.weight_bytes -= embedding.nbytes
            log.info("embedding table (%.0f MiB) kept in host memory", embedding.nbytes / 2**20)
        elif on_host:
            place_on_device(model, device)
        return model, config
    # Planned again from the loaded model's real tensor sizes.
    own, staged, fixed_bytes, host_embedding_bytes = _inventory(model, predicted.strategy)
    same = ("budget_bytes", "workspace_bytes", "kv_bytes", "reserve_bytes", "strategy")
    plan = plan_offload(
        [sum(tensor.nbytes for tensor, _ in regs.values()) for regs in own],
        [packed_offsets(tensor for tensor, _ in regs.values())[1] for regs in staged],
        fixed_bytes=fixed_bytes,
        host_embedding_bytes=host_embedding_bytes,
        max_resident_layers=profile.max_resident_layers,
        max_model_len=max_model_len,
        **{name: getattr(predicted, name) for name in same},
    )
    plan.check(profile.name)
    LayerStreamer(model, device, plan)
    return model, config
