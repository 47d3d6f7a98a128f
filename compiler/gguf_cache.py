"""One parse of a GGUF file per compile.

A compile of a GGUF reads it five times: transformers parses it for the config, the tokenizer and the weights, the
source check reads its architecture and the gguf quantize method its blocks. Every `gguf.GGUFReader(path)` builds
all metadata fields in Python — for SmolLM2 the 49,152-token vocabulary and its merges, about 5 s each on this
machine — before any tensor is touched. Within `shared_gguf_readers()` the readers are made once per file and
shared (they only map the file read-only); outside it nothing changes.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator


@contextlib.contextmanager
def shared_gguf_readers() -> Iterator[None]:
    """While active, `gguf.GGUFReader(path)` (read mode) returns one reader per file (same path, size and mtime);
    every caller imports the class from the `gguf` package at call time, transformers included."""
    try:
        import gguf
    except ImportError:  # no GGUF support installed: nothing to share
        yield
        return
    original = gguf.GGUFReader
    readers: dict[tuple[str, int, int], object] = {}

    def reader(path, mode: str = "r"):
        if mode != "r":
            return original(path, mode)
        stat = os.stat(path)
        key = (os.path.realpath(path), stat.st_size, stat.st_mtime_ns)
        if key not in readers:
            readers[key] = original(path, mode)
        return readers[key]

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = original
