"""What a SIGKILLed compile leaves next to its output is cleaned up by the next compile to that output; nothing of a
live writer, another host or another name is touched, and a swap cut between its renames gets the previous artifact
back (runtime/write_leftovers.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from fxllm.cli import main
from fxllm.runtime.write_leftovers import STAGING, remove_leftovers
from tests.conftest import hidden_entries, snapshot


def run_python(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120)


KILLED_WHILE_WRITING = """
import os, sys
from pathlib import Path
from fxllm.runtime.artifact import staging_directory
with staging_directory(sys.argv[1]) as stage:
    (stage / "model.onnx.data").write_bytes(b"w" * 4096)
    os.kill(os.getpid(), 9)
"""


def test_a_killed_compile_s_staging_directory_is_removed_by_the_next(tmp_path):
    output = tmp_path / "out"
    result = run_python(KILLED_WHILE_WRITING, str(output))
    assert result.returncode == -signal.SIGKILL, result.stderr
    [left] = hidden_entries(tmp_path)
    assert left.startswith(".out.staging-") and not output.exists()
    done = remove_leftovers(output)
    assert len(done) == 1 and "staging directory" in done[0] and left in done[0], done
    assert hidden_entries(tmp_path) == [] and not output.exists()
    assert remove_leftovers(output) == []  # nothing left to do


def test_an_output_name_near_the_file_system_s_limit_gets_a_staging_name_that_fits(tmp_path, make_tiny_model):
    """A 240-byte output name is legal; its staging directory's name (the output's and ~60 bytes of owner) was not,
    and the compile failed with "File name too long" on the path the user gave. Killed writers' leftovers of such
    an output are still recognised and removed."""
    output = tmp_path / ("z" * 200 + "é" * 20)  # 240 bytes in UTF-8
    result = run_python(KILLED_WHILE_WRITING, str(output))
    assert result.returncode == -signal.SIGKILL, result.stderr
    [left] = hidden_entries(tmp_path)
    assert len(os.fsencode(left)) <= 255 and left.startswith(".zzz")
    assert len(remove_leftovers(output)) == 1 and hidden_entries(tmp_path) == []
    assert main(["compile", str(make_tiny_model("llama")), "-o", str(output)]) == 0
    assert (output / "manifest.json").is_file() and hidden_entries(tmp_path) == []
    assert main(["compile", str(make_tiny_model("llama")), "-o", str(output)]) == 0  # replaced: the retired name too


def test_a_live_writer_s_staging_directory_is_kept(tmp_path):
    output = tmp_path / "out"
    code = ("import sys, time\nfrom fxllm.runtime.artifact import staging_directory\n"
            "with staging_directory(sys.argv[1]):\n    print('in', flush=True)\n    time.sleep(60)\n")
    writer = subprocess.Popen([sys.executable, "-c", code, str(output)], stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline().strip() == "in"
        [left] = hidden_entries(tmp_path)
        assert remove_leftovers(output) == []
        assert hidden_entries(tmp_path) == [left]
    finally:
        writer.send_signal(signal.SIGTERM)  # its own cleanup removes the staging directory
        writer.wait(timeout=30)
    deadline = time.monotonic() + 10
    while hidden_entries(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert hidden_entries(tmp_path) == []


def test_a_live_writer_whose_pid_reads_as_dead_here_is_kept(tmp_path):
    """Pids repeat across PID namespaces: a compile in a container sharing the volume and the host name named its
    staging directory after its pid 1, and a compile here took it for a dead writer's and removed it mid-write (the
    first then failed with an internal error). The writer holds its directories locked; a held one is kept. Here the
    writer names its directory after a pid that has exited, as the other namespace's pid reads here."""
    output = tmp_path / "out"
    exited = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                            text=True).stdout.strip()
    code = ("import os, sys, time\nos.getpid = lambda: int(sys.argv[2])\n"
            "from fxllm.runtime.artifact import staging_directory\n"
            "with staging_directory(sys.argv[1]):\n    print('in', flush=True)\n    time.sleep(60)\n")
    writer = subprocess.Popen([sys.executable, "-c", code, str(output), exited], stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline().strip() == "in"
        [left] = hidden_entries(tmp_path)
        assert f"-{exited}-0." in left  # to the name alone it is a dead writer's
        assert remove_leftovers(output) == []
        assert hidden_entries(tmp_path) == [left]
    finally:
        writer.kill()
        writer.wait(timeout=30)
    assert len(remove_leftovers(output)) == 1 and hidden_entries(tmp_path) == []  # killed: the lock went with it


def test_a_swap_killed_between_its_renames_gets_the_previous_artifact_back(artifact_copy):
    before = snapshot(artifact_copy)
    code = """
import os, sys
from pathlib import Path
import fxllm.runtime.artifact as artifact
from fxllm.runtime.contract import MANIFEST_FILE
output = Path(sys.argv[1])
real_replace = os.replace
def replace(source, destination):
    if Path(destination) == output and not output.exists():  # the new artifact's rename, the old one moved aside
        os.kill(os.getpid(), 9)
    real_replace(source, destination)
os.replace = replace
with artifact.staging_directory(output) as stage:
    (stage / "new.bin").write_bytes(b"new")
    artifact.write_manifest(stage, {"fxllm_version": "test"})
"""
    result = run_python(code, str(artifact_copy))
    assert result.returncode == -signal.SIGKILL, result.stderr
    assert not artifact_copy.exists()  # killed between the two renames
    assert len(hidden_entries(artifact_copy.parent)) == 2  # the new artifact's staging and the old one's retired copy
    done = remove_leftovers(artifact_copy)
    assert any("restored the previous artifact" in line for line in done), done
    assert any("staging directory" in line for line in done), done
    assert snapshot(artifact_copy) == before
    assert hidden_entries(artifact_copy.parent) == []


def test_directories_that_are_not_a_dead_writer_s_of_this_output_are_kept(tmp_path):
    output = tmp_path / "out"
    dead = run_python("from pathlib import Path\nfrom fxllm.runtime.write_leftovers import owned_prefix, STAGING\n"
                      "print(owned_prefix(Path('x'), STAGING))").stdout.strip()
    tag = dead.split(f".{STAGING}-", 1)[1]  # host-pid-start. of a process that has exited
    other_host = "0" * 8 if not tag.startswith("0" * 8) else "1" * 8
    kept = [
        f".out.{STAGING}-{other_host}-{tag.split('-', 1)[1]}abc",  # another host's (a shared file system)
        f".outer.{STAGING}-{tag}abc",  # another output's
        ".out.abc123",  # an older fxllm's, or anyone's
        f"out.{STAGING}-{tag}abc",  # not hidden: not ours
    ]
    for name in kept:
        (tmp_path / name).mkdir()
    (tmp_path / f".out.{STAGING}-{tag}file").write_text("a file, not a directory")
    assert remove_leftovers(output) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*kept, f".out.{STAGING}-{tag}file"])


def test_compile_cleans_up_before_it_writes_and_says_so(capsys, tmp_path, broken_model):
    """A compile to an output with a dead writer's staging directory next to it removes it (a note on stderr) and
    goes on; here its model cannot be loaded, which fails as before, after the cleanup."""
    output = tmp_path / "out"
    assert run_python(KILLED_WHILE_WRITING, str(output)).returncode == -signal.SIGKILL
    assert len(hidden_entries(tmp_path)) == 1
    capsys.readouterr()
    code = main(["compile", str(broken_model), "-o", str(output)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and err[0].startswith("fxllm: note: removed '.out.staging-"), err
    assert err[-1].startswith("fxllm: error: "), err
    assert hidden_entries(tmp_path) == [] and not os.path.lexists(output)
