"""Writing GGUF test files with the `gguf` package: metadata copied from an existing file (optionally overridden)."""

from __future__ import annotations

from typing import Any


def copy_metadata(reader, writer, overrides: dict[str, Any] | None = None) -> None:
    """Every key-value field of `reader` (a GGUFReader) into `writer` (a GGUFWriter, architecture already set),
    with `overrides` replacing the values of the keys it names."""
    from gguf import GGUFValueType

    overrides = overrides or {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        kind = field.types[0]
        if name in overrides:
            writer.add_key_value(name, overrides[name], kind)
        elif kind == GGUFValueType.ARRAY:
            item = field.types[1]
            values = [bytes(field.parts[i]).decode("utf-8", "surrogateescape") if item == GGUFValueType.STRING
                      else field.parts[i].tolist()[0] for i in field.data]
            writer.add_key_value(name, values, kind, sub_type=item)
        elif kind == GGUFValueType.STRING:
            writer.add_key_value(name, bytes(field.parts[-1]).decode("utf-8", "surrogateescape"), kind)
        else:
            writer.add_key_value(name, field.parts[-1].tolist()[0], kind)
