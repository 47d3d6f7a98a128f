"""KV caches that live on the torch backend's device (CPU or CUDA): the same interfaces as the numpy caches
(runtime/kv_cache.py, runtime/paged_cache.py), holding torch tensors, so the model runner drives either without
knowing where the cache is. Nothing here copies K/V to the host: rows are dropped, positions trimmed, slots
written and blocks copied with device ops. torch is imported when a cache is made, never at import.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from fxllm.runtime.contract import CONTIGUOUS, PAGED, cache_input, cache_output


@dataclass
class TorchContiguousCache:
    """Per layer one [B, kv_heads, past, head_dim] device tensor, replaced by each step's present output."""

    keys: list[Any]
    values: list[Any]

    @classmethod
    def empty(cls, layers: int, batch: int, kv_heads: int, head_dim: int, device, dtype) -> TorchContiguousCache:
        import torch

        shape = (batch, kv_heads, 0, head_dim)
        return cls([torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)],
                   [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)])

    @property
    def length(self) -> int:
        return self.keys[0].shape[2]

    def feeds(self) -> dict[str, Any]:
        feeds = {cache_input(CONTIGUOUS, "key", i): k for i, k in enumerate(self.keys)}
        feeds.update({cache_input(CONTIGUOUS, "value", i): v for i, v in enumerate(self.values)})
        return feeds

    def update(self, outputs: dict[str, Any]) -> None:
        self.keys = [outputs[cache_output(CONTIGUOUS, "key", i)] for i in range(len(self.keys))]
        self.values = [outputs[cache_output(CONTIGUOUS, "value", i)] for i in range(len(self.values))]

    def select_rows(self, rows: list[int]) -> None:
        """Keep only these batch rows (finished sequences leave the batch)."""
        index = _index(self.keys[0], rows)
        self.keys = [k.index_select(0, index) for k in self.keys]
        self.values = [v.index_select(0, index) for v in self.values]

    def drop_leading(self, count: int) -> None:
        """Forget the first `count` cached positions (left padding no remaining row needs)."""
        self.keys = [k[:, :, count:].contiguous() for k in self.keys]
        self.values = [v[:, :, count:].contiguous() for v in self.values]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    def truncate(self, length: int) -> None:
        """Keep the first `length` positions (speculative decoding rolls back rejected draft tokens)."""
        if length < self.length:
            self.keys = [k[:, :, :length] for k in self.keys]
            self.values = [v[:, :, :length] for v in self.values]


class TorchPagedPool:
    """Per layer one K and one V pool [num_blocks, block_size, kv_heads, head_dim] on the device, fed to the graph
    as inputs (read in place) and written slot by slot with each step's new K/V."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int, device,
                 dtype):
        import torch

        shape = (num_blocks, block_size, kv_heads, head_dim)
        self.block_size = block_size
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    def feeds(self, first: int = 0, end: int | None = None) -> dict[str, Any]:
        """Every layer's pool, or the slice of blocks [first, end) of it (views); see PagedKVPool.feeds."""
        feeds = {cache_input(PAGED, "key", i): k[first:end] for i, k in enumerate(self.keys)}
        feeds.update({cache_input(PAGED, "value", i): v[first:end] for i, v in enumerate(self.values)})
        return feeds

    def new_kv_buffers(self, batch: int, tokens: int) -> None:
        """No host destinations: the new K/V stay on the device (see PagedKVPool.new_kv_buffers)."""
        return None

    def write(self, outputs: dict[str, Any], slots: np.ndarray) -> None:
        """Store new_key_i / new_value_i [B, Hkv, T, D] at slots [B, T] (block * block_size + offset); a slot of -1
        (a padding position) is not written."""
        valid = slots >= 0
        every = bool(valid.all())
        index = _index(self.keys[0], slots if every else slots[valid])
        mask = None if every else _index(self.keys[0], valid).bool()
        blocks, offsets = index // self.block_size, index % self.block_size
        for i, (keys, values) in enumerate(zip(self.keys, self.values)):
            new_keys = outputs[cache_output(PAGED, "key", i)].transpose(1, 2)
            new_values = outputs[cache_output(PAGED, "value", i)].transpose(1, 2)
            keys[blocks, offsets] = (new_keys if every else new_keys[mask]).to(keys.dtype)
            values[blocks, offsets] = (new_values if every else new_values[mask]).to(values.dtype)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: duplicate source blocks into their new private blocks."""
        if not pairs:
            return
        sources = _index(self.keys[0], [source for source, _ in pairs])
        targets = _index(self.keys[0], [target for _, target in pairs])
        for pool in self.keys + self.values:
            pool[targets] = pool[sources]


def _index(like, values) -> Any:
    """An int64 index tensor on the device of `like` (one small host-to-device copy)."""
    import torch

    return torch.as_tensor(np.asarray(values, dtype=np.int64), device=like.device)
