"""The compiled artifact: a directory with manifest.json, the ONNX model (+ external weights) and the tokenizer.

Written into a temporary sibling directory and renamed into place at the end, so a failed or interrupted compile
never leaves a directory that looks valid. An existing output directory is replaced only when it is an fxllm artifact
by its own manifest's marker ("kind": "fxllm-artifact") and holds nothing the manifest does not own: a compile never
deletes a user's files. What a SIGKILLed compile leaves behind is named after its writer and cleaned up by the next
compile to the same output (runtime/write_leftovers.py). Reading and validating a manifest is runtime/manifest.py's
job.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from fxllm.errors import ArtifactError
from fxllm.runtime.contract import ARTIFACT_KIND, FORMAT_VERSION, MANIFEST_FILE
from fxllm.runtime.interruption import held_back, interruptible
from fxllm.runtime.write_leftovers import RETIRED, STAGING, hold, owned_prefix, release

_MAX_MANIFEST_BYTES = 16 << 20  # a manifest is kilobytes; a bigger "manifest.json" is somebody else's file


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def check_output(output: str | os.PathLike) -> Path:
    """The resolved output path, or ArtifactError (one line, nothing deleted) when the compiler must not replace it.
    Replaceable: a path that does not exist, an empty directory, or an fxllm artifact whose manifest carries the
    marker "kind": "fxllm-artifact" and which holds no file or directory the manifest does not own (the files it
    lists, the directories leading to them, and manifest.json itself). Never a path inside another artifact (a
    speculative artifact's draft/ folder): its manifest's checksums would no longer hold."""
    if not str(output).strip():
        raise ArtifactError("the output path is empty")
    try:
        path = Path(output).resolve()
    except (OSError, RuntimeError) as exc:  # RuntimeError: a symlink loop
        raise ArtifactError(f"cannot use output '{output}': {exc}") from None
    holder = next((parent for parent in path.parents
                   if (_existing_manifest(parent) or {}).get("kind") == ARTIFACT_KIND), None)
    if holder is not None:
        raise ArtifactError(f"output '{path}' is inside the fxllm artifact '{holder}', whose manifest lists its files; "
                            "choose an output directory outside it")
    if not path.exists():
        return path
    if not path.is_dir():
        raise ArtifactError(f"output '{path}' exists and is not a directory; choose another output path")
    if path in _working_directory_and_parents():  # the new artifact is swapped in by a rename: the shell would be
        # left in the old directory, deleted, and see nothing there
        raise ArtifactError(f"output '{path}' is the current directory or holds it, which a compile replaces; run it "
                            f"from outside (e.g. from '{path.parent}') or choose another output directory")
    if not any(path.iterdir()):
        return path
    manifest = _existing_manifest(path)
    refuse = "refusing to replace it: delete it yourself or choose another output directory"
    if manifest is None:
        raise ArtifactError(f"'{path}' exists and is not an fxllm artifact; {refuse}")
    if manifest.get("kind") != ARTIFACT_KIND:
        if "format_version" in manifest and "fxllm_version" in manifest:
            raise ArtifactError(f"'{path}' was written by an older fxllm whose manifest lacks the "
                                f"\"kind\": \"{ARTIFACT_KIND}\" marker; {refuse}")
        raise ArtifactError(f"'{path}' holds a {MANIFEST_FILE} that is not an fxllm artifact's; {refuse}")
    foreign = _unowned_entries(path, manifest)
    if foreign:
        more = f" and {len(foreign) - 1} more" if len(foreign) > 1 else ""
        raise ArtifactError(f"'{path}' is an fxllm artifact but also holds '{foreign[0]}'{more}, which its manifest "
                            f"does not list; {refuse}")
    return path


def _existing_manifest(directory: Path) -> dict[str, Any] | None:
    """The JSON object in directory/manifest.json, or None when there is none that reads as one."""
    path = directory / MANIFEST_FILE
    try:
        if path.is_symlink() or not path.is_file() or path.stat().st_size > _MAX_MANIFEST_BYTES:
            return None
        manifest = json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError):
        return None
    return manifest if isinstance(manifest, dict) else None


def _unowned_entries(directory: Path, manifest: dict[str, Any]) -> list[str]:
    """Paths under `directory` (relative, POSIX, sorted) that the manifest does not own. It owns the regular files
    it lists and manifest.json; never a symlink, a special file or an empty directory (fxllm writes none)."""
    listed = manifest.get("files")
    owned = {MANIFEST_FILE} | {name for name in (listed if isinstance(listed, dict) else ()) if isinstance(name, str)}
    foreign = []
    for root, folders, files in os.walk(directory, onerror=_raise):  # does not descend into symlinked folders
        relative = Path(root).relative_to(directory).as_posix()
        prefix = "" if relative == "." else relative + "/"
        foreign += [prefix + name for name in folders if os.path.islink(os.path.join(root, name))]
        foreign += [prefix + name for name in files
                    if prefix + name not in owned or os.path.islink(os.path.join(root, name))
                    or not os.path.isfile(os.path.join(root, name))]
        if not folders and not files:
            foreign.append(prefix)
    return sorted(foreign)


def _raise(error: OSError) -> None:
    raise error


@contextmanager
def staging_directory(output: str | os.PathLike, late_signals: list[int] | None = None) -> Iterator[Path]:
    """Yield a new, hidden temporary directory next to `output`; when the block succeeds it replaces `output`,
    when it fails or is interrupted (SIGINT, SIGTERM, SIGHUP: runtime/interruption.py) it vanishes, with the parent
    directories made for it, and `output` is left as it was. `output` is checked (check_output) on entry and again
    just before the swap; the staging directory is created on entry, so an unwritable location fails before any
    work. A signal that comes during the swap is not an interruption (the work is done): it is a note, and appended
    to `late_signals` for the caller to end what would follow."""
    output = check_output(output)
    blocker = next((p for p in reversed(output.parents) if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise ArtifactError(f"cannot write the output directory '{output}': '{blocker}' is not a directory")
    with interruptible():
        staging = lock = None
        created = [parent for parent in output.parents if not parent.exists()]  # deepest first
        try:
            with held_back():  # a signal now is raised once `staging` is set, inside this try: it gets cleaned
                staging = _create_staging(output)
                lock = hold(staging)  # a compile in another PID namespace must not take it for a dead one's
            yield staging
            for file in staging.rglob("*"):  # some writers (onnx external data) create files 0600
                if file.is_file():
                    file.chmod(0o666 & ~_umask())
            check_output(output)  # again: the user may have put files there while we compiled
            with held_back(raise_after=False) as held:  # never between the two renames; done once they are
                _swap_into_place(staging, output)
            if held.signum is not None:
                if late_signals is not None:
                    late_signals.append(held.signum)
                print(f"fxllm: note: {signal.Signals(held.signum).name} came as '{output}' was put in place; the "
                      "compile had finished and the new artifact is whole", file=sys.stderr)
        except BaseException as exc:
            vanished = staging is not None and not staging.exists()  # before the cleanup below removes it
            if staging is not None:
                shutil.rmtree(staging, ignore_errors=True)
            _remove_empty(created)
            if isinstance(exc, FileNotFoundError) and vanished and _inside(exc.filename, staging):
                raise ArtifactError(f"the staging directory '{staging}' of '{output}' was removed while the compile "
                                    "wrote into it (by another process?); nothing was replaced") from exc
            if (isinstance(exc, OSError) and exc.errno in (None, errno.ENOSPC, errno.EDQUOT) and staging is not None
                    and (exc.filename is None or _inside(exc.filename, staging))):
                # a writer that lost the errno: numpy's tofile (under the ONNX export) reports a full disk as
                # "problem writing element N to file"; a plain write names no file; the space it had taken is
                # freed again by now. A full disk elsewhere (a --dump-dir) is left to name its own file.
                raise ArtifactError(f"writing the artifact to '{output.parent}' failed ({exc.strerror or exc}); is "
                                    f"the disk full? {_free_space(output.parent)} free there now, with the partial "
                                    "artifact removed") from exc
            raise
        finally:
            release(lock)


def _remove_empty(directories: list[Path]) -> None:
    """Remove the directories a failed write created for its output, deepest first, while they are empty (another
    process may have put something there meanwhile: that one and those above it stay)."""
    for directory in directories:
        try:
            directory.rmdir()
        except OSError:
            return


def _working_directory_and_parents() -> list[Path]:
    """This process's working directory, resolved, and every directory above it (none if it was deleted)."""
    try:
        cwd = Path.cwd().resolve()
    except OSError:
        return []
    return [cwd, *cwd.parents]


def _free_space(directory: Path) -> str:
    """The space left to unprivileged writers on the file system holding `directory`, e.g. '12.3 MiB'."""
    from fxllm.runtime.checks import byte_size

    try:
        stats = os.statvfs(directory)
    except OSError:
        return "unknown space"
    return byte_size(stats.f_bavail * stats.f_frsize)


def _create_staging(output: Path) -> Path:
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=owned_prefix(output, STAGING), dir=output.parent))
    except OSError as exc:
        raise ArtifactError(f"cannot write the output directory '{output}': {exc.strerror or exc}") from exc
    staging.chmod(0o777 & ~_umask())  # mkdtemp makes 0700; an artifact is as readable as any new directory
    return staging


SWAP_ATTEMPTS = 3


def _swap_into_place(staging: Path, output: Path) -> None:
    """Put `staging` in place as `output`, an artifact already there moved aside first (kept if it holds files it
    does not own). Another compile finishing into the same output at the same instant can put its artifact there
    between this one's look and its rename ("Directory not empty", an internal error ~1 in 1,260 racing pairs):
    that artifact is then replaced as any earlier one, trying SWAP_ATTEMPTS times. No lock: a lock on a shared
    directory could be held by anybody (`flock DIR job`), and where a file system has none the race stays."""
    for _ in range(SWAP_ATTEMPTS):
        if not output.exists():
            try:
                os.replace(staging, output)
                return
            except OSError as exc:
                if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                    raise
                continue  # another compile's artifact took the place just now
        # Move the old artifact aside first, so at every instant `output` is either old or new, never half.
        retired = Path(tempfile.mkdtemp(prefix=owned_prefix(output, RETIRED), dir=output.parent))
        lock = hold(retired)
        try:
            if _retire_and_replace(staging, output, retired):
                return
        finally:
            release(lock)
    raise ArtifactError(f"other compiles put their artifacts at '{output}' {SWAP_ATTEMPTS} times as this one put its "
                        "own in place; this compile's artifact was not kept")


def _retire_and_replace(staging: Path, output: Path, retired: Path) -> bool:
    """Move `output` into `retired`, then `staging` to `output`; False (nothing of `staging` moved) where another
    compile's swap came between (`output` gone, or back before the second rename), True once in place."""
    try:
        os.replace(output, retired / "artifact")
    except FileNotFoundError:  # another swap moved it aside just now
        shutil.rmtree(retired, ignore_errors=True)
        return False
    try:
        os.replace(staging, output)
    except BaseException as exc:
        if isinstance(exc, OSError) and exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
            _dispose_of_replaced(retired, output)  # another swap put its artifact there between the two renames
            return False
        os.replace(retired / "artifact", output)
        shutil.rmtree(retired, ignore_errors=True)
        raise
    _dispose_of_replaced(retired, output)
    return True


def _dispose_of_replaced(retired: Path, output: Path) -> None:
    """Remove the artifact a swap moved into `retired`, unless it holds a file its manifest does not own (put
    there after the compile's last check: the user's), which is kept next to `output`, with a note."""
    try:  # the swap is done: whatever this finds or fails, the new artifact is in place
        old = _existing_manifest(retired / "artifact")
        late = (_unowned_entries(retired / "artifact", old) if old is not None
                else sorted(os.listdir(retired / "artifact")))  # an empty directory was the output: nothing to keep
    except OSError:
        late = ["(unreadable)"]
    if late:  # put there after the last check_output: the user's, so the old artifact is kept, in plain sight
        kept = _unused_name(output.with_name(f"{output.name}.replaced-{time.strftime('%Y%m%d-%H%M%S')}"))
        try:
            os.replace(retired / "artifact", kept)
        except OSError:
            kept = retired / "artifact"
        print(f"fxllm: note: the replaced artifact held '{late[0]}'{' and more' if len(late) > 1 else ''}, which "
              f"it does not own (put there as the compile finished); it is kept as '{kept}'", file=sys.stderr)
        if kept.parent == retired:
            return
    shutil.rmtree(retired, ignore_errors=True)


def _inside(filename: str | bytes | None, directory: Path) -> bool:
    """Whether an error's file name lies in `directory` (None: the error named none)."""
    return filename is not None and Path(os.fsdecode(filename)).is_relative_to(directory)


def _unused_name(path: Path) -> Path:
    """`path`, or the first of path-2, path-3, ... that does not exist."""
    candidate, number = path, 1
    while candidate.exists() or candidate.is_symlink():
        number += 1
        candidate = path.with_name(f"{path.name}-{number}")
    return candidate


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_manifest(directory: Path, manifest: dict[str, Any]) -> None:
    """Write directory/manifest.json: the fxllm-artifact marker, the format version, `manifest`, and the sha256 and
    size of every other file in the directory (a draft's own manifest.json in a subdirectory included)."""
    own = {MANIFEST_FILE, f".{MANIFEST_FILE}.tmp"}
    files = sorted(p for p in directory.rglob("*") if p.is_file() and str(p.relative_to(directory)) not in own)
    manifest = {
        "kind": ARTIFACT_KIND,
        "format_version": FORMAT_VERSION,
        **manifest,
        "files": {str(p.relative_to(directory)): {"sha256": sha256_file(p), "bytes": p.stat().st_size} for p in files},
    }
    temporary = directory / f".{MANIFEST_FILE}.tmp"
    temporary.write_text(json.dumps(manifest, indent=2, allow_nan=False) + "\n")  # what load_manifest reads back
    os.replace(temporary, directory / MANIFEST_FILE)  # a crash mid-write never leaves a half manifest
