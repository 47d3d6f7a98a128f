"""The model runner: executes what a scheduler decided (a ScheduledBatch) on a backend and returns logits. It owns
the KV cache's placement — the paged pool, or the contiguous cache of the running batch — builds every feed by the
contract's names, and writes each call's new K/V. It owns no policy: which requests run, and what is sampled, is
decided elsewhere.

Contiguous cache, one batch at a time: a prefill left-pads the rows' prompts (`attention_mask` 1 on real tokens,
`position_ids = max(cumsum(mask) - 1, 0)`) and starts a new cache (a one-row prompt is fed in calls of equal
spans of at most `prefill_tokens` tokens; None: one call); each decode feeds every remaining row's last
token after dropping the cache rows of requests that left (and any leading columns that are padding in every row
still there). A right-padded artifact (ModelIO.right_padded) takes the rows padded at the end instead, each row's
mask its own length of ones, and each row's logits from its own last position. Paged cache: rows at their own
positions, read through block tables, their new K/V written into the pool slots the scheduler assigned. Paged
rows may differ in length (a speculative decode feeds each row its last token and its drafts): shorter rows are
padded at the end — a padding token sees only its row, sits at the row's last real position, and its K/V is never
written — and every fed position's logits come back.

A prefill call whose logits nobody reads (a chunk before the last, unless prompt logits are wanted) selects no
position of a select-logits artifact where the backend allows an empty selection (`allows_empty_selection`), so
the lm_head does not run for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import numpy as np

from fxllm.runtime.backend import Backend, StepFeeds
from fxllm.runtime.contract import (ATTENTION_MASK, BLOCK_TABLES, CONTEXT_LENS, INPUT_IDS, LOGITS, LOGITS_INDEX,
                                    POSITION_IDS, ModelIO, ModelSpec, is_block_run)
from fxllm.runtime.decode_mask import DecodeMask
from fxllm.runtime.kv_cache import (ContiguousKVCache, SharedKVCache, batch_columns, host_cache_dtype,
                                    new_contiguous_cache)
from fxllm.runtime.paged_cache import HeadMajorKVPool, PagedKVPool
from fxllm.runtime.scheduler import PREFILL, ScheduledBatch


@dataclass
class RunnerOutput:
    logits: np.ndarray  # [B, V]: each row's last fed position ([B, 0] where none was computed: nothing sampled)
    all_logits: list[np.ndarray] | None = None  # per row [tokens fed, V]: prompt logits, or a speculative decode


class ModelRunner:
    def __init__(self, backend: Backend, io: ModelIO, spec: ModelSpec, pad_token_id: int = 0,
                 pool: PagedKVPool | HeadMajorKVPool | None = None, prefill_tokens: int | None = None):
        self.backend = backend
        self.prefill_tokens = prefill_tokens  # contiguous prefill: tokens a call (None: the whole batch in one)
        self._empty_selection = getattr(backend, "allows_empty_selection", False)
        self.io = io
        self.spec = spec
        self.pad_token_id = pad_token_id
        self.pool = pool  # paged artifacts
        self._rows: list[object] = []  # contiguous: the requests of the running batch, in cache row order
        self._cache: ContiguousKVCache | None = None
        self._mask: DecodeMask | None = None

    @classmethod
    def create(cls, backend: Backend, io: ModelIO, spec: ModelSpec, pad_token_id: int = 0,
               num_blocks: int | None = None, prefill_tokens: int | None = None) -> ModelRunner:
        """A runner with its KV storage: a pool of `num_blocks` blocks for paged artifacts."""
        pool = None
        if io.paged:
            if io.head_major_pool:
                make = partial(HeadMajorKVPool, dtype=host_cache_dtype(io))
            else:  # a backend may keep the pool on its device
                make = getattr(backend, "new_paged_pool", None) or partial(PagedKVPool, dtype=host_cache_dtype(io))
            pool = make(io.num_layers, num_blocks, io.block_size, spec.num_kv_heads, spec.head_dim)
        return cls(backend, io, spec, pad_token_id, pool, prefill_tokens)

    def execute(self, batch: ScheduledBatch) -> RunnerOutput:
        if self.io.paged:
            return self._execute_paged(batch)
        if batch.kind == PREFILL:
            return self._prefill_contiguous(batch)
        return self._decode_contiguous(batch)

    def reset(self) -> None:
        """Forget the running contiguous batch (its requests failed or left)."""
        self._rows, self._cache, self._mask = [], None, None

    # -- one sequence on its own contiguous cache (scoring, speculative decoding) ------------------------------------

    def new_cache(self, batch: int = 1) -> ContiguousKVCache:
        return new_contiguous_cache(self.io, self.spec, self.backend, batch)

    def step_one(self, cache: ContiguousKVCache, token_ids: list[int], start: int, all_logits: bool) -> np.ndarray:
        """Feed token_ids after the `start` tokens in `cache`, appending their K/V; logits [T, V] of every fed token,
        or [1, V] of the last unless all_logits."""
        ids = np.asarray([token_ids], dtype=np.int64)
        positions = np.arange(start, start + len(token_ids), dtype=np.int64)[None]
        mask = np.ones((1, start + len(token_ids)), dtype=np.int64)
        return self._run_contiguous(ids, positions, mask, cache, all_logits)[0]

    # -- contiguous batches -----------------------------------------------------------------------------------------

    def _prefill_contiguous(self, batch: ScheduledBatch) -> RunnerOutput:
        finished = self._cache  # the previous batch's cache: only this runner holds it
        self.reset()
        rows = batch.token_ids
        width = max(len(ids) for ids in rows)
        input_ids = np.full((len(rows), width), self.pad_token_id, dtype=np.int64)
        mask = np.zeros((len(rows), width), dtype=np.int64)
        right = self.io.right_padded
        for row, ids in enumerate(rows):  # right-padded: from column 0; left-padded: ending in the last column
            columns = slice(0, len(ids)) if right else slice(width - len(ids), width)
            input_ids[row, columns] = ids
            mask[row, columns] = 1
        positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
        lasts = [len(ids) - 1 for ids in rows] if right else [width - 1] * len(rows)  # each row's last column
        if self.io.shared_buffer:
            # room for the generation too (no buffer move mid-way), up to the room doubling would give: memory
            # stays within 2x the prompt (or its minimum capacity) whatever max_tokens says
            longest = max(r.params.max_tokens for r in batch.requests)
            extra = min(longest, max(width, SharedKVCache.MIN_CAPACITY))
            capacity = min(width + extra, self.spec.max_positions)
            # what the scheduler's KV budget counted (left-padded rows keep their padding columns: no context cap)
            ceiling = batch_columns(width, longest, self.spec.max_positions if right else None)
            recyclable = (isinstance(finished, SharedKVCache)  # and within the budget's count
                          and finished.capacity <= max(ceiling, SharedKVCache.MIN_CAPACITY))
            reused = finished.recycled(len(rows), capacity) if recyclable else None
            finished = None  # buffers not recycled are freed before new ones are made (what the backend still binds
            # goes when the new ones are bound)
            cache = reused or self.new_cache(len(rows))
            cache.grow_to(capacity)
            cache.ceiling = ceiling
        else:
            cache = self.new_cache(len(rows))
        selected = sorted(set(lasts))
        logits = self._prompt_in_chunks(input_ids, positions, mask, cache, batch.prompt_logits, selected)
        self._rows, self._cache, self._mask = list(batch.requests), cache, DecodeMask(mask, right)
        if batch.prompt_logits:  # every position's logits
            all_logits = [logits[row, lasts[row] + 1 - len(ids):lasts[row] + 1] for row, ids in enumerate(rows)]
            return RunnerOutput(logits[np.arange(len(rows)), lasts], all_logits)
        if logits.shape[1] == len(selected):  # the selected columns, in `selected` order
            return RunnerOutput(logits[np.arange(len(rows)), [selected.index(last) for last in lasts]])
        return RunnerOutput(logits[np.arange(len(rows)), lasts])

    def _decode_contiguous(self, batch: ScheduledBatch) -> RunnerOutput:
        cache, mask = self._cache, self._mask
        if batch.requests != self._rows:  # some requests left the batch: drop their cache rows
            row_of = {id(request): row for row, request in enumerate(self._rows)}
            keep = [row_of[id(request)] for request in batch.requests]
            cache.select_rows(keep)
            mask.select_rows(keep)
            padding = int(mask.array.any(0).argmax())  # leading columns that are padding in every remaining row
            # a shared buffer keeps them: its attention may rotate by cache row (ort attention-rotary), and
            # dropping columns would move the queries' rows but not the keys already rotated
            if padding and not isinstance(cache, SharedKVCache):
                cache.drop_leading(padding)
                mask.drop_leading(padding)
            self._rows = list(batch.requests)
        ids = np.asarray(batch.token_ids, dtype=np.int64)
        positions = np.asarray(batch.positions, dtype=np.int64)[:, None]
        logits = self._run_contiguous(ids, positions, mask.grow(), cache, all_logits=False)
        return RunnerOutput(logits[:, -1])

    def _prompt_in_chunks(self, input_ids: np.ndarray, position_ids: np.ndarray, attention_mask: np.ndarray,
                          cache: ContiguousKVCache, all_logits: bool, selected: list[int]) -> np.ndarray:
        """A one-row prompt [1, W] in calls of equal spans of at most `prefill_tokens` tokens: the logits one call
        would give ([B, W, V] for all_logits or an artifact that computes every position, else [B, len(selected),
        V]: the columns `selected`, ascending; a one-row prompt's is its last). Each call's attention scores only the
        keys before its own tokens (ONNX Runtime's GroupQueryAttention scores the whole [T, T] square of a call, then
        masks half of it) and holds scores for its span only: SmolLM2 fp32 prefilled 1,035 tokens in 0.86x the time
        in calls of 207. Several rows go in one call: GroupQueryAttention feeds several tokens after a past only to a
        batch of one."""
        width = input_ids.shape[1]
        columns = width if self.prefill_tokens is None or len(input_ids) > 1 else self.prefill_tokens
        calls = -(-width // columns)
        span = -(-width // calls)
        pieces = []
        for start in range(0, width, span):
            end = min(width, start + span)
            wanted = all_logits or end == width
            logits = self._run_contiguous(input_ids[:, start:end], position_ids[:, start:end],
                                          attention_mask[:, :end], cache, all_logits, wanted,
                                          [column - start for column in selected] if end == width else None)
            if wanted:
                pieces.append(logits)
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces, axis=1)

    def _run_contiguous(self, input_ids: np.ndarray, position_ids: np.ndarray, attention_mask: np.ndarray,
                        cache: ContiguousKVCache, all_logits: bool, wanted: bool = True,
                        selected: list[int] | None = None) -> np.ndarray:
        """One call; the cache takes the new K/V. Logits [B, T or len(selected), V] (`selected`: the columns of a
        select-logits artifact, default the last; unwanted: whatever the artifact computes when asked for none,
        possibly nothing)."""
        if isinstance(cache, SharedKVCache):
            cache.reserve(attention_mask.shape[1])
        feeds = StepFeeds({INPUT_IDS: input_ids, POSITION_IDS: position_ids, ATTENTION_MASK: attention_mask,
                           **self._logits_index(input_ids.shape[1], all_logits, wanted, selected)}, cache.feeds())
        outputs = self.backend.run(feeds)
        cache.update(outputs)
        return outputs[LOGITS]

    # -- paged ------------------------------------------------------------------------------------------------------

    def _execute_paged(self, batch: ScheduledBatch) -> RunnerOutput:
        """Rows at their own positions, padded at the end to the longest; the pool takes their new K/V at
        batch.slots. The model sees the slice of the pool that the batch's blocks span, and block tables counted
        from its first block (padded with that block, never visible): a pool-reading attention (ort
        paged-attention) then reads no block outside it. A head-major pool's step of one sequence whose blocks form
        a run writes its K/V into the pool itself (runtime/contract.py)."""
        self.pool.copy_blocks(batch.copies)
        lengths = [len(ids) for ids in batch.token_ids]
        width, rows = max(lengths), len(lengths)
        first = min(min(blocks) for blocks in batch.block_tables)
        end = max(max(blocks) for blocks in batch.block_tables) + 1
        table = np.full((rows, max(len(t) for t in batch.block_tables)), first, dtype=np.int64)
        input_ids = np.full((rows, width), self.pad_token_id, dtype=np.int64)
        slots = np.full((rows, width), -1, dtype=np.int64)  # -1: padding, written nowhere
        for row, (blocks, ids, row_slots) in enumerate(zip(batch.block_tables, batch.token_ids, batch.slots)):
            table[row, :len(blocks)] = blocks
            input_ids[row, :len(ids)] = ids
            slots[row, :len(ids)] = row_slots
        table -= first
        run = self.io.head_major_pool and is_block_run(table.tolist())  # the step writes its K/V in place
        positions = np.asarray(batch.positions, dtype=np.int64)
        offsets = np.minimum(np.arange(width, dtype=np.int64), np.asarray(lengths, dtype=np.int64)[:, None] - 1)
        all_positions = batch.prompt_logits or batch.drafts is not None or min(lengths) != width
        feeds = StepFeeds({INPUT_IDS: input_ids, POSITION_IDS: positions[:, None] + offsets, BLOCK_TABLES: table,
                           CONTEXT_LENS: positions, **self._logits_index(width, all_positions, batch.sample)},
                          self.pool.feeds(first, end),
                          self.pool.run_outputs(first) if run else self.pool.new_kv_buffers(rows, width))
        outputs = self.backend.run(feeds)
        self.pool.write(outputs, slots)
        logits = outputs[LOGITS]
        if not all_positions:
            return RunnerOutput(logits[:, -1] if logits.shape[1] else logits[:, :, 0])  # [B, 0]: none computed
        per_row = [logits[row, :length] for row, length in enumerate(lengths)]
        return RunnerOutput(np.stack([row[-1] for row in per_row]), per_row)

    def _logits_index(self, width: int, all_logits: bool, wanted: bool = True,
                      selected: list[int] | None = None) -> dict[str, np.ndarray]:
        """select-logits artifacts compute only the positions asked for: all, `selected` (default the last), or
        none (logits not wanted, where the backend allows an empty selection)."""
        if not self.io.selects_logits:
            return {}
        if all_logits:
            return {LOGITS_INDEX: np.arange(width, dtype=np.int64)}
        if not wanted and self._empty_selection:
            return {LOGITS_INDEX: np.zeros(0, dtype=np.int64)}
        return {LOGITS_INDEX: np.asarray(selected if selected else [width - 1], dtype=np.int64)}
