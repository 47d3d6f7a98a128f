"""Progress bars for long steps: on for terminals, quiet in CI and when FXLLM_QUIET is set, and absent (no error)
where tqdm is not installed: it comes with the compiler extra, and the runtime-only install has no bars."""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Iterable
from typing import TypeVar

T = TypeVar("T")


def enabled() -> bool:
    return sys.stderr.isatty() and not os.environ.get("FXLLM_QUIET") and importlib.util.find_spec("tqdm") is not None


def progress(items: Iterable[T], **kwargs) -> Iterable[T]:
    if not enabled():
        return items
    from tqdm import tqdm

    return tqdm(items, leave=False, **kwargs)


def status(message: str) -> None:
    """One line on stderr for a phase that has no natural unit of progress (export, lowering)."""
    if not os.environ.get("FXLLM_QUIET"):
        print(message, file=sys.stderr, flush=True)


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def counter(total: int, **kwargs):
    """A progress bar advanced by hand (bar.update(n)); a silent stand-in when bars are off."""
    if not enabled():
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, leave=False, **kwargs)
