"""fxllm.load and fxllm.compile given a path or an option table of the wrong kind: a typed FxllmError naming the
argument, never pathlib's TypeError or an AttributeError from deep inside the compiler."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

import fxllm
from fxllm.errors import ArtifactError, InvalidArgumentError, ModelSourceError, PipelineError

NOT_PATHS = [None, 5, b"/tmp/artifact", ["/tmp/artifact"]]


@pytest.mark.parametrize("path", NOT_PATHS)
def test_load_of_something_that_is_not_a_path_names_the_argument(path):
    """fxllm.load(None) was `TypeError: expected str, bytes or os.PathLike object, not NoneType`."""
    with pytest.raises(InvalidArgumentError, match="path must be a path .*got ") as caught:
        fxllm.load(path)
    assert caught.value.param == "path"


def test_load_of_a_path_the_system_cannot_look_up_is_an_artifact_error(tmp_path):
    """A name past the file system's limit made Path.exists() raise OSError (ENAMETOOLONG) out of fxllm.load."""
    with pytest.raises(ArtifactError, match="cannot read artifact .*: File name too long"):
        fxllm.load(tmp_path / ("a" * 5000))


def test_load_of_an_empty_path_is_not_the_working_directory(make_tiny_artifact, monkeypatch):
    """fxllm.load("") (and `fxllm inspect ""`) loaded the working directory, an artifact when run from inside one."""
    monkeypatch.chdir(make_tiny_artifact("llama"))
    for path in ("", " "):
        with pytest.raises(ArtifactError, match="the artifact path is empty"):
            fxllm.load(path)


def test_an_empty_model_draft_or_reference_path_is_refused(make_tiny_model, make_tiny_artifact, tmp_path,
                                                           monkeypatch):
    """'' was the working directory: `fxllm compile ""` and `--draft ""` compiled the model found there, and
    `eval --reference ""` dropped the reference without a word."""
    from fxllm.evaluation import evaluate

    monkeypatch.chdir(make_tiny_model("llama"))  # a model directory: what '' compiled
    with pytest.raises(ModelSourceError, match="the model path is empty"):
        fxllm.compile("", tmp_path / "out")
    with pytest.raises(PipelineError, match="--draft is empty"):
        fxllm.compile(make_tiny_model("llama"), tmp_path / "out", draft="")
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 4)
    with pytest.raises(ModelSourceError, match="the model path is empty"):
        evaluate(make_tiny_artifact("llama"), text, reference="")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("model", NOT_PATHS)
def test_compile_of_a_model_that_is_not_a_path_is_a_model_source_error(model, tmp_path):
    with pytest.raises(ModelSourceError, match="model must be a path"):
        fxllm.compile(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("output", NOT_PATHS)
def test_compile_to_an_output_that_is_not_a_path_is_an_artifact_error(output, make_tiny_model, tmp_path):
    """fxllm.compile(model, None) was a TypeError; str(None) must not become an output directory named 'None'."""
    with pytest.raises(ArtifactError, match="output must be a path"):
        fxllm.compile(make_tiny_model("llama"), output)
    assert not Path("None").exists()


def test_compile_with_a_dump_dir_that_is_not_a_path_is_a_pipeline_error(make_tiny_model, tmp_path):
    with pytest.raises(PipelineError, match="dump_dir must be a path"):
        fxllm.compile(make_tiny_model("llama"), tmp_path / "out", dump_dir=7)


@pytest.mark.parametrize("pass_options", [{"gqa": 5}, 5, ["gqa"], {"gqa": {1: 2}}, {3: {}}])
def test_compile_with_a_malformed_pass_options_table_is_a_pipeline_error(pass_options, make_tiny_model, tmp_path):
    """pass_options={"gqa": 5} was `TypeError: 'int' object is not iterable` from the pipeline's setup."""
    with pytest.raises(PipelineError, match="pass_options must map pass names"):
        fxllm.compile(make_tiny_model("llama"), tmp_path / "out", pass_options=pass_options)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("quant_options", [5, ["group_size"], {64: "group_size"}])
def test_compile_with_a_malformed_quant_options_table_is_a_pipeline_error(quant_options, make_tiny_model, tmp_path):
    with pytest.raises(PipelineError, match="quant_options must map option names"):
        fxllm.compile(make_tiny_model("llama"), tmp_path / "out", quant="int8", quant_options=quant_options)


NOT_UTF8 = os.fsdecode(b"artifact-\xff")  # a name the file system allows, which Python holds as a lone surrogate


def test_compile_to_an_output_whose_name_is_not_utf8_fails_before_any_work(make_tiny_model, tmp_path):
    """onnx.checker and ONNX Runtime take only UTF-8 paths: `fxllm compile MODEL -o $'\\xff'` loaded, captured and
    lowered the model, then exited 2 ("internal error: TypeError: check_model_path(): incompatible function
    arguments"). Now it is refused first, and nothing is written."""
    with pytest.raises(ArtifactError, match=r"output .* is not valid UTF-8 \(byte 0xff at character \d+\)"):
        fxllm.compile(make_tiny_model("llama"), tmp_path / NOT_UTF8)
    assert list(tmp_path.iterdir()) == []


def test_load_of_an_artifact_whose_name_is_not_utf8_says_so(make_tiny_artifact, tmp_path):
    """Loading one was ONNX Runtime's pybind11 signature dump ("__init__(): incompatible constructor arguments")."""
    copy = tmp_path / NOT_UTF8
    shutil.copytree(make_tiny_artifact("llama"), copy)
    with pytest.raises(InvalidArgumentError, match="path .* is not valid UTF-8 .*use a name that is valid UTF-8"):
        fxllm.load(copy)


def test_a_dump_dir_whose_name_is_not_utf8_is_still_written(make_tiny_model, tmp_path):
    """Only the paths onnx and ONNX Runtime open must be UTF-8: dumps are written by Python, which takes any name."""
    dumps = tmp_path / NOT_UTF8
    fxllm.compile(make_tiny_model("llama"), tmp_path / "out", dump_dir=dumps)
    assert (dumps / "summary.txt").is_file() and (tmp_path / "out" / "manifest.json").is_file()


@pytest.mark.parametrize("options, message", [
    ({"int8_activations": None}, "int8_activations must be True or False, got NoneType None"),
    ({"int8_activations": 0}, "int8_activations must be True or False"),
    ({"requantize": "yes"}, "requantize must be True or False"),
    ({"passes": 5}, "passes must be a comma-separated string or a list of pass names"),
    ({"keep_layers": "1"}, "keep_layers must be a layer count >= 1"),
    ({"keep_layers": 0}, "keep_layers must be a layer count >= 1"),
    ({"keep_layers": 3}, "keep_layers=3 keeps more layers than the model's 2"),
])
def test_compile_options_of_the_wrong_type_are_refused(make_tiny_model, tmp_path, options, message):
    """fxllm.compile(..., int8_activations=None) wrote "int8_activations": null into the manifest: the compile
    succeeded and every load of the artifact failed ("must be true or false; recompile the artifact"). passes=5 and
    keep_layers="1" were TypeErrors, keep_layers past the model's layers a capture error about attention nodes."""
    with pytest.raises(PipelineError, match=message):
        fxllm.compile(make_tiny_model("llama"), tmp_path / "out", **options)
    assert not (tmp_path / "out").exists()
