"""The speculative decoding loop: a draft proposes k tokens, the target scores all k+1 positions in one call, and
`verify_draft` keeps exactly the target's distribution (runtime/speculative.py). Both KV caches roll back to the
accepted prefix. Sequences of a batch are decoded one after another (each with its own seeded random stream).

Per round, for a sequence whose last token t is sampled but not yet in either cache:
  draft:  feed the tokens it has not seen (t included), then its own k-1 proposals → k proposals + their distributions
  target: feed [t, d1..dk] → k+1 distributions; accept a prefix of n proposals, plus one corrected or bonus token
  caches: target keeps t, d1..dn; draft keeps what it saw up to dn; the new last token is the next round's t.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np

from fxllm.runtime.kv_cache import ContiguousKVCache
from fxllm.runtime.sampler import SamplingParams
from fxllm.runtime.speculative import (EXACT_RULE, NgramProposer, SpeculativeStats, one_hot_probs, processed_probs,
                                       sample, verify_draft)


class SpeculativeDecoder:
    def __init__(self, target, draft, mode: str, k: int, rule: str = EXACT_RULE):
        self.target = target  # Engine (contiguous KV cache)
        self.draft = draft  # Engine, or None for ngram
        self.mode = mode
        self.k = k
        self.rule = rule  # tests only: runtime/speculative.py's deliberately wrong rule proves the tests can fail
        self.ngram = NgramProposer(k=k) if mode == "ngram" else None
        self.stats = SpeculativeStats()
        self.prefill_s = 0.0

    def run(self, sequences: list, max_new_tokens: int, params: SamplingParams) -> Iterator[tuple[int, str]]:
        self.stats = SpeculativeStats()
        self.prefill_s = 0.0  # the target's prompt prefills (the draft's happen inside its first proposal)
        for index, sequence in enumerate(sequences):
            yield from self._sequence(index, sequence, max_new_tokens, params)

    def _probs(self, logits: np.ndarray, params: SamplingParams) -> np.ndarray:
        return processed_probs(logits, params.temperature, params.top_k, params.top_p)

    def _sequence(self, index: int, sequence, max_new_tokens: int, params: SamplingParams
                  ) -> Iterator[tuple[int, str]]:
        rng = np.random.default_rng(params.seed)
        tokens = list(sequence.result.prompt_token_ids)
        target_cache = self.target.new_cache()
        start = time.perf_counter()
        logits = self.target.step_one(target_cache, tokens, 0, all_logits=False)[-1]
        self.prefill_s += time.perf_counter() - start
        draft_cache = self.draft.new_cache() if self.draft is not None else None
        pending = [sample(self._probs(logits, params), rng) if not params.greedy else int(logits.argmax())]
        while True:
            for token in pending:
                tokens.append(token)
                last = len(sequence.result.token_ids) + 1 >= max_new_tokens
                yield index, self.target._append(sequence, token, last)
                if sequence.done:
                    return
            room = max_new_tokens - len(sequence.result.token_ids)
            # never propose past the last token we may emit, nor past either model's context
            limit = min(self.target.max_context, self.draft.max_context if self.draft is not None else 10**9)
            k = max(0, min(self.k, room - 1, limit - len(tokens)))
            start = time.perf_counter()
            proposals, draft_probs = self._propose(tokens, draft_cache, k, params, rng)
            self.stats.draft_time_s += time.perf_counter() - start
            start = time.perf_counter()
            feed = [tokens[-1], *proposals]
            target_logits = self.target.step_one(target_cache, feed, len(tokens) - 1, all_logits=True)
            target_probs = self._probs(target_logits, params) if not params.greedy else target_logits
            pending, accepted = verify_draft(np.asarray(proposals, dtype=np.int64), draft_probs, target_probs, rng,
                                             greedy=params.greedy, rule=self.rule)
            self.stats.verify_time_s += time.perf_counter() - start
            self.stats.record(len(proposals), accepted)
            target_cache.truncate(len(tokens) + accepted)
            if draft_cache is not None:
                draft_cache.truncate(min(draft_cache.length, len(tokens) + accepted))

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
