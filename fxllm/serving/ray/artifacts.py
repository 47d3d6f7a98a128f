"""Where a replica finds its artifact, on whichever node Ray places it.

- A **path** (`/shared/models/smollm2-paged`): every node must be able to read it (a shared filesystem: NFS, a
  mounted bucket, the same disk image). It is loaded in place; loading verifies every file's checksum.
- A **URI** (`https://host/artifacts/smollm2-paged`, `file:///mnt/slow/smollm2-paged`, or `s3://...` / `gs://...`
  and any other scheme fsspec knows, when fsspec and its backend are installed): the artifact directory at that
  address is copied once per node into the cache (`~/.cache/fxllm/artifacts/`, or `$FXLLM_ARTIFACT_CACHE`),
  keyed by the SHA-256 of its manifest.json (which lists every file's SHA-256, so it names the content): first the
  manifest, then each file it lists, each checked against its checksum as it arrives, the whole copy validated
  with the runtime's own manifest checks before it is renamed into place. Replicas on the same node wait for the
  one that copies (a file lock) and reuse its copy; a later deployment of the same artifact copies nothing. What a
  replica killed mid-copy left (its hidden staging directory) is removed by the next one that copies.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from fxllm.errors import ArtifactError
from fxllm.runtime.contract import MANIFEST_FILE
from fxllm.runtime.manifest import confine, load_manifest

CHUNK = 1 << 20
COMPLETE = ".fxllm-copy-complete"  # written last into a finished copy


def is_uri(source: str) -> bool:
    return "://" in source


def cache_root() -> Path:
    return Path(os.environ.get("FXLLM_ARTIFACT_CACHE", Path.home() / ".cache" / "fxllm" / "artifacts"))


def local_artifact(source: str, cache: Path | None = None) -> Path:
    """The local directory to load `source` from: the path itself, or the cached copy of a URI (copied now if this
    node has none yet). ArtifactError (one line) when the URI cannot be read or a file does not match."""
    if not is_uri(source):
        return Path(source)
    cache = cache or cache_root()
    manifest_bytes = _read_all(source, MANIFEST_FILE)
    digest = hashlib.sha256(manifest_bytes).hexdigest()
    target = cache / digest[:32]
    if (target / COMPLETE).is_file():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with _locked(cache / f"{digest[:32]}.lock"):
        if not (target / COMPLETE).is_file():  # nobody copied it while this replica waited for the lock
            _copy(source, manifest_bytes, target)
    return target


def _copy(source: str, manifest_bytes: bytes, target: Path) -> None:
    """Copy `source` into `target` through a hidden staging directory, verified before it is renamed into place;
    the caller holds the target's lock, so staging directories of the target found here are a dead replica's."""
    try:
        manifest = json.loads(manifest_bytes.decode("utf-8"))
        files = manifest["files"]
        if not isinstance(files, dict):
            raise TypeError
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError):
        raise ArtifactError(f"'{source}' has no valid fxllm {MANIFEST_FILE}") from None
    for leftover in target.parent.glob(f".{target.name}-*"):  # a replica killed mid-copy (SIGKILL, OOM): the
        shutil.rmtree(leftover, ignore_errors=True)  # caller holds this target's lock, so no copy is live
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        for name, entry in files.items():
            destination = confine(staging, name, "files")  # never write outside the copy
            destination.parent.mkdir(parents=True, exist_ok=True)
            _fetch_checked(source, name, entry, destination)
        (staging / MANIFEST_FILE).write_bytes(manifest_bytes)
        load_manifest(staging, verify=True)  # the runtime's own checks, on the complete copy
        (staging / COMPLETE).write_text(source + "\n")
        if target.exists():  # an unfinished copy left by a replica that died
            shutil.rmtree(target)
        staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _fetch_checked(source: str, name: str, entry: dict, destination: Path) -> None:
    digest, size = hashlib.sha256(), 0
    with _open(source, name) as remote, open(destination, "wb") as local:
        for block in iter(lambda: remote.read(CHUNK), b""):
            digest.update(block)
            size += len(block)
            local.write(block)
    if not isinstance(entry, dict) or size != entry.get("bytes") or digest.hexdigest() != entry.get("sha256"):
        raise ArtifactError(f"'{name}' copied from '{source}' does not match the checksum in its manifest "
                            f"({size} bytes); the copy at the source is corrupt or changed while being copied")


def _read_all(source: str, name: str) -> bytes:
    with _open(source, name) as handle:
        return handle.read()


@contextlib.contextmanager
def _open(source: str, name: str) -> Iterator[IO[bytes]]:
    """The file `name` of the artifact directory at URI `source`, opened for reading bytes."""
    address = source.rstrip("/") + "/" + urllib.parse.quote(name)
    scheme = urllib.parse.urlsplit(source).scheme.lower()
    try:
        if scheme == "file":
            with open(urllib.request.url2pathname(urllib.parse.urlsplit(address).path), "rb") as handle:
                yield handle
        elif scheme in ("http", "https"):
            with urllib.request.urlopen(address, timeout=60) as handle:
                yield handle
        else:
            yield from _fsspec_open(address, scheme)
    except urllib.error.HTTPError as exc:
        raise ArtifactError(f"cannot read '{address}': HTTP {exc.code} {exc.reason}") from None
    except urllib.error.URLError as exc:
        raise ArtifactError(f"cannot read '{address}': {exc.reason}") from None
    except OSError as exc:
        raise ArtifactError(f"cannot read '{address}': {exc.strerror or exc}") from None


def _fsspec_open(address: str, scheme: str) -> Iterator[IO[bytes]]:
    try:
        import fsspec
    except ImportError:
        raise ArtifactError(f"artifact URIs with scheme '{scheme}://' need fsspec and its backend for that scheme "
                            "(e.g. `pip install fsspec s3fs`); http(s):// and file:// work without them") from None
    try:
        with fsspec.open(address, "rb") as handle:
            yield handle
    except (ImportError, ValueError) as exc:  # fsspec: unknown protocol, or its backend is not installed
        raise ArtifactError(f"cannot read '{address}': {exc}") from None


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
