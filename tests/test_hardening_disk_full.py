"""A compile that runs out of disk space: a one-line ArtifactError that says so (exit status 1), the previous artifact
left whole, nothing of the new one left behind."""

from __future__ import annotations

import errno
import hashlib
import shutil
import subprocess
from pathlib import Path

import pytest

from fxllm.cli import main


@pytest.fixture
def small_disk(tmp_path) -> Path:
    """A 40 MiB tmpfs: room for the tiny artifact (25 MiB) but not for a second copy beside it. Mounting one needs
    root (CAP_SYS_ADMIN); elsewhere the test is skipped."""
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=40M", "tmpfs", str(mount_point)],
                             capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    yield mount_point
    subprocess.run(["umount", str(mount_point)], check=True)


def _digest(directory: Path) -> dict[str, str]:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def test_a_full_disk_is_a_user_error_and_keeps_the_previous_artifact(capsys, small_disk, make_tiny_model,
                                                                     make_tiny_artifact):
    """numpy's tofile, writing the ONNX weights, reports a full disk as `OSError: problem writing element N to
    file` with no errno: `fxllm compile` called it an internal error (exit status 2)."""
    output = small_disk / "artifact"
    shutil.copytree(make_tiny_artifact("llama"), output)
    before = _digest(output)
    capsys.readouterr()
    assert main(["compile", str(make_tiny_model("llama")), "-o", str(output)]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fxllm: error: writing the artifact to "), lines
    assert "is the disk full?" in lines[0] and "free there now" in lines[0]
    assert [p.name for p in small_disk.iterdir()] == ["artifact"]  # no staging directory left
    assert _digest(output) == before


@pytest.mark.parametrize("error", [OSError("problem writing element 3 to file"),  # numpy's tofile: no errno
                                   OSError(errno.ENOSPC, "No space left on device"),
                                   OSError(errno.EDQUOT, "Disk quota exceeded")])
def test_a_write_failing_for_space_is_said_to_be_one(tmp_path, error):
    """Which writer meets the full disk first depends on what was written before it: numpy's tofile loses the
    errno, a plain file.write (the tokenizer, torch-backed tensors) raises ENOSPC, which was printed bare as
    "No space left on device". Both are the one line naming the place and the space left."""
    from fxllm.errors import ArtifactError
    from fxllm.runtime.artifact import staging_directory

    output = tmp_path / "artifact"
    with pytest.raises(ArtifactError, match=rf"^writing the artifact to '{tmp_path}' failed \(.+\); is the disk "
                                            r"full\? .+ free there now, with the partial artifact removed$"):
        with staging_directory(output):
            raise error
    assert list(tmp_path.iterdir()) == []


def test_a_full_disk_elsewhere_names_its_own_file(tmp_path):
    """A full disk under another directory (a --dump-dir on another file system) is not blamed on the artifact's."""
    from fxllm.runtime.artifact import staging_directory

    elsewhere = str(tmp_path / "dumps" / "summary.txt")
    with pytest.raises(OSError) as raised:
        with staging_directory(tmp_path / "artifact"):
            raise OSError(errno.ENOSPC, "No space left on device", elsewhere)
    assert type(raised.value) is OSError and raised.value.filename == elsewhere
