"""The weights a model file stores (name, element count, bits per element, float or not) and its custom metadata,
read without loading any weight: an ONNX file's initializers and metadata_props (parsed from the protobuf wire
format: `onnx` is the compile extra's, and the runtime must not need it) or a torch.export archive's weight configs
and extra files."""

from __future__ import annotations

import json
import math
import mmap
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

from fxllm.errors import ArtifactError

# Bits per element by element type: ONNX's TensorProto.DataType, torch.export's serialized ScalarType.
_ONNX_BITS = {1: 32, 2: 8, 3: 8, 4: 16, 5: 16, 6: 32, 7: 64, 9: 8, 10: 16, 11: 64, 12: 32, 13: 64, 16: 16, 17: 8,
              18: 8, 19: 8, 20: 8, 21: 4, 22: 4, 23: 4}
_ONNX_FLOATS = {1, 10, 11, 16, 17, 18, 19, 20, 23}
_TORCH_BITS = {1: 8, 2: 8, 3: 16, 4: 32, 5: 64, 6: 16, 7: 32, 8: 64, 12: 8, 13: 16, 28: 16, 29: 8, 30: 8, 31: 8,
               32: 8, 33: 8, 34: 32, 35: 64}
_TORCH_FLOATS = {6, 7, 8, 13, 29, 30, 31, 32, 33}


class StoredTensor(NamedTuple):
    """A weight as the model file stores it: name, element count, bits per element, and whether it is float."""

    name: str
    elements: int
    bits: int
    is_float: bool


def stored_tensors(model_file: Path) -> Iterator[StoredTensor]:
    """Every stored weight of an ONNX model (its graph's initializers) or a torch.export archive (its weights and
    constants), read from the file's metadata without loading any weight; other files hold none."""
    try:
        if model_file.suffix == ".onnx":
            yield from _onnx_initializers(model_file)
        elif model_file.suffix == ".pt2":
            yield from _pt2_tensors(model_file)
    except (ValueError, IndexError, KeyError, TypeError, zipfile.BadZipFile) as exc:
        raise ArtifactError(f"cannot read the weights' metadata in '{model_file.name}': {exc}") from None


def stored_metadata(model_file: Path) -> dict[str, str]:
    """An ONNX model's metadata_props or a torch.export archive's extra files, as {key: value}, read without
    loading any weight (what a backend's `metadata()` returns once loaded); other files have none."""
    try:
        if model_file.suffix == ".onnx":
            return _onnx_metadata(model_file)
        if model_file.suffix == ".pt2":
            return _pt2_extra_files(model_file)
    except (ValueError, IndexError, zipfile.BadZipFile, UnicodeDecodeError) as exc:
        raise ArtifactError(f"cannot read the metadata of '{model_file.name}': {exc}") from None
    return {}


def _onnx_metadata(path: Path) -> dict[str, str]:
    """ModelProto.metadata_props (field 14): StringStringEntryProto key (1), value (2)."""
    found = {}
    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
        for number, value in _fields(data, 0, len(data)):
            if number != 14 or not isinstance(value, tuple):
                continue
            entry = {field: data[text[0]:text[1]].decode("utf-8") for field, text in _fields(data, *value)
                     if field in (1, 2) and isinstance(text, tuple)}
            found[entry.get(1, "")] = entry.get(2, "")
    return found


def _pt2_extra_files(path: Path) -> dict[str, str]:
    """The archive's extra files (`<root>/extra/<name>`), as torch.export.load's extra_files reads them."""
    with zipfile.ZipFile(path) as archive:
        return {name.split("/", 2)[2]: archive.read(name).decode("utf-8") for name in archive.namelist()
                if name.count("/") >= 2 and name.split("/", 2)[1] == "extra" and not name.endswith("/")}


def _onnx_initializers(path: Path) -> Iterator[StoredTensor]:
    """The initializers of an ONNX file's main graph: ModelProto.graph (field 7) → GraphProto.initializer (5) →
    TensorProto dims (1), data_type (2), name (8). Parsed from the protobuf wire format: `onnx` is the compile
    extra's, and `fxllm inspect` is the runtime's."""
    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
        for number, value in _fields(data, 0, len(data)):
            if number != 7 or not isinstance(value, tuple):
                continue
            for field, tensor in _fields(data, *value):
                if field == 5 and isinstance(tensor, tuple):
                    yield _onnx_tensor(data, *tensor)


def _onnx_tensor(data: mmap.mmap, start: int, end: int) -> StoredTensor:
    dims, data_type, name = [], 0, ""
    for number, value in _fields(data, start, end):
        if number == 1 and isinstance(value, tuple):  # packed repeated int64
            position = value[0]
            while position < value[1]:
                dim, position = _varint(data, position)
                dims.append(dim)
        elif number == 1:
            dims.append(value)
        elif number == 2:
            data_type = value
        elif number == 8 and isinstance(value, tuple):
            name = data[value[0]:value[1]].decode("utf-8", "replace")
    return StoredTensor(name, math.prod(dims), _ONNX_BITS.get(data_type, 0), data_type in _ONNX_FLOATS)


def _fields(data: mmap.mmap, start: int, end: int) -> Iterator[tuple[int, int | tuple[int, int] | None]]:
    """(field number, value) of each field of the message in data[start:end]: an int for a varint, (start, end) of
    a length-delimited field's bytes, None for a fixed-width one. ValueError/IndexError when malformed."""
    position = start
    while position < end:
        key, position = _varint(data, position)
        number, wire = key >> 3, key & 7
        value: int | tuple[int, int] | None = None
        if wire == 0:
            value, position = _varint(data, position)
        elif wire == 2:
            length, position = _varint(data, position)
            value, position = (position, position + length), position + length
        elif wire in (1, 5):
            position += 8 if wire == 1 else 4
        else:
            raise ValueError(f"protobuf wire type {wire} at byte {position}")
        if position > end:
            raise ValueError(f"a field runs past the end of its message at byte {end}")
        yield number, value


def _varint(data: mmap.mmap, position: int) -> tuple[int, int]:
    """The base-128 varint at `position` → (value, the position after it)."""
    result = shift = 0
    while True:
        byte = data[position]
        position += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, position
        shift += 7
        if shift > 63:
            raise ValueError(f"a varint longer than 10 bytes at byte {position}")


def _pt2_tensors(path: Path) -> Iterator[StoredTensor]:
    """The weights and constants a torch.export archive lists in its *_weights_config.json and
    *_constants_config.json: name → tensor_meta {dtype (ScalarType), sizes [{as_int}]}."""
    with zipfile.ZipFile(path) as archive:
        for entry in archive.namelist():
            if not entry.endswith(("_weights_config.json", "_constants_config.json")):
                continue
            for name, tensor in json.loads(archive.read(entry)).get("config", {}).items():
                meta = tensor["tensor_meta"]
                elements = math.prod(int(size["as_int"]) for size in meta["sizes"])
                yield StoredTensor(name, elements, _TORCH_BITS.get(meta["dtype"], 0), meta["dtype"] in _TORCH_FLOATS)
