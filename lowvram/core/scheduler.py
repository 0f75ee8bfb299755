"""Which sequences run next, with how many tokens: prefill steps chunked under the token budget,
or decode steps of one token each that preempt the newest sequences (recomputed later) when
pages run out. `num_lookahead_tokens` also takes the next step's page, for pipelined decode."""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from lowvram.core.block_manager import BlockManager, PrefixMatch
from lowvram.core.sequence import Sequence

# A step scoring a prompt holds logits for every position: [tokens, vocab] FP32, 80 MB at 128 x 150k.
MAX_SCORED_TOKENS = 128


def is_scoring(seq: Sequence) -> bool:
    """Whether the sequence still has prompt tokens to score (params.prompt_logprobs)."""
    return seq.params.prompt_logprobs is not None and len(seq.prompt_logprobs) < len(seq.prompt_token_ids)


@dataclass
class ScheduledBatch:
    """What the model runner sees of a step. live_tables: every sequence holding pages, by id;
    free_block_ids: pages nobody holds; positions: where each sequence's new tokens start;
    is_steady: every running sequence decodes and nobody waits to be admitted."""

    is_prefill: bool
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) pages to copy before the step
    block_tables: list[list[int]] = field(default_factory=list)
    live_tables: Mapping[int, list[int]] = field(default_factory=dict)
    free_block_ids: Collection[int] = ()
    positions: list[int] = field(default_factory=list)
    is_steady: bool = False


class Scheduler:
    def __init__(
        self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int, num_lookahead_tokens: int = 0
    ):
        self.block_manager = block_manager
        self.num_lookahead_tokens = num_lookahead_tokens
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # Set by the controller; both only delay work, nothing is dropped.
        self.batch_limit = max_num_seqs
        self.is_throttled = False

    def set_batch_limit(self, limit: int) -> list[Sequence]:
        """Lower or raise the number of running sequences; returns those preempted to fit."""
        self.batch_limit = max(1, min(limit, self.max_num_seqs))
        return [self.preempt() for _ in range(len(self.running) - self.batch_limit)]

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch(is_prefill=True)
        budget = self.max_num_batched_tokens
        # Sequences already running but not fully computed (chunked prefill) go first.
        for seq in self.running:
            if seq.num_uncomputed_tokens > 1 and budget > 0:
                budget -= self._try_add(batch, seq, budget)
        while budget > 0 and self.may_admit():
            took = self._try_add(batch, self.waiting[0], budget)
            if not took:
                break
            budget -= took
            self.running.append(self.waiting.popleft())
        if not batch.seqs:
            batch = self._schedule_decode()
        if not batch.seqs and len(self.running) > 1:
            # All running sequences wait for pages mid-prefill: the newest yields (each fits alone).
            victim = self.preempt()
            batch = self.schedule()
            batch.preempted.insert(0, victim)
        return self.with_pages(batch)

    def with_pages(self, batch: ScheduledBatch) -> ScheduledBatch:
        """`batch` with the pages its sequences hold, once they are allocated."""
        batch.block_tables = [self.block_manager.block_table(seq.seq_id) for seq in batch.seqs]
        batch.positions = [seq.num_computed_tokens for seq in batch.seqs]
        batch.live_tables = self.block_manager.tables
        batch.free_block_ids = self.block_manager.free_blocks
        return batch

    def may_admit(self) -> bool:
        """Whether the next waiting sequence may join now: below the limit, not throttled (or preempted)."""
        return bool(
            self.waiting
            and len(self.running) < self.batch_limit
            and not (self.is_throttled and self.running and self.waiting[0].num_preemptions == 0)
        )

    def _try_add(self, batch: ScheduledBatch, seq: Sequence, budget: int) -> int:
        bm = self.block_manager
        budget = min(budget, MAX_SCORED_TOKENS) if is_scoring(seq) else budget
        if seq.num_computed_tokens == 0 and not bm.block_table(seq.seq_id):
            # A fresh (or recomputing) sequence starts from any cached prefix.
            # A prompt still to be scored needs every position's logits, which cached pages do not keep.
            match = PrefixMatch([], 0) if is_scoring(seq) else bm.match_prefix(seq.all_token_ids)
            num_new = min(seq.num_tokens - match.num_tokens, budget)
            if not bm.can_acquire(match, match.num_tokens + num_new):
                return 0
            copy = bm.acquire(seq.seq_id, match)
            if copy is not None:
                batch.copies.append(copy)
            seq.num_computed_tokens = match.num_tokens
        else:
            num_new = min(seq.num_uncomputed_tokens, budget)
            if not bm.can_allocate(seq.seq_id, seq.num_computed_tokens + num_new):
                return 0
        bm.allocate(seq.seq_id, seq.num_computed_tokens + num_new)
        batch.seqs.append(seq)
        batch.num_new_tokens.append(num_new)
        return num_new

    def _schedule_decode(self) -> ScheduledBatch:
        batch = ScheduledBatch(is_prefill=False)
        bm = self.block_manager
        for seq in list(self.running):
            # Skips a sequence preempted below to make room for an older one.
            if seq not in self.running or seq.num_uncomputed_tokens != 1:
                continue
            num_tokens = seq.num_tokens
            if bm.num_missing(seq.seq_id, num_tokens):  # 1 step in 16: the last page is full
                while seq in self.running and not bm.can_allocate(seq.seq_id, num_tokens):
                    batch.preempted.append(self.preempt())
                if seq not in self.running:
                    continue
                bm.allocate(seq.seq_id, num_tokens)
            if self.num_lookahead_tokens and bm.can_allocate(seq.seq_id, num_tokens + self.num_lookahead_tokens):
                bm.allocate(seq.seq_id, num_tokens + self.num_lookahead_tokens)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(1)
        batch.is_steady = bool(batch.seqs) and len(batch.seqs) == len(self.running) and not self.may_admit()
        return batch

    def preempt(self, seq: Sequence | None = None) -> Sequence:
        """Free `seq`'s (default: the newest one's) pages and queue it first for recomputation."""
        seq = seq or self.running[-1]
        self.running.remove(seq)
        self._release(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)
        return seq

    def finish(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)

    def _release(self, seq: Sequence) -> None:
        """Free the pages, keeping what was computed cached for later requests."""
        if seq.num_computed_tokens:
            self.block_manager.commit_partial(seq.seq_id, seq.all_token_ids, seq.num_computed_tokens)
        self.block_manager.free(seq.seq_id)
