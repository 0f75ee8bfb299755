"""Routed experts in host memory with a small device cache per MoE layer (DeepSeek-V2-Lite: 64
experts a layer, 6 per token). A slot is one flat buffer the expert's tensors view, so moving an
expert is one copy; the experts routed most often lately stay.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass, fields, replace

import torch
from torch import nn

from lowvram.errors import ConfigError, ModelLoadError

# Tensors inside a flat buffer start at multiples of this: aligned loads for the INT4 kernels.
ALIGN_BYTES = 256
# Per step, an expert's routing count decays by this factor before the new count is added.
FREQUENCY_DECAY = 0.9


def align(num_bytes: int) -> int:
    return -(-num_bytes // ALIGN_BYTES) * ALIGN_BYTES


def packed_offsets(tensors) -> tuple[list[int], int]:
    """Byte offsets of `tensors` packed one after another at aligned starts, and the end of the last."""
    offsets, end = [], 0
    for tensor in tensors:
        offsets.append(align(end))
        end = offsets[-1] + tensor.nbytes
    return offsets, end


def view_like(flat: torch.Tensor, offset: int, like: torch.Tensor) -> torch.Tensor:
    """The bytes of uint8 `flat` at `offset` as a tensor of `like`'s dtype and shape."""
    return flat[offset : offset + like.nbytes].view(like.dtype).view(like.shape)


@dataclass
class ExpertCacheStats:
    """Counters over every MoE layer. A lookup is one expert one step needs at one layer."""

    num_lookups: int = 0
    num_hits: int = 0  # lookups whose expert was on the device or already on its way
    num_fetches: int = 0  # host-to-device expert copies, prefetched or on demand
    num_prefetches: int = 0
    num_prefetch_hits: int = 0  # prefetched experts the next lookup needed
    fetched_bytes: int = 0
    num_tokens: int = 0  # tokens that went through the model

    @property
    def hit_rate(self) -> float:
        return self.num_hits / self.num_lookups if self.num_lookups else 1.0

    @property
    def bytes_per_token(self) -> float:
        return self.fetched_bytes / self.num_tokens if self.num_tokens else 0.0

    @property
    def prefetch_accuracy(self) -> float:
        return self.num_prefetch_hits / self.num_prefetches if self.num_prefetches else 0.0

    def copy(self) -> ExpertCacheStats:
        return replace(self)

    def since(self, earlier: ExpertCacheStats) -> ExpertCacheStats:
        return ExpertCacheStats(**{f.name: getattr(self, f.name) - getattr(earlier, f.name) for f in fields(self)})

    def as_dict(self) -> dict:
        rates = ("hit_rate", "bytes_per_token", "prefetch_accuracy")
        return {**asdict(self), **{name: getattr(self, name) for name in rates}}


def expert_adder(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, counts: list[int]):
    """(out, add) for x [T, hidden] routed as weights/ids [T, k], `counts[e]` tokens to expert e:
    add(e, module) adds expert e's weighted output to zeros `out` [T, hidden] for its tokens,
    found without a host sync per expert."""
    out = torch.zeros_like(x)
    order = ids.flatten().argsort(stable=True)  # [T*k]: the pairs ordered by expert, tokens in order
    rows, sorted_weights = order // ids.shape[1], weights.flatten()[order]
    starts = list(itertools.accumulate(counts[:-1], initial=0))

    def add(expert: int, module: nn.Module) -> None:
        span = slice(starts[expert], starts[expert] + counts[expert])
        out.index_add_(0, rows[span], module(x.index_select(0, rows[span])) * sorted_weights[span, None].to(x.dtype))

    return out, add


def _tensors(expert: nn.Module) -> list[tuple[dict, str, torch.Tensor]]:
    """(the module's _parameters or _buffers, name, tensor) of every tensor under `expert`."""
    tables = [table for module in expert.modules() for table in (module._parameters, module._buffers)]
    return [(table, name, tensor) for table in tables for name, tensor in table.items() if tensor is not None]


def _host_rows(num_rows: int, row_bytes: int, is_pinned: bool) -> list[torch.Tensor]:
    """`num_rows` host buffers of `row_bytes`, in blocks of power-of-two size: torch's pinned
    allocator rounds each request up to one (288 MiB of experts would take 512)."""
    rows: list[torch.Tensor] = []
    while len(rows) < num_rows:
        block_bytes = 2 ** int(math.log2((num_rows - len(rows)) * row_bytes))
        count = min(num_rows - len(rows), max(1, block_bytes // row_bytes))
        rows += torch.empty((count, row_bytes), dtype=torch.uint8, pin_memory=is_pinned).unbind(0)
    return rows


class ExpertCache:
    """One MoE layer's routed experts, all in host memory, `num_slots` of them on `device`; the
    expert modules become the slots' compute modules. On CUDA experts move on a side stream."""

    def __init__(self, experts: list[nn.Module], num_slots: int, device: torch.device | str, stats: ExpertCacheStats):
        self.device = torch.device(device)
        self.num_experts = len(experts)
        self.stats = stats
        tensors = [_tensors(expert) for expert in experts]
        signatures = [[(name, t.shape, t.dtype) for _, name, t in entries] for entries in tensors]
        for e, signature in enumerate(signatures):
            if signature != signatures[0]:
                raise ModelLoadError(
                    f"expert {e} has other tensors than expert 0 (shapes, dtypes or compensation "
                    "terms); every routed expert of a layer must have the same ones"
                )
        self.offsets, end = packed_offsets(t for _, _, t in tensors[0])
        self.expert_bytes = align(end)
        is_cuda = self.device.type == "cuda"
        self.host = _host_rows(self.num_experts, self.expert_bytes, is_pinned=is_cuda)  # one per expert
        for row, entries in zip(self.host, tensors):
            for offset, (_, _, tensor) in zip(self.offsets, entries):
                view_like(row, offset, tensor).copy_(tensor)
        self.likes = [view_like(self.host[0], offset, t) for offset, (_, _, t) in zip(self.offsets, tensors[0])]
        self.modules = list(experts)  # module i computes whatever expert slot i holds
        self.tables = [[(table, name) for table, name, _ in entries] for entries in tensors]  # where they register
        self.frequency = [0.0] * self.num_experts
        self.prefetched: set[int] = set()
        self._stream = torch.cuda.Stream(self.device) if is_cuda else None
        self.slots = torch.empty(0, dtype=torch.uint8)
        self.resize(num_slots)

    @property
    def num_slots(self) -> int:
        return self.slots.shape[0]

    @property
    def device_bytes(self) -> int:
        return self.slots.numel()

    def _point_at(self, module: int, flat: torch.Tensor) -> None:
        """Make module `module`'s tensors views of `flat` (a slot), dropping what they held."""
        for (table, name), offset, like in zip(self.tables[module], self.offsets, self.likes):
            view = view_like(flat, offset, like)
            table[name] = nn.Parameter(view, requires_grad=False) if isinstance(table[name], nn.Parameter) else view

    def resize(self, num_slots: int) -> None:
        """Reallocate the device slots (contents are refetched: the lowest expert ids first)."""
        if not 1 <= num_slots <= self.num_experts:
            raise ConfigError(f"an expert cache needs 1..{self.num_experts} slots, got {num_slots}")
        self.synchronize()
        self.slots = torch.empty(0, dtype=torch.uint8)  # free the old slots before allocating new ones
        self.slots = torch.empty((num_slots, self.expert_bytes), dtype=torch.uint8, device=self.device)
        nowhere = torch.empty(self.expert_bytes, dtype=torch.uint8, device="meta")
        for m in range(self.num_experts):
            self._point_at(m, self.slots[m] if m < num_slots else nowhere)
        self.expert_in_slot = [-1] * num_slots
        self.slot_of: dict[int, int] = {}
        if self._stream is not None:
            self._copied = [torch.cuda.Event() for _ in range(num_slots)]
            self._used = [torch.cuda.Event() for _ in range(num_slots)]
        self._is_copy_pending = [False] * num_slots
        self._has_use = [False] * num_slots
        for s in range(num_slots):
            self._load(s, s)
        self.synchronize()

    def synchronize(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()

    def _load(self, expert: int, slot: int) -> None:
        """Copy an expert into a slot, after the compute that last read the slot."""
        old = self.expert_in_slot[slot]
        if old >= 0:
            del self.slot_of[old]
        self.expert_in_slot[slot] = expert
        self.slot_of[expert] = slot
        if self._stream is None:
            self.slots[slot].copy_(self.host[expert])
            return
        with torch.cuda.stream(self._stream):
            if self._has_use[slot]:
                self._stream.wait_event(self._used[slot])
            self.slots[slot].copy_(self.host[expert], non_blocking=True)
            self._copied[slot].record(self._stream)
        self._is_copy_pending[slot] = True

    def _fetch(self, expert: int, slot: int) -> None:
        self._load(expert, slot)
        self.stats.num_fetches += 1
        self.stats.fetched_bytes += self.expert_bytes

    def _victims(self, keep: set[int]) -> list[int]:
        """Slots that may take another expert, best first: empty ones, then the least routed lately."""
        empty = [s for s, e in enumerate(self.expert_in_slot) if e < 0]
        held = [s for s, e in enumerate(self.expert_in_slot) if e >= 0 and e not in keep]
        return empty + sorted(held, key=lambda s: self.frequency[self.expert_in_slot[s]])

    def run(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """The routed experts' weighted outputs: x [T, hidden], weights/ids [T, k] -> [T, hidden];
        `counts[e]` tokens chose expert e. Resident experts compute while the missing ones are
        copied into slots of experts not needed; the rest follow in waves into slots whose expert
        has finished (the copy waits for it on the GPU, never on the host)."""
        self.frequency = [f * FREQUENCY_DECAY + c for f, c in zip(self.frequency, counts)]
        needed = [e for e, c in enumerate(counts) if c]
        resident = [e for e in needed if e in self.slot_of]
        missing = [e for e in needed if e not in self.slot_of]
        self.stats.num_lookups += len(needed)
        self.stats.num_hits += len(resident)
        self.stats.num_prefetch_hits += len(self.prefetched.intersection(resident))
        self.prefetched.clear()

        out, add = expert_adder(x, weights, ids, counts)

        def compute(expert: int) -> int:
            slot = self.slot_of[expert]
            if self._is_copy_pending[slot]:
                torch.cuda.current_stream(self.device).wait_event(self._copied[slot])
                self._is_copy_pending[slot] = False
            add(expert, self.modules[slot])
            if self._stream is not None:
                self._used[slot].record(torch.cuda.current_stream(self.device))
                self._has_use[slot] = True
            return slot

        queued: list[int] = []
        for expert, slot in zip(missing, self._victims(set(needed))):
            self._fetch(expert, slot)
            queued.append(expert)
        waiting = missing[len(queued) :]
        finished_slots = [compute(e) for e in resident]
        while queued or waiting:
            # Refill the finished slots first, so these copies overlap the compute queued next.
            while waiting and finished_slots:
                slot = min(finished_slots, key=lambda s: self.frequency[self.expert_in_slot[s]])
                finished_slots.remove(slot)
                self._fetch(waiting[0], slot)
                queued.append(waiting.pop(0))
            finished_slots.append(compute(queued.pop(0)))
        return out

    def prefetch(self, counts: list[int]) -> None:
        """Start copying the experts a guess of the routing names (`counts[e]` tokens each), the most
        guessed first, into slots of experts it does not name; `run` waits for them on the GPU."""
        guessed = {e for e, c in enumerate(counts) if c}
        wanted = sorted((e for e in guessed if e not in self.slot_of), key=lambda e: (-counts[e], -self.frequency[e]))
        for expert, slot in zip(wanted, self._victims(guessed)):
            self._fetch(expert, slot)
            self.prefetched.add(expert)
            self.stats.num_prefetches += 1
