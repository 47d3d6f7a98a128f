"""What a killed compile leaves next to its output, and how the next write to that output cleans it up.

A compile writes its artifact into a hidden staging directory next to the output and swaps it into place
(runtime/artifact.py); on an error or on SIGINT/SIGTERM/SIGHUP it removes that directory itself. SIGKILL — the
out-of-memory killer's signal — cannot be caught: the staging directory, as large as the artifact, stays behind, and
every retry that is killed the same way adds another. A swap cut between its two renames leaves the previous artifact
in a hidden "retired" directory and nothing at the output.

So both directories are named after the process that made them: `.{output}.{role}-{host}-{pid}-{start}.{random}`,
where host is a short hash of the host name and start the process's start time (Linux's /proc; 0 elsewhere), which
tells a dead writer from a live one even when its pid has been reused; and the writer holds each directory locked
(flock) while it lives, since pids repeat across PID namespaces (containers sharing a volume and a host name: a
compile took another's staging directory for a dead one's and removed it mid-write). Before it writes, a compile calls
`remove_leftovers(output)`: each leftover of a writer on this host that is no longer running is cleaned up — a
staging directory removed, a retired directory moved back to the output when the output is missing (the swap never
finished: the previous artifact comes back) and removed otherwise. Directories of live writers, of other hosts (a
shared file system) and of any other name are never touched.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import socket
from pathlib import Path

STAGING = "staging"
RETIRED = "retired"


NAME_MAX = 255  # bytes in one file name (Linux, macOS)
OWNER_ROOM = 64  # bytes the role, host tag, pid, start time and tempfile's random suffix add to the output's name


def owned_prefix(output: Path, role: str) -> str:
    """The name prefix of a `role` (STAGING or RETIRED) directory this process makes for `output`; tempfile adds
    the random suffix."""
    return f".{_output_part(output)}.{role}-{_host_tag()}-{os.getpid()}-{_start_time(os.getpid()) or 0}."


def _output_part(output: Path) -> str:
    """The output's name as its staging and retired directories carry it: whole where that fits a file name, else
    its head and a hash of the whole (a 220-byte output name, itself legal, made a staging name past NAME_MAX and
    the compile failed with "File name too long" on the path the user gave)."""
    name = output.name
    room = NAME_MAX - OWNER_ROOM
    if len(os.fsencode(name)) <= room:
        return name
    digest = hashlib.sha256(os.fsencode(name)).hexdigest()[:16]
    head = name
    while len(os.fsencode(head)) > room - len(digest) - 1:
        head = head[:-1]
    return f"{head}~{digest}"


def remove_leftovers(output: str | os.PathLike) -> list[str]:
    """Clean up what dead writers on this host left next to `output` (module docstring); one line per directory
    handled, saying what was done. Errors while removing are ignored: a leftover that stays is retried next time."""
    output = Path(output)
    parent = output.parent
    if not parent.is_dir():
        return []
    pattern = re.compile(rf"^\.{re.escape(_output_part(output))}\.({STAGING}|{RETIRED})-([0-9a-f]{{8}})-(\d+)-(\d+)"
                         r"\.[^/]+$")
    done = []
    try:
        candidates = sorted(parent.iterdir())
    except OSError:
        return []
    for entry in candidates:
        match = pattern.match(entry.name)
        if match is None or not entry.is_dir() or entry.is_symlink():
            continue
        role, host, pid, start = match.group(1), match.group(2), int(match.group(3)), int(match.group(4))
        if host != _host_tag() or _running(pid, start) or _held(entry):
            continue
        previous = entry / "artifact"
        if role == RETIRED and previous.is_dir() and not os.path.lexists(output):
            try:
                os.replace(previous, output)
            except OSError:
                continue
            done.append(f"restored the previous artifact at '{output}' from '{entry.name}', where a compile killed "
                        f"mid-swap (pid {pid}) had left it")
            shutil.rmtree(entry, ignore_errors=True)
            continue
        shutil.rmtree(entry, ignore_errors=True)
        if not os.path.lexists(entry):
            what = "staging directory" if role == STAGING else "retired copy of an artifact"
            done.append(f"removed '{entry.name}', the {what} of a compile that was killed (pid {pid})")
    return done


def hold(directory: Path) -> int | None:
    """Lock a directory this process writes (flock on it, until the returned descriptor is closed), so that
    remove_leftovers elsewhere never takes it for a dead writer's; None where the file system cannot lock it."""
    return _locked(directory, wait=True)  # waits: a cleanup's probe (_held) holds it for an instant


def release(descriptor: int | None) -> None:
    """Let go of what hold() locked (None: nothing was)."""
    if descriptor is not None:
        os.close(descriptor)


def _held(directory: Path) -> bool:
    """Whether a live writer holds the directory locked (hold)."""
    try:
        release(_locked(directory, wait=False))
    except BlockingIOError:
        return True
    return False


def _locked(directory: Path, wait: bool) -> int | None:
    """A descriptor of `directory` holding its flock; None where it cannot be opened or locked; BlockingIOError
    when another holds it and `wait` is False."""
    import fcntl

    try:
        descriptor = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return None
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
    except BlockingIOError:
        os.close(descriptor)
        raise
    except OSError:
        os.close(descriptor)
        return None
    return descriptor


def _host_tag() -> str:
    return hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


def _start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (field 22 of /proc/PID/stat), or None where unreadable."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2:].split()  # the command name, in parentheses, may hold spaces
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def _running(pid: int, start: int) -> bool:
    """Whether the process `pid` that started at `start` (0: unknown) still runs on this host."""
    if start and Path("/proc/self/stat").exists():
        return _start_time(pid) == start  # None (gone) or another start time (the pid was reused): not running
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # it exists but belongs to someone else
        return True
    return True
