"""Schedulers: pure policy. Each `schedule()` decides the next model call (a ScheduledBatch) from the waiting and
running requests and the KV cache's bookkeeping; the model runner executes it and the engine core samples. A
scheduler never calls the model.

PagedScheduler — continuous batching over a paged KV cache; requests join and leave between calls. An iteration
admits waiting requests in arrival order while their tokens fit in free blocks, the batch has room (`max_batch`) and
their prompts fit the iteration's prefill budget of `max_tokens_per_step` tokens (the first always does); each
admitted request is prefilled alone, in chunks of at most `prefill_call_tokens` tokens (default: the budget)
starting after its prefix-cached blocks (one call per chunk; a prompt longer than the budget is prefilled whole
before the next decode); the iteration ends with one decode call for every running request. When a decode finds no
free block, the most recently admitted request is preempted: its blocks are freed and it returns to the front of the
queue; on readmission its prompt and the tokens it already generated are recomputed (prefix-cache hits make that
cheap), so its output is unchanged. With speculation (`speculative=True`) each decode row feeds the request's last
token and the draft tokens proposed for it (Request.spec_token_ids), with a slot reserved for each; when the pool is
short a row drops its drafts before anyone is preempted; after the call only the tokens the verification kept are
committed and the other reserved slots are released.

StaticBatchScheduler — contiguous KV cache: when no batch runs, up to `max_batch` waiting requests form one
left-padded batch, prefilled as one batch (the runner feeds a one-row prompt in calls of at most
`max_tokens_per_step` tokens) and decoded in lock-step; finished rows leave it, and requests that
arrive meanwhile wait until it drains. (Joining a running contiguous batch would mean re-padding every row's
cache; the paged artifact is the one built for that.) With a `token_budget` the batch also stops taking requests
where its cache could outgrow the budget: rows × (its longest prompt + its longest generation) positions, as the
runner sizes the buffers; a request that alone needs more is refused when it is added.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from fxllm.errors import GenerationError, InvalidArgumentError
from fxllm.runtime.block_manager import BlockManager, OutOfBlocks
from fxllm.runtime.kv_cache import batch_columns
from fxllm.runtime.request import Request, RequestStatus

PREFILL, DECODE = "prefill", "decode"


@dataclass
class ScheduledBatch:
    """One model call. Row i feeds token_ids[i] after positions[i] tokens already cached (paged: rows of equal
    length; contiguous prefill: whole prompts, left-padded by the runner). `sample`: the last fed position of each
    row is sampled (false for a prefill chunk before the last); `prompt_logits`: every fed position's logits are
    wanted (prompt logprobs). Paged only: block tables, the pool slot of every fed token, and the copy-on-write
    block copies to make before the call (copy-on-write, prefix-cache hits copied into a run). `drafts` (a speculative decode): each row's draft tokens, fed after its
    last token (rows then differ in length); every fed position's logits come back."""

    kind: str  # PREFILL or DECODE
    requests: list[Request]
    token_ids: list[list[int]]
    positions: list[int]
    sample: bool = True
    prompt_logits: bool = False
    block_tables: list[list[int]] | None = None
    slots: list[list[int]] | None = None
    copies: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)  # left the running batch to make room for this call
    drafts: list[list[int]] | None = None


class _Queues:
    """The waiting queue and the running batch, shared by both policies."""

    def __init__(self, max_batch: int):
        if max_batch < 1:
            raise GenerationError(f"max_batch must be >= 1, got {max_batch}")
        self.max_batch = max_batch
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.preemptions = 0
        self.prefill_cached_tokens = 0  # prompt tokens whose KV came from the prefix cache at admission

    @property
    def num_running(self) -> int:
        """Requests holding KV cache."""
        return len(self.running)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _leave_queues(self, request: Request) -> None:
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)

    def _decode_rows(self) -> tuple[list[list[int]], list[int]]:
        return [[r.output_token_ids[-1]] for r in self.running], [r.num_tokens - 1 for r in self.running]


class PagedScheduler(_Queues):
    def __init__(self, manager: BlockManager, max_batch: int = 64, max_tokens_per_step: int = 512,
                 prefill_call_tokens: int | None = None, speculative: bool = False, attention_span: int = 0):
        """prefill_call_tokens: the most prompt tokens one prefill call feeds (None: max_tokens_per_step, the
        iteration's admission budget). attention_span > 0: no layer's query sees keys more than attention_span - 1
        positions back (every layer slides, spec.attention_span); blocks wholly before the next query's window are
        released as it moves."""
        super().__init__(max_batch)
        if prefill_call_tokens is None:
            prefill_call_tokens = max_tokens_per_step
        for name, value in (("max_tokens_per_step", max_tokens_per_step), ("prefill_call_tokens", prefill_call_tokens)):
            if value < 1:
                raise GenerationError(f"{name} must be >= 1, got {value}")
        self.manager = manager
        self.speculative = speculative
        self.max_tokens_per_step = max_tokens_per_step
        self.prefill_call_tokens = prefill_call_tokens
        self.attention_span = attention_span
        self.peak_blocks_used = 0
        self.peak_waste = 0.0
        self._prefilling: Request | None = None  # admitted, prompt partly computed
        self._admitting = True  # the current iteration still admits (else: its decode is next)
        self._budget = max_tokens_per_step  # prefill tokens the current iteration may still admit

    @property
    def num_running(self) -> int:
        return len(self.running) + (self._prefilling is not None)

    def check_fits(self, prompt_tokens: int, max_tokens: int) -> None:
        """Refuse a request the pool could never hold, before it waits forever."""
        needed = self.manager.blocks_needed(prompt_tokens + max_tokens)
        if needed > self.manager.num_blocks:
            prompt_fits = self.manager.blocks_needed(prompt_tokens + 1) <= self.manager.num_blocks
            raise InvalidArgumentError(
                "max_tokens" if prompt_fits else "prompt",
                f"a request of {prompt_tokens} prompt + {max_tokens} new tokens needs {needed} KV blocks, but the "
                f"pool has {self.manager.num_blocks} ({self.manager.capacity_tokens} tokens): ask for fewer tokens "
                "(the pool's size is the engine's KV budget)")

    def remove(self, request: Request) -> None:
        """The request leaves (finished, aborted, failed): out of the queues, its blocks freed at once."""
        self._leave_queues(request)
        if self._prefilling is request:
            self._prefilling = None
        if request.seq_id in self.manager:
            self.manager.free(request.seq_id)

    def schedule(self) -> ScheduledBatch | None:
        if self._prefilling is not None:
            return self._prefill_chunk(self._prefilling)
        for _ in range(2):  # a second round when every running request was preempted
            if self._admitting:
                request = self._admit_next()
                if request is not None:
                    self._prefilling = request
                    return self._prefill_chunk(request)
            self._admitting, self._budget = True, self.max_tokens_per_step  # the decode ends the iteration
            if self.running:
                batch = self._decode()
                if batch.requests:
                    return batch
        return None

    def update(self, batch: ScheduledBatch, cached: list[int | None] | None = None) -> None:
        """After a successful call: the fed tokens' KV is in the pool (of row i only the first cached[i] when given:
        a speculative round's rejected drafts, whose reserved slots go back); a fully prefilled request joins the
        batch."""
        for row, (request, chunk) in enumerate(zip(batch.requests, batch.token_ids)):
            keep = chunk if cached is None or cached[row] is None else chunk[:cached[row]]
            self.manager.commit_tokens(request.seq_id, keep)
            request.num_computed_tokens += len(keep)
            if len(keep) < len(chunk):
                self.manager.release_slots(request.seq_id)
            if self.attention_span:  # the next query is at num_computed_tokens: it sees the span ending there
                self.manager.release_before(request.seq_id, request.num_computed_tokens - self.attention_span + 1)
        if batch.kind == PREFILL and batch.sample:
            self._prefilling = None
            self.running.append(batch.requests[0])

    def _admit_next(self) -> Request | None:
        if not self.waiting or len(self.running) >= self.max_batch:
            return None
        request = self.waiting[0]
        tokens = request.all_token_ids  # after a preemption: the prompt and what it generated so far
        if self._budget != self.max_tokens_per_step and len(tokens) > self._budget:
            return None
        try:
            # A request that wants prompt logprobs computes every position: it takes no cached block.
            cached = self.manager.allocate(request.seq_id, tokens, reuse_cached=request.prompt_logprobs is None)
        except OutOfBlocks:
            return None
        self.waiting.popleft()
        request.status, request.num_computed_tokens = RequestStatus.RUNNING, cached
        request.metrics.cached_prompt_tokens += cached
        self.prefill_cached_tokens += cached
        self._budget -= len(tokens) - cached
        return request

    def _prefill_chunk(self, request: Request) -> ScheduledBatch:
        tokens, start = request.all_token_ids, request.num_computed_tokens
        chunk = tokens[start:start + self.prefill_call_tokens]
        return ScheduledBatch(PREFILL, [request], [chunk], [start], sample=start + len(chunk) == len(tokens),
                              prompt_logits=request.needs_prompt_logits, copies=self.manager.take_copies(request.seq_id),
                              block_tables=[self.manager.block_table(request.seq_id)],
                              slots=[self.manager.slot_mapping(request.seq_id, start, len(chunk))])

    def _decode(self) -> ScheduledBatch:
        copies: list[tuple[int, int]] = []
        preempted: list[Request] = []
        for request in list(self.running):  # every row's own token first: only that preempts anyone
            if request not in self.running:
                continue  # preempted while making room for an earlier one
            while True:
                try:
                    copies += self.manager.append_slots(request.seq_id, 1)
                    break
                except OutOfBlocks:
                    victim = self.running.pop()  # the most recently admitted
                    self._preempt(victim)
                    preempted.append(victim)
                    if victim is request:
                        break
        # then drafts where blocks are left, earlier rows first: speculation is optional, so every row decodes plainly
        # before anyone is preempted (placing a row's drafts with its token let an earlier row's drafts take the
        # blocks a later row needed for its one token)
        drafts: dict[int, list[int]] = {}
        for request in self.running:
            row_drafts = list(request.spec_token_ids or []) if self.speculative else []
            if row_drafts:
                try:
                    copies += self.manager.append_slots(request.seq_id, len(row_drafts))
                except OutOfBlocks:
                    row_drafts = []
            drafts[request.seq_id] = row_drafts
        tokens, positions = self._decode_rows()
        rows = [drafts[r.seq_id] for r in self.running] if self.speculative else None
        if rows is not None:
            tokens = [row + extra for row, extra in zip(tokens, rows)]
        batch = ScheduledBatch(DECODE, list(self.running), tokens, positions, copies=copies, preempted=preempted,
                               block_tables=[self.manager.block_table(r.seq_id) for r in self.running],
                               slots=[self.manager.slot_mapping(r.seq_id, p, len(row))
                                      for r, p, row in zip(self.running, positions, tokens)], drafts=rows)
        self._record_usage()
        return batch

    def _preempt(self, request: Request) -> None:
        self.manager.free(request.seq_id)
        request.status, request.num_computed_tokens = RequestStatus.WAITING, 0
        request.spec_token_ids = request.spec_probs = None  # proposed for a round that will not run
        request.metrics.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(request)

    def _record_usage(self) -> None:
        used = self.manager.num_used_blocks
        if used >= self.peak_blocks_used:
            self.peak_blocks_used, self.peak_waste = used, self.manager.waste()

    def reset_peaks(self) -> None:
        self.peak_blocks_used, self.peak_waste = 0, 0.0


class StaticBatchScheduler(_Queues):
    """`token_budget`: most K/V positions (rows × columns) the batch's cache may hold, None for no bound;
    `max_positions`: the model's context (no row's columns exceed it); `min_columns`: positions a cache row holds
    however short its sequence (the preallocated buffers' first size)."""

    def __init__(self, max_batch: int, token_budget: int | None = None, max_positions: int | None = None,
                 min_columns: int = 1):
        super().__init__(max_batch)
        self.token_budget, self.max_positions, self.min_columns = token_budget, max_positions, min_columns

    def _columns(self, width: int, longest: int) -> int:
        return max(batch_columns(width, longest, self.max_positions), self.min_columns)

    def check_fits(self, prompt_tokens: int, max_tokens: int) -> None:
        """A request whose own cache row could outgrow the KV budget is refused before it waits (any other fits a
        batch of its own)."""
        if self.token_budget is None or self._columns(prompt_tokens, max_tokens) <= self.token_budget:
            return
        prompt_fits = self._columns(prompt_tokens, 1) <= self.token_budget
        raise InvalidArgumentError(
            "max_tokens" if prompt_fits else "prompt",
            f"a request of {prompt_tokens} prompt + {max_tokens} new tokens needs room for "
            f"{self._columns(prompt_tokens, max_tokens)} tokens of KV cache, but the engine's KV budget holds "
            f"{self.token_budget} (kv_cache_memory, --kv-cache-memory): ask for fewer tokens")

    def remove(self, request: Request) -> None:
        self._leave_queues(request)

    def schedule(self) -> ScheduledBatch | None:
        if self.running:
            tokens, positions = self._decode_rows()
            return ScheduledBatch(DECODE, list(self.running), tokens, positions)
        if not self.waiting:
            return None
        batch: list[Request] = []
        width = longest = 0
        while self.waiting and len(batch) < self.max_batch:
            request = self.waiting[0]
            wider = max(width, len(request.prompt_token_ids))
            longer = max(longest, request.params.max_tokens)
            if batch and self.token_budget is not None and \
                    (len(batch) + 1) * self._columns(wider, longer) > self.token_budget:
                break
            batch.append(self.waiting.popleft())
            width, longest = wider, longer
        for request in batch:
            request.status = RequestStatus.RUNNING
        return ScheduledBatch(PREFILL, batch, [r.prompt_token_ids for r in batch], [0] * len(batch),
                              prompt_logits=any(r.needs_prompt_logits for r in batch))

    def update(self, batch: ScheduledBatch, cached: list[int | None] | None = None) -> None:
        """After a successful call (a contiguous cache keeps its own KV: `cached` only counts)."""
        for row, (request, chunk) in enumerate(zip(batch.requests, batch.token_ids)):
            kept = cached[row] if cached is not None and cached[row] is not None else len(chunk)
            request.num_computed_tokens += kept
        if batch.kind == PREFILL:
            self.running.extend(batch.requests)
