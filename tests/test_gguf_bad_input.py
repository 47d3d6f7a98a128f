"""GGUF files a hostile user hands to `fxllm compile`: a tensor without dimensions, a rotary base or norm epsilon
that is not a usable number. Each is refused in one line naming the file and the tensor or key, before anything is
written; before, the first failed inside gguf-py ("tuple index out of range") and the others compiled, their NaN
logits then blamed on the weights."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFValueType

from fxllm.cli import main
from fxllm.compiler.source_checks import check_supported
from fxllm.compiler.sources import resolve_source
from fxllm.errors import ModelSourceError
from tests.gguf_files import Typed


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


FLOAT32, FLOAT64 = GGUFValueType.FLOAT32, GGUFValueType.FLOAT64
ROPE_BASE, EPSILON = "must be a positive finite number, got", "must be a finite number >= 0, got"


@pytest.mark.parametrize("key, value, message", [
    ("llama.rope.freq_base", Typed(math.nan, FLOAT32), rf"{ROPE_BASE} nan \(FLOAT32\)"),
    ("llama.rope.freq_base", Typed(math.inf, FLOAT32), rf"{ROPE_BASE} inf \(FLOAT32\)"),
    ("llama.rope.freq_base", Typed(0.0, FLOAT32), rf"{ROPE_BASE} 0 \(FLOAT32\)"),
    ("llama.rope.freq_base", Typed(-10000.0, FLOAT64), rf"{ROPE_BASE} -10000 \(FLOAT64\)"),
    ("llama.rope.freq_base", Typed("10000", GGUFValueType.STRING), rf"{ROPE_BASE} '10000' \(STRING\)"),
    ("llama.rope.freq_base", Typed([10000.0], GGUFValueType.ARRAY, FLOAT32), rf"{ROPE_BASE} 10000 \(ARRAY/FLOAT32\)"),
    ("llama.attention.layer_norm_rms_epsilon", Typed(-1e-5, FLOAT32), rf"{EPSILON} -1e-05 \(FLOAT32\)"),
    ("llama.attention.layer_norm_rms_epsilon", Typed(math.nan, FLOAT32), rf"{EPSILON} nan \(FLOAT32\)"),
    ("llama.attention.layer_norm_epsilon", Typed(math.nan, FLOAT32), rf"{EPSILON} nan \(FLOAT32\)"),  # LayerNorm's
])
def test_a_bad_rope_base_or_norm_epsilon_is_named(tiny_hf, tmp_path, key, value, message):
    """Read as transformers' rope_theta / rms_norm_eps, these compiled: NaN or infinite logits at the first step."""
    from tests.gguf_files import write_gguf

    path = write_gguf(tiny_hf, tmp_path / "m.gguf", overrides={key: value})
    with pytest.raises(ModelSourceError, match=r"m\.gguf': " + key.replace(".", r"\.") + " " + message) as caught:
        check_supported(resolve_source(path))
    assert "\n" not in str(caught.value)


def test_compile_refuses_a_nan_rope_base_in_one_line(tiny_hf, tmp_path, capfd, monkeypatch):
    """The hostile user's command: one line naming the key, nothing written (it compiled, then the logits check
    blamed the weights)."""
    from tests.gguf_files import write_gguf

    monkeypatch.setenv("FXLLM_QUIET", "1")
    path = write_gguf(tiny_hf, tmp_path / "m.gguf",
                      overrides={"llama.rope.freq_base": Typed(math.nan, GGUFValueType.FLOAT32)})
    line = compile_error(path, tmp_path / "artifact", capfd)
    assert "m.gguf': llama.rope.freq_base must be a positive finite number, got nan (FLOAT32)" in line, line


def test_a_file_holding_more_blocks_than_its_header_is_refused(tiny_hf, tmp_path):
    """block_count 1 over a file of 2 blocks compiled as a 1-layer cut of the model without a word (transformers maps
    the header's blocks only); the same from a config.json was already refused."""
    from tests.gguf_files import write_gguf

    path = write_gguf(tiny_hf, tmp_path / "m.gguf", "Q8_0", overrides={"llama.block_count": 1})
    with pytest.raises(ModelSourceError, match=r"m\.gguf' holds tensors of block 1 but its header's "
                                               r"llama\.block_count is 1"):
        check_supported(resolve_source(path))
    check_supported(resolve_source(write_gguf(tiny_hf, tmp_path / "ok.gguf", "Q8_0")))  # the file as written: fine


def test_a_gguf_is_read_apart_from_its_folders_other_files(q8_gguf, tiny_hf, tmp_path):
    """llama.cpp's converter writes the .gguf into the Hugging Face folder it came from, and any folder may hold
    another model's files: transformers took the folder's tokenizer.json over the GGUF's vocabulary (a foreign one
    paired other ids with the weights, silently; the converter's own dropped the GGUF's special tokens and chat
    template) and its generation_config.json's end ids. A GGUF is read as llama.cpp reads it: alone."""
    import json
    import shutil

    from fxllm.compiler.sources import load_model, load_tokenizer

    folder = tmp_path / "hf-folder-with-gguf"
    shutil.copytree(tiny_hf, folder)
    shutil.copy(q8_gguf, folder / q8_gguf.name)
    foreign = json.loads((folder / "tokenizer.json").read_text())
    vocabulary = foreign["model"]["vocab"]
    foreign["model"]["vocab"] = {token: len(vocabulary) - 1 - i for token, i in vocabulary.items()}
    (folder / "tokenizer.json").write_text(json.dumps(foreign))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 7]}))

    alone, beside = resolve_source(q8_gguf), resolve_source(folder / q8_gguf.name)
    expected, got = load_tokenizer(alone), load_tokenizer(beside)
    text = "The quick brown fox, 42 times."
    assert got(text)["input_ids"] == expected(text)["input_ids"]
    assert (got.eos_token, got.chat_template) == (expected.eos_token, expected.chat_template)
    assert load_model(beside).generation_config.eos_token_id == load_model(alone).generation_config.eos_token_id


def test_without_a_temporary_folder_a_gguf_alone_still_loads_and_one_beside_others_is_one_line(q8_gguf, tiny_hf,
                                                                                               tmp_path, monkeypatch):
    """Reading a GGUF apart from its folder's files takes a temporary folder; where none can be made (a read-only
    container, a full /tmp) a GGUF alone in its folder is read in place as before, and one beside other model
    files is refused in one line saying what to do, not blamed on the weights."""
    import shutil
    import tempfile

    from fxllm.compiler.sources import load_model, load_tokenizer

    def no_temporary_folder(*args, **kwargs):
        raise FileNotFoundError(2, "No usable temporary directory found")

    monkeypatch.setattr(tempfile, "mkdtemp", no_temporary_folder)
    assert load_tokenizer(resolve_source(q8_gguf))("The quick")["input_ids"]
    folder = tmp_path / "beside"
    shutil.copytree(tiny_hf, folder)
    shutil.copy(q8_gguf, folder / q8_gguf.name)
    for load in (load_tokenizer, load_model):
        with pytest.raises(ModelSourceError, match=rf"^'{folder / q8_gguf.name}' shares its folder with other model "
                                                   r"files \(config\.json, .*\), .* set TMPDIR to a writable "
                                                   r"directory, or move the \.gguf into a folder of its own$"):
            load(resolve_source(folder / q8_gguf.name))
