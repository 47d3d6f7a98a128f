"""One parse of a GGUF file, and one tensor-name map per architecture, per compile.

A compile of a GGUF reads it five times: transformers parses it for the config, the tokenizer and the weights, the
source check reads its architecture and the gguf quantize method its blocks. Every `gguf.GGUFReader(path)` builds
all metadata fields in Python — for SmolLM2 the 49,152-token vocabulary and its merges, about 5 s each on this
machine — before any tensor is touched. Within `shared_gguf_readers()` the readers are made once per file and
shared (they only map the file read-only); outside it nothing changes.

transformers also asks `gguf.get_tensor_name_map(arch, layers)` once per submodule of the model while it maps the
weights (397 times for SmolLM2), and each call builds the whole name table again (~11 ms): 4.4 s of a 50 s compile.
Within the same context the maps are built once per (architecture, layers) and shared; callers only read them.

The readers made here also parse faster: gguf-py slices its `np.memmap` once per field part (4 million slices for
SmolLM2's vocabulary), and each memmap slice runs memmap's Python `__array_finalize__`; the same slices of a plain
ndarray view of the same mapping (`_PlainViewReader`) parsed SmolLM2's header in 0.8 s instead of 2.6 s, with equal
fields and tensors. `load_model` and `load_tokenizer` (compiler/sources.py) share the readers too, so a GGUF model
loaded outside a compile (`fxllm eval --reference`) is parsed once: SmolLM2's load_model took 7.4 s instead of 37.5 s.

Every reader made here, and `gguf_reader`'s outside the context, refuses a tensor whose header gives it no
dimensions: gguf-py reads a quantized one as the last dimension of an empty shape ("tuple index out of range") and
a float one as a scalar.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

_active = False  # shared_gguf_readers is re-entrant: an inner use shares the outer one's readers

F = TypeVar("F", bound=Callable)


def sharing_gguf_readers(function: F) -> F:
    """Decorator: run `function` inside shared_gguf_readers()."""
    @functools.wraps(function)
    def run(*args, **kwargs):
        with shared_gguf_readers():
            return function(*args, **kwargs)

    return run  # type: ignore[return-value]


@functools.cache
def _checked_reader(base: type) -> type:
    """`base` (gguf.GGUFReader) that raises a ValueError naming the first tensor whose header gives it no
    dimensions, before gguf-py builds any tensor."""

    class _CheckedReader(base):  # type: ignore[misc, valid-type]
        def _build_tensors(self, start_offs: int, fields: list) -> None:
            for field in fields:  # parts: name length, name, n_dims, dims, type, offset
                if int(field.parts[2][0]) == 0:
                    raise ValueError(f"tensor {field.name} has no dimensions (n_dims 0 in its header)")
            super()._build_tensors(start_offs, fields)

    return _CheckedReader


@functools.cache
def _plain_view_reader(base: type) -> type:
    """`_checked_reader(base)` (base: gguf.GGUFReader) whose `data` is a plain ndarray view of the file's memmap:
    the same bytes, mapped read-only, without memmap's per-slice Python hook."""
    import numpy as np

    class _PlainViewReader(_checked_reader(base)):  # type: ignore[misc]
        @property
        def data(self):
            return self._plain_data

        @data.setter
        def data(self, mapped) -> None:
            self._mapped = mapped  # keeps the mapping open for as long as the reader lives
            self._plain_data = mapped.view(np.ndarray)

    return _PlainViewReader


def gguf_reader(path: str | os.PathLike) -> Any:
    """A read-only gguf.GGUFReader of `path`: within shared_gguf_readers the file's shared reader, else a new one.
    Raises gguf-py's errors as they come, and a ValueError naming a tensor whose header gives it no dimensions."""
    import gguf

    if _active:
        return gguf.GGUFReader(path)
    return _checked_reader(gguf.GGUFReader)(path)


@contextlib.contextmanager
def shared_gguf_readers() -> Iterator[None]:
    """While active, `gguf.GGUFReader(path)` (read mode) returns one reader per file (same path, size and mtime) and
    `gguf.get_tensor_name_map(arch, n)` one map per (arch, n); every caller looks them up in the `gguf` package at
    call time, transformers included. Re-entrant: nested uses share the outermost one's readers."""
    global _active
    try:
        import gguf
    except ImportError:  # no GGUF support installed: nothing to share
        yield
        return
    if not hasattr(gguf, "GGUFReader") or _active:  # a namespace package of that name, not the gguf library (seen on
        yield                                       # the GPU machine), or already sharing: nothing to add
        return
    original = gguf.GGUFReader
    fast = _plain_view_reader(original)
    original_name_map = gguf.get_tensor_name_map
    readers: dict[tuple[str, int, int], object] = {}
    name_maps: dict[tuple[object, int], object] = {}

    def reader(path, mode: str = "r"):
        if mode != "r":
            return original(path, mode)
        stat = os.stat(path)
        key = (os.path.realpath(path), stat.st_size, stat.st_mtime_ns)
        if key not in readers:
            readers[key] = fast(path, mode)
        return readers[key]

    def name_map(arch, n_blocks: int):
        key = (arch, n_blocks)
        if key not in name_maps:
            name_maps[key] = original_name_map(arch, n_blocks)
        return name_maps[key]

    gguf.GGUFReader = reader
    gguf.get_tensor_name_map = name_map
    _active = True
    try:
        yield
    finally:
        _active = False
        gguf.GGUFReader = original
        gguf.get_tensor_name_map = original_name_map
