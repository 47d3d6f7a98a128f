"""The compiled artifact: a directory with manifest.json, the ONNX model (+ external weights) and the tokenizer.

Written into a temporary sibling directory and renamed into place at the end, so a failed compile never leaves a
directory that looks valid. Reading and validating a manifest is runtime/manifest.py's job.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from fxllm.errors import ArtifactError
from fxllm.runtime.contract import FORMAT_VERSION, MANIFEST_FILE


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def check_output(output: str | os.PathLike) -> Path:
    """Refuse an output path we must not replace, before any expensive work."""
    output = Path(output).resolve()
    if output.exists() and not output.is_dir():
        raise ArtifactError(f"output '{output}' is a file, not an artifact directory")
    if output.exists() and not (output / MANIFEST_FILE).exists() and any(output.iterdir()):
        raise ArtifactError(f"'{output}' exists and is not an fxllm artifact; refusing to replace it")
    return output


@contextmanager
def staging_directory(output: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary directory next to `output`; on success it replaces `output`, on failure it vanishes."""
    output = check_output(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{output.name}.", dir=output.parent))
    staging.chmod(0o777 & ~_umask())  # mkdtemp makes 0700; an artifact is as readable as any new directory
    try:
        yield staging
        for file in staging.rglob("*"):  # some writers (onnx external data) create files 0600
            if file.is_file():
                file.chmod(0o666 & ~_umask())
        if output.exists():
            # Move the old artifact aside first, so at every instant `output` is either old or new, never half.
            retired = Path(tempfile.mkdtemp(prefix=f".{output.name}.old.", dir=output.parent))
            os.replace(output, retired / "artifact")
            os.replace(staging, output)
            shutil.rmtree(retired, ignore_errors=True)
        else:
            os.replace(staging, output)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_manifest(directory: Path, manifest: dict[str, Any]) -> None:
    files = sorted(p for p in directory.rglob("*") if p.is_file() and not p.name.startswith((MANIFEST_FILE, f".{MANIFEST_FILE}")))
    manifest = {
        "format_version": FORMAT_VERSION,
        **manifest,
        "files": {str(p.relative_to(directory)): {"sha256": sha256_file(p), "bytes": p.stat().st_size} for p in files},
    }
    temporary = directory / f".{MANIFEST_FILE}.tmp"
    temporary.write_text(json.dumps(manifest, indent=2) + "\n")
    os.replace(temporary, directory / MANIFEST_FILE)  # a crash mid-write never leaves a half manifest
