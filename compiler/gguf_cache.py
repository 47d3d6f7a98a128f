"""One parse of a GGUF file, and one tensor-name map per architecture, per compile.

A compile of a GGUF reads it five times: transformers parses it for the config, the tokenizer and the weights, the
source check reads its architecture and the gguf quantize method its blocks. Every `gguf.GGUFReader(path)` builds
all metadata fields in Python — for SmolLM2 the 49,152-token vocabulary and its merges, about 5 s each on this
machine — before any tensor is touched. Within `shared_gguf_readers()` the readers are made once per file and
shared (they only map the file read-only); outside it nothing changes.

transformers also asks `gguf.get_tensor_name_map(arch, layers)` once per submodule of the model while it maps the
weights (397 times for SmolLM2), and each call builds the whole name table again (~11 ms): 4.4 s of a 50 s compile.
Within the same context the maps are built once per (architecture, layers) and shared; callers only read them.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator


@contextlib.contextmanager
def shared_gguf_readers() -> Iterator[None]:
    """While active, `gguf.GGUFReader(path)` (read mode) returns one reader per file (same path, size and mtime) and
    `gguf.get_tensor_name_map(arch, n)` one map per (arch, n); every caller looks them up in the `gguf` package at
    call time, transformers included."""
    try:
        import gguf
    except ImportError:  # no GGUF support installed: nothing to share
        yield
        return
    if not hasattr(gguf, "GGUFReader"):  # a namespace package of that name, not the gguf library (seen on the GPU
        yield                            # machine): nothing to share either
        return
    original = gguf.GGUFReader
    original_name_map = gguf.get_tensor_name_map
    readers: dict[tuple[str, int, int], object] = {}
    name_maps: dict[tuple[object, int], object] = {}

    def reader(path, mode: str = "r"):
        if mode != "r":
            return original(path, mode)
        stat = os.stat(path)
        key = (os.path.realpath(path), stat.st_size, stat.st_mtime_ns)
        if key not in readers:
            readers[key] = original(path, mode)
        return readers[key]

    def name_map(arch, n_blocks: int):
        key = (arch, n_blocks)
        if key not in name_maps:
            name_maps[key] = original_name_map(arch, n_blocks)
        return name_maps[key]

    gguf.GGUFReader = reader
    gguf.get_tensor_name_map = name_map
    try:
        yield
    finally:
        gguf.GGUFReader = original
        gguf.get_tensor_name_map = original_name_map
