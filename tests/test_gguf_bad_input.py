"""GGUF files a hostile user hands to `fxllm compile`: a tensor without dimensions. Each is refused in one line
naming the file and the tensor, before anything is written; before, it failed inside gguf-py ("tuple index out of
range")."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fxllm.cli import main


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory) -> Path:
    from tests.gguf_files import tiny_hf_model

    return tiny_hf_model("llama", tmp_path_factory.mktemp("bad-input") / "hf")


@pytest.fixture(scope="module")
def q8_gguf(tiny_hf, tmp_path_factory) -> Path:
    from tests.gguf_files import write_gguf

    return write_gguf(tiny_hf, tmp_path_factory.mktemp("q8") / "m.gguf", "Q8_0")


def without_dimensions(source: Path, path: Path, name: str, type_name: str) -> Path:
    """`source` rewritten to `path` with tensor `name` stored as `type_name` (F32, or a quantized type written as
    one block of bytes) under a header that gives it 0 dimensions; gguf-py's `add_tensor` writes the shape it is
    given. Returns `path`."""
    from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
    from gguf.constants import GGML_QUANT_SIZES

    from tests.gguf_files import copy_metadata

    reader = GGUFReader(source)
    writer = GGUFWriter(path, "llama")
    copy_metadata(reader, writer)
    for tensor in reader.tensors:
        raw = None if tensor.tensor_type == GGMLQuantizationType.F32 else tensor.tensor_type
        if tensor.name != name:
            writer.add_tensor(tensor.name, np.ascontiguousarray(tensor.data), raw_dtype=raw)
        elif type_name == "F32":
            writer.add_tensor(name, np.array(1.0, np.float32))
        else:  # int8, not uint8: gguf-py would turn a uint8 array's shape into the quantized shape
            kind = GGMLQuantizationType[type_name]
            writer.add_tensor(name, np.zeros(GGML_QUANT_SIZES[kind][1], np.int8), raw_shape=(), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def compile_error(path: Path, output: Path, capfd) -> str:
    """The one stderr line of `fxllm compile path -o output`, which must fail (exit 1) writing nothing."""
    capfd.readouterr()
    code = main(["compile", str(path), "-o", str(output)])
    err = capfd.readouterr().err
    lines = err.strip().splitlines()
    assert code == 1 and len(lines) == 1 and lines[0].startswith("fxllm: error: "), err
    assert not output.exists()
    return lines[0]


@pytest.mark.parametrize("name, type_name", [
    ("blk.0.attn_q.weight", "Q8_0"),  # was "cannot read GGUF file '...': tuple index out of range"
    ("output_norm.weight", "F32"),  # was read as a scalar, then refused after loading as transformers' model.norm
])
def test_a_tensor_without_dimensions_is_named(q8_gguf, tmp_path, capfd, monkeypatch, name, type_name):
    monkeypatch.setenv("FXLLM_QUIET", "1")
    path = without_dimensions(q8_gguf, tmp_path / "z.gguf", name, type_name)
    line = compile_error(path, tmp_path / "artifact", capfd)
    assert f"z.gguf': tensor {name} has no dimensions" in line, line
