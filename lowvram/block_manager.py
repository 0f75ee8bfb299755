"""KV page bookkeeping in plain Python: which pages each sequence owns.

Pages are handed out from the front of a free list and returned to its back, so
allocation order is deterministic and testable.
"""

from __future__ import annotations

from collections import deque


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_blocks: deque[int] = deque(range(num_blocks))
        self.tables: dict[int, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_missing(self, seq_id: int, num_tokens: int) -> int:
        """Pages `seq_id` still needs to hold `num_tokens` tokens."""
        return max(0, self.blocks_for(num_tokens) - len(self.tables.get(seq_id, ())))

    def can_allocate(self, seq_id: int, num_tokens: int) -> bool:
        return self.num_missing(seq_id, num_tokens) <= self.num_free_blocks

    def allocate(self, seq_id: int, num_tokens: int) -> list[int]:
        """Grow the sequence's table to cover `num_tokens`; returns the table."""
        missing = self.num_missing(seq_id, num_tokens)
        if missing > self.num_free_blocks:
            raise MemoryError(f"need {missing} KV pages, {self.num_free_blocks} free")
        table = self.tables.setdefault(seq_id, [])
        table.extend(self.free_blocks.popleft() for _ in range(missing))
        return table

    def free(self, seq_id: int) -> None:
        """Return every page of the sequence; unknown ids are ignored (abort may race finish)."""
        self.free_blocks.extend(self.tables.pop(seq_id, ()))

    def block_table(self, seq_id: int) -> list[int]:
        return self.tables.get(seq_id, [])
