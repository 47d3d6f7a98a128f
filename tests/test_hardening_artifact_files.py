"""Files an artifact's manifest names that are there but are not regular files: the refusal says what is wrong
(not "missing"), and nothing is read from them."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from fxllm.errors import ArtifactError
from fxllm.runtime.contract import MANIFEST_FILE
from fxllm.runtime.manifest import load_manifest

SOME_CHECKSUM = {"sha256": "0" * 64, "bytes": 0}


def _listing(artifact: Path, name: str) -> None:
    """Make the artifact's manifest list `name` as one of its files."""
    path = artifact / MANIFEST_FILE
    manifest = json.loads(path.read_text())
    manifest["files"][name] = SOME_CHECKSUM
    path.write_text(json.dumps(manifest))


@pytest.fixture
def artifact(make_tiny_artifact, tmp_path) -> Path:
    copy = tmp_path / "artifact"
    shutil.copytree(make_tiny_artifact("llama"), copy)
    return copy


@pytest.mark.parametrize("make, name", [(lambda path: path.mkdir(), "extra"), (os.mkfifo, "fifo"),
                                        (lambda path: None, ".")])
def test_a_listed_file_that_is_not_a_regular_file_is_named_as_such(artifact, make, name):
    """A manifest listing a directory or a FIFO was refused as "artifact file 'fifo' is missing", though `ls`
    shows it there; the message now says it is not a regular file."""
    make(artifact / name)
    _listing(artifact, name)
    with pytest.raises(ArtifactError, match=f"artifact file '{name}' in .* is not a regular file"):
        load_manifest(artifact)


def test_a_listed_file_that_is_absent_is_still_missing(artifact):
    _listing(artifact, "gone.bin")
    with pytest.raises(ArtifactError, match="artifact file 'gone.bin' is missing from"):
        load_manifest(artifact)


def test_weights_the_manifest_stopped_listing_are_refused(artifact):
    """model.onnx.data dropped from the manifest's files (and then changed) is not read unchecked: ONNX Runtime
    would load whatever file of that name it finds, and the generation was garbage with exit status 0."""
    path = artifact / MANIFEST_FILE
    manifest = json.loads(path.read_text())
    del manifest["files"]["model.onnx.data"]
    path.write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match=r"'model.onnx.data' \(the weights of model.onnx\) is not checksummed"):
        load_manifest(artifact)


def test_an_artifact_replaced_while_it_loads_is_read_again(make_tiny_artifact, make_tiny_model, tokenizer, tmp_path,
                                                           monkeypatch):
    """A compile that finished while `fxllm generate` or `fxllm serve` loaded the same artifact made the load read
    files of both (the probe: one model's model.onnx with the other's weights, exit 0 and text of neither model; or a
    false 'checksum mismatch'): the files are checked, then opened again by path. Now a load whose path names another
    directory after it than before reads the new artifact again. Here the swap comes between the model and its
    tokenizer: the engine must be the new artifact's alone."""
    import fxllm
    import fxllm.runtime.engine as engine_module
    from transformers import AutoModelForCausalLM

    from tests.conftest import PROMPTS, tiny_config

    other = tmp_path / "other-model"
    torch.manual_seed(1)
    AutoModelForCausalLM.from_config(tiny_config("llama")).save_pretrained(other)
    tokenizer.save_pretrained(other)
    new = tmp_path / "new"
    fxllm.compile(other, new)
    old = make_tiny_artifact("llama")
    tokens = {name: fxllm.load(path).generate(PROMPTS[0], max_new_tokens=12).token_ids
              for name, path in (("old", old), ("new", new))}
    assert tokens["old"] != tokens["new"]
    served = tmp_path / "served"
    shutil.copytree(old, served)
    real = engine_module.load_tokenizer
    swaps = []

    def swapped_first(directory):
        if not swaps:  # what a compile's last step does: the old directory aside, the new one in its place
            swaps.append(served.rename(tmp_path / "retired"))
            shutil.copytree(new, served)
        return real(directory)

    monkeypatch.setattr(engine_module, "load_tokenizer", swapped_first)
    assert fxllm.load(served).generate(PROMPTS[0], max_new_tokens=12).token_ids == tokens["new"]
    assert swaps
