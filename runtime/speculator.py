"""Speculative decoding inside the engine core: a draft proposes up to k tokens per sequence, the target scores
them all in one call, and `verify_draft` keeps exactly the target's distribution (runtime/speculative.py).

Speculator holds what every cache kind shares — the draft (runtime/drafter.py), each round's k, the verification of
one sequence's round, the counters. PagedSpeculator runs it on the paged cache, batched (the contiguous cache's
one-request-at-a-time loop is runtime/speculative_decoder.py). A paged round, for every running request whose
last token t is sampled but not yet in the cache:

  before scheduling  the speculator proposes d1..dk (stored on the request: spec_token_ids, spec_probs);
  scheduling         the scheduler reserves slots for [t, d1..dk] per row (without drafts for a row when the pool
                     is short, before it preempts anyone) — runtime/scheduler.py;
  one target call    every row feeds [t, d1..dk] (rows of different lengths, padded), the logits of all their
                     positions come back, each row is verified with its own seeded stream;
  rollback           the scheduler commits t and the accepted drafts and releases the other reserved slots
                     (BlockManager.release_slots): rejected tokens never reach a full, hashed block, so prefix
                     caching and preemption (by recompute) work unchanged; the draft's own cache follows at
                     its next proposal.
"""

from __future__ import annotations

import time

import numpy as np

from fxllm.runtime.drafter import Drafter
from fxllm.runtime.metrics import SpeculativeMetrics
from fxllm.runtime.model_runner import ModelRunner
from fxllm.runtime.request import Request
from fxllm.runtime.sampler import SampledTokens
from fxllm.runtime.scheduler import ScheduledBatch
from fxllm.runtime.speculative import EXACT_RULE, SpeculativeStats, processed_probs, verify_draft


class Speculator:
    def __init__(self, target: ModelRunner, drafter: Drafter, k: int, context: int, rule: str = EXACT_RULE):
        """context: the most positions a round may reach (the smaller of the target's and the draft's context)."""
        self.target = target
        self.drafter = drafter
        self.k = k
        self.context = context
        self.rule = rule  # tests only: runtime/speculative.py's deliberately wrong rule proves the tests can fail
        self.stats = SpeculativeStats()

    @property
    def mode(self) -> str:
        return self.drafter.mode

    def metrics(self) -> SpeculativeMetrics:
        """The counters since load, a copy. target_calls counts verified sequences (one per request and round)."""
        return SpeculativeMetrics(**vars(self.stats), mode=self.mode, k=self.k)

    def budget(self, request: Request) -> int:
        """Draft tokens worth proposing this round: never past the request's last token or the context."""
        room = request.params.max_tokens - len(request.output_token_ids)
        return max(0, min(self.k, room - 1, self.context - request.num_tokens))

    def propose(self, request: Request) -> tuple[list[int], np.ndarray | None]:
        """The draft's proposals for the request's next round and their distributions (None when greedy)."""
        start = time.perf_counter()
        try:
            return self.drafter.propose(request.seq_id, request.all_token_ids, self.budget(request), request.params,
                                        request.sampler.rngs[0])
        finally:
            self.stats.draft_time_s += time.perf_counter() - start

    def verify(self, request: Request, proposals: list[int], draft_probs: np.ndarray | None,
               target_logits: np.ndarray) -> SampledTokens:
        """One sequence's round: target_logits [len(proposals) + 1, V] at [t, d1..dk]; the tokens to emit (the
        accepted drafts and one corrected or bonus token) and how many fed tokens' KV stays (t and the accepted)."""
        params, greedy = request.params, request.params.greedy
        logits = request.sampling_logits(target_logits, proposals)  # row i after the drafts before it
        target_probs = logits if greedy else processed_probs(logits, params.temperature, params.top_k, params.top_p,
                                                             params.min_p)
        pending, accepted = verify_draft(np.asarray(proposals, dtype=np.int64), draft_probs, target_probs,
                                         request.sampler.rngs[0], greedy=greedy, rule=self.rule)
        self.stats.record(len(proposals), accepted)
        return SampledTokens(pending, target_logits[:len(pending)], cached=1 + accepted)

    def handles(self, batch: ScheduledBatch) -> bool:
        """Whether `execute` runs this batch (else the engine core runs it as without a draft)."""
        raise NotImplementedError

    def execute(self, batch: ScheduledBatch) -> list[SampledTokens]:
        raise NotImplementedError

    def needs_drafts(self, running: list[Request]) -> list[Request]:
        """The running requests to call `draft` for before the next schedule (none: drafts run inside rounds)."""
        return []

    def draft(self, request: Request) -> None:
        request.spec_token_ids, request.spec_probs = self.propose(request)

    def release(self, request: Request) -> None:
        """The request left: drop its draft state."""
        self.drafter.release(request.seq_id)
        request.spec_token_ids = request.spec_probs = None


class PagedSpeculator(Speculator):
    def needs_drafts(self, running: list[Request]) -> list[Request]:
        """The running requests whose next round has no proposals yet."""
        return [request for request in running if request.spec_token_ids is None]

    def handles(self, batch: ScheduledBatch) -> bool:
        """Decode batches of a speculative scheduler: rows [t, d1..dk]; prefills run and sample as without a draft."""
        return batch.drafts is not None

    def execute(self, batch: ScheduledBatch) -> list[SampledTokens]:
        start = time.perf_counter()
        out = self.target.execute(batch)
        results = []
        for request, drafts, logits in zip(batch.requests, batch.drafts, out.all_logits):
            probs = None if request.params.greedy else request.spec_probs[:len(drafts)]
            results.append(self.verify(request, drafts, probs, logits))
            request.spec_token_ids = request.spec_probs = None  # consumed: the next round proposes afresh
        self.stats.verify_time_s += time.perf_counter() - start
        return results
