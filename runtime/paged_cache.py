"""The paged KV pool: per layer one K and one V array of [num_blocks, block_size, kv_heads, head_dim], fed to the
model as inputs (ONNX Runtime reads numpy inputs in place) and written slot by slot with each step's new K/V."""

from __future__ import annotations

import re

import numpy as np

from fxllm.errors import GenerationError
from fxllm.runtime.contract import PAGED, cache_input, cache_output

DEFAULT_KV_BUDGET = 512 * 2**20  # the pool of a paged artifact when neither a budget nor a block count is given
DEFAULT_POOL_SEQUENCES = 64  # ... or less when this many full-context sequences fit in less (the default max_batch)
UNITS = {"": 1, "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30,
         "TIB": 2**40}


def parse_bytes(value: int | str) -> int:
    """256MB, 1.5GiB, 4096 → bytes."""
    if isinstance(value, int):
        return value
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(value))
    if not match:
        raise GenerationError(f"cannot read '{value}' as a memory size (examples: 256MB, 1GiB, 4096)")
    if match.group(2).upper() not in UNITS:
        raise GenerationError(f"cannot read '{value}' as a memory size: unknown unit '{match.group(2)}' (B, KB, MB, "
                              "GB, TB, KiB, MiB, GiB, TiB)")
    return int(float(match.group(1)) * UNITS[match.group(2).upper()])


def default_num_blocks(block_bytes: int, block_size: int, max_positions: int) -> int:
    """Blocks in the default pool: DEFAULT_KV_BUDGET, at most what DEFAULT_POOL_SEQUENCES full-context sequences
    fill (a short-context model's pool, counted whole against the memory available, needs no 512 MiB), and never
    less than one."""
    per_sequence = -(-max_positions // block_size)
    return max(min(DEFAULT_KV_BUDGET // block_bytes, DEFAULT_POOL_SEQUENCES * per_sequence), per_sequence)


# Why the pools touch their first block at allocation: np.zeros maps pages at first touch, on 2 MiB pages here (numpy
# advises them for large arrays), and where memory is fragmented the kernel compacts memory for each; a 512 MiB
# pool's first request, touching a page per layer, K/V and (head-major) head, took 0.1-0.8 s longer than the next
# (SmolLM2 paged, 23 and 69 prompt tokens: 86-794 against 35-80 ms). Blocks are taken lowest first, so the first
# request's pages are the first block's: touched at load, that request took 49-81 ms. Touching the whole pool
# instead (what llama.cpp's buffer clear does) cost 0.7-0.85 s of load and measured ~4% slower decode steps (10
# alternating process pairs at 69 tokens, 7 slower), so the rest is left to fault in as it is reached
# (docs/targets.md, nineteenth session).


class StepKV:
    """Where a step's new_key_i / new_value_i outputs [batch, Hkv, tokens, D] are written (StepFeeds.outputs):
    views of one reused array [2·layers, batch, Hkv, tokens, D], and the step's new K/V as that one array."""

    def __init__(self, outputs: list[str], dtype=np.float32):
        self._outputs = outputs
        self._dtype = dtype
        self._array: np.ndarray | None = None
        self._feeds: dict[str, np.ndarray] = {}

    def buffers(self, batch: int, kv_heads: int, tokens: int, head_dim: int) -> dict[str, np.ndarray]:
        """The destinations, the same dict while the shape holds."""
        shape = (len(self._outputs), batch, kv_heads, tokens, head_dim)
        if self._array is None or self._array.shape != shape:
            self._array = np.empty(shape, self._dtype)
            self._feeds = dict(zip(self._outputs, self._array))
        return self._feeds

    def stacked(self, outputs: dict[str, np.ndarray]) -> np.ndarray:
        """The step's new K/V [2·layers, B, Hkv, T, D]: the reused array when the outputs landed there, else a
        stack of them."""
        if self._feeds and all(outputs[name] is array for name, array in self._feeds.items()):
            return self._array
        return np.stack([outputs[name] for name in self._outputs])


class PagedKVPool:
    """One allocation [2·layers, blocks, block_size, kv_heads, head_dim]: layer i's keys are row i, its values row
    layers + i, so a step's new K/V of every layer are written with one indexed assignment. `dtype`: the graph's
    cache element type (float16 for a half-precision artifact)."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                 dtype=np.float32):
        self.block_size = block_size
        self._pools = np.zeros((2 * num_layers, num_blocks, block_size, kv_heads, head_dim), dtype)
        self._pools[:, 0, 0] = 0  # the first request's pages, now (see above)
        self.keys = list(self._pools[:num_layers])
        self.values = list(self._pools[num_layers:])
        self._names = [cache_input(PAGED, kind, i) for kind in ("key", "value") for i in range(num_layers)]
        self._outputs = [cache_output(PAGED, kind, i) for kind in ("key", "value") for i in range(num_layers)]
        self._feeds: tuple[tuple[int, int | None], dict[str, np.ndarray]] | None = None
        self._new = StepKV(self._outputs, dtype)

    @property
    def nbytes(self) -> int:
        return self._pools.nbytes

    def feeds(self, first: int = 0, end: int | None = None) -> dict[str, np.ndarray]:
        """Every layer's pool, or the slice of blocks [first, end) of it (views: nothing is copied); block tables
        fed with a slice count from `first`. The same slice again gives the same dict (StepFeeds.state: a backend
        keeps its bindings)."""
        if self._feeds is None or self._feeds[0] != (first, end):
            self._feeds = (first, end), dict(zip(self._names, self._pools[:, first:end]))
        return self._feeds[1]

    def new_kv_buffers(self, batch: int, tokens: int) -> dict[str, np.ndarray]:
        """Destinations for a step's new_key_i / new_value_i outputs [batch, Hkv, tokens, D] (StepFeeds.outputs):
        views of one array, the same dict while the shape holds, consumed by `write` before the next step."""
        return self._new.buffers(batch, self._pools.shape[3], tokens, self._pools.shape[4])

    def write(self, outputs: dict[str, np.ndarray], slots: np.ndarray) -> None:
        """Store new_key_i / new_value_i [B, Hkv, T, D] at slots [B, T] (block * block_size + offset); a slot of -1
        (a padding position) is not written."""
        valid = slots >= 0
        every = bool(valid.all())
        blocks, offsets = np.divmod(slots if every else slots[valid], self.block_size)
        new = self._new.stacked(outputs).transpose(0, 1, 3, 2, 4)  # [2L, B, T, Hkv, D]
        self._pools[:, blocks, offsets] = new if every else new[:, valid]

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: duplicate source blocks into their new private blocks."""
        for source, target in pairs:
            self._pools[:, target] = self._pools[:, source]


class HeadMajorKVPool:
    """The pool of a head-major paged artifact (runtime/contract.py): one allocation [2·layers, kv_heads, slots,
    head_dim] plus one head of padding, tensor i (layer i's keys, then every layer's values) fed as the
    C-contiguous [1, kv_heads, slots, head_dim] view that starts at the first block a step reads: head h of the
    view is head h of the tensor from that block on (the last head's view runs past its tensor into the next one,
    or the padding, rows the step never reads). A step of one sequence whose blocks form a run writes its K/V in
    place (`run_outputs`); any other step's new K/V are written here (`write`), as in PagedKVPool."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                 dtype=np.float32):
        self.block_size = block_size
        slots = num_blocks * block_size
        tensors = 2 * num_layers
        self._flat = np.zeros((tensors * kv_heads + 1) * slots * head_dim, dtype)
        self._pools = self._flat[:tensors * kv_heads * slots * head_dim].reshape(tensors, kv_heads, slots, head_dim)
        self._pools[:, :, 0] = 0  # the first request's pages, now (see above)
        self._names = [cache_input(PAGED, kind, i) for kind in ("key", "value") for i in range(num_layers)]
        self._outputs = [cache_output(PAGED, kind, i) for kind in ("key", "value") for i in range(num_layers)]
        self._view_shape = (1, kv_heads, slots, head_dim)
        self._feeds: tuple[int, dict[str, np.ndarray], dict[str, np.ndarray]] | None = None
        self._new = StepKV(self._outputs, dtype)

    @property
    def nbytes(self) -> int:
        return self._flat.nbytes

    def feeds(self, first: int = 0, end: int | None = None) -> dict[str, np.ndarray]:
        """Every tensor's view from block `first` on (`end` is not needed: a view always spans the pool's slots);
        the same `first` again gives the same dict (StepFeeds.state: a backend keeps its bindings)."""
        return self._views(first)[0]

    def run_outputs(self, first: int) -> dict[str, np.ndarray]:
        """Destinations for a run step's new_key_i / new_value_i: the views `feeds(first)` gives, so the step's K/V
        land in the pool (StepFeeds.outputs; `write` then has nothing to do)."""
        return self._views(first)[1]

    def _views(self, first: int) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        if self._feeds is None or self._feeds[0] != first:
            size = int(np.prod(self._view_shape))
            rows = self._pools.shape[1] * self._pools.shape[2]
            start = first * self.block_size * self._pools.shape[3]
            views = [self._flat[start + i * rows * self._pools.shape[3]:][:size].reshape(self._view_shape)
                     for i in range(len(self._names))]
            self._feeds = first, dict(zip(self._names, views)), dict(zip(self._outputs, views))
        return self._feeds[1], self._feeds[2]

    def new_kv_buffers(self, batch: int, tokens: int) -> dict[str, np.ndarray]:
        """Destinations for a gathering step's new_key_i / new_value_i [batch, Hkv, tokens, D] (see
        PagedKVPool.new_kv_buffers)."""
        return self._new.buffers(batch, self._pools.shape[1], tokens, self._pools.shape[3])

    def write(self, outputs: dict[str, np.ndarray], slots: np.ndarray) -> None:
        """Store new_key_i / new_value_i [B, Hkv, T, D] at slots [B, T] (block * block_size + offset; -1: padding,
        not written); nothing when the outputs are a run step's views (already in place)."""
        if self._feeds is not None and all(outputs.get(name) is view for name, view in self._feeds[2].items()):
            return
        valid = (slots >= 0).ravel()
        new = self._new.stacked(outputs)
        tensors, batch, heads, tokens, dim = new.shape
        new = new.transpose(0, 2, 1, 3, 4).reshape(tensors, heads, batch * tokens, dim)  # [2L, Hkv, B·T, D]
        if valid.all():
            self._pools[:, :, slots.ravel()] = new
        else:
            self._pools[:, :, slots.ravel()[valid]] = new[:, :, valid]

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: duplicate source blocks into their new private blocks."""
        size = self.block_size
        for source, target in pairs:
            self._pools[:, :, target * size:(target + 1) * size] = self._pools[:, :, source * size:(source + 1) * size]
