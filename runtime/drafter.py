"""Draft proposals for speculative decoding, one sequence at a time: prompt lookup (ngram, no model) or a draft
model on its own KV cache.

A draft model keeps one contiguous KV cache per sequence (batch 1), whichever cache the target uses: the draft is
compiled through the default (contiguous) pipeline, and its cache is private to the speculator, so neither the
target's block pool nor its prefix cache ever holds draft KV. The cache is reused as far as the tokens it was fed
agree with the sequence: each proposal cuts it back to that common prefix (after a verification: the accepted
drafts; after proposals that were never verified, say of a preempted request: the tokens before them), feeds the
sequence's tokens from there (its whole prompt the first time), then its own proposals: one call each, or all k in
one call through the draft's unrolled graph (runtime/unrolled_draft.py) when the engine loaded it.
"""

from __future__ import annotations

import numpy as np

from fxllm.runtime.kv_cache import ContiguousKVCache
from fxllm.runtime.model_runner import ModelRunner
from fxllm.runtime.request import SamplingParams
from fxllm.runtime.speculative import NgramProposer, one_hot_probs, processed_probs, sample
from fxllm.runtime.unrolled_draft import UnrolledDraft


class Drafter:
    def __init__(self, mode: str, k: int, vocab_size: int, runner: ModelRunner | None,
                 unrolled: UnrolledDraft | None = None):
        """mode "ngram" proposes by prompt lookup (runner None); any other mode runs the draft model: `unrolled`
        (its k-step graph, k equal to this k) when given, else `runner`, one call per draft token."""
        self.mode = mode
        self.vocab_size = vocab_size
        self.runner = runner
        self.unrolled = unrolled
        self.ngram = NgramProposer(k=k) if mode == "ngram" else None
        self._caches: dict[int, tuple[ContiguousKVCache, list[int]]] = {}  # sequence id → (KV cache, tokens fed)

    def propose(self, seq_id: int, tokens: list[int], k: int, params: SamplingParams,
                rng: np.random.Generator) -> tuple[list[int], np.ndarray | None]:
        """Up to k draft tokens continuing `tokens`, and the distributions they were drawn from ([n, V], processed
        as the target's will be; one-hot for ngram); None instead of distributions when greedy."""
        if k <= 0 or self.unrolled is not None and not self.unrolled.fits(len(tokens)):  # (the context's end)
            return [], None if params.greedy else np.zeros((0, self.vocab_size))
        if self.ngram is not None:
            proposals = self.ngram.propose(tokens)[:k]
            return proposals, None if params.greedy else one_hot_probs(proposals, self.vocab_size)
        if seq_id not in self._caches:
            self._caches[seq_id] = ((self.unrolled or self.runner).new_cache(), [])
        cache, fed = self._caches[seq_id]
        keep = min(_common_prefix(fed, tokens), len(tokens) - 1)  # feed at least one token: its logits propose
        cache.truncate(keep)
        del fed[keep:]
        feed = tokens[keep:]
        if self.unrolled is not None:  # all k in one call; a budget below k keeps the first ones
            proposals, probs = self.unrolled.propose(cache, feed, params, rng)
            fed += feed + proposals[:-1]
            return proposals[:k], None if probs is None else probs[:k]
        proposals, distributions = [], []
        for _ in range(k):
            fed += feed
            logits = self.runner.step_one(cache, feed, cache.length, all_logits=False)[-1]
            if params.greedy:
                token = int(logits.argmax())
            else:
                probs = processed_probs(logits, params.temperature, params.top_k, params.top_p)
                token = sample(probs, rng)
                distributions.append(probs)
            proposals.append(token)
            feed = [token]
        return proposals, None if params.greedy else np.stack(distributions)

    def release(self, seq_id: int) -> None:
        self._caches.pop(seq_id, None)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(np.asarray(a[:n], dtype=np.int64) != np.asarray(b[:n], dtype=np.int64))
    return int(differ[0]) if differ.size else n
