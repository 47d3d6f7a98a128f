"""runtime/huge_pages.py: memory made while a session loads is moved onto 2 MiB pages, its contents unchanged; the
switch turns it off."""

from __future__ import annotations

import ctypes
import os
import re
import sys

import numpy as np
import pytest

import fxllm
from fxllm.runtime import huge_pages

MADV_NOHUGEPAGE = 15


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


@pytest.fixture
def numpy_without_huge_pages():
    """numpy advises huge pages for its own large arrays; ONNX Runtime's allocations, which this is for, get none."""
    from numpy._core.multiarray import _set_madvise_hugepage

    was = _set_madvise_hugepage(False)
    yield
    _set_madvise_hugepage(was)


def small_pages_only(array: np.ndarray) -> None:
    """Advise the whole 2 MiB pages inside untouched `array` MADV_NOHUGEPAGE: on 4 KiB pages once written, whatever
    the THP mode (a machine in `always` mode would otherwise give them huge pages as they fault in)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    start = -(-array.ctypes.data // huge_pages.HUGE_PAGE) * huge_pages.HUGE_PAGE
    end = (array.ctypes.data + array.nbytes) // huge_pages.HUGE_PAGE * huge_pages.HUGE_PAGE
    assert libc.madvise(start, end - start, MADV_NOHUGEPAGE) == 0, os.strerror(ctypes.get_errno())


def test_new_memory_is_collapsed_and_keeps_its_contents(numpy_without_huge_pages):
    before = huge_pages.anonymous_mappings()
    # 40 MiB: above glibc's largest mmap threshold (32 MiB), so a mapping of its own, untouched until written
    weights = np.empty(10 << 20, dtype=np.float32)
    small_pages_only(weights)
    np.random.default_rng(0).standard_normal(out=weights, dtype=np.float32)
    expected = weights.copy()
    assert huge_bytes_under(weights) == 0
    moved = huge_pages.collapse_new_mappings(before)
    np.testing.assert_array_equal(weights, expected)
    if not kernel_collapses():
        pytest.skip(f"no MADV_COLLAPSE on this kernel ({os.uname().release}) or THP off")
    assert moved >= 18 * huge_pages.HUGE_PAGE
    assert huge_bytes_under(weights) >= 18 * huge_pages.HUGE_PAGE


def test_switched_off_by_the_environment(monkeypatch, make_tiny_artifact):
    monkeypatch.setenv(huge_pages.ENVIRONMENT_SWITCH, "0")
    assert not huge_pages.enabled()
    assert fxllm.load(make_tiny_artifact("llama")).backend.huge_page_bytes == 0
