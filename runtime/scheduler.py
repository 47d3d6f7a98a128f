"""Continuous batching over a paged KV cache: requests join and leave the running batch between steps.

Policy (one loop iteration): admit waiting requests in arrival order while their tokens fit in free blocks, the
batch has room, and their prompts fit this iteration's prefill budget of `max_tokens_per_step` tokens (the first
one always does); prefill each alone, in chunks of at most `max_tokens_per_step` tokens, starting after its
prefix-cached blocks; then run one decode step for every running request. Prefill and decode alternate: running
requests wait for about one budget of prefill per decode step (a single prompt longer than the budget is prefilled
whole, chunk by chunk, before the next decode step), and a burst of requests fills the decode batch quickly. When a decode step finds no
free block, the most recently admitted request is preempted: its blocks are freed and it goes back to the front of
the queue; on readmission its prompt and the tokens it already generated are recomputed (prefix-cache hits make
that cheap), so its output is unchanged.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from fxllm.errors import GenerationError
from fxllm.runtime.block_manager import BlockManager, OutOfBlocks
from fxllm.runtime.contract import BLOCK_TABLES, CONTEXT_LENS, INPUT_IDS, LOGITS, LOGITS_INDEX, POSITION_IDS
from fxllm.runtime.paged_cache import PagedKVPool
from fxllm.runtime.sampler import Sampler


@dataclass
class SchedulerMetrics:
    steps: int = 0
    prefill_steps: int = 0
    decode_steps: int = 0
    preemptions: int = 0
    batch_sizes: list[int] = field(default_factory=list)  # decode batch size per decode step
    prefill_tokens: int = 0  # tokens actually computed in prefill (prefix hits excluded)
    prefill_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    peak_blocks_used: int = 0
    peak_waste: float = 0.0  # unfilled / allocated slots, at the step where most blocks were in use
    prefix_hits: int = 0  # full prompt blocks found in the prefix cache during this run
    prefix_queries: int = 0  # full prompt blocks looked up during this run

    def to_dict(self, manager: BlockManager) -> dict:
        return {
            "steps": self.steps, "prefill_steps": self.prefill_steps, "decode_steps": self.decode_steps,
            "preemptions": self.preemptions, "prefill_tokens": self.prefill_tokens,
            "prefill_cached_tokens": self.prefill_cached_tokens,
            "prefill_seconds": round(self.prefill_seconds, 4), "decode_seconds": round(self.decode_seconds, 4),
            "mean_decode_batch": round(float(np.mean(self.batch_sizes)), 2) if self.batch_sizes else 0.0,
            "max_decode_batch": max(self.batch_sizes, default=0),
            "blocks_total": manager.num_blocks, "blocks_free": manager.num_free_blocks,
            "blocks_used": manager.num_used_blocks, "peak_blocks_used": self.peak_blocks_used,
            "kv_waste_at_peak": round(self.peak_waste, 4),
            "prefix_hit_rate": round(self.prefix_hits / self.prefix_queries, 4) if self.prefix_queries else 0.0,
        }


@dataclass
class _Request:
    index: int  # position in the caller's list (and its sampler stream)
    sequence: object  # engine._Sequence: result + detokenizer
    max_new_tokens: int
    cached: int = 0  # prompt tokens found in the prefix cache at admission

    @property
    def generated(self) -> list[int]:
        return self.sequence.result.token_ids

    @property
    def tokens(self) -> list[int]:
        return self.sequence.result.prompt_token_ids + self.generated


class ContinuousBatcher:
    def __init__(self, engine, manager: BlockManager, pool: PagedKVPool, max_batch: int = 64,
                 max_tokens_per_step: int = 512):
        if max_batch < 1 or max_tokens_per_step < 1:
            raise GenerationError("max_batch and max_tokens_per_step must be >= 1")
        self.engine = engine
        self.manager = manager
        self.pool = pool
        self.max_batch = max_batch
        self.max_tokens_per_step = max_tokens_per_step
        self.metrics = SchedulerMetrics()

    def run(self, sequences: list, max_new_tokens: int, sampler: Sampler) -> Iterator[tuple[int, str]]:
        """Generate for every sequence; yields (sequence index, text delta) as tokens are sampled."""
        for seq in sequences:
            longest = min(len(seq.result.prompt_token_ids) + max_new_tokens, self.engine.max_context)
            needed = self.manager.blocks_needed(longest)
            if needed > self.manager.num_blocks:
                raise GenerationError(
                    f"a request of {len(seq.result.prompt_token_ids)} prompt + {max_new_tokens} new tokens needs "
                    f"{needed} KV blocks, but the pool has {self.manager.num_blocks} "
                    f"({self.manager.capacity_tokens} tokens); raise the KV budget or lower max_new_tokens")
        self.metrics = SchedulerMetrics()
        hits_before, queries_before = self.manager.prefix_hits, self.manager.prefix_queries
        requests = [_Request(i, seq, max_new_tokens) for i, seq in enumerate(sequences)]
        try:
            yield from self._loop(deque(requests), [], sampler)
        finally:  # also when the caller stops early (a closed stream) or a step fails: leave no blocks behind
            for request in requests:
                if request.index in self.manager:
                    self.manager.free(request.index)
            self.metrics.prefix_hits = self.manager.prefix_hits - hits_before
            self.metrics.prefix_queries = self.manager.prefix_queries - queries_before

    def _loop(self, waiting: deque, running: list[_Request], sampler: Sampler) -> Iterator[tuple[int, str]]:
        while waiting or running:
            budget = self.max_tokens_per_step
            while waiting and len(running) < self.max_batch and (
                    budget == self.max_tokens_per_step or len(waiting[0].tokens) <= budget) and self._admit(waiting[0]):
                request = waiting.popleft()
                budget -= len(request.tokens) - request.cached
                yield from self._prefill(request, sampler)
                if request.sequence.done:
                    self.manager.free(request.index)
                else:
                    running.append(request)
            if running:
                yield from self._decode(running, waiting, sampler)
            elif waiting and not self._admit_possible(waiting[0]):
                raise GenerationError("no KV blocks free and nothing running: the pool is too small")  # defensive

    # -- admission and prefill ------------------------------------------------------------------------------------

    def _admit_possible(self, request: _Request) -> bool:
        return self.manager.can_allocate(request.tokens)

    def _admit(self, request: _Request) -> bool:
        try:
            cached = self.manager.allocate(request.index, request.tokens)
        except OutOfBlocks:
            return False
        request.cached = cached
        return True

    def _prefill(self, request: _Request, sampler: Sampler) -> Iterator[tuple[int, str]]:
        tokens = request.tokens
        position = request.cached
        self.metrics.prefill_cached_tokens += position
        start = time.perf_counter()
        while position < len(tokens):
            chunk = tokens[position:position + self.max_tokens_per_step]
            logits = self._step([request], [chunk], [position])
            self.manager.commit_tokens(request.index, chunk)
            position += len(chunk)
            self.metrics.prefill_steps += 1
            self.metrics.prefill_tokens += len(chunk)
        self.metrics.prefill_seconds += time.perf_counter() - start
        yield from self._sample([request], logits, sampler)

    # -- decode ---------------------------------------------------------------------------------------------------

    def _decode(self, running: list[_Request], waiting: deque, sampler: Sampler) -> Iterator[tuple[int, str]]:
        for request in list(running):
            if request not in running:
                continue  # preempted while making room for an earlier one
            while True:
                try:
                    self.pool.copy_blocks(self.manager.append_slots(request.index, 1))
                    break
                except OutOfBlocks:
                    victim = running.pop()  # the most recently admitted
                    self.manager.free(victim.index)
                    waiting.appendleft(victim)
                    self.metrics.preemptions += 1
                    if victim is request:
                        break
        if not running:
            return
        self._record_usage()
        start = time.perf_counter()
        positions = [len(r.tokens) - 1 for r in running]
        logits = self._step(running, [[r.generated[-1]] for r in running], positions)
        for request in running:
            self.manager.commit_tokens(request.index, [request.generated[-1]])
        self.metrics.decode_seconds += time.perf_counter() - start
        self.metrics.decode_steps += 1
        self.metrics.batch_sizes.append(len(running))
        yield from self._sample(running, logits, sampler)
        for request in [r for r in running if r.sequence.done]:
            running.remove(request)
            self.manager.free(request.index)

    def score(self, token_ids: list[int]) -> np.ndarray:
        """Logits [T,V] of every position of one sequence (evaluation), through a temporary sequence."""
        seq_id = -1
        self.manager.allocate(seq_id, token_ids, reuse_cached=False)  # every slot is recomputed and written
        try:
            request = _Request(seq_id, None, 0)
            return self._step([request], [list(token_ids)], [0], all_logits=True)[0]
        finally:
            self.manager.free(seq_id)

    # -- one model call ---------------------------------------------------------------------------------------------

    def _step(self, requests: list[_Request], chunks: list[list[int]], positions: list[int],
              all_logits: bool = False) -> np.ndarray:
        """Run new tokens `chunks` (equal lengths) at `positions` (tokens already in the cache) → last logits [B,V]
        (or all positions' [B,T,V])."""
        batch, width = len(requests), len(chunks[0])
        tables = [self.manager.block_table(r.index) for r in requests]
        table = np.zeros((batch, max(len(t) for t in tables)), dtype=np.int64)
        for row, blocks in enumerate(tables):
            table[row, :len(blocks)] = blocks
        position_ids = np.asarray(positions, dtype=np.int64)[:, None] + np.arange(width, dtype=np.int64)
        feeds = {INPUT_IDS: np.asarray(chunks, dtype=np.int64), POSITION_IDS: position_ids,
                 BLOCK_TABLES: table, CONTEXT_LENS: np.asarray(positions, dtype=np.int64)}
        if self.engine.selects_logits:
            feeds[LOGITS_INDEX] = np.arange(width, dtype=np.int64) if all_logits else np.asarray([width - 1])
        feeds.update(self.pool.feeds())
        outputs = self.engine.backend.run(feeds)
        slots = np.asarray([self.manager.slot_mapping(r.index, p, width) for r, p in zip(requests, positions)])
        self.pool.write(outputs, slots)
        self.metrics.steps += 1
        return outputs[LOGITS] if all_logits else outputs[LOGITS][:, -1]

    def _sample(self, requests: list[_Request], logits: np.ndarray, sampler: Sampler) -> Iterator[tuple[int, str]]:
        tokens = sampler(logits, [r.index for r in requests])
        for request, token in zip(requests, tokens):
            last = len(request.generated) + 1 >= request.max_new_tokens
            yield request.index, self.engine._append(request.sequence, int(token), last)

    def _record_usage(self) -> None:
        used = self.manager.num_used_blocks
        if used >= self.metrics.peak_blocks_used:
            self.metrics.peak_blocks_used = used
            self.metrics.peak_waste = self.manager.waste()
