"""Contiguous KV cache: per layer one [B, kv_heads, past, head_dim] array, replaced by each step's present output."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fxllm.runtime.contract import CONTIGUOUS, cache_input, cache_output


@dataclass
class ContiguousKVCache:
    keys: list[np.ndarray]
    values: list[np.ndarray]

    @classmethod
    def empty(cls, layers: int, batch: int, kv_heads: int, head_dim: int) -> ContiguousKVCache:
        shape = (batch, kv_heads, 0, head_dim)
        return cls([np.zeros(shape, np.float32) for _ in range(layers)],
                   [np.zeros(shape, np.float32) for _ in range(layers)])

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
