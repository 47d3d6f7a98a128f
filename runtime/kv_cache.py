"""Contiguous KV cache: per layer one [B, kv_heads, past, head_dim] array, replaced by each step's present output."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from fxllm.runtime.contract import CONTIGUOUS, ModelIO, ModelSpec, cache_input, cache_output


@dataclass
class ContiguousKVCache:
    keys: list[np.ndarray]
    values: list[np.ndarray]

    @classmethod
    def empty(cls, layers: int, batch: int, kv_heads: int, head_dim: int, dtype=np.float32) -> ContiguousKVCache:
        shape = (batch, kv_heads, 0, head_dim)
        return cls([np.zeros(shape, dtype) for _ in range(layers)], [np.zeros(shape, dtype) for _ in range(layers)])

    @property
    def length(self) -> int:
        return self.keys[0].shape[2]

    def feeds(self) -> dict[str, np.ndarray]:
        feeds = {cache_input(CONTIGUOUS, "key", i): k for i, k in enumerate(self.keys)}
        feeds.update({cache_input(CONTIGUOUS, "value", i): v for i, v in enumerate(self.values)})
        return feeds

    def update(self, outputs: dict[str, np.ndarray]) -> None:
        self.keys = [outputs[cache_output(CONTIGUOUS, "key", i)] for i in range(len(self.keys))]
        self.values = [outputs[cache_output(CONTIGUOUS, "value", i)] for i in range(len(self.values))]

    def select_rows(self, rows: list[int]) -> None:
        """Keep only these batch rows (finished sequences leave the batch)."""
        self.keys = [np.ascontiguousarray(k[rows]) for k in self.keys]
        self.values = [np.ascontiguousarray(v[rows]) for v in self.values]

    def drop_leading(self, count: int) -> None:
        """Forget the first `count` cached positions (left padding no remaining row needs)."""
        self.keys = [np.ascontiguousarray(k[:, :, count:]) for k in self.keys]
        self.values = [np.ascontiguousarray(v[:, :, count:]) for v in self.values]

    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.keys + self.values)

    def truncate(self, length: int) -> None:
        """Keep the first `length` positions (speculative decoding rolls back rejected draft tokens)."""
        if length < self.length:
            self.keys = [k[:, :, :length] for k in self.keys]
            self.values = [v[:, :, :length] for v in self.values]


@dataclass
class SharedKVCache:
    """A contiguous cache in preallocated buffers that the model updates in place (shared-buffer artifacts, see
    runtime/contract.py): per layer [B, kv_heads, capacity, head_dim], rows [0, length) valid. The backend binds
    each present output to its past input's memory; `reserve` is called before each step with the step's total."""

    keys: list[np.ndarray]
    values: list[np.ndarray]
    length: int = 0
    pending: int = 0  # the total the step being run will leave
    # Rows the batch can ever need (its longest prompt + its longest generation, within the context): doubling stops
    # there, so the buffers stay within what the scheduler's KV budget counted for the batch. None: no ceiling.
    ceiling: int | None = None
    _feeds: dict[str, np.ndarray] | None = field(default=None, repr=False, compare=False)
    MIN_CAPACITY = 256  # rows allocated at first; doubled whenever a step needs more (amortized copies)

    @classmethod
    def empty(cls, layers: int, batch: int, kv_heads: int, head_dim: int, dtype=np.float32) -> SharedKVCache:
        """dtype: the graph's cache element type (int8 for a quantized cache: codes, the scales are the graph's)."""
        buffers = _one_block(2 * layers, (batch, kv_heads, cls.MIN_CAPACITY, head_dim), dtype)
        return cls(buffers[:layers], buffers[layers:])

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]

    def reserve(self, total: int) -> None:
        """Make room for `total` rows (the step's past + new tokens), keeping the valid ones."""
        if total > self.capacity:
            # past its ceiling (a caller's count was short) doubling resumes: never one move a step
            capped = self.ceiling is not None and total <= self.ceiling
            self.grow_to(max(total, min(2 * self.capacity, self.ceiling) if capped else 2 * self.capacity))
        self.pending = total

    def grow_to(self, capacity: int) -> None:
        """At least `capacity` rows, the valid ones kept: a prefill sizes the buffers for its whole generation, so
        no decode step stops to move them (at 1,035 tokens of SmolLM2 a move is 47 MB copied into 95 MB of fresh
        pages)."""
        if capacity > self.capacity:
            self._move(0, capacity)

    def _move(self, start: int, capacity: int, rows: list[int] | None = None) -> None:
        """New buffers of `capacity` rows holding rows [start, length) of the old ones (batch rows `rows` only)."""
        old = self.keys + self.values
        batch = old[0].shape[0] if rows is None else len(rows)
        new = _one_block(len(old), (batch, old[0].shape[1], capacity, old[0].shape[3]), old[0].dtype)
        for source, target in zip(old, new):
            source = source if rows is None else source[rows]
            target[:, :, : self.length - start] = source[:, :, start: self.length]
        self.keys, self.values, self._feeds = new[: len(self.keys)], new[len(self.keys):], None

    def feeds(self) -> dict[str, np.ndarray]:
        """The buffers by input name: one dict until a buffer moves, then a new one (StepFeeds' `state`); do not
        modify it."""
        if self._feeds is None:
            self._feeds = {cache_input(CONTIGUOUS, "key", i): k for i, k in enumerate(self.keys)}
            self._feeds.update({cache_input(CONTIGUOUS, "value", i): v for i, v in enumerate(self.values)})
        return self._feeds

    def update(self, outputs: dict[str, np.ndarray]) -> None:
        """The step wrote its rows into the buffers themselves; only the valid length moves."""
        self.length = self.pending

    def select_rows(self, rows: list[int]) -> None:
        self._move(0, self.capacity, rows)

    def drop_leading(self, count: int) -> None:
        self._move(count, self.capacity)
        self.length -= count

    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.keys + self.values)

    def truncate(self, length: int) -> None:
        """Forget positions from `length` on (they are overwritten by later steps)."""
        self.length = min(self.length, length)

    def recycled(self, batch: int, capacity: int) -> SharedKVCache | None:
        """An empty cache in this finished cache's buffers, zeroed, when they hold `batch` rows and at least
        `capacity` positions but no more than a new cache would grow to (2x, or the minimum capacity: a long
        generation's buffers are not kept for short ones), else None. The caller must own this cache alone and
        never use it again: the new one writes into the same arrays. Why reuse: the backend keeps the arrays bound
        (no rebinding), and on the 2-core development VM an engine's second generation, the first on freshly
        allocated buffers, often ran its prefill ~2x slower inside GroupQueryAttention (23 tokens: ~100-130 ms
        against ~60), which reusing the buffers did not show (docs/targets.md)."""
        if self.keys[0].shape[0] != batch or not capacity <= self.capacity <= max(2 * capacity, self.MIN_CAPACITY):
            return None
        for buffer in self.keys + self.values:
            buffer.fill(0)
        return SharedKVCache(self.keys, self.values)


def _one_block(count: int, shape: tuple[int, ...], dtype=np.float32) -> list[np.ndarray]:
    """`count` zeroed buffers of `shape`, views of one allocation (one mapping per move instead of one per
    buffer: the kernel may back it with transparent huge pages, which 1-2 MB arrays never get; on the 2-core
    development VM it mostly did not, even when madvised, and no speed change was measurable beyond noise)."""
    return list(np.zeros((count, *shape), dtype))


def new_contiguous_cache(io: ModelIO, spec: ModelSpec, backend: object, batch: int = 1) -> ContiguousKVCache:
    """An empty contiguous cache for a graph of this calling convention: in-place buffers for a shared-buffer graph,
    else the backend's (device-resident) kind if it has one, else host arrays."""
    if io.shared_buffer:
        return SharedKVCache.empty(io.num_layers, batch, spec.num_kv_heads, spec.head_dim, host_cache_dtype(io))
    make = getattr(backend, "new_contiguous_cache", None)
    if make is not None:
        return make(io.num_layers, batch, spec.num_kv_heads, spec.head_dim)
    return ContiguousKVCache.empty(io.num_layers, batch, spec.num_kv_heads, spec.head_dim, host_cache_dtype(io))


def batch_columns(width: int, longest: int, context: int | None) -> int:
    """Cache columns a contiguous batch can ever need: its widest prompt plus its longest generation, capped at the
    context where given (right-padded rows; None for left-padded ones, whose padding columns stay, so together they
    may pass it). What the scheduler's KV budget counts and where a shared buffer's doubling stops, kept in one place
    so the two agree."""
    return width + longest if context is None else min(width + longest, context)


def host_cache_dtype(io: ModelIO) -> np.dtype:
    """The numpy element type of a graph's cache tensors: int8 codes, float16 for a half-precision artifact, else
    float32 (bfloat16 too, which numpy lacks: the TensorRT backend converts on the device; ONNX Runtime refuses
    bfloat16 artifacts when loading them)."""
    names = io.cache_dtypes
    return np.dtype(next(iter(names))) if len(names) == 1 and names <= {"int8", "float16"} else np.dtype(np.float32)
