"""Speculative decoding inside the engine core: a draft proposes k tokens, the target scores all k+1 positions in
one call, and `verify_draft` keeps exactly the target's distribution (runtime/speculative.py). Both KV caches roll
back to the accepted prefix.

It executes the batches of a StaticBatchScheduler with max_batch=1 (contiguous caches, one request at a time; each
request keeps its own seeded stream): a prefill computes the prompt and samples the first token, each decode is one
round. Per round, for a request whose last token t is sampled but in neither cache yet:
  draft:  feed the tokens it has not seen (t included), then its own k-1 proposals → k proposals + their distributions
  target: feed [t, d1..dk] → k+1 distributions; accept a prefix of n proposals, plus one corrected or bonus token
  caches: target keeps t, d1..dn; draft keeps what it saw up to dn; the new last token is the next round's t.
The engine core appends the round's tokens one by one and drops those after a stop.

Seam for batched speculation on the paged cache: a round is a ScheduledBatch whose rows feed [t, d1..dk] (the paged
graph takes several tokens per row), verified row by row; rollback releases the rejected slots.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from fxllm.runtime.kv_cache import ContiguousKVCache
from fxllm.runtime.metrics import SpeculativeMetrics
from fxllm.runtime.model_runner import ModelRunner
from fxllm.runtime.request import Request, SamplingParams
from fxllm.runtime.scheduler import PREFILL, ScheduledBatch
from fxllm.runtime.speculative import (EXACT_RULE, NgramProposer, SpeculativeStats, one_hot_probs, processed_probs,
                                       sample, verify_draft)


@dataclass
class SampledTokens:
    """What one call produced for one request: tokens in order, the logits rows they were drawn from ([n, V]), and
    the prompt positions' logits when asked for."""

    token_ids: list[int]
    logits: np.ndarray | None = None
    prompt_logits: np.ndarray | None = None


@dataclass
class _State:
    target: ContiguousKVCache
    draft: ContiguousKVCache | None


class SpeculativeDecoder:
    def __init__(self, target: ModelRunner, draft: ModelRunner | None, mode: str, k: int, target_context: int,
                 draft_context: int | None = None, rule: str = EXACT_RULE):
        self.target = target
        self.draft = draft  # None for ngram
        self.mode = mode
        self.k = k
        self.rule = rule  # tests only: runtime/speculative.py's deliberately wrong rule proves the tests can fail
        # never propose past either model's context
        self.context = min(target_context, draft_context if draft is not None and draft_context else target_context)
        self.ngram = NgramProposer(k=k) if mode == "ngram" else None
        self.stats = SpeculativeStats()
        self._states: dict[int, _State] = {}

    def metrics(self) -> SpeculativeMetrics:
        """The counters since load, a copy."""
        return SpeculativeMetrics(**vars(self.stats), mode=self.mode, k=self.k)

    def execute(self, batch: ScheduledBatch) -> list[SampledTokens]:
        run = self._prefill if batch.kind == PREFILL else self._round
        return [run(request, batch.prompt_logits) for request in batch.requests]

    def release(self, request: Request) -> None:
        self._states.pop(request.seq_id, None)

    def _prefill(self, request: Request, prompt_logits: bool) -> SampledTokens:
        state = _State(self.target.new_cache(), self.draft.new_cache() if self.draft is not None else None)
        self._states[request.seq_id] = state
        logits = self.target.step_one(state.target, request.prompt_token_ids, 0, all_logits=prompt_logits)
        params = request.params
        last = logits[-1]
        token = int(last.argmax()) if params.greedy else sample(self._probs(last, params), request.sampler.rngs[0])
        return SampledTokens([token], logits[-1:], logits if prompt_logits else None)

    def _round(self, request: Request, _: bool) -> SampledTokens:
        state = self._states[request.seq_id]
        params, rng = request.params, request.sampler.rngs[0]
        tokens = request.all_token_ids
        room = params.max_tokens - len(request.output_token_ids)
        k = max(0, min(self.k, room - 1, self.context - len(tokens)))  # never propose past the last token we emit
        start = time.perf_counter()
        proposals, draft_probs = self._propose(tokens, state.draft, k, params, rng)
        self.stats.draft_time_s += time.perf_counter() - start
        start = time.perf_counter()
        target_logits = self.target.step_one(state.target, [tokens[-1], *proposals], len(tokens) - 1, all_logits=True)
        target_probs = self._probs(target_logits, params) if not params.greedy else target_logits
        pending, accepted = verify_draft(np.asarray(proposals, dtype=np.int64), draft_probs, target_probs, rng,
                                         greedy=params.greedy, rule=self.rule)
        self.stats.verify_time_s += time.perf_counter() - start
        self.stats.record(len(proposals), accepted)
        state.target.truncate(len(tokens) + accepted)
        if state.draft is not None:
            state.draft.truncate(min(state.draft.length, len(tokens) + accepted))
        return SampledTokens(pending, target_logits[:len(pending)])

    def _probs(self, logits: np.ndarray, params: SamplingParams) -> np.ndarray:
        return processed_probs(logits, params.temperature, params.top_k, params.top_p)

    def _propose(self, tokens: list[int], cache: ContiguousKVCache | None, k: int, params: SamplingParams,
                 rng: np.random.Generator) -> tuple[list[int], np.ndarray | None]:
        """k draft tokens and the draft's distributions they were drawn from ([k, V]; None when greedy)."""
        vocab = self.target.spec.vocab_size
        if k <= 0:
            return [], None if params.greedy else np.zeros((0, vocab))
        if self.ngram is not None:
            proposals = self.ngram.propose(tokens)[:k]
            return proposals, None if params.greedy else one_hot_probs(proposals, vocab).reshape(len(proposals), vocab)
        proposals, distributions = [], []
        feed = tokens[cache.length:]
        for _ in range(k):
            logits = self.draft.step_one(cache, feed, cache.length, all_logits=False)[-1]
            probs = self._probs(logits, params) if not params.greedy else None
            token = int(logits.argmax()) if params.greedy else sample(probs, rng)
            proposals.append(token)
            distributions.append(probs)
            feed = [token]
        return proposals, None if params.greedy else np.stack(distributions)
