"""Speculative decoding on the contiguous KV cache: one request at a time, each on its own target cache.

It executes the batches of a StaticBatchScheduler with max_batch=1 (a contiguous batch cannot give its rows
different lengths, and every round changes each row's length by a different amount): a prefill computes the prompt
and samples the first token, each decode is one round. Per round, for a request whose last token t is sampled but
in neither cache yet:
  draft:  feed the tokens it has not seen (t included), then its own k-1 proposals → k proposals + their distributions
  target: feed [t, d1..dk] → k+1 distributions; accept a prefix of n proposals, plus one corrected or bonus token
  caches: target keeps t, d1..dn; draft keeps what it saw up to dn; the new last token is the next round's t.
The engine core appends the round's tokens one by one and drops those after a stop. Paged artifacts verify every
running request in one call instead (runtime/speculator.py, PagedSpeculator).
"""

from __future__ import annotations

import time

from fxllm.runtime.kv_cache import ContiguousKVCache, SharedKVCache, batch_columns
from fxllm.runtime.request import Request
from fxllm.runtime.sampler import SampledTokens, sample_rows
from fxllm.runtime.scheduler import PREFILL, ScheduledBatch
from fxllm.runtime.speculator import Speculator


class SpeculativeDecoder(Speculator):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._caches: dict[int, ContiguousKVCache] = {}  # the target's cache of each running request

    def handles(self, batch: ScheduledBatch) -> bool:
        return True  # every call of a contiguous artifact with a draft

    def execute(self, batch: ScheduledBatch) -> list[SampledTokens]:
        run = self._prefill if batch.kind == PREFILL else self._round
        return [run(request, batch.prompt_logits) for request in batch.requests]

    def release(self, request: Request) -> None:
        super().release(request)
        self._caches.pop(request.seq_id, None)

    def _prefill(self, request: Request, prompt_logits: bool) -> SampledTokens:
        cache = self._caches[request.seq_id] = self.target.new_cache()
        if isinstance(cache, SharedKVCache):  # a verification feeds up to k tokens past the request's last one
            cache.ceiling = batch_columns(len(request.prompt_token_ids), request.params.max_tokens + self.k,
                                          self.context)
        logits = self.target.step_one(cache, request.prompt_token_ids, 0, all_logits=prompt_logits)
        token = int(sample_rows(request.sampling_logits(logits[-1:]), [request.sampler])[0])
        return SampledTokens([token], logits[-1:], logits if prompt_logits else None)

    def _round(self, request: Request, _: bool) -> SampledTokens:
        cache = self._caches[request.seq_id]
        tokens = request.all_token_ids
        proposals, draft_probs = self.propose(request)
        start = time.perf_counter()
        target_logits = self.target.step_one(cache, [tokens[-1], *proposals], len(tokens) - 1, all_logits=True)
        result = self.verify(request, proposals, draft_probs, target_logits)
        cache.truncate(len(tokens) - 1 + result.cached)
        self.stats.verify_time_s += time.perf_counter() - start
        return result
