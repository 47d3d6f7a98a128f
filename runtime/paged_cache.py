"""The paged KV pool: per layer one K and one V array of [num_blocks, block_size, kv_heads, head_dim], fed to the
model as inputs (ONNX Runtime reads numpy inputs in place) and written slot by slot with each step's new K/V."""

from __future__ import annotations

import re

import numpy as np

from fxllm.errors import GenerationError
from fxllm.runtime.contract import PAGED, cache_input, cache_output

DEFAULT_KV_BUDGET = 512 * 2**20  # the pool of a paged artifact when neither a budget nor a block count is given
UNITS = {"": 1, "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_bytes(value: int | str) -> int:
    """256MB, 1.5GiB, 4096 → bytes."""
    if isinstance(value, int):
        return value
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(value))
    if not match or match.group(2).upper() not in UNITS:
        raise GenerationError(f"cannot read '{value}' as a memory size (examples: 256MB, 1GiB, 4096)")
    return int(float(match.group(1)) * UNITS[match.group(2).upper()])


def default_num_blocks(block_bytes: int, block_size: int, max_positions: int) -> int:
    """Blocks in the default pool: DEFAULT_KV_BUDGET, and never less than one full-context sequence."""
    return max(DEFAULT_KV_BUDGET // block_bytes, -(-max_positions // block_size))


class PagedKVPool:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int):
        shape = (num_blocks, block_size, kv_heads, head_dim)
        self.block_size = block_size
        self.keys = [np.zeros(shape, np.float32) for _ in range(num_layers)]
        self.values = [np.zeros(shape, np.float32) for _ in range(num_layers)]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.keys + self.values)

    def feeds(self) -> dict[str, np.ndarray]:
        feeds = {cache_input(PAGED, "key", i): k for i, k in enumerate(self.keys)}
        feeds.update({cache_input(PAGED, "value", i): v for i, v in enumerate(self.values)})
        return feeds

    def write(self, outputs: dict[str, np.ndarray], slots: np.ndarray) -> None:
        """Store new_key_i / new_value_i [B, Hkv, T, D] at slots [B, T] (block * block_size + offset); a slot of -1
        (a padding position) is not written."""
        valid = slots >= 0
        every = bool(valid.all())
        blocks, offsets = np.divmod(slots if every else slots[valid], self.block_size)
        for i, (keys, values) in enumerate(zip(self.keys, self.values)):
            new_keys = outputs[cache_output(PAGED, "key", i)].transpose(0, 2, 1, 3)
            new_values = outputs[cache_output(PAGED, "value", i)].transpose(0, 2, 1, 3)
            keys[blocks, offsets] = new_keys if every else new_keys[valid]
            values[blocks, offsets] = new_values if every else new_values[valid]

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: duplicate source blocks into their new private blocks."""
        for source, target in pairs:
            for array in self.keys + self.values:
                array[target] = array[source]
