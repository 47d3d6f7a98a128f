"""Interruptions while an artifact is written. Inside `interruptible()`, SIGINT, SIGTERM and SIGHUP raise Interrupted,
so the staging directory's cleanup runs on the way out: SIGTERM's and SIGHUP's default action would end the process
on the spot and leave the hidden staging directory behind. `held_back()` marks a few steps that must not be cut in
two (creating the staging directory, the two renames of the swap): a signal during them is raised right after."""

from __future__ import annotations

import _signal
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from fxllm.errors import Interrupted

SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))


class _Guard:
    """The state of the active interruptible block: the handler raises once; while held back it only records."""

    def __init__(self) -> None:
        self.fired: int | None = None  # the signal raised as Interrupted, once one was
        self.holding = False
        self.pending: int | None = None

    def handle(self, signum: int, frame) -> None:
        if self.fired is not None:
            return  # the first signal's exception is unwinding: let its cleanup finish
        if self.holding:
            self.pending = self.pending or signum
            return
        self.fired = signum
        raise Interrupted(signum)


_guard: _Guard | None = None  # the active block's (main thread only; a nested block keeps the outer one)


@contextmanager
def interruptible() -> Iterator[None]:
    """While the block runs, the first of SIGINT/SIGTERM/SIGHUP raises Interrupted(signum) in it; later ones are
    ignored so that the cleanup the exception triggers can finish. The previous handlers come back on exit. Signals
    the process ignores (e.g. SIGHUP under nohup) stay ignored. Only the main thread can take signals in Python;
    elsewhere, and inside an enclosing interruptible block, this does nothing.

    An Interrupted raised inside a library's bookkeeping can make that library's own cleanup fail on the way out
    (torch's dispatch-mode stack: "AssertionError: Trying to pop empty mode stack" replaced SIGTERM's Interrupted
    mid-lowering), so whatever leaves the block after a signal fired leaves it as Interrupted(that signal), chained
    to what replaced it."""
    global _guard
    if _guard is not None or threading.current_thread() is not threading.main_thread():
        yield
        return
    guard = _Guard()
    previous = {}
    _guard = guard
    try:
        for number in SIGNALS:
            handler = signal.getsignal(number)
            if handler is not None and handler is not signal.SIG_IGN:  # None: set outside Python, not restorable
                previous[number] = signal.signal(number, guard.handle)
        try:
            yield
        except BaseException as exc:
            if guard.fired is None or isinstance(exc, (Interrupted, GeneratorExit)):
                raise
            raise Interrupted(guard.fired) from exc
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
        _guard = None


class Held:
    """What held_back saw: `signum`, the signal that arrived while its block ran (None: none)."""

    signum: int | None = None


@contextmanager
def held_back(raise_after: bool = True) -> Iterator[Held]:
    """Inside an interruptible block: a signal that arrives while this block runs is raised as Interrupted when it
    ends (unless the block itself failed). With raise_after=False, for a block after which the work is done (the
    swap that puts a new artifact in place), it is only recorded in the yielded Held, and later ones are ignored
    until the interruptible block ends: an exit status that says "interrupted" must mean the output is as it was.
    Outside an interruptible block: nothing to hold back."""
    held = Held()
    guard = _guard
    if guard is None or guard.holding:
        yield held
        return
    guard.holding = True
    try:
        yield held
    finally:
        guard.holding = False
    if guard.pending is not None and guard.fired is None:
        guard.fired = guard.pending
        held.signum = guard.pending
        if raise_after:
            raise Interrupted(guard.pending)


@contextmanager
def ctrl_c_after() -> Iterator[None]:
    """On the main thread, while Python's own SIGINT handler is installed: a Ctrl-C that arrives inside the block is
    raised as KeyboardInterrupt once the block has ended, not in the middle of it. For an engine step: cut in two
    (inside the scheduler's bookkeeping, ONNX Runtime's bindings, the hand-over of outputs) it leaked KV blocks,
    lost other callers' requests or left stale bindings. Elsewhere, or under a handler of the program's own,
    nothing changes."""
    # _signal: signal.signal and getsignal wrap each call in enum conversions (a failed enum lookup for a
    # function handler), ~20 µs of every engine step's Python
    if threading.current_thread() is not threading.main_thread() or \
            _signal.getsignal(_signal.SIGINT) is not _signal.default_int_handler:
        yield
        return
    arrived: list[int] = []
    previous = _signal.signal(_signal.SIGINT, lambda signum, frame: arrived.append(signum))
    try:
        yield
    finally:
        _signal.signal(_signal.SIGINT, previous)
    if arrived:
        raise KeyboardInterrupt
