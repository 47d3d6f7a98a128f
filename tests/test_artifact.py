"""Artifacts: complete manifest, checksums verified on load, never a half-written directory."""

from __future__ import annotations

import json
import shutil

import pytest

import fxllm
from fxllm.errors import ArtifactError
from fxllm.runtime.contract import FORMAT_VERSION
from fxllm.runtime.manifest import load_manifest


@pytest.fixture
def artifact_copy(make_tiny_artifact, tmp_path):
    target = tmp_path / "copy"
    shutil.copytree(make_tiny_artifact("llama"), target)
    return target


def test_manifest_describes_the_artifact(make_tiny_artifact):
    manifest = load_manifest(make_tiny_artifact("llama")).data
    assert manifest["format_version"] == FORMAT_VERSION and manifest["fxllm_version"] == fxllm.__version__
    assert [p["name"] for p in manifest["passes"]] == ["cleanup", "gqa", "fuse-projections", "select-logits", "kv-cache"]
    assert manifest["spec"]["num_kv_heads"] == 2 and manifest["target"] == "ort"
    assert {"model.onnx", "model.onnx.data", "tokenizer/tokenizer.json"} <= set(manifest["files"])
    assert all(len(entry["sha256"]) == 64 for entry in manifest["files"].values())
    assert manifest["io"]["inputs"][0] == {"name": "input_ids", "dims": ["batch", "tokens"], "dtype": "int64"}


def test_flipped_weight_bytes_are_detected(artifact_copy):
    weights = artifact_copy / "model.onnx.data"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="'model.onnx.data' is corrupt"):
        fxllm.load(artifact_copy)


def test_newer_format_version_is_refused(artifact_copy):
    path = artifact_copy / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["format_version"] = FORMAT_VERSION + 1
    path.write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match=f"format version {FORMAT_VERSION + 1} is newer.*upgrade fxllm"):
        fxllm.load(artifact_copy)


def test_missing_file_and_missing_manifest(artifact_copy, tmp_path):
    (artifact_copy / "tokenizer" / "tokenizer.json").unlink()
    with pytest.raises(ArtifactError, match="'tokenizer/tokenizer.json' is missing"):
        fxllm.load(artifact_copy)
    with pytest.raises(ArtifactError, match="not an fxllm artifact"):
        fxllm.load(tmp_path)
    with pytest.raises(ArtifactError, match="does not exist"):
        fxllm.load(tmp_path / "nope")


def test_failed_compile_leaves_nothing(make_tiny_model, tmp_path, monkeypatch):
    import fxllm.compiler.targets.onnx_export as lower

    def explode(*args, **kwargs):
        raise RuntimeError("simulated lowering failure")

    monkeypatch.setattr(lower, "lower_to_onnx", explode)
    output = tmp_path / "out"
    with pytest.raises(RuntimeError, match="simulated"):
        fxllm.compile(make_tiny_model("llama"), output)
    assert not output.exists()
    assert list(tmp_path.iterdir()) == [], "the staging directory must be removed too"


def test_manifest_without_checksums_is_refused(artifact_copy):
    path = artifact_copy / "manifest.json"
    manifest = json.loads(path.read_text())
    del manifest["files"]
    path.write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="incomplete \\(missing files\\)"):
        fxllm.load(artifact_copy)
    path.write_text("[1, 2]")
    with pytest.raises(ArtifactError, match="no format_version"):
        fxllm.load(artifact_copy)
