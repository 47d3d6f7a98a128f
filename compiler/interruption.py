"""Interruptions during a compile. SIGINT, SIGTERM and SIGHUP raise Interrupted inside the compile, so the staging
directory's cleanup runs on the way out: SIGTERM's and SIGHUP's default action would end the process on the spot and
leave the hidden staging directory behind."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from fxllm.errors import Interrupted

SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))
_active = False  # an interruptible block is running (a draft's nested compile then keeps the outer handlers)


@contextmanager
def interruptible() -> Iterator[None]:
    """While the block runs, the first of SIGINT/SIGTERM/SIGHUP raises Interrupted(signum) in it; later ones are
    ignored so that the cleanup the exception triggers can finish. The previous handlers come back on exit. Signals
    the process ignores (e.g. SIGHUP under nohup) stay ignored. Only the main thread can take signals in Python;
    elsewhere, and inside an enclosing interruptible block, this does nothing."""
    global _active
    if _active or threading.current_thread() is not threading.main_thread():
        yield
        return
    fired = False

    def interrupt(signum, frame):
        nonlocal fired
        if not fired:
            fired = True
            raise Interrupted(signum)

    previous = {}
    _active = True
    try:
        for number in SIGNALS:
            handler = signal.getsignal(number)
            if handler is not None and handler is not signal.SIG_IGN:  # None: set outside Python, not restorable
                previous[number] = signal.signal(number, interrupt)
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
        _active = False
