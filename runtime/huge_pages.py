"""Transparent huge pages for a model's weights (Linux): the memory an ONNX Runtime session loaded its weights into,
moved onto 2 MiB pages once the session is made.

Why: a decode step reads every weight once, hundreds of MB on 4 KiB pages, a TLB miss every 4 KiB (two-level in a
virtual machine). This machine's THP mode is `madvise`, so nothing of ONNX Runtime's is backed by huge pages unless
asked: SmolLM2's fp32 decode step measured 0.93x (median of six paired processes) with its memory collapsed, the
GGUF-exact one 0.73-0.94x, a 1 GiB read 20 → 23-26 GB/s (docs/targets.md). ONNX Runtime's allocations cannot be
advised before they are made, so the mappings the session created are collapsed afterwards (MADV_COLLAPSE, Linux
6.1+), 2 MiB at a time (one call over a long range measured slower), ~1-2 s for 570 MB here. In THP mode `always`
the kernel backs only part of it by itself (SmolLM2 fp32: 238-244 of 600 MiB; 530 MiB after the collapse, +0.7 s of
load; an AMD EPYC VM, 2026-12-07).

Only private anonymous mappings of at least 4 MiB that appeared or changed while the session loaded and are at
least 90% resident are touched (a sparse one would grow when collapsed). Anything the kernel refuses (an older
kernel, THP off, no free huge page) is left as it was: this changes speed, never contents. FXLLM_HUGE_PAGES=0
turns it off, fxllm.load(..., huge_pages=False) for one engine; `fxllm generate` asks worth_collapsing."""

from __future__ import annotations

import ctypes
import errno
import os
import re
import sys

ENVIRONMENT_SWITCH = "FXLLM_HUGE_PAGES"
HUGE_PAGE = 2 << 20
MIN_MAPPING = 2 * HUGE_PAGE
MIN_RESIDENT = 0.9
MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25
THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"
_HEADER = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) (\S+) \S+ \S+ (\d+)\s*(.*)$")


# Decode steps from which collapsing pays at load (fxllm generate asks worth_collapsing): the collapse cost a one-shot
# `fxllm generate` 0.8-2.8 s of wall time (SmolLM2 fp32, 8 new tokens: 2.7-4.7 against 1.9 s) and saves ~7% of a step
# (~1.4 ms of SmolLM2's ~20), so it is won back after ~600-2,000 steps.
WORTH_STEPS = 1024


def worth_collapsing(decode_steps: int) -> bool:
    """Whether a process that will run about `decode_steps` decode steps gains by collapsing at load; a server or
    a long-lived engine does (fxllm.load's default)."""
    return decode_steps >= WORTH_STEPS


def enabled() -> bool:
    """Linux with transparent huge pages not `never`, and not turned off by FXLLM_HUGE_PAGES=0."""
    if not sys.platform.startswith("linux") or os.environ.get(ENVIRONMENT_SWITCH, "").strip() == "0":
        return False
    try:
        with open(THP_MODE) as mode:
            return "[never]" not in mode.read()
    except OSError:
        return False


def anonymous_mappings() -> dict[tuple[int, int], int]:
    """{(start, end): resident anonymous bytes} of this process's private, writable, anonymous mappings (the heap
    included), from /proc/self/smaps; {} where it cannot be read."""
    mappings: dict[tuple[int, int], int] = {}
    current: tuple[int, int] | None = None
    try:
        with open("/proc/self/smaps") as smaps:
            for line in smaps:
                header = _HEADER.match(line)
                if header:
                    start, end, permissions, inode, name = header.groups()
                    anonymous = permissions == "rw-p" and inode == "0" and name in ("", "[heap]")
                    current = (int(start, 16), int(end, 16)) if anonymous else None
                    if current:
                        mappings[current] = 0
                elif current and line.startswith("Anonymous:"):
                    mappings[current] = int(line.split()[1]) << 10
    except OSError:
        return {}
    return mappings


def collapse_new_mappings(before: dict[tuple[int, int], int]) -> int:
    """Move the anonymous mappings made or grown since `before` (anonymous_mappings() then) onto huge pages.
    Returns the bytes moved."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    moved = 0
    for (start, end), resident in anonymous_mappings().items():
        size = end - start
        if (start, end) in before or size < MIN_MAPPING or resident < MIN_RESIDENT * size:
            continue
        first = -(-start // HUGE_PAGE) * HUGE_PAGE
        last = end // HUGE_PAGE * HUGE_PAGE
        if libc.madvise(first, last - first, MADV_HUGEPAGE) != 0:
            continue
        for page in range(first, last, HUGE_PAGE):
            if libc.madvise(page, HUGE_PAGE, MADV_COLLAPSE) == 0:
                moved += HUGE_PAGE
            elif ctypes.get_errno() == errno.EINVAL:  # a kernel before 6.1: no MADV_COLLAPSE at all
                return moved
    return moved
