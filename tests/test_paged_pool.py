"""runtime/paged_cache.PagedKVPool.write: a step's new K/V land in their slots, whatever the batch shape, whether
they come in the pool's staging arrays or in arrays of their own; a padding slot (-1) is never written."""

from __future__ import annotations

import numpy as np
import pytest

from fxllm.runtime.contract import PAGED, cache_output
from fxllm.runtime.paged_cache import (DEFAULT_KV_BUDGET, DEFAULT_POOL_SEQUENCES, HeadMajorKVPool, PagedKVPool,
                                        default_num_blocks)

LAYERS, BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM = 3, 10, 4, 2, 5


def _expected(pool: np.ndarray, new: dict[str, np.ndarray], slots: np.ndarray) -> np.ndarray:
    """The pools after the write, slot by slot: new_<kind>_<layer>[b, :, t] at (block, offset) = divmod(slot)."""
    want = pool.copy()
    for row in range(slots.shape[0]):
        for token in range(slots.shape[1]):
            slot = int(slots[row, token])
            if slot < 0:
                continue
            block, offset = divmod(slot, BLOCK_SIZE)
            for index, kind in enumerate(("key", "value")):
                for layer in range(LAYERS):
                    want[index * LAYERS + layer, block, offset] = new[cache_output(PAGED, kind, layer)][row, :, token]
    return want


@pytest.mark.parametrize("slots", [[[13]], [[-1]], [[5, 6, 7]], [[9], [30], [2]], [[4, 5], [22, -1]]],
                         ids=["one-row-one-token", "one-padding-slot", "one-row-tokens", "rows", "rows-padded"])
@pytest.mark.parametrize("staged", [True, False], ids=["staging", "own-arrays"])
def test_new_kv_land_in_their_slots(slots, staged):
    rng = np.random.default_rng(0)
    pool = PagedKVPool(LAYERS, BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    pool._pools[:] = rng.standard_normal(pool._pools.shape)
    slots = np.asarray(slots, dtype=np.int64)
    batch, tokens = slots.shape
    outputs = pool.new_kv_buffers(batch, tokens) if staged else {
        cache_output(PAGED, kind, layer): np.empty((batch, KV_HEADS, tokens, HEAD_DIM), np.float32)
        for kind in ("key", "value") for layer in range(LAYERS)}
    for array in outputs.values():
        array[:] = rng.standard_normal(array.shape)
    want = _expected(pool._pools, outputs, slots)
    pool.write(outputs, slots)
    np.testing.assert_array_equal(pool._pools, want)


def test_memory_sizes_take_terabytes_and_name_an_unknown_unit():
    """'1TB' was 'cannot read as a memory size' while '100GB' was read."""
    from fxllm.errors import GenerationError
    from fxllm.runtime.paged_cache import parse_bytes

    assert (parse_bytes("1TB"), parse_bytes("2TiB"), parse_bytes("1.5GiB")) == (10 ** 12, 2 ** 41, 3 * 2 ** 29)
    with pytest.raises(GenerationError, match="unknown unit 'PB'"):
        parse_bytes("1PB")


def _resident_fraction(array: np.ndarray) -> float:
    """The share of the array's pages in memory now (mincore(2))."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    page = mmap.PAGESIZE
    start = array.ctypes.data // page * page
    length = array.ctypes.data + array.nbytes - start
    vector = ctypes.create_string_buffer((length + page - 1) // page)
    assert libc.mincore(start, length, vector) == 0, ctypes.get_errno()
    return sum(byte & 1 for byte in vector.raw) / len(vector.raw)


@pytest.mark.parametrize("pool_type", [PagedKVPool, HeadMajorKVPool])
def test_the_pages_a_first_request_writes_are_in_memory_when_the_pool_is_made(pool_type):
    """The page of block 0's first slot (blocks are taken lowest first) of every layer, K/V and head is mapped at
    allocation, so the first request does not pay for faulting those pages in (2 MiB pages: up to milliseconds
    each); the pool stays zero."""
    pool = pool_type(2, 2048, 16, 2, 64)  # 32 MiB
    if pool_type is PagedKVPool:  # [2·layers, blocks, block_size, kv_heads, head_dim]
        first_slots = list(pool._pools[:, 0, 0])
    else:  # [2·layers, kv_heads, slots, head_dim]
        first_slots = [pool._pools[tensor, head, 0] for tensor in range(4) for head in range(2)]
    resident = [_resident_fraction(part) for part in first_slots]  # before anything reads the pool
    assert pool._pools.nbytes >= 32 << 20 and resident == [1.0] * len(first_slots)
    assert not pool._pools.any()


def test_the_default_pool_is_512_mib_or_64_full_contexts_whichever_is_less():
    block_bytes, block_size = 65536, 16
    assert default_num_blocks(block_bytes, block_size, 8192) == DEFAULT_KV_BUDGET // block_bytes  # < 64 × 512
    assert default_num_blocks(block_bytes, block_size, 256) == DEFAULT_POOL_SEQUENCES * 256 // block_size
    assert default_num_blocks(1 << 30, block_size, 100) == 7  # never less than one full context
