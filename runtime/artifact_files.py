"""The files of an artifact that loading trusts only after checking them: every path the manifest names stays inside
the artifact directory, every listed file has its recorded size and sha256, the tokenizer directory holds only
files the manifest lists (tokenizer loaders read whatever they find there), and so does a model file's external
data (ONNX Runtime reads it by name)."""

from __future__ import annotations

import glob
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import TYPE_CHECKING, Any

from fxllm.errors import ArtifactError
from fxllm.runtime.artifact import sha256_file

if TYPE_CHECKING:
    from fxllm.runtime.manifest import Manifest


def verify_files(manifest: Manifest) -> None:
    """Every listed file exists, is a regular file inside the artifact, and has its recorded size and sha256."""
    for name, entry in manifest.files.items():
        file = confine(manifest.directory, name, "files")
        if not file.exists():
            raise ArtifactError(f"artifact file '{name}' is missing from '{manifest.directory}'")
        if not file.is_file():  # a directory, FIFO or device where the manifest names a file: never read it
            raise ArtifactError(f"artifact file '{name}' in '{manifest.directory}' is not a regular file; recompile "
                                "the artifact")
        if file.stat().st_size != entry["bytes"] or sha256_file(file) != entry["sha256"]:
            raise ArtifactError(f"artifact file '{name}' is corrupt (checksum mismatch); recompile the artifact")


def check_weights_listed(manifest: Manifest) -> None:
    """A model file's external data (`model.onnx.data` next to `model.onnx`: ONNX Runtime reads whatever file of
    that name it finds) must be a file the manifest lists and therefore checksums: weights the manifest stopped
    listing would be read unchecked."""
    models = [manifest.model_file] + ([manifest.unrolled_draft.model_file] if manifest.unrolled_draft else [])
    root = manifest.directory.resolve()
    for model in models:
        for path in sorted(model.parent.glob(f"{glob.escape(model.name)}.*")):
            relative = path.relative_to(root).as_posix()
            if path.is_file() and relative not in manifest.files:
                raise ArtifactError(f"'{relative}' (the weights of {model.name}) is not checksummed by the artifact's "
                                    "manifest; recompile the artifact")


def check_tokenizer_dir(manifest: Manifest) -> None:
    """Tokenizer loaders read whatever files they find in their directory: every file there must be one the
    manifest lists (and therefore checksums and confines), so nothing added later can change tokenization."""
    if not manifest.tokenizer_dir.is_dir():
        raise ArtifactError(f"the artifact's tokenizer directory '{manifest.data['tokenizer_dir']}' is missing")
    root = manifest.directory.resolve()
    for path in sorted(manifest.tokenizer_dir.rglob("*")):
        relative = path.relative_to(root).as_posix()
        if not path.is_dir() and not path.is_file():  # a FIFO, socket or device: reading it could block forever
            raise ArtifactError(f"'{relative}' in the artifact's tokenizer directory is not a regular file; remove it "
                                "or recompile")
        if (path.is_file() or path.is_symlink()) and relative not in manifest.files:
            raise ArtifactError(f"'{relative}' in the artifact's tokenizer directory is not part of the artifact (the "
                                "manifest does not list it); remove it or recompile")


def confine(directory: Path, relative: Any, field: str) -> Path:
    """DIRECTORY/RELATIVE, refused unless RELATIVE is a relative path without `..` that resolves (symlinks
    followed) inside DIRECTORY."""
    if not isinstance(relative, str) or not relative or "\0" in relative or "\\" in relative:
        raise ArtifactError(f"manifest field '{field}' names an invalid path {relative!r}")
    posix = PurePosixPath(relative)
    if posix.is_absolute() or PureWindowsPath(relative).drive or ".." in posix.parts:
        raise ArtifactError(f"manifest field '{field}' names '{relative}', outside the artifact directory; only "
                            "paths relative to the artifact, without '..', are allowed")
    root = directory.resolve()
    resolved = (root / posix).resolve()
    if resolved != root and root not in resolved.parents:
        raise ArtifactError(f"manifest field '{field}' names '{relative}', which resolves outside the artifact "
                            f"directory (to '{resolved}')")
    return resolved
