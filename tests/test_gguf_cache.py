"""compiler/gguf_cache.py: within shared_gguf_readers a GGUF file is parsed once, by a reader that gives the same
fields and tensors as gguf-py's own; loading a GGUF model or tokenizer outside a compile shares readers too."""

from __future__ import annotations

import gguf
import numpy as np

from fxllm.compiler.gguf_cache import shared_gguf_readers
from fxllm.compiler.sources import load_model, load_tokenizer, resolve_source
from tests.gguf_files import tiny_hf_model, write_gguf


def test_shared_reader_reads_what_gguf_py_reads():
    source = resolve_source("smollm2-135m")  # the real file: a 49,152-token vocabulary and Q4_1 blocks
    path = source.directory / source.gguf_file
    expected = gguf.GGUFReader(path)
    with shared_gguf_readers():
        shared = gguf.GGUFReader(path)
        with shared_gguf_readers():  # re-entrant: the inner use shares the outer one's reader
            assert gguf.GGUFReader(path) is shared
        assert gguf.GGUFReader(path) is shared
    assert gguf.GGUFReader is not type(shared) and isinstance(shared, gguf.GGUFReader)
    assert list(shared.fields) == list(expected.fields)
    for name, field in expected.fields.items():
        other = shared.fields[name]
        assert (other.offset, other.data, other.types) == (field.offset, field.data, field.types), name
        assert len(other.parts) == len(field.parts) and all(np.array_equal(a, b) for a, b in zip(other.parts,
                                                                                                field.parts)), name
    assert [t.name for t in shared.tensors] == [t.name for t in expected.tensors]
    for mine, theirs in zip(shared.tensors, expected.tensors):
        assert (mine.tensor_type, mine.n_bytes, tuple(mine.shape)) == (theirs.tensor_type, theirs.n_bytes,
                                                                        tuple(theirs.shape))
        assert np.array_equal(mine.data, theirs.data), mine.name


def test_loading_a_gguf_model_and_tokenizer_parses_the_file_once(tmp_path, monkeypatch):
    path = write_gguf(tiny_hf_model("llama", tmp_path / "hf"), tmp_path / "tiny.Q8_0.gguf", "Q8_0")
    parsed = []
    original = gguf.GGUFReader.__init__

    def counting(self, *args, **kwargs):
        parsed.append(args[0] if args else kwargs.get("path"))
        original(self, *args, **kwargs)

    monkeypatch.setattr(gguf.GGUFReader, "__init__", counting)
    source = resolve_source(str(path))
    model = load_model(source)  # transformers reads the file for the config and the weights, fxllm for the check
    assert len(parsed) == 1 and model.config.num_hidden_layers == 2
    parsed.clear()
    assert load_tokenizer(source)("Paris is")["input_ids"]
    assert len(parsed) == 1
