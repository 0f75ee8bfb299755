"""Decoder layers that do not fit the device budget run from host memory.

A 7B model in AWQ INT4 does not fit a 4 GB card beside its KV cache. The split
(memory_plan.plan_offload): the head and the norms stay on the device; the embedding
table moves to host memory, where a step looks up its rows and copies only the
[T, hidden] activations over; the first decoder layers stay on the device as far as the
budget allows after the workspace and one full-length sequence's KV; the rest stream.

Streaming ("stream", the default): each streamed layer's tensors, whatever their names
(so AWQ tensors and fused projections stream like plain weights), are packed into one
pinned host buffer. Two device staging buffers take turns: while layer k computes from
one, layer k+1's copy sits in the other, and layer k+2's copy starts on a side stream as
soon as layer k's kernels are done; CUDA events order the streams and the CPU never
waits. Forward hooks point a layer's tensors at its staging buffer and back at the host
copy afterwards (so state_dict and reports see the real weights). The last layers queue
the first ones of the next pass, so those copies run while the step samples. On the CPU
the same copies happen synchronously, so CPU tests exercise the whole path.

Strategy "cpu": attention stays on the GPU (its weights staged as above) and each
streamed layer's MLP, 87% of its bytes, runs on the CPU from float32 host weights, so
the bus carries activations instead of weights. It loses to streaming wherever the bus
is PCIe 4 or better (scripts/bench_7b_streaming.py measures both).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from torch import nn

from lowvram.config import Profile
from lowvram.errors import ConfigError
from lowvram.kernels.awq_format import dequantize_awq
from lowvram.memory.plan import (
    NUM_STAGING_BUFFERS,
    OffloadPlan,
    keeps_embeddings_on_host,
    plan_offload,
    plan_weight_offload,
    weight_bytes_by_kind,
)
from lowvram.models.batch_invariance import InvariantLinear
from lowvram.models.config import ModelConfig, load_model_config
from lowvram.models.dense import CausalLM
from lowvram.models.loader import is_deepseek_v2_checkpoint, load_model
from lowvram.quant.awq_linear import LORA_A, LORA_B, AwqLinear

log = logging.getLogger("lowvram")

# Tensors inside a packed layer start at multiples of this: aligned loads for the kernels,
# and the same alignment the caching allocator gives the all-resident tensors.
ALIGN_BYTES = 256
# The "cpu" strategy dequantizes INT4 weights in slices of this many elements (bounded scratch).
DEQUANT_CHUNK_ELEMENTS = 1 << 24


def _align(num_bytes: int) -> int:
    return -(-num_bytes // ALIGN_BYTES) * ALIGN_BYTES


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


# ---------------------------------------------------------------- where tensors are registered


@dataclass
class _Binding:
    """One place a tensor is registered: `module._parameters[name]` or `module._buffers[name]`."""

    module: nn.Module
    name: str
    is_parameter: bool

    def wrap(self, tensor: torch.Tensor) -> torch.Tensor:
        """The object to register (Parameters stay Parameters); made once, set many times."""
        if self.is_parameter and not isinstance(tensor, nn.Parameter):
            return nn.Parameter(tensor, requires_grad=False)
        return tensor

    def set(self, tensor: torch.Tensor) -> None:
        (self.module._parameters if self.is_parameter else self.module._buffers)[self.name] = tensor


Registrations = dict[int, tuple[torch.Tensor, list[_Binding]]]


def _registrations(root: nn.Module, skip: set[int] = frozenset()) -> Registrations:
    """Every parameter and buffer under `root`, by tensor id, with every place it is
    registered. Modules whose id is in `skip`, and host-computed modules, are not entered."""
    found: Registrations = {}
    seen: set[int] = set()
    stack = [root]
    while stack:
        module = stack.pop()
        if id(module) in seen or id(module) in skip or isinstance(module, HostComputed):
            continue
        seen.add(id(module))
        for is_parameter, table in ((True, module._parameters), (False, module._buffers)):
            for name, tensor in table.items():
                if tensor is not None:
                    found.setdefault(id(tensor), (tensor, []))[1].append(_Binding(module, name, is_parameter))
        stack.extend(reversed([m for m in module._modules.values() if m is not None]))
    return found


def place_on_device(model: nn.Module, device: torch.device, kept: Collection[int] = ()) -> None:
    """Move every parameter and buffer of `model` but the `kept` ones (tensor ids) to
    `device`, each once, in module order (tied tensors stay tied)."""
    for tensor_id, (tensor, bindings) in _registrations(model).items():
        if tensor_id in kept:
            continue
        moved = tensor.to(device)
        for binding in bindings:
            binding.set(binding.wrap(moved))


@dataclass
class _LayerInventory:
    own: Registrations  # tensors only this layer holds
    staged: Registrations  # what a streamed copy of it carries

    @property
    def device_bytes(self) -> int:
        return sum(_nbytes(t) for t, _ in self.own.values())

    @property
    def staged_bytes(self) -> int:
        """Bytes of the packed copy (_PackedLayer): the tensors at aligned offsets."""
        total = 0
        for tensor, _ in self.staged.values():
            total = _align(total) + _nbytes(tensor)
        return total


@dataclass
class _Inventory:
    layers: list[_LayerInventory]
    fixed_bytes: int  # tensors outside the layers (or shared between them) that stay on the device
    host_embedding_bytes: int  # the embedding table, when nothing else holds it (an untied head)


def _inventory(model: CausalLM, strategy: str) -> _Inventory:
    layers = list(model.model.layers)
    per_layer = [_registrations(layer) for layer in layers]
    outside = _registrations(model, skip={id(layer) for layer in layers})
    counts = Counter(tensor_id for regs in per_layer for tensor_id in regs)
    inventories = []
    for layer, regs in zip(layers, per_layer):
        own = {i: entry for i, entry in regs.items() if counts[i] == 1 and i not in outside}
        staged = own
        mlp = getattr(layer, "mlp", None)
        if strategy == "cpu" and isinstance(mlp, nn.Module):
            on_cpu = _registrations(mlp)
            staged = {i: entry for i, entry in own.items() if i not in on_cpu}
        inventories.append(_LayerInventory(own, staged))
    shared = {i: entry for regs in per_layer for i, entry in regs.items() if counts[i] > 1 and i not in outside}
    embedding = getattr(model.model.embed_tokens, "weight", None)
    is_movable = (
        embedding is not None
        and id(embedding) in outside
        and all(binding.module is model.model.embed_tokens for binding in outside[id(embedding)][1])
    )
    host_embedding = _nbytes(embedding) if is_movable and id(embedding) not in shared else 0
    fixed = sum(_nbytes(t) for t, _ in {**outside, **shared}.values()) - host_embedding
    return _Inventory(inventories, fixed, host_embedding)


# ---------------------------------------------------------------- host-side modules


class _PinnedAsDevice:
    """The CUDA array interface of a pinned host tensor: with unified addressing the GPU reads
    pinned host memory at the host address, so torch.as_tensor(this, device="cuda") makes a
    CUDA tensor whose kernels read the rows over the bus (no copy is made). Two-byte dtypes
    go through as int16 (the interface has no bfloat16)."""

    def __init__(self, host: torch.Tensor):
        self.host = host  # kept alive by the CUDA tensor's storage, which holds this object
        typestr = {1: "|u1", 2: "<i2", 4: "<i4", 8: "<i8"}[host.element_size()]
        self.__cuda_array_interface__ = {
            "shape": tuple(host.shape),
            "typestr": typestr,
            "data": (host.data_ptr(), False),
            "strides": None,
            "version": 3,
        }


def pinned_device_view(host: torch.Tensor, device: torch.device) -> torch.Tensor | None:
    """A CUDA tensor over pinned, contiguous `host` memory (read through unified addressing),
    or None where the driver does not map it (the caller then copies rows over itself)."""
    if not host.is_pinned() or not host.is_contiguous():
        return None
    try:
        view = torch.as_tensor(_PinnedAsDevice(host), device=device)  # integers of the element's size
    except (RuntimeError, TypeError) as exc:  # no unified addressing, or an unmapped allocation
        log.info("pinned host memory is not readable from %s (%s); rows are copied instead", device, exc)
        return None
    return view.view(host.dtype)


class HostEmbedding(nn.Module):
    """An embedding table in host memory: only the [T, hidden] activations cross the bus.
    Keeps the name `weight`, so state_dict and the loader's reports see the same tensor as before.

    On a CUDA device the table is pinned and the GPU gathers its rows itself, reading the
    pinned memory through unified addressing (`device_view`): a step's token ids never need
    to reach the host, and a CUDA graph captures the gather like any other kernel. Where the
    driver cannot map the table, a step gathers its rows on the host instead; a decode graph
    is then captured with a copy from a fixed pinned buffer, and `stage` fills that buffer
    with the next replay's rows before each replay (lowvram.engine.cuda_graphs)."""

    def __init__(self, weight: torch.Tensor, device: torch.device):
        super().__init__()
        self.device = torch.device(device)
        self.device_view: torch.Tensor | None = None  # [V, hidden] on the device, reading host memory
        if self.device.type == "cuda":
            with torch.inference_mode(False):
                pinned = torch.empty_like(weight, pin_memory=True)
                pinned.copy_(weight)
            weight = pinned
            self.device_view = pinned_device_view(weight, self.device)
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.num_embeddings, self.embedding_dim = weight.shape
        self._rows: torch.Tensor | None = None  # pinned [T, hidden], reused by every step
        self._copied = torch.cuda.Event() if self.device.type == "cuda" else None
        self._graph_rows: torch.Tensor | None = None  # pinned [max batch, hidden], what graphs copy from

    def stage(self, token_ids: list[int], capacity: int) -> None:
        """Gather the rows of `token_ids` (a graph's batch, padding included) for the next
        replay. `capacity` is the largest batch any graph holds: the buffer is made once at
        that size, since graphs keep its address. The caller makes sure no replay still reads it."""
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
    """A module computed on the CPU in float32 inside a model on another device: its input
    is copied over and its output back. The layer-streaming walk never enters it."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x.to("cpu", torch.float32)).to(x.device, x.dtype)


def dense_linear(awq: AwqLinear, compute_device: torch.device) -> nn.Linear:
    """The float32 host nn.Linear an AwqLinear computes: INT4 dequantized (in slices of
    output columns, on `compute_device`), low-rank compensation folded into the weight (the
    bias already holds any bias correction)."""
    k, n, g = awq.in_features, awq.out_features, awq.group_size
    weight = torch.empty(n, k, dtype=torch.float32)  # nn.Linear layout [N, K]
    cols = max(8, DEQUANT_CHUNK_ELEMENTS // k // 8 * 8)  # whole int32 words of 8 columns
    for start in range(0, n, cols):
        end = min(n, start + cols)
        part = dequantize_awq(
            awq.qweight[:, start // 8 : end // 8].to(compute_device),
            awq.qzeros[:, start // 8 : end // 8].to(compute_device),
            awq.scales[:, start:end].to(compute_device),
            g,
            dtype=torch.float32,
        )  # [K, cols]
        weight[start:end] = part.t().contiguous().cpu()
    lora_a, lora_b = getattr(awq, LORA_A), getattr(awq, LORA_B)
    if lora_a is not None and lora_b is not None:
        weight += lora_b.float().cpu() @ lora_a.float().cpu()  # [N, r] @ [r, K]: x A^T B^T = x (B A)^T
    bias = awq.bias.float().cpu() if awq.bias is not None else None
    kind = InvariantLinear if awq.is_batch_invariant else nn.Linear  # the model was built batch-invariant
    linear = kind(k, n, bias=bias is not None, device="meta")
    linear.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        linear.bias = nn.Parameter(bias, requires_grad=False)
    return linear


def compute_on_host(module: nn.Module, compute_device: torch.device) -> HostComputed:
    """`module` as a float32 CPU module (its AwqLinears made dense), wrapped to run on the CPU."""
    for name, child in list(module.named_modules()):
        if isinstance(child, AwqLinear) and name:
            parent_name, _, attr = name.rpartition(".")
            parent = module.get_submodule(parent_name) if parent_name else module
            setattr(parent, attr, dense_linear(child, compute_device))
    if isinstance(module, AwqLinear):
        module = dense_linear(module, compute_device)
    return HostComputed(module.to("cpu", torch.float32))


# ---------------------------------------------------------------- streamed layers


@dataclass(frozen=True)
class _Packed:
    """Where one tensor sits in a packed layer, and where it is registered."""

    offset: int
    dtype: torch.dtype
    shape: torch.Size
    num_bytes: int
    bindings: list[_Binding]


class _PackedLayer:
    """One streamed layer: its tensors packed into one host buffer (pinned on CUDA), and
    the tensors to register while it computes from each staging buffer."""

    def __init__(self, index: int, registrations: Registrations, is_pinned: bool):
        self.index = index
        self.entries: list[_Packed] = []
        offset = 0
        for tensor, bindings in registrations.values():
            offset = _align(offset)
            self.entries.append(_Packed(offset, tensor.dtype, tensor.shape, _nbytes(tensor), bindings))
            offset += _nbytes(tensor)
        self.num_bytes = offset
        self.host = torch.empty(self.num_bytes, dtype=torch.uint8, pin_memory=is_pinned)
        for view, (tensor, _) in zip(self._views(self.host), registrations.values()):
            view.copy_(tensor)
        self.host_bound = self._bound(self.host)
        self.staging_bound: list[list[tuple[_Binding, torch.Tensor]]] = []
        self.bind(self.host_bound)  # the unpacked originals are freed once the caller drops them

    def _views(self, storage: torch.Tensor) -> list[torch.Tensor]:
        return [storage[e.offset : e.offset + e.num_bytes].view(e.dtype).view(e.shape) for e in self.entries]

    def _bound(self, storage: torch.Tensor) -> list[tuple[_Binding, torch.Tensor]]:
        return [
            (binding, binding.wrap(view))
            for view, e in zip(self._views(storage), self.entries)
            for binding in e.bindings
        ]

    def add_staging(self, storage: torch.Tensor) -> None:
        self.staging_bound.append(self._bound(storage))

    @staticmethod
    def bind(bound: list[tuple[_Binding, torch.Tensor]]) -> None:
        for binding, tensor in bound:
            binding.set(tensor)


@dataclass
class StreamingStats:
    """Counters since the streamer was made; bytes are host-to-device copies of layers."""

    num_copies: int = 0
    copied_bytes: int = 0
    num_missed_prefetches: int = 0  # layers whose copy had not been queued ahead (an interrupted pass)
    num_layer_passes: int = 0


@dataclass
class _Buffers:
    """The staging buffers and, per buffer, the layer it holds or receives and its events."""

    storage: list[torch.Tensor]
    holds: list[int | None]  # streamed layer index
    copied: list[torch.cuda.Event | None]  # the copy into the buffer is done
    computed: list[torch.cuda.Event | None]  # the last layer computed from the buffer is done
    last_used: int | None = None
    copy_stream: torch.cuda.Stream | None = None


class LayerStreamer:
    """Splits a model loaded in host memory as `plan` says and runs its streamed layers.

    Places the fixed weights and the resident layers on `device`, packs the streamed
    layers into host memory, moves an untied embedding table to a HostEmbedding, and
    hooks the streamed layers (see the module notes). Attaches itself as
    `model.layer_streamer`, sets `model.weight_bytes` to what the device holds, and turns
    `model.supports_cuda_graphs` off while anything streams: a graph would replay stale
    weights and cannot hold the host-side lookups.
    """

    def __init__(self, model: CausalLM, device: torch.device | str, plan: OffloadPlan):
        self.plan = plan
        self.device = torch.device(device)
        self.is_cuda = self.device.type == "cuda"
        self.stats = StreamingStats()
        layers = list(model.model.layers)
        streamed = layers[plan.num_resident_layers :]
        with torch.no_grad():
            if plan.strategy == "cpu":
                for layer in streamed:
                    if isinstance(getattr(layer, "mlp", None), nn.Module):
                        layer.mlp = compute_on_host(layer.mlp, self.device)
            inventory = _inventory(model, plan.strategy)
            self.has_host_embedding = plan.is_embedding_on_host and inventory.host_embedding_bytes > 0
            embedding = model.model.embed_tokens.weight if self.has_host_embedding else None
            staged = [layer.staged for layer in inventory.layers[plan.num_resident_layers :]]
            kept = {i for regs in staged for i in regs} | ({id(embedding)} if embedding is not None else set())
            place_on_device(model, self.device, kept)
            self.layers = [
                _PackedLayer(plan.num_resident_layers + k, regs, self.is_cuda) for k, regs in enumerate(staged)
            ]
            if embedding is not None:
                model.model.embed_tokens = HostEmbedding(embedding, self.device)
            buffer_bytes = max((layer.num_bytes for layer in self.layers), default=0)
            num_buffers = min(NUM_STAGING_BUFFERS, len(self.layers))
            storage = [torch.empty(buffer_bytes, dtype=torch.uint8, device=self.device) for _ in range(num_buffers)]
            for layer in self.layers:
                for buffer in storage:
                    layer.add_staging(buffer)
        events = (lambda: [torch.cuda.Event() for _ in storage]) if self.is_cuda else (lambda: [None] * num_buffers)
        self.buffers = _Buffers(
            storage,
            [None] * num_buffers,
            events(),
            events(),
            copy_stream=torch.cuda.Stream(device=self.device) if self.is_cuda else None,
        )
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

    # -- the copy schedule ------------------------------------------------------
    def _holding(self, k: int) -> int | None:
        return self.buffers.holds.index(k) if k in self.buffers.holds else None

    def _load(self, k: int, b: int) -> None:
        """Copy streamed layer k into buffer b once the layer computing from b is done."""
        layer, buffers = self.layers[k], self.buffers
        target = buffers.storage[b][: layer.num_bytes]
        if self.is_cuda:
            with torch.cuda.stream(buffers.copy_stream):
                buffers.copy_stream.wait_event(buffers.computed[b])
                target.copy_(layer.host, non_blocking=True)
                buffers.copied[b].record(buffers.copy_stream)
        else:
            target.copy_(layer.host)
        buffers.holds[b] = k
        self.stats.num_copies += 1
        self.stats.copied_bytes += layer.num_bytes

    def _before_layer(self, k: int, module: nn.Module, args) -> None:
        buffers = self.buffers
        b = self._holding(k)
        if b is None:  # a pass that stopped part-way left the schedule behind
            self.stats.num_missed_prefetches += 1
            b = 0 if len(buffers.storage) == 1 or buffers.last_used != 0 else 1
            self._load(k, b)
        if self.is_cuda:
            torch.cuda.current_stream(self.device).wait_event(buffers.copied[b])
        self.layers[k].bind(self.layers[k].staging_bound[b])
        buffers.last_used = b

    def _after_layer(self, k: int, module: nn.Module, args, output) -> None:
        buffers = self.buffers
        b = buffers.last_used
        layer = self.layers[k]
        layer.bind(layer.host_bound)
        if self.is_cuda:
            buffers.computed[b].record(torch.cuda.current_stream(self.device))
        self.stats.num_layer_passes += 1
        upcoming = (k + len(buffers.storage)) % len(self.layers)
        if self._holding(upcoming) is None:
            self._load(upcoming, b)


# ---------------------------------------------------------------- loading for a profile


def load_model_for_profile(
    model_dir: str | Path,
    profile: Profile,
    device: torch.device | str,
    dtype: torch.dtype | None = None,
    *,
    held_bytes: int = 0,
) -> tuple[CausalLM, ModelConfig]:
    """Build and load a checkpoint for `profile`: projections fused, batch-invariant kernels
    when the profile asks, and, when its `weight_offload` calls for a split
    (memory_plan.plan_weight_offload), loaded into host memory and split by a LayerStreamer
    sized from the real tensors. DeepSeek-V2 checkpoints size their routed experts' device
    cache from the profile instead (loader.load_model).

    `held_bytes` is device memory the process already holds (memory_plan.memory_budget_bytes).
    Raises OutOfMemoryError with the numbers when not even every layer streaming fits.
    """
    model_dir, device = Path(model_dir), torch.device(device)
    if is_deepseek_v2_checkpoint(model_dir):
        if profile.batch_invariant:
            raise ConfigError(
                f"batch_invariant: true is not available for DeepSeek-V2 models ({model_dir}): its MLA "
                f"attention and expert routing have no batch-invariant kernels; set batch_invariant: false "
                f"in profile '{profile.name}'"
            )
        return load_model(model_dir, device, dtype, profile=profile, held_bytes=held_bytes)
    dtype = dtype or (torch.float16 if device.type == "cuda" else torch.float32)
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
            config,
            profile,
            weights,
            element_bytes,
            max_model_len,
            device_type=device.type,
            held_bytes=held_bytes,
        )
    # Fusing makes new tensors and drops the ones they replace. Done on the device, the dropped
    # ones would leave holes the allocator keeps (1.7 GiB for the 1.5B shape in FP16), so on
    # CUDA the model is built in host memory and placed after; the fused tensors are the ones
    # that stream.
    on_host = predicted is not None or device.type == "cuda" or is_embedding_on_host
    model, config = load_model(
        model_dir,
        torch.device("cpu") if on_host else device,
        dtype,
        fuse=True,
        batch_invariant=profile.batch_invariant,
    )
    if predicted is None:
        if is_embedding_on_host:  # everything on the device but the (untied) embedding table
            embedding = model.model.embed_tokens.weight
            place_on_device(model, device, kept={id(embedding)})
            model.model.embed_tokens = HostEmbedding(embedding, device)
            model.weight_bytes -= _nbytes(embedding)
            log.info("embedding table (%.0f MiB) kept in host memory", _nbytes(embedding) / 2**20)
        elif on_host:
            place_on_device(model, device)
        return model, config
    # Planned again from the loaded model's real tensor sizes.
    inventory = _inventory(model, predicted.strategy)
    plan = plan_offload(
        [layer.device_bytes for layer in inventory.layers],
        [layer.staged_bytes for layer in inventory.layers],
        fixed_bytes=inventory.fixed_bytes,
        host_embedding_bytes=inventory.host_embedding_bytes,
        budget_bytes=predicted.budget_bytes,
        workspace_bytes=predicted.workspace_bytes,
        kv_bytes=predicted.kv_bytes,
        reserve_bytes=predicted.reserve_bytes,
        strategy=predicted.strategy,
        max_resident_layers=profile.max_resident_layers,
        max_model_len=max_model_len,
    )
    plan.check(profile.name)
    LayerStreamer(model, device, plan)
    return model, config
