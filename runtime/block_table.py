"""One sequence's block table in the paged KV pool: which physical block holds each of its logical blocks, which
tokens are committed (their KV written), how many slots are reserved, and the chained hashes of its full committed
blocks (prefix caching). runtime/block_manager.py owns the tables; this is their plain state and lookups."""

from __future__ import annotations

from dataclasses import dataclass, field

RELEASED = -1  # a table entry whose block was given back because no layer can see its positions any more


@dataclass
class SequenceBlocks:
    blocks: list[int]  # block table: logical block i -> physical block id, or RELEASED
    tokens: list[int]  # committed tokens, i.e. whose KV is in the pool
    reserved: int  # token slots the table covers; >= len(tokens)
    hashes: list[bytes] = field(default_factory=list)  # chained hash of each full committed block (prefix caching)

    def held(self) -> list[tuple[int, int]]:
        """(logical index, block) of the blocks the sequence holds (RELEASED entries left out)."""
        return [(i, block) for i, block in enumerate(self.blocks) if block != RELEASED]

    def table_for_the_model(self) -> list[int]:
        """The physical block of each logical block; a released block's entry names another block of the sequence
        (the model reads it, its mask hides it)."""
        stand_in = next((block for block in self.blocks if block != RELEASED), 0)
        return [stand_in if block == RELEASED else block for block in self.blocks]

    def released_prefix_end(self, end: int) -> int:
        """Where the released entries (always a prefix of the table) end, walking back from logical block `end`:
        so a release step costs the blocks it releases, not the length of the context."""
        start = end
        while start > 0 and self.blocks[start - 1] != RELEASED:
            start -= 1
        return start

    def copy(self) -> SequenceBlocks:
        return SequenceBlocks(list(self.blocks), list(self.tokens), self.reserved, list(self.hashes))


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
