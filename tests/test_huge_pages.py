"""runtime/huge_pages.py: memory made while a session loads is moved onto 2 MiB pages, its contents unchanged; the
switch turns it off."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import re
import sys
import time

import numpy as np
import pytest

import fxllm
from fxllm.errors import InvalidArgumentError
from fxllm.runtime import huge_pages


def kernel_collapses() -> bool:
    """Linux 6.1+ (MADV_COLLAPSE) with transparent huge pages not `never`."""
    release = re.match(r"(\d+)\.(\d+)", os.uname().release) if sys.platform.startswith("linux") else None
    return bool(release) and (int(release[1]), int(release[2])) >= (6, 1) and huge_pages.enabled()


def huge_bytes_under(array: np.ndarray) -> int:
    """AnonHugePages of the mapping that holds the middle of `array`, from /proc/self/smaps."""
    address, inside, huge = array.ctypes.data + array.nbytes // 2, False, 0
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            span = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
            if span:
                inside = int(span[1], 16) <= address < int(span[2], 16)
            elif inside and line.startswith("AnonHugePages:"):
                huge = int(line.split()[1]) << 10
    return huge


def kernel_refuses_a_collapse(pages: int) -> str:
    """The errno name with which the kernel refuses to collapse one of `pages` 2 MiB pages of a fresh mapping (""
    where it collapses them all): EAGAIN or ENOMEM when it finds no free huge page, as under the memory pressure of
    a parallel test run."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    memory = mmap.mmap(-1, (pages + 1) * huge_pages.HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        memory.write(b"\x01" * len(memory))
        view = ctypes.c_char.from_buffer(memory)
        start = ctypes.addressof(view)
        del view  # the mapping cannot be closed while a ctypes view of it lives
        first = -(-start // huge_pages.HUGE_PAGE) * huge_pages.HUGE_PAGE
        for page in range(first, first + pages * huge_pages.HUGE_PAGE, huge_pages.HUGE_PAGE):
            if libc.madvise(page, huge_pages.HUGE_PAGE, huge_pages.MADV_COLLAPSE) != 0:
                error = ctypes.get_errno()
                return errno.errorcode.get(error, str(error)) if error in (errno.EAGAIN, errno.ENOMEM) else ""
        return ""
    finally:
        memory.close()


def fresh_small_page_memory(size: int) -> mmap.mmap:
    """A new private anonymous mapping (as ONNX Runtime's large allocations are), advised MADV_NOHUGEPAGE before its
    first touch: on 4 KiB pages once written, whatever the THP mode (`always` would give huge pages as it faults in)
    and whatever memory the allocator holds (np.empty in a long-lived process reused memory already on huge pages)."""
    memory = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    memory.madvise(mmap.MADV_NOHUGEPAGE)
    return memory


def test_new_memory_is_collapsed_and_keeps_its_contents():
    if not hasattr(mmap, "MADV_NOHUGEPAGE"):
        pytest.skip("transparent huge pages are Linux's")
    before = huge_pages.anonymous_mappings()
    memory = fresh_small_page_memory(40 << 20)
    weights = np.frombuffer(memory, dtype=np.float32)
    np.random.default_rng(0).standard_normal(out=weights, dtype=np.float32)
    expected = weights.copy()
    assert huge_bytes_under(weights) == 0
    moved = huge_pages.collapse_new_mappings(before)
    np.testing.assert_array_equal(weights, expected)
    if not kernel_collapses():
        pytest.skip(f"no MADV_COLLAPSE on this kernel ({os.uname().release}) or THP off")
    if huge_bytes_under(weights) >= 18 * huge_pages.HUGE_PAGE:
        assert moved >= 18 * huge_pages.HUGE_PAGE
    for _ in range(3):  # the kernel compacts memory meanwhile; a second call collapses what it could not
        if huge_bytes_under(weights) >= 18 * huge_pages.HUGE_PAGE:
            break
        time.sleep(1)
        huge_pages.collapse_new_mappings(before)
    np.testing.assert_array_equal(weights, expected)
    missing = 18 - huge_bytes_under(weights) // huge_pages.HUGE_PAGE
    if missing > 0 and (refusal := kernel_refuses_a_collapse(missing)):
        pytest.skip(f"the kernel has no free 2 MiB pages now ({refusal}): other tests fill memory")
    assert huge_bytes_under(weights) >= 18 * huge_pages.HUGE_PAGE


def test_switched_off_by_the_environment(monkeypatch, make_tiny_artifact):
    monkeypatch.setenv(huge_pages.ENVIRONMENT_SWITCH, "0")
    assert not huge_pages.enabled()
    assert fxllm.load(make_tiny_artifact("llama")).backend.huge_page_bytes == 0


@pytest.fixture
def collapses(monkeypatch) -> list[int]:
    """Each real collapse_new_mappings call made while loading, as the bytes it moved (huge pages on for the test)."""
    monkeypatch.delenv(huge_pages.ENVIRONMENT_SWITCH, raising=False)
    monkeypatch.setattr(huge_pages, "enabled", lambda: True)
    calls: list[int] = []
    real = huge_pages.collapse_new_mappings
    monkeypatch.setattr(huge_pages, "collapse_new_mappings", lambda before: calls.append(real(before)) or calls[-1])
    return calls


def test_load_collapses_unless_asked_not_to(collapses, make_tiny_artifact):
    artifact = make_tiny_artifact("llama")
    reference = fxllm.load(artifact, huge_pages=False)
    assert collapses == [] and reference.backend.huge_page_bytes == 0
    engine = fxllm.load(artifact)
    assert len(collapses) == 1 and engine.backend.huge_page_bytes == collapses[0]
    prompt = [[5, 17, 33, 2, 9]]
    assert engine.generate_ids(prompt, max_new_tokens=8)[0].token_ids == \
        reference.generate_ids(prompt, max_new_tokens=8)[0].token_ids
    with pytest.raises(InvalidArgumentError, match="huge_pages"):
        fxllm.load(artifact, huge_pages="no")


@pytest.mark.parametrize(("max_new_tokens", "collapsed"), [(64, False), (huge_pages.WORTH_STEPS, True)])
def test_a_one_shot_generate_collapses_only_when_it_decodes_long_enough(collapses, make_tiny_artifact, capsys,
                                                                        max_new_tokens, collapsed):
    """`fxllm generate` pays the collapse (seconds of load) only where its decode steps win it back."""
    from fxllm.cli import main

    assert main(["generate", str(make_tiny_artifact("llama")), "--prompt", "hello", "--max-new-tokens",
                 str(max_new_tokens)]) in (0, None)
    assert (len(collapses) == 1) is collapsed
    capsys.readouterr()
