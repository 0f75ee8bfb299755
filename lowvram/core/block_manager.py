"""KV page bookkeeping and prefix caching (after vLLM's): full pages named by a chained hash of
their tokens (compared on a match), freed pages cached LRU and counted free, a finished
sequence's partial last page reused by copy-on-write. Allocation order is deterministic."""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from dataclasses import dataclass

ROOT_HASH = 0


def chain_hash(parent: int, tokens: tuple[int, ...]) -> int:
    return hash((parent, tokens))


@dataclass
class PrefixMatch:
    """Pages a new sequence can start from: shared full pages and an optional page to copy."""

    block_ids: list[int]
    num_tokens: int  # tokens covered by block_ids plus the copied partial page
    copy_from: int | None = None  # a cached partial page whose first `copy_tokens` tokens match
    copy_tokens: int = 0


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.free_blocks: deque[int] = deque(range(num_blocks))
        self.cached_free: OrderedDict[int, None] = OrderedDict()  # ref 0, content known; LRU first
        self.ref_counts = [0] * num_blocks
        self.tables: dict[int, list[int]] = {}
        self.block_hash: dict[int, int] = {}  # full page -> chain hash
        self.block_tokens: dict[int, tuple[int, ...]] = {}  # page -> its tokens (full or partial)
        self.block_parent: dict[int, int] = {}  # page -> chain hash of the page before it
        self.hash_to_block: dict[int, int] = {}
        self.partial_to_block: dict[int, int] = {}  # parent chain hash -> cached partial page
        self.num_hashed: dict[int, int] = {}  # seq -> full pages of its table already hashed

    @property
    def num_free_blocks(self) -> int:
        """Never-used pages plus cached pages nobody holds."""
        return len(self.free_blocks) + len(self.cached_free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached_free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def used_block_ids(self) -> set[int]:
        """Pages some sequence holds (the union of the tables, not a scan of the pool)."""
        return set(itertools.chain.from_iterable(self.tables.values()))

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_missing(self, seq_id: int, num_tokens: int) -> int:
        """Pages `seq_id` still needs to hold `num_tokens` tokens."""
        return max(0, self.blocks_for(num_tokens) - len(self.tables.get(seq_id, ())))

    def can_allocate(self, seq_id: int, num_tokens: int) -> bool:
        return self.num_missing(seq_id, num_tokens) <= self.num_free_blocks

    def _take_free_block(self) -> int:
        if self.free_blocks:
            block = self.free_blocks.popleft()
        else:
            block, _ = self.cached_free.popitem(last=False)
            h = self.block_hash.pop(block, None)
            if h is not None and self.hash_to_block.get(h) == block:
                del self.hash_to_block[h]
            parent = self.block_parent.pop(block, None)
            if parent is not None and self.partial_to_block.get(parent) == block:
                del self.partial_to_block[parent]
            self.block_tokens.pop(block, None)
        self.ref_counts[block] = 1
        return block

    def allocate(self, seq_id: int, num_tokens: int) -> list[int]:
        """Grow the sequence's table to cover `num_tokens`; returns the table."""
        missing = self.num_missing(seq_id, num_tokens)
        if missing > self.num_free_blocks:
            raise MemoryError(f"need {missing} KV pages, {self.num_free_blocks} free")
        table = self.tables.setdefault(seq_id, [])
        table.extend(self._take_free_block() for _ in range(missing))
        return table

    def free(self, seq_id: int) -> None:
        """Release the sequence's pages, last first (a cached conversation is evicted from its tail)."""
        self.num_hashed.pop(seq_id, None)
        for block in reversed(self.tables.pop(seq_id, [])):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                if block in self.block_tokens:
                    self.cached_free[block] = None
                else:
                    self.free_blocks.append(block)

    def block_table(self, seq_id: int) -> list[int]:
        return self.tables.get(seq_id, [])

    def match_prefix(self, token_ids: list[int]) -> PrefixMatch:
        """The longest cached prefix of `token_ids`, leaving the last token to compute (for its logits)."""
        if not self.enable_prefix_caching:
            return PrefixMatch([], 0)
        bs = self.block_size
        limit = len(token_ids) - 1
        blocks: list[int] = []
        parent = ROOT_HASH
        while (len(blocks) + 1) * bs <= limit:
            tokens = tuple(token_ids[len(blocks) * bs : (len(blocks) + 1) * bs])
            h = chain_hash(parent, tokens)
            block = self.hash_to_block.get(h)
            if block is None or self.block_tokens.get(block) != tokens or self.block_parent.get(block) != parent:
                break
            blocks.append(block)
            parent = h
        match = PrefixMatch(blocks, len(blocks) * bs)
        partial = self.partial_to_block.get(parent)
        if partial is not None:
            cached = self.block_tokens[partial]
            rest = token_ids[len(blocks) * bs : limit]
            num_same = next((i for i, (a, b) in enumerate(zip(cached, rest)) if a != b), min(len(cached), len(rest)))
            if num_same:
                match.copy_from, match.copy_tokens = partial, num_same
                match.num_tokens += num_same
        return match

    def can_acquire(self, match: PrefixMatch, num_tokens: int) -> bool:
        """Whether `num_tokens` fit when starting from `match` (its idle cached pages count as taken)."""
        idle = sum(1 for b in match.block_ids if self.ref_counts[b] == 0)
        return self.blocks_for(num_tokens) - len(match.block_ids) + idle <= self.num_free_blocks

    def acquire(self, seq_id: int, match: PrefixMatch) -> tuple[int, int] | None:
        """Start `seq_id`'s table from a match; returns (src, dst) when a partial page must be copied."""
        table = self.tables.setdefault(seq_id, [])
        assert not table, "acquire starts a table"
        for block in match.block_ids:
            if self.ref_counts[block] == 0:
                del self.cached_free[block]
            self.ref_counts[block] += 1
            table.append(block)
        self.num_hashed[seq_id] = len(match.block_ids)
        if match.copy_from is None:
            return None
        # Keep the source page from being evicted by the allocation of its own copy.
        is_idle = self.ref_counts[match.copy_from] == 0
        if is_idle:
            del self.cached_free[match.copy_from]
            self.ref_counts[match.copy_from] = 1
        dst = self._take_free_block()
        table.append(dst)
        if is_idle:
            self.ref_counts[match.copy_from] = 0
            self.cached_free[match.copy_from] = None
        return match.copy_from, dst

    def num_uncommitted(self, seq_id: int, num_computed_tokens: int) -> int:
        """Fully computed pages whose content `commit` has not recorded yet (0 without prefix caching)."""
        if not self.enable_prefix_caching:
            return 0
        num_full = min(len(self.tables.get(seq_id, ())), num_computed_tokens // self.block_size)
        return max(0, num_full - self.num_hashed.get(seq_id, 0))

    def commit(self, seq_id: int, token_ids: list[int], num_computed_tokens: int) -> None:
        """Record the content of the sequence's pages that are now fully computed."""
        if not self.enable_prefix_caching:
            return
        table = self.tables.get(seq_id, [])
        bs = self.block_size
        done = self.num_hashed.get(seq_id, 0)
        parent = self.block_hash.get(table[done - 1], ROOT_HASH) if done else ROOT_HASH
        while done < min(len(table), num_computed_tokens // bs):
            block = table[done]
            tokens = tuple(token_ids[done * bs : (done + 1) * bs])
            h = chain_hash(parent, tokens)
            # The newest page with this content wins: evicting an older duplicate must not unname it.
            self.hash_to_block[h] = block
            self.block_hash[block] = h
            self.block_tokens[block] = tokens
            self.block_parent[block] = parent
            parent = h
            done += 1
        self.num_hashed[seq_id] = done

    def commit_partial(self, seq_id: int, token_ids: list[int], num_computed_tokens: int) -> None:
        """Remember the last, partly filled page of a finishing sequence for copy-on-write reuse."""
        table = self.tables.get(seq_id, [])
        bs = self.block_size
        num_full = num_computed_tokens // bs
        if not self.enable_prefix_caching or num_computed_tokens % bs == 0 or num_full >= len(table):
            return
        self.commit(seq_id, token_ids, num_computed_tokens)
        block = table[num_full]
        if self.ref_counts[block] != 1 or block in self.block_hash:
            return
        parent = self.block_hash.get(table[num_full - 1], ROOT_HASH) if num_full else ROOT_HASH
        old = self.partial_to_block.get(parent)
        if old is not None and old != block:
            self.block_parent.pop(old, None)
            self.block_tokens.pop(old, None)
            if self.ref_counts[old] == 0 and old in self.cached_free:
                del self.cached_free[old]
                self.free_blocks.append(old)
        self.partial_to_block[parent] = block
        self.block_parent[block] = parent
        self.block_tokens[block] = tuple(token_ids[num_full * bs : num_computed_tokens])
