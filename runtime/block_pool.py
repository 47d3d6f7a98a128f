"""The physical KV blocks behind the block manager: reference counts, the free list and the prefix cache.

A block is free (reference count 0) or held by one or more sequences. A full block of committed tokens may be
registered in the prefix cache under the chained hash of its content; when its last holder lets go it stays
cached but evictable, and allocation takes never-cached free blocks first — the block after the sequence's last
one when that is free, else the lowest index — then evicts the least recently released cached one. So a
sequence's blocks lie together, in order where they can: the slice of the pool a step reads stays small, and a
head-major pool's step of one sequence whose blocks form a run attends in place (runtime/model_runner.py). What a
block means to a sequence (its logical position, the tokens in it) is the block manager's business
(runtime/block_manager.py).
"""

from __future__ import annotations

import hashlib
import heapq
from collections import OrderedDict
from collections.abc import Iterable

from fxllm.errors import GenerationError

ROOT_HASH = bytes(32)  # the "parent" of a sequence's first block


def block_hash(parent: bytes, tokens: Iterable[int]) -> bytes:
    """The chained hash of a full block: its tokens after the block whose hash is `parent`."""
    # sha256 rather than hash(): Python's hash is cheap to collide on purpose, and a collision would hand one
    # request another's KV. The parent digest has a fixed length, so parent + tokens parses one way only.
    return hashlib.sha256(parent + ",".join(map(str, tokens)).encode()).digest()


class OutOfBlocks(GenerationError):
    """Not enough free KV blocks for the request. The manager's state is unchanged: the caller can wait or preempt."""

    def __init__(self, needed: int, free: int, total: int) -> None:
        super().__init__(f"need {needed} free KV blocks but only {free} of {total} are free; "
                         "wait for sequences to finish or preempt one, then retry")
        self.needed = needed
        self.free = free


def expect(condition: bool, message: str) -> None:
    """An invariant check that also runs under python -O (not `assert`)."""
    if not condition:
        raise AssertionError(message)


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.refs = [0] * num_blocks
        self._fresh = bytearray(b"\x01") * num_blocks  # 1: free and never cached (ref 0, no cached content)
        self._num_fresh = num_blocks
        # the fresh blocks, lowest first: a heap that may also hold stale entries (blocks taken out of order by
        # take_at, dropped when popped), so taking a given block costs O(1) instead of a search and a re-heapify
        self._lowest: list[int] = list(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # ref 0 with cached content, least recent first
        self._hash_to_block: dict[bytes, int] = {}
        self._block_to_hash: dict[int, bytes] = {}

    def __eq__(self, other: object) -> bool:  # state comparisons (tests: a refused call changes nothing)
        return isinstance(other, BlockPool) and vars(self) == vars(other)

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take, cached-but-unreferenced ones included."""
        return self._num_fresh + len(self._evictable)

    @property
    def num_cached(self) -> int:
        """Blocks registered in the prefix cache, referenced or not."""
        return len(self._block_to_hash)

    def lookup(self, digest: bytes) -> int | None:
        """The cached block holding this content, if any."""
        return self._hash_to_block.get(digest)

    def cached_prefix(self, tokens: list[int], block_size: int) -> tuple[list[int], list[bytes]]:
        """The cached blocks holding the leading full blocks of `tokens`, as far as they are cached, and their
        chained hashes."""
        blocks: list[int] = []
        hashes: list[bytes] = []
        parent = ROOT_HASH
        for i in range(len(tokens) // block_size):
            parent = block_hash(parent, tokens[i * block_size:(i + 1) * block_size])
            block = self._hash_to_block.get(parent)
            if block is None:
                break
            blocks.append(block)
            hashes.append(parent)
        return blocks, hashes

    def cached_hash(self, block: int) -> bytes | None:
        return self._block_to_hash.get(block)

    def take(self, after: int | None = None) -> int:
        """A free block, now referenced once: never-cached ones first (block `after` + 1 when it is one, else the
        lowest), else the least recently released cached one (evicted from the prefix cache)."""
        if after is not None and after + 1 < self.num_blocks and self._fresh[after + 1]:
            return self.take_at(after + 1)
        if self._num_fresh:
            block = heapq.heappop(self._lowest)
            while not self._fresh[block]:  # a stale entry
                block = heapq.heappop(self._lowest)
            return self.take_at(block)
        block, _ = self._evictable.popitem(last=False)
        del self._hash_to_block[self._block_to_hash.pop(block)]
        self.refs[block] = 1
        return block

    def is_fresh(self, block: int) -> bool:
        """Free and never cached: a block `take_at` can take."""
        return bool(self._fresh[block])

    def take_at(self, block: int) -> int:
        """This fresh block (`is_fresh`), now referenced once."""
        self._fresh[block] = 0
        self._num_fresh -= 1
        self.refs[block] = 1
        return block

    def take_run(self, start: int, count: int) -> list[int]:
        """Fresh blocks start .. start + count - 1 (`fresh_run` found them), now referenced once each."""
        return [self.take_at(block) for block in range(start, start + count)]

    def fresh_run(self, count: int) -> int | None:
        """The lowest block that starts `count` consecutive fresh blocks, or None."""
        start = self._fresh.find(b"\x01" * count)
        return None if start < 0 else start

    def acquire(self, block: int) -> None:
        """One more holder of a (cached) block; an unreferenced one leaves the free pool."""
        if self.refs[block] == 0:
            del self._evictable[block]
        self.refs[block] += 1

    def release(self, block: int) -> None:
        """One holder fewer; at zero the block is free again (still cached, evictable, if it holds cached content)."""
        self.refs[block] -= 1
        if self.refs[block] == 0:
            if block in self._block_to_hash:
                self._evictable[block] = None
            else:
                self._fresh[block] = 1
                self._num_fresh += 1
                if len(self._lowest) >= 2 * self.num_blocks:  # stale entries piled up: rebuild (sorted is a heap)
                    self._lowest = [b for b in range(self.num_blocks) if self._fresh[b]]
                else:
                    heapq.heappush(self._lowest, block)

    def register(self, block: int, digest: bytes) -> None:
        """Cache a full block under its content hash; another block that already holds the same content (two
        sequences computed it concurrently) keeps the entry."""
        if digest not in self._hash_to_block:
            self._hash_to_block[digest] = block
            self._block_to_hash[block] = digest

    def check_invariants(self, owners: list[int], caching: bool) -> None:
        """Raise AssertionError naming the first broken invariant; owners[b]: how many tables hold block b."""
        for block, (refs, owned) in enumerate(zip(self.refs, owners)):
            expect(refs == owned, f"block {block} has ref count {refs} but {owned} owners")
        fresh = [block for block in range(self.num_blocks) if self._fresh[block]]
        expect(len(fresh) == self._num_fresh, f"{len(fresh)} fresh blocks counted as {self._num_fresh}")
        expect(set(fresh) <= set(self._lowest), "a fresh block is missing from the lowest-first heap")
        free = fresh + list(self._evictable)
        expect(len(set(free)) == len(free), "a block is in the free pool twice")
        for block in free:
            expect(self.refs[block] == 0, f"block {block} is free but has ref count {self.refs[block]}")
        used = sum(refs > 0 for refs in self.refs)
        expect(len(free) + used == self.num_blocks, f"{len(free)} free + {used} used blocks != {self.num_blocks} total")
        expect(all(block in self._block_to_hash for block in self._evictable), "an evictable block is not cached")
        expect(not any(block in self._block_to_hash for block in fresh), "a never-cached free block is cached")
        expect(len(self._hash_to_block) == len(self._block_to_hash)
               and all(self._block_to_hash.get(block) == h for h, block in self._hash_to_block.items()),
               "the hash -> block and block -> hash maps disagree")
        expect(caching or not self._hash_to_block, "blocks cached with prefix caching off")
