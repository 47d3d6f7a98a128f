"""Paged KV block manager: a hypothesis state machine checks it against a model of the sequences and a simulated KV
pool (every committed position must hold the KV of exactly its own prefix), plus focused unit tests."""

from __future__ import annotations

import copy
from collections import Counter
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition, rule,
                                 run_state_machine_as_test)

from fxllm.errors import GenerationError
from fxllm.runtime.block_manager import BlockManager, OutOfBlocks

# ---- state machine

TOKENS = st.integers(0, 3)
# A few shared prefixes so that prompts share full blocks and prefix hits actually happen.
PREFIXES = [(), (1, 2, 3, 0), (1, 2, 3, 0, 2, 2, 1, 3), (0, 0, 0, 0, 0, 0), (2, 2, 1, 3)]
PROMPTS = st.builds(lambda prefix, suffix: list(prefix) + suffix, st.sampled_from(PREFIXES),
                    st.lists(TOKENS, max_size=6)).filter(bool)

STATS: Counter[str] = Counter()


@dataclass
class Expected:
    tokens: list[int]  # committed
    pending: list[int]  # reserved, not yet written: what the sequence will write there

    @property
    def reserved(self) -> int:
        return len(self.tokens) + len(self.pending)


def snapshot(bm: BlockManager) -> dict:
    return copy.deepcopy(bm.__dict__)


class BlockManagerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.bm: BlockManager | None = None
        self.model: dict[int, Expected] = {}
        self.pool: dict[int, tuple[int, ...]] = {}  # slot -> the token prefix whose KV the slot holds
        self.next_id = 0

    @initialize(num_blocks=st.integers(1, 32), block_size=st.sampled_from([1, 2, 4]), caching=st.booleans(),
                keep_runs=st.booleans())
    def init(self, num_blocks: int, block_size: int, caching: bool, keep_runs: bool) -> None:
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching=caching, keep_runs=keep_runs)

    def _copy(self, pairs: list[tuple[int, int]]) -> None:
        """What the runner does with block copies: each slot of the source block into the target block."""
        size = self.bm.block_size
        for src, dst in pairs:
            for offset in range(size):
                content = self.pool.get(src * size + offset)
                if content is None:
                    self.pool.pop(dst * size + offset, None)
                else:
                    self.pool[dst * size + offset] = content

    def _pick(self, data) -> int:
        return data.draw(st.sampled_from(sorted(self.model)))

    def _write_and_commit(self, sid: int, n: int) -> None:
        """What the engine does: run the model on n pending tokens, write their KV at slot_mapping, commit."""
        exp = self.model[sid]
        chunk = exp.pending[:n]
        for k, slot in enumerate(self.bm.slot_mapping(sid, len(exp.tokens), n)):
            self.pool[slot] = tuple(exp.tokens + chunk[:k + 1])
        self.bm.commit_tokens(sid, chunk)
        exp.tokens += chunk
        del exp.pending[:n]

    @rule(prompt=PROMPTS, data=st.data())
    def allocate(self, prompt: list[int], data) -> None:
        STATS["steps"] += 1
        bm, size = self.bm, self.bm.block_size
        sid, self.next_id = self.next_id, self.next_id + 1
        can = bm.can_allocate(prompt)
        before = snapshot(bm)
        try:
            cached = bm.allocate(sid, prompt)
        except OutOfBlocks:
            STATS["out_of_blocks"] += 1
            assert not can
            assert snapshot(bm) == before
            return
        assert can
        assert cached % size == 0 and cached <= (len(prompt) - 1) // size * size
        assert bm.prefix_hits - before["prefix_hits"] == cached // size
        queries = (len(prompt) - 1) // size if bm.enable_prefix_caching else 0
        assert bm.prefix_queries - before["prefix_queries"] == queries
        assert bm.enable_prefix_caching or cached == 0
        assert bm.token_ids(sid) == prompt[:cached]
        STATS["prefix_hits"] += cached // size
        relocated = bm.take_copies(sid)
        if relocated:
            STATS["relocated_hits"] += len(relocated)
            assert [dst for _, dst in relocated] == bm.block_table(sid)[:cached // size]
        self._copy(relocated)
        if bm.keep_runs and bm.block_table(sid) == sorted(bm.block_table(sid)):
            STATS["runs"] += 1
        self.model[sid] = Expected(prompt[:cached], prompt[cached:])
        # Usually prefill all of the rest now; sometimes only part (chunked prefill) or none, leaving slots pending.
        rest = len(prompt) - cached
        self._write_and_commit(sid, data.draw(st.one_of(st.just(rest), st.integers(0, rest))))

    @precondition(lambda self: self.model)
    @rule(data=st.data(), count=st.integers(0, 5))
    def append(self, data, count: int) -> None:
        STATS["steps"] += 1
        bm = self.bm
        sid = self._pick(data)
        exp = self.model[sid]
        new_tokens = data.draw(st.lists(TOKENS, min_size=count, max_size=count))
        can = bm.can_append_slots(sid, count)
        table = bm.block_table(sid)
        before = snapshot(bm)
        try:
            copies = bm.append_slots(sid, count)
        except OutOfBlocks:
            STATS["out_of_blocks"] += 1
            assert not can
            assert snapshot(bm) == before
            return
        assert can
        after = bm.block_table(sid)
        assert after[:len(table)] != table or not copies
        for src, dst in copies:
            STATS["copy_on_write"] += 1
            i = table.index(src)
            assert after[i] == dst and bm.ref_count(dst) == 1 and bm.ref_count(src) >= 1
        self._copy(copies)
        assert [b for b in after[:len(table)] if b not in table] == [dst for _, dst in copies]
        exp.pending += new_tokens
        self._write_and_commit(sid, data.draw(st.integers(0, len(exp.pending))))

    @precondition(lambda self: self.model)
    @rule(data=st.data(), count=st.integers(1, 5))
    def speculate(self, data, count: int) -> None:
        """A speculative round: reserve slots for drafts, write the KV of every pending slot, commit only an
        accepted prefix and release the rest. The rejected tokens' KV stays in released slots: if any of it were
        committed or cached, a later sequence sharing the block would fail the pool check."""
        STATS["steps"] += 1
        bm = self.bm
        sid = self._pick(data)
        exp = self.model[sid]
        try:
            copies = bm.append_slots(sid, count)
        except OutOfBlocks:
            return
        size = bm.block_size
        for src, dst in copies:
            for offset in range(size):
                content = self.pool.get(src * size + offset)
                self.pool[dst * size + offset] = content
        exp.pending += data.draw(st.lists(TOKENS, min_size=count, max_size=count))
        start = len(exp.tokens)
        for k, slot in enumerate(bm.slot_mapping(sid, start, len(exp.pending))):
            self.pool[slot] = tuple(exp.tokens + exp.pending[:k + 1])
        accepted = data.draw(st.integers(0, len(exp.pending)))
        bm.commit_tokens(sid, exp.pending[:accepted])
        exp.tokens += exp.pending[:accepted]
        exp.pending = []
        used = bm.num_used_blocks
        bm.release_slots(sid)
        assert bm.num_reserved(sid) == len(exp.tokens) and bm.num_used_blocks <= used
        STATS["rollbacks"] += accepted < count

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def fork(self, data) -> None:
        STATS["steps"] += 1
        parent = self._pick(data)
        child, self.next_id = self.next_id, self.next_id + 1
        free = self.bm.num_free_blocks
        self.bm.fork(parent, child)
        assert self.bm.block_table(child) == self.bm.block_table(parent)
        assert self.bm.num_free_blocks == free
        exp = self.model[parent]
        # The child writes different tokens into its pending slots: a missed copy-on-write shows up in the pool check.
        pending = data.draw(st.lists(TOKENS, min_size=len(exp.pending), max_size=len(exp.pending)))
        self.model[child] = Expected(list(exp.tokens), pending)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def free(self, data) -> None:
        STATS["steps"] += 1
        sid = self._pick(data)
        self.bm.free(sid)
        del self.model[sid]
        assert sid not in self.bm
        with pytest.raises(GenerationError):
            self.bm.block_table(sid)

    @precondition(lambda self: len(self.model) >= 4)
    @rule()
    def free_all(self) -> None:
        STATS["steps"] += 1
        self._free_everything()

    def _free_everything(self) -> None:
        for sid in list(self.model):
            self.bm.free(sid)
            del self.model[sid]
        assert self.bm.num_free_blocks == self.bm.num_blocks and self.bm.num_used_blocks == 0
        assert all(self.bm.ref_count(b) == 0 for b in range(self.bm.num_blocks))
        assert self.bm.waste() == 0.0
        self.bm.check_invariants()

    @invariant()
    def consistent(self) -> None:
        bm = self.bm
        if bm is None:
            return
        bm.check_invariants()
        owners = Counter()
        for sid, exp in self.model.items():
            table = bm.block_table(sid)
            assert len(set(table)) == len(table)
            assert len(table) == bm.blocks_needed(exp.reserved)
            assert bm.num_tokens(sid) == len(exp.tokens) and bm.num_reserved(sid) == exp.reserved
            assert bm.token_ids(sid) == exp.tokens
            for p, slot in enumerate(bm.slot_mapping(sid, 0, len(exp.tokens))):
                assert self.pool.get(slot) == tuple(exp.tokens[:p + 1]), f"wrong KV at position {p} of {sid}"
            owners.update(table)
        assert all(bm.ref_count(b) == owners[b] for b in range(bm.num_blocks))
        assert bm.num_used_blocks == len(owners)
        assert bm.num_free_blocks + bm.num_used_blocks == bm.num_blocks

    def teardown(self) -> None:
        if self.bm is not None:
            self._free_everything()


def test_random_operations_keep_block_manager_consistent():
    STATS.clear()
    run_state_machine_as_test(BlockManagerMachine, settings=settings(
        max_examples=300, stateful_step_count=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]))
    print(f"\nblock manager state machine: {dict(STATS)}")
    assert STATS["steps"] >= 10_000
    assert STATS["prefix_hits"] and STATS["copy_on_write"] and STATS["out_of_blocks"] and STATS["rollbacks"]
    assert STATS["relocated_hits"] and STATS["runs"]


# ---- focused unit tests


def test_shared_prompt_reuses_cached_blocks():
    bm = BlockManager(num_blocks=8, block_size=4)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert bm.allocate(0, prompt) == 0
    bm.commit_tokens(0, prompt)
    assert (bm.prefix_hits, bm.prefix_queries) == (0, 2)
    assert bm.allocate(1, prompt[:8] + [42, 43]) == 8
    assert bm.block_table(1)[:2] == bm.block_table(0)[:2]
    assert bm.block_table(1)[2] != bm.block_table(0)[2]
    assert [bm.ref_count(b) for b in bm.block_table(0)] == [2, 2, 1]
    assert (bm.prefix_hits, bm.prefix_queries) == (2, 4) and bm.prefix_hit_rate == 0.5
    assert bm.token_ids(1) == prompt[:8]
    assert bm.num_used_blocks == 4
    bm.check_invariants()


def test_never_the_whole_prompt_is_cached():
    bm = BlockManager(num_blocks=8, block_size=4)
    prompt = list(range(8))
    bm.allocate(0, prompt)
    bm.commit_tokens(0, prompt)
    # Both blocks are cached, but the last token must be computed for its logits: only the first block is reused.
    assert bm.allocate(1, prompt) == 4
    assert bm.block_table(1)[0] == bm.block_table(0)[0] and bm.block_table(1)[1] != bm.block_table(0)[1]
    bm.check_invariants()


def test_prefix_hash_is_chained():
    bm = BlockManager(num_blocks=8, block_size=2)
    bm.allocate(0, [1, 2, 3, 4, 5])
    bm.commit_tokens(0, [1, 2, 3, 4, 5])
    # Block [3, 4] is cached, but after the prefix [1, 2], not after [9, 9].
    assert bm.allocate(1, [9, 9, 3, 4, 5]) == 0
    assert bm.prefix_hits == 0
    assert set(bm.block_table(1)).isdisjoint(bm.block_table(0))


def test_prefix_caching_off():
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    bm.allocate(0, [1, 2, 3])
    bm.commit_tokens(0, [1, 2, 3])
    assert bm.allocate(1, [1, 2, 3]) == 0
    assert (bm.prefix_hits, bm.prefix_queries, bm.num_cached_blocks) == (0, 0, 0)


def test_allocation_that_must_not_reuse_cached_blocks():
    bm = BlockManager(num_blocks=8, block_size=2)
    bm.allocate(0, [1, 2, 3])
    bm.commit_tokens(0, [1, 2, 3])
    assert bm.allocate(1, [1, 2, 3], reuse_cached=False) == 0  # e.g. scoring, which rewrites every slot
    assert set(bm.block_table(1)).isdisjoint(bm.block_table(0))
    assert (bm.prefix_hits, bm.prefix_queries) == (0, 1)  # only the first allocation looked the cache up
    bm.check_invariants()


def test_copy_on_write_after_fork():
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.allocate(0, [1, 2, 3, 4, 5, 6])
    bm.commit_tokens(0, [1, 2, 3, 4, 5, 6])
    bm.fork(0, 1)
    parent = bm.block_table(0)
    assert bm.block_table(1) == parent and all(bm.ref_count(b) == 2 for b in parent)
    assert bm.token_ids(1) == bm.token_ids(0)
    copies = bm.append_slots(1)
    child = bm.block_table(1)
    assert copies == [(parent[1], child[1])]
    assert child[0] == parent[0] and child[1] != parent[1]
    assert bm.block_table(0) == parent
    assert [bm.ref_count(b) for b in child] == [2, 1] and bm.ref_count(parent[1]) == 1
    assert bm.slot_mapping(1, 6, 1) == [child[1] * 4 + 2]
    bm.commit_tokens(1, [7])
    # The parent's last block is private again: no copy needed.
    assert bm.append_slots(0) == []
    assert bm.block_table(0) == parent
    bm.check_invariants()


def test_pending_slots_of_a_shared_block_are_not_writable():
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.allocate(0, [1, 2, 3, 4, 5, 6])
    bm.commit_tokens(0, [1, 2, 3, 4, 5])  # position 5 stays reserved but unwritten
    bm.fork(0, 1)
    for call in (lambda: bm.slot_mapping(0, 5, 1), lambda: bm.commit_tokens(1, [6])):
        with pytest.raises(GenerationError, match="shared"):
            call()
    assert bm.slot_mapping(0, 0, 5) == bm.slot_mapping(1, 0, 5)  # committed positions are fine to look up
    parent = bm.block_table(0)
    assert bm.append_slots(0, 0) == [(parent[1], bm.block_table(0)[1])]  # count=0: only make pending slots private
    bm.commit_tokens(0, [6])
    bm.commit_tokens(1, [7])  # the child is now the sole owner of the old block
    bm.check_invariants()


def test_fork_then_append_into_new_block_copies_nothing():
    bm = BlockManager(num_blocks=8, block_size=2)
    bm.allocate(0, [1, 2, 3, 4])
    bm.commit_tokens(0, [1, 2, 3, 4])
    bm.fork(0, 1)
    assert bm.append_slots(1) == []  # the next token starts a new block; the full shared ones are never written
    assert bm.block_table(1)[:2] == bm.block_table(0)
    bm.check_invariants()


def test_out_of_blocks_leaves_state_unchanged():
    bm = BlockManager(num_blocks=3, block_size=2)
    bm.allocate(0, [1, 2, 3])
    bm.commit_tokens(0, [1, 2, 3])
    state = copy.deepcopy(bm.__dict__)
    assert not bm.can_allocate([5, 6, 7, 8, 9])
    with pytest.raises(OutOfBlocks) as info:
        bm.allocate(1, [5, 6, 7, 8, 9])
    assert info.value.needed == 3 and info.value.free == 1
    assert bm.__dict__ == state and 1 not in bm
    assert not bm.can_append_slots(0, 4)
    with pytest.raises(OutOfBlocks):
        bm.append_slots(0, 4)
    assert bm.__dict__ == state
    assert bm.append_slots(0, 3) == []
    assert bm.num_free_blocks == 0
    bm.check_invariants()


def test_copy_on_write_needs_a_free_block():
    bm = BlockManager(num_blocks=2, block_size=4)
    bm.allocate(0, [1, 2, 3, 4, 5])
    bm.commit_tokens(0, [1, 2, 3, 4, 5])
    bm.fork(0, 1)
    state = copy.deepcopy(bm.__dict__)
    assert not bm.can_append_slots(1)
    with pytest.raises(OutOfBlocks):
        bm.append_slots(1)
    assert bm.__dict__ == state
    bm.free(0)
    assert bm.append_slots(1) == []  # sole owner now: written in place
    bm.check_invariants()


@pytest.mark.parametrize("num_blocks, block_size, bad", [(0, 4, "num_blocks"), (-1, 4, "num_blocks"),
                                                          (8, 0, "block_size"), (8, 3, "block_size"),
                                                          (8, 6, "block_size"), (8, 2.0, "block_size")])
def test_invalid_config(num_blocks, block_size, bad):
    with pytest.raises(GenerationError, match=bad):
        BlockManager(num_blocks, block_size)


def test_misuse_raises_generation_error():
    bm = BlockManager(num_blocks=4, block_size=2)
    for call in (lambda: bm.free(7), lambda: bm.append_slots(7), lambda: bm.block_table(7),
                 lambda: bm.commit_tokens(7, [1]), lambda: bm.fork(7, 8), lambda: bm.allocate(0, [])):
        with pytest.raises(GenerationError):
            call()
    bm.allocate(0, [1, 2, 3])
    with pytest.raises(GenerationError, match="already"):
        bm.allocate(0, [1])
    with pytest.raises(GenerationError, match="already exists"):
        bm.fork(0, 0)
    with pytest.raises(GenerationError, match="overruns"):
        bm.commit_tokens(0, [1, 2, 3, 4])
    with pytest.raises(GenerationError, match="outside"):
        bm.slot_mapping(0, 2, 2)
    bm.check_invariants()


def test_lru_eviction_of_cached_free_blocks():
    bm = BlockManager(num_blocks=5, block_size=2)
    for sid, prompt in enumerate([[1, 1, 9], [2, 2, 9]]):
        bm.allocate(sid, prompt)
        bm.commit_tokens(sid, prompt)
    a, b = bm.block_table(0)[0], bm.block_table(1)[0]
    bm.free(0)
    bm.free(1)
    assert bm.num_free_blocks == 5 and bm.num_cached_blocks == 2
    # Never-cached free blocks go first: the two cached ones survive a 2-block allocation.
    bm.allocate(2, [5, 5, 5])
    assert bm.num_cached_blocks == 2 and not {a, b} & set(bm.block_table(2))
    # Then the least recently released cached block: [1, 1] (sequence 0) before [2, 2].
    bm.allocate(3, [6, 6, 6])
    assert bm.block_table(3)[1] == a and bm.num_cached_blocks == 1
    bm.free(2)
    bm.free(3)
    assert bm.allocate(4, [1, 1, 9]) == 0  # evicted
    free = bm.num_free_blocks
    assert bm.allocate(5, [2, 2, 9]) == 2  # still cached: taken back from the free pool
    assert bm.block_table(5)[0] == b and bm.ref_count(b) == 1
    assert bm.num_free_blocks == free - 2
    bm.check_invariants()


def test_waste_counts_unreserved_slots_once_per_block():
    bm = BlockManager(num_blocks=8, block_size=4)
    assert bm.waste() == 0.0
    bm.allocate(0, [1, 2, 3, 4, 5])  # 2 blocks, 8 slots, 5 reserved
    assert bm.waste() == 3 / 8
    bm.commit_tokens(0, [1, 2, 3, 4, 5])
    bm.fork(0, 1)  # shares both blocks: still 8 slots
    assert bm.waste() == 3 / 8
    bm.append_slots(1, 2)  # copies the last block: 3 blocks, the copy has 3 of 4 slots reserved
    assert bm.waste() == (3 + 1) / 12
    bm.free(0)
    bm.free(1)
    assert bm.waste() == 0.0


def test_sizes():
    bm = BlockManager(num_blocks=6, block_size=4)
    assert bm.capacity_tokens == 24
    assert [bm.blocks_needed(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    assert (bm.num_free_blocks, bm.num_used_blocks) == (6, 0)


def test_rejected_draft_tokens_never_enter_the_prefix_cache():
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.allocate(0, [1, 2, 3])
    bm.commit_tokens(0, [1, 2, 3])
    bm.append_slots(0, 6)  # the last sampled token and 5 drafts: positions 3..8, three blocks
    assert len(bm.block_table(0)) == 3
    bm.commit_tokens(0, [4, 5])  # the sampled token and one accepted draft; the block [1, 2, 3, 4] is full
    bm.release_slots(0)
    assert bm.num_reserved(0) == 5 and len(bm.block_table(0)) == 2 and bm.num_used_blocks == 2
    assert bm.num_cached_blocks == 1  # only the full block of committed tokens
    # A prompt that continues with the rejected drafts finds only the committed block.
    assert bm.allocate(1, [1, 2, 3, 4, 5, 9, 9, 9, 7]) == 4
    bm.release_slots(0)  # nothing reserved past the committed tokens: a no-op
    assert bm.num_reserved(0) == 5
    bm.check_invariants()


def test_never_cached_blocks_are_taken_lowest_first_so_a_sequence_lies_together():
    """A sequence allocated after others left takes the lowest free blocks, in order: the slice of the pool a
    step reads (runtime/model_runner.py) is then about its own context."""
    bm = BlockManager(num_blocks=12, block_size=2, enable_prefix_caching=False)
    bm.allocate(0, list(range(7)))  # blocks 0-3
    bm.allocate(1, list(range(5)))  # blocks 4-6
    bm.free(0)
    bm.allocate(2, list(range(9)))  # 5 blocks: the four freed ones first, then the next lowest
    assert bm.block_table(2) == [0, 1, 2, 3, 7]
    bm.check_invariants()


def test_a_sequence_takes_the_block_after_its_last_when_it_is_free():
    """Its blocks then form a run (a head-major pool attends in place); the lowest free block went elsewhere."""
    manager = BlockManager(num_blocks=10, block_size=4, enable_prefix_caching=False)
    manager.allocate(0, range(8))  # blocks 0, 1
    manager.allocate(1, range(4))  # 2
    manager.allocate(2, range(4))  # 3
    manager.free(1)  # 2 is the lowest free block now
    manager.append_slots(2, 4)
    assert manager.block_table(2) == [3, 4]
    manager.append_slots(0, 4)  # 2 is next to sequence 0's last block
    assert manager.block_table(0) == [0, 1, 2]
    manager.allocate(3, range(12))  # a new sequence: the lowest free block, then its successors
    assert manager.block_table(3) == [5, 6, 7]
    manager.check_invariants()


def test_keep_runs_copies_prefix_hits_into_a_run_when_they_cannot_be_extended():
    """A request sharing a finished one's first blocks, then diverging: the block after its hits holds the finished
    request's cached content, so its blocks would not be one run. With keep_runs the hits are copied into a fresh
    run (handed out once, for the caller to copy before the model reads them) and stay cached for others."""
    manager = BlockManager(num_blocks=12, block_size=4, keep_runs=True)
    first = list(range(100, 116))
    manager.allocate(0, first + [1])  # blocks 0-4
    manager.commit_tokens(0, first + [1])
    manager.free(0)  # 0-3 full and cached, evictable
    assert manager.allocate(1, first[:8] + [7] * 9) == 8  # hits 0, 1; diverges in block 2 (cached: 0's content)
    assert manager.block_table(1) == [4, 5, 6, 7, 8]  # 4 held 0's last, partial block: never cached
    assert manager.take_copies(1) == [(0, 4), (1, 5)] and manager.take_copies(1) == []
    assert manager.num_cached_blocks == 4 and manager.ref_count(0) == 0  # still cached, evictable
    manager.check_invariants()
    assert manager.allocate(2, first[:8] + [5] * 3) == 8  # the same hits again, into the next fresh run
    assert manager.block_table(2) == [9, 10, 11] and manager.take_copies(2) == [(0, 9), (1, 10)]
    manager.check_invariants()


def test_keep_runs_shares_hits_a_live_sequence_holds_and_places_new_sequences_in_a_fresh_run():
    manager = BlockManager(num_blocks=12, block_size=4, keep_runs=True)
    shared = list(range(100, 108))
    manager.allocate(0, shared + [1])  # blocks 0-2
    manager.commit_tokens(0, shared + [1])
    manager.allocate(1, [9] * 5)  # 3, 4
    manager.free(1)
    assert manager.allocate(2, shared + [2] * 9) == 8  # hits 0, 1, held by the live sequence 0: stay shared
    assert manager.block_table(2) == [0, 1, 3, 4, 5] and manager.take_copies(2) == []
    manager.free(2)
    manager.free(0)
    manager.allocate(3, [4] * 13)  # no hit: the lowest fresh run of 4 blocks (2 is fresh: 0's partial block)
    assert manager.block_table(3) == [2, 3, 4, 5]
    assert manager.allocate(4, shared + [3] * 2) == 8  # hits 0, 1, no longer held; 2 is 3's: copied into a run
    assert manager.block_table(4) == [6, 7, 8] and manager.take_copies(4) == [(0, 6), (1, 7)]
    manager.check_invariants()
