"""Routed experts in host memory with a small cache of them on the device.

An MoE layer of DeepSeek-V2-Lite holds 64 routed experts (about 4.5 MiB each in AWQ
INT4, 7.3 GiB over 26 layers) but a token uses 6 of them, so a 4 GB card keeps all
experts in host memory (pinned, so copies are asynchronous) and a few per layer in
device slots. `ExpertCache` is one layer's cache; its slots are flat byte buffers
that the expert modules' tensors view, so moving an expert is one copy.

Which experts stay: the ones routed most often lately (an exponentially decayed
count per expert). What moves when: see `ExpertCache.run` and `ExpertCache.prefetch`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace

import torch
from torch import nn

from lowvram.errors import ConfigError, ModelLoadError

# Tensors inside a slot start at multiples of this: aligned loads for the INT4 kernels.
ALIGN_BYTES = 256
# Per step, an expert's routing count decays by this factor before the new count is added.
FREQUENCY_DECAY = 0.9


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
        """The counts accumulated after `earlier` (a copy taken before)."""
        return ExpertCacheStats(**{f.name: getattr(self, f.name) - getattr(earlier, f.name) for f in fields(self)})

    def as_dict(self) -> dict:
        return {
            **asdict(self),
            "hit_rate": self.hit_rate,
            "bytes_per_token": self.bytes_per_token,
            "prefetch_accuracy": self.prefetch_accuracy,
        }


def group_by_expert(
    ids: torch.Tensor, weights: torch.Tensor, counts: list[int]
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Token-expert pairs ordered by expert, without a host sync per expert.

    ids, weights: [T, k]; counts[e]: pairs routed to expert e (on the host). Returns
    (token rows [T*k], their routing weights [T*k], starts): expert e's pairs are
    `starts[e] : starts[e] + counts[e]`, in token order.
    """
    order = ids.flatten().argsort(stable=True)  # [T*k]
    starts = [0] * len(counts)
    for e in range(1, len(counts)):
        starts[e] = starts[e - 1] + counts[e - 1]
    return order // ids.shape[1], weights.flatten()[order], starts


def add_expert_output(
    out: torch.Tensor, expert: nn.Module, x: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor
) -> None:
    """out[rows] += weights * expert(x[rows]); rows [n] token rows, weights [n] their routing weights."""
    out.index_add_(0, rows, expert(x.index_select(0, rows)) * weights[:, None].to(x.dtype))


@dataclass(frozen=True)
class _Piece:
    """One tensor of an expert inside its flat buffer."""

    module_name: str
    attr: str
    offset_bytes: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    is_parameter: bool

    @property
    def num_bytes(self) -> int:
        return torch.Size(self.shape).numel() * torch.empty((), dtype=self.dtype).element_size()


def _layout(expert: nn.Module) -> tuple[list[_Piece], int]:
    """Where each parameter and buffer of an expert lives in its flat buffer, and the buffer's size."""
    pieces, offset = [], 0
    for module_name, module in expert.named_modules():
        tensors = [(n, t, True) for n, t in module._parameters.items() if t is not None]
        tensors += [(n, t, False) for n, t in module._buffers.items() if t is not None]
        for attr, tensor, is_parameter in tensors:
            piece = _Piece(module_name, attr, offset, tuple(tensor.shape), tensor.dtype, is_parameter)
            pieces.append(piece)
            offset += -(-piece.num_bytes // ALIGN_BYTES) * ALIGN_BYTES
    return pieces, offset


def _host_rows(num_rows: int, row_bytes: int, is_pinned: bool) -> list[torch.Tensor]:
    """`num_rows` host buffers of `row_bytes`. torch's pinned allocator rounds every request
    up to a power of two (288 MiB of experts would take 512), so rows come in blocks of
    power-of-two size: a few percent lost instead of up to half."""
    rows: list[torch.Tensor] = []
    while len(rows) < num_rows:
        block_bytes = 2 ** int(math.log2((num_rows - len(rows)) * row_bytes))
        count = min(num_rows - len(rows), max(1, block_bytes // row_bytes))
        rows += torch.empty((count, row_bytes), dtype=torch.uint8, pin_memory=is_pinned).unbind(0)
    return rows


def _view(flat: torch.Tensor, piece: _Piece) -> torch.Tensor:
    return flat[piece.offset_bytes : piece.offset_bytes + piece.num_bytes].view(piece.dtype).view(piece.shape)


def _point_at(expert: nn.Module, pieces: list[_Piece], flat: torch.Tensor) -> None:
    """Make the expert's tensors views of `flat` (a slot), dropping whatever they held."""
    for piece in pieces:
        module = expert.get_submodule(piece.module_name)
        view = _view(flat, piece)
        if piece.is_parameter:
            module._parameters[piece.attr] = nn.Parameter(view, requires_grad=False)
        else:
            module._buffers[piece.attr] = view


class ExpertCache:
    """One MoE layer's routed experts: every one in host memory, `num_slots` on the device.

    Args:
        experts: the layer's expert modules, loaded (on any device); their tensors are
            copied into host memory and the modules become the slots' compute modules.
        num_slots: experts kept on the device, 1..len(experts).
        device: where the slots live. On CUDA the host copies are pinned and experts
            move on a side stream; on the CPU the same code copies synchronously.
        stats: counters shared by every layer's cache.
    """

    def __init__(self, experts: list[nn.Module], num_slots: int, device: torch.device | str, stats: ExpertCacheStats):
        self.device = torch.device(device)
        self.num_experts = len(experts)
        self.stats = stats
        self.pieces, self.expert_bytes = _layout(experts[0])
        for e, expert in enumerate(experts[1:], 1):
            if _layout(expert) != (self.pieces, self.expert_bytes):
                raise ModelLoadError(
                    f"expert {e} has other tensors than expert 0 (shapes, dtypes or compensation "
                    "terms); every routed expert of a layer must have the same ones"
                )
        is_cuda = self.device.type == "cuda"
        self.host = _host_rows(self.num_experts, self.expert_bytes, is_pinned=is_cuda)  # one per expert
        for e, expert in enumerate(experts):
            for piece in self.pieces:
                tensor = getattr(expert.get_submodule(piece.module_name), piece.attr)
                _view(self.host[e], piece).copy_(tensor)
        self.modules = list(experts)  # module i computes whatever expert slot i holds
        self.frequency = [0.0] * self.num_experts
        self.prefetched: set[int] = set()
        self._stream = torch.cuda.Stream(self.device) if is_cuda else None
        self.slots = torch.empty(0, dtype=torch.uint8)
        self.resize(num_slots)

    # -- slots -------------------------------------------------------------------
    @property
    def num_slots(self) -> int:
        return self.slots.shape[0]

    @property
    def device_bytes(self) -> int:
        return self.slots.numel()

    def resize(self, num_slots: int) -> None:
        """Reallocate the device slots (contents are refetched: the lowest expert ids first)."""
        if not 1 <= num_slots <= self.num_experts:
            raise ConfigError(f"an expert cache needs 1..{self.num_experts} slots, got {num_slots}")
        self.synchronize()
        self.slots = torch.empty(0, dtype=torch.uint8)  # free the old slots before allocating new ones
        self.slots = torch.empty((num_slots, self.expert_bytes), dtype=torch.uint8, device=self.device)
        for s in range(num_slots):
            _point_at(self.modules[s], self.pieces, self.slots[s])
        for module in self.modules[num_slots:]:
            _point_at(module, self.pieces, torch.empty(self.expert_bytes, dtype=torch.uint8, device="meta"))
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
        """Wait for every copy in flight."""
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

    # -- compute -----------------------------------------------------------------
    def run(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Sum of the routed experts' weighted outputs: x [T, hidden], weights/ids [T, k] -> [T, hidden].

        `counts[e]` is how many of the T tokens chose expert e (known on the host).

        Design: routing needs this layer's post-attention hidden state, so the exact set is
        known only now. Experts already in a slot (including ones `prefetch` started during
        the previous layer) compute first, while the missing ones are copied on the side
        stream into the slots of experts this step does not need (least routed first).
        When more experts are missing than such slots, the rest follow in waves: each
        goes into the slot of an expert that has finished computing, as soon as it has
        (the copy waits for that compute on the GPU, not on the host). Nothing here waits
        on the host, so copies overlap compute. A one-token decode step with a cold cache
        moves at most k experts per layer.
        """
        self._update_frequency(counts)
        needed = [e for e, c in enumerate(counts) if c]
        resident = [e for e in needed if e in self.slot_of]
        missing = [e for e in needed if e not in self.slot_of]
        self.stats.num_lookups += len(needed)
        self.stats.num_hits += len(resident)
        self.stats.num_prefetch_hits += len(self.prefetched.intersection(resident))
        self.prefetched.clear()

        token_rows, sorted_weights, starts = group_by_expert(ids, weights, counts)
        out = torch.zeros_like(x)

        def compute(expert: int) -> int:
            slot = self.slot_of[expert]
            if self._is_copy_pending[slot]:
                torch.cuda.current_stream(self.device).wait_event(self._copied[slot])
                self._is_copy_pending[slot] = False
            span = slice(starts[expert], starts[expert] + counts[expert])
            add_expert_output(out, self.modules[slot], x, token_rows[span], sorted_weights[span])
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
        """Start copying experts a guess of this layer's routing names (`counts[e]` tokens
        guessed for expert e), the most guessed first, into slots of experts the guess does
        not name. Returns at once; `run` waits for the copies on the GPU."""
        guessed = {e for e, c in enumerate(counts) if c}
        wanted = sorted((e for e in guessed if e not in self.slot_of), key=lambda e: (-counts[e], -self.frequency[e]))
        for expert, slot in zip(wanted, self._victims(guessed)):
            self._fetch(expert, slot)
            self.prefetched.add(expert)
            self.stats.num_prefetches += 1

    def _update_frequency(self, counts: list[int]) -> None:
        self.frequency = [f * FREQUENCY_DECAY + c for f, c in zip(self.frequency, counts)]
