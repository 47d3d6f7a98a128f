"""Paged KV-cache block manager: maps each sequence's token positions onto fixed-size blocks of one shared KV pool
(runtime/block_pool.py), with reference-counted sharing (fork, copy-on-write) and prefix caching of full blocks
under a chained hash.

A sequence's slots are reserved ahead of the model call that writes them (append_slots) and committed once its
KV is written (commit_tokens); only committed tokens ever enter the prefix cache, and only in full blocks. So
speculative decoding may write draft tokens into reserved slots, commit the accepted ones and give the rest back
(release_slots): a rejected token never lands in a hashed block, and a block the rollback empties returns to the
free list uncached.
"""

from __future__ import annotations

from collections.abc import Iterable

from fxllm.errors import GenerationError
from fxllm.runtime.block_pool import ROOT_HASH, BlockPool, OutOfBlocks, block_hash, expect
from fxllm.runtime.block_table import RELEASED, SequenceBlocks, is_int

__all__ = ["BlockManager", "OutOfBlocks"]


class BlockManager:
    """Owns the block tables of live sequences and the pool of free blocks; the caller owns the KV tensors and
    performs the copies `append_slots` returns. A block's slot i holds the KV of token position
    logical_block * block_size + i of every sequence whose table maps that logical block to it."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 keep_runs: bool = False) -> None:
        """keep_runs: place a new sequence's blocks as one ascending run where the pool has room — its prefix-cache
        hits copied into the run (`take_copies`) when they cannot be extended in place and no live sequence holds
        them — for a pool that attends in place over a run (a head-major pool, runtime/contract.py)."""
        if not is_int(num_blocks) or num_blocks < 1:
            raise GenerationError(f"num_blocks must be an integer >= 1, got {num_blocks!r}")
        if not is_int(block_size) or block_size < 1 or block_size & (block_size - 1):
            raise GenerationError(f"block_size must be a power of two >= 1, got {block_size!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.prefix_hits = 0  # in blocks
        self.prefix_queries = 0  # in blocks: full prompt blocks looked up in the prefix cache
        self.keep_runs = keep_runs
        self._pool = BlockPool(num_blocks)
        self._seqs: dict[int, SequenceBlocks] = {}
        self._copies: dict[int, list[tuple[int, int]]] = {}  # seq → (cached block, its copy) not yet handed out

    # ---- metrics and lookups

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take, cached-but-unreferenced ones included."""
        return self._pool.num_free

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix cache, referenced or not."""
        return self._pool.num_cached

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    def blocks_needed(self, num_tokens: int) -> int:
        if num_tokens < 0:
            raise GenerationError(f"num_tokens must be >= 0, got {num_tokens}")
        return -(-num_tokens // self.block_size)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    def block_table(self, seq_id: int) -> list[int]:
        """The physical block of each logical block; a released block's entry names another block of the sequence
        (the model reads it, its mask hides it)."""
        return self._seq(seq_id).table_for_the_model()

    def num_tokens(self, seq_id: int) -> int:
        """Committed tokens: positions whose KV is in the pool."""
        return len(self._seq(seq_id).tokens)

    def num_reserved(self, seq_id: int) -> int:
        """Token slots the sequence's block table covers: committed tokens plus slots reserved but not yet written."""
        return self._seq(seq_id).reserved

    def token_ids(self, seq_id: int) -> list[int]:
        return list(self._seq(seq_id).tokens)

    def ref_count(self, block_id: int) -> int:
        if not 0 <= block_id < self.num_blocks:
            raise GenerationError(f"block id {block_id} is out of range [0, {self.num_blocks})")
        return self._pool.refs[block_id]

    def waste(self) -> float:
        """Fraction of the allocated slots (a shared block counted once) that no live sequence has reserved."""
        filled: dict[int, int] = {}
        for seq in self._seqs.values():
            for i, block in seq.held():
                filled[block] = max(filled.get(block, 0), min(self.block_size, seq.reserved - i * self.block_size))
        allocated = len(filled) * self.block_size
        return (allocated - sum(filled.values())) / allocated if allocated else 0.0

    # ---- allocation

    def can_allocate(self, token_ids: Iterable[int]) -> bool:
        tokens = self._prompt(token_ids)
        return self._blocks_to_take(tokens, self._prefix_hits(tokens)[0]) <= self.num_free_blocks

    def allocate(self, seq_id: int, token_ids: Iterable[int], reuse_cached: bool = True) -> int:
        """Reserve slots for a new sequence's prompt, reusing cached leading full blocks (unless reuse_cached is
        False: a caller that recomputes and rewrites every slot must not share any). Returns how many prompt
        tokens already have their KV in the pool (a multiple of block_size, never the whole prompt: the last
        token is always computed so the model yields logits); commit_tokens the rest once computed."""
        if seq_id in self._seqs:
            raise GenerationError(f"sequence {seq_id} already has blocks allocated")
        tokens = self._prompt(token_ids)
        hits, hashes = self._prefix_hits(tokens) if reuse_cached else ([], [])
        needed = self._blocks_to_take(tokens, hits)
        if needed > self.num_free_blocks:
            raise OutOfBlocks(needed, self.num_free_blocks, self.num_blocks)
        for block in hits:  # a relocated sequence holds its hits until their copies are handed out
            self._pool.acquire(block)
        count = self.blocks_needed(len(tokens))
        start = self._run_start(hits, count) if self.keep_runs else None
        if start is not None:
            blocks = self._pool.take_run(start, count)
            if hits:
                self._copies[seq_id] = list(zip(hits, blocks))
        else:
            blocks = list(hits)
            for _ in range(count - len(hits)):
                blocks.append(self._pool.take(after=blocks[-1] if blocks else None))
        cached = len(hits) * self.block_size
        self._seqs[seq_id] = SequenceBlocks(blocks, tokens[:cached], len(tokens), hashes)
        if self.enable_prefix_caching and reuse_cached:
            self.prefix_queries += (len(tokens) - 1) // self.block_size
            self.prefix_hits += len(hits)
        return cached

    def take_copies(self, seq_id: int) -> list[tuple[int, int]]:
        """The (cached block, its copy in the sequence's run) pairs a relocating allocation made, once: the caller
        copies them into the KV pool before the model reads the sequence (the first prefill call); the cached
        blocks are released now, so nothing may allocate between this and those copies."""
        pairs = self._copies.pop(seq_id, [])
        for source, _ in pairs:
            self._pool.release(source)
        return pairs

    def can_append_slots(self, seq_id: int, count: int = 1) -> bool:
        cow, new = self._append_plan(self._seq(seq_id), count)
        return len(cow) + new <= self.num_free_blocks

    def append_slots(self, seq_id: int, count: int = 1) -> list[tuple[int, int]]:
        """Reserve `count` more token slots. Any shared block that holds a slot still to be written (new or reserved
        earlier) is first replaced by a private copy; returns the (src_block, dst_block) copies the caller must make
        in the KV pool before writing. count=0 only makes the already reserved slots private."""
        seq = self._seq(seq_id)
        cow, new = self._append_plan(seq, count)
        if len(cow) + new > self.num_free_blocks:
            raise OutOfBlocks(len(cow) + new, self.num_free_blocks, self.num_blocks)
        copies = []
        for i in cow:
            src, dst = seq.blocks[i], self._pool.take(after=seq.blocks[i - 1] if i else None)
            self._pool.release(src)  # stays held: another sequence still holds it
            seq.blocks[i] = dst
            copies.append((src, dst))
        for _ in range(new):
            seq.blocks.append(self._pool.take(after=seq.blocks[-1] if seq.blocks else None))
        seq.reserved += count
        return copies

    def release_before(self, seq_id: int, position: int) -> int:
        """Give back the blocks all of whose positions lie before `position` (a sliding window no longer reaches
        them: nothing will read their KV again); they leave the table as RELEASED entries, and cached ones stay
        in the prefix cache for other prompts. Returns how many were released."""
        seq = self._seq(seq_id)
        end = min(max(position, 0) // self.block_size, self.blocks_needed(len(seq.tokens)))
        start = seq.released_prefix_end(end)
        for i in range(start, end):
            self._pool.release(seq.blocks[i])
            seq.blocks[i] = RELEASED
        return end - start

    def release_slots(self, seq_id: int) -> None:
        """Give back the slots reserved past the committed tokens (speculative decoding rolls back its rejected
        draft tokens): the table keeps only the blocks its committed tokens need; the others, which hold no
        committed token and so were never cached, return to the free list. Whatever was written into the released
        slots is garbage that the next write at those positions replaces."""
        seq = self._seq(seq_id)
        keep = self.blocks_needed(len(seq.tokens))
        for block in reversed(seq.blocks[keep:]):
            self._pool.release(block)
        del seq.blocks[keep:]
        seq.reserved = len(seq.tokens)

    def slot_mapping(self, seq_id: int, start: int, count: int) -> list[int]:
        """Pool slot (block_id * block_size + offset) of each token position start .. start+count-1, where the caller
        writes (or, for committed positions, finds) their KV. Refuses uncommitted positions in a shared block."""
        seq = self._seq(seq_id)
        self._check_range(seq_id, seq, start, count)
        self._check_private(seq_id, seq, start, start + count)
        size = self.block_size
        return [seq.blocks[pos // size] * size + pos % size for pos in range(start, start + count)]

    def commit_tokens(self, seq_id: int, token_ids: Iterable[int]) -> None:
        """Record tokens whose KV is now written at the next reserved positions; newly full blocks enter the prefix
        cache."""
        seq = self._seq(seq_id)
        tokens = [int(t) for t in token_ids]
        start = len(seq.tokens)
        if start + len(tokens) > seq.reserved:
            raise GenerationError(f"committing {len(tokens)} tokens at position {start} overruns the {seq.reserved} "
                                  f"slots reserved for sequence {seq_id}; call append_slots first")
        self._check_private(seq_id, seq, start, start + len(tokens))
        seq.tokens.extend(tokens)
        if self.enable_prefix_caching:
            self._register_full_blocks(seq)

    def fork(self, parent_id: int, child_id: int) -> None:
        """The child shares all the parent's blocks; the first write to a shared block copies it (append_slots)."""
        parent = self._seq(parent_id)
        if child_id in self._seqs:
            raise GenerationError(f"cannot fork into sequence {child_id}: it already exists")
        for _, block in parent.held():
            self._pool.acquire(block)
        self._seqs[child_id] = parent.copy()

    def free(self, seq_id: int) -> None:
        seq = self._seq(seq_id)
        self.take_copies(seq_id)  # never made: the sequence's copies hold nothing anyone reads
        del self._seqs[seq_id]
        # Tail first: eviction takes the least recently released, and the tail is the part other prompts are least
        # likely to share.
        for _, block in reversed(seq.held()):
            self._pool.release(block)

    # ---- consistency

    def check_invariants(self) -> None:
        """Raise AssertionError naming the first broken invariant of the block bookkeeping."""
        owners = [0] * self.num_blocks
        for sid, seq in self._seqs.items():
            held = seq.held()
            expect(len({block for _, block in held}) == len(held), f"sequence {sid} holds a block twice: {seq.blocks}")
            expect(len(seq.blocks) == self.blocks_needed(seq.reserved),
                   f"sequence {sid} has {len(seq.blocks)} blocks for {seq.reserved} reserved slots")
            expect(len(seq.tokens) <= seq.reserved,
                   f"sequence {sid} committed {len(seq.tokens)} tokens into {seq.reserved} slots")
            full = len(seq.tokens) // self.block_size if self.enable_prefix_caching else 0
            expect(len(seq.hashes) == full, f"sequence {sid} has {len(seq.hashes)} block hashes, expected {full}")
            for i, block in held:
                owners[block] += 1
                cached = self._pool.cached_hash(block)
                expect(cached is None or i < len(seq.hashes) and seq.hashes[i] == cached,
                       f"cached block {block} is logical block {i} of sequence {sid} with different content")
            for source, _ in self._copies.get(sid, []):  # hits held until their copies are handed out
                owners[source] += 1
        self._pool.check_invariants(owners, self.enable_prefix_caching)

    # ---- internals

    def _seq(self, seq_id: int) -> SequenceBlocks:
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise GenerationError(f"unknown sequence id {seq_id}: not allocated, or already freed")
        return seq

    @staticmethod
    def _prompt(token_ids: Iterable[int]) -> list[int]:
        tokens = [int(t) for t in token_ids]
        if not tokens:
            raise GenerationError("cannot allocate blocks for an empty prompt")
        return tokens

    def _prefix_hits(self, tokens: list[int]) -> tuple[list[int], list[bytes]]:
        """Cached blocks holding the prompt's leading full blocks (the last token excluded), and their hashes."""
        if not self.enable_prefix_caching:
            return [], []
        return self._pool.cached_prefix(tokens[:len(tokens) - 1], self.block_size)

    def _run_start(self, hits: list[int], count: int) -> int | None:
        """Where a new sequence of `count` blocks (its hits acquired) should start its run: None when its hits
        already are one and the fresh blocks after them complete it (the ordinary allocation does), or when a live
        sequence also holds a hit (they stay shared: sequences running together gather their blocks anyway, and
        copies would cost the pool the memory sharing saves); else the lowest fresh run of `count` blocks (None
        when there is none: the blocks go wherever they can)."""
        if any(self._pool.refs[block] > 1 for block in hits):
            return None
        if hits and all(b == hits[0] + i for i, b in enumerate(hits)) and hits[0] + count <= self.num_blocks \
                and all(self._pool.is_fresh(b) for b in range(hits[-1] + 1, hits[0] + count)):
            return None
        return self._pool.fresh_run(count)

    def _blocks_to_take(self, tokens: list[int], hits: list[int]) -> int:
        # A hit on an unreferenced cached block takes it out of the free pool just like a fresh block.
        return self.blocks_needed(len(tokens)) - len(hits) + sum(self._pool.refs[block] == 0 for block in hits)

    def _append_plan(self, seq: SequenceBlocks, count: int) -> tuple[list[int], int]:
        """Logical indices of shared blocks holding a slot still to be written, and how many new blocks are needed."""
        if not is_int(count) or count < 0:
            raise GenerationError(f"count must be an integer >= 0, got {count!r}")
        end = seq.reserved + count
        cow = []
        if end > len(seq.tokens):
            first = len(seq.tokens) // self.block_size  # every table block from here on holds an unwritten slot
            cow = [i for i in range(first, len(seq.blocks)) if self._pool.refs[seq.blocks[i]] > 1]
        return cow, self.blocks_needed(end) - len(seq.blocks)

    def _check_range(self, seq_id: int, seq: SequenceBlocks, start: int, count: int) -> None:
        if start < 0 or count < 0 or start + count > seq.reserved:
            raise GenerationError(f"positions [{start}, {start + count}) are outside the {seq.reserved} slots "
                                  f"reserved for sequence {seq_id}")

    def _check_private(self, seq_id: int, seq: SequenceBlocks, start: int, stop: int) -> None:
        """Writing an uncommitted position of a shared block would corrupt the other owners' KV."""
        size = self.block_size
        first_unwritten = max(start, len(seq.tokens))
        if stop <= first_unwritten:
            return
        for i in range(first_unwritten // size, -(-stop // size)):
            if self._pool.refs[seq.blocks[i]] > 1:
                raise GenerationError(f"sequence {seq_id}'s block {seq.blocks[i]} is shared and would be written; "
                                      "call append_slots first to copy it")

    def _register_full_blocks(self, seq: SequenceBlocks) -> None:
        size = self.block_size
        for i in range(len(seq.hashes), len(seq.tokens) // size):
            parent = seq.hashes[-1] if seq.hashes else ROOT_HASH
            digest = block_hash(parent, seq.tokens[i * size:(i + 1) * size])
            seq.hashes.append(digest)
            self._pool.register(seq.blocks[i], digest)
