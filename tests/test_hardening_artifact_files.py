"""Files an artifact's manifest names that are there but are not regular files: the refusal says what is wrong
(not "missing"), and nothing is read from them."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

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
