"""One engine core shared by any number of threads and open streams (#16 item 4): calls run together through
the core, one step at a time.

Callers (Engine.generate / generate_ids / stream from any thread, AsyncEngine's loop thread) submit requests
here, each with a sink that receives the request's outputs. Whoever waits for outputs drives: under the step lock
it applies the queued requests, runs one core step and hands every output of that step to its request's sink —
other callers' outputs included — before it lets go; a caller that finds another thread stepping waits for that
thread's steps instead of the lock (which the stepping thread could win again and again), so a request returns as
soon as it is done. So requests from different threads and streams are batched together, the core only ever runs
on one thread at a time, and each request's outputs arrive in order. A caller that stops waiting (a closed stream)
aborts its request, which frees its KV blocks at once.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from fxllm.errors import GenerationError
from fxllm.runtime.engine_core import EngineCore, request_id_in_use
from fxllm.runtime.interruption import ctrl_c_after
from fxllm.runtime.request import Request, RequestOutput, SamplingParams

Sink = Callable[[RequestOutput], None]
logger = logging.getLogger("fxllm.engine")


class CoreDriver:
    def __init__(self, core: EngineCore):
        self.core = core
        self.accepting = True  # False once shutting down: submit refuses new requests
        self._step_lock = threading.Lock()  # held while the core runs (and its outputs are delivered)
        # notified each time the step lock is let go: a caller whose outputs another thread's steps deliver waits
        # on it rather than on the lock, which the stepping thread may win again and again (for its whole request).
        # Reentrant for the same reason as _lock: the collector's abort_soon may notify inside a notify or a wait
        self._released = threading.Condition(threading.RLock())
        # guards _sinks and _pending; never held while waiting for the step lock. Reentrant: the garbage collector
        # may close an abandoned stream (abort_soon) on a thread that holds it
        self._lock = threading.RLock()
        self._sinks: dict[str, Sink] = {}  # unfinished requests (queued or in the core) → where outputs go
        self._pending: deque[Request] = deque()  # submitted, not yet in the core
        self._aborts: deque[str] = deque()  # aborted, not yet applied to the core (applied before the next step)
        self._outbox: deque[RequestOutput] = deque()  # outputs of a step not yet handed to their sinks
        self._queued = 0  # requests and aborts queued so far (under _lock) ...
        self._applied = 0  # ... and how many of them are applied to the core (under the step lock)

    def submit(self, requests: list[tuple[str, str | list[int], SamplingParams]], sinks: list[Sink]) -> None:
        """Check every request (raising the first problem, GenerationError, before any is queued), then queue all.
        Their outputs go to the sinks (called on whichever thread steps, under the step lock: keep them short)."""
        made = [self.core.new_request(request_id, prompt, params) for request_id, prompt, params in requests]
        with self._lock:
            if not self.accepting:
                raise GenerationError("the engine is shutting down and accepts no new requests")
            ids = [request.request_id for request in made]
            taken = next((i for i in ids if i in self._sinks), None)
            if taken is not None:
                raise request_id_in_use(taken, ended=self._sinks[taken] is _discard)
            repeated = _first_repeated(ids)
            if repeated is not None:
                raise GenerationError(f"request id {repeated!r:.60} is given to more than one request of the batch")
            for request, sink in zip(made, sinks):
                self._sinks[request.request_id] = sink
                self._pending.append(request)
            self._queued += len(made)

    def abort(self, request_id: str, notify: bool = True) -> None:
        """Abort now (blocks free when this returns; waits for a running step to end). With notify, the request's
        sink still receives its final "abort" output from the next step; without, the sink is dropped at once."""
        self.queue_abort(request_id, notify)
        self.flush()

    def flush(self) -> None:
        """Apply the requests and aborts queued so far: when this returns they are in the core (an abort's blocks
        are free). Applies them itself when no step runs, else waits for the stepping thread, which applies them
        before its step (waiting for the lock instead could take as long as that thread keeps stepping)."""
        with self._lock:
            target = self._queued
        while self._applied < target:
            with self._stepping(blocking=False) as held:
                if held:
                    self._apply_pending()
                    continue
            self._wait_for_the_stepping_thread(lambda: self._applied >= target)

    def abort_soon(self, request_id: str, notify: bool = True) -> None:
        """Abort now if no step is running, else before the next one; never waits. For a stream's cleanup, which
        the garbage collector may run on any thread, the stepping one included (abort() would wait for its own
        step lock there: a deadlock)."""
        self.queue_abort(request_id, notify)
        with self._stepping(blocking=False) as held:
            if held:
                self._apply_pending()

    def queue_abort(self, request_id: str, notify: bool = True) -> None:
        """Abort without waiting: the abort is applied before the next step runs, whichever thread runs it (a
        thread waiting for the step lock could otherwise watch the stepping thread win it again and again)."""
        with self._lock:
            if not notify and request_id in self._sinks:
                self._sinks[request_id] = _discard  # the id stays taken until the core's final output has passed
            self._aborts.append(request_id)
            self._queued += 1

    def queue_abort_all(self) -> int:
        """Abort every unfinished request without waiting, all in one batch that the next step applies before it
        runs (aborting them one by one, each waiting for the step lock, lets the stepping thread run a queued
        request between two aborts: at shutdown it could then run to its end). How many were aborted."""
        with self._lock:
            ids = list(self._sinks)
            self._aborts.extend(ids)
            self._queued += len(ids)
        return len(ids)

    def fail_all(self, message: str) -> None:
        """End every unfinished request with finish_reason "error" (after a step raised: a bug, not a failing model
        call, which the core handles itself). Each sink gets its final output even if the core is broken."""
        with self._stepping():
            self._apply_pending()
            self._deliver()
            with self._lock:
                sinks, self._sinks = self._sinks, {}
            for request_id, sink in sinks.items():
                try:
                    self.core.abort(request_id, error=message)
                except Exception:  # the core is broken; the caller still learns its request failed
                    logger.exception("could not abort %r", request_id)
                sink(RequestOutput(request_id, [], "", True, "error", error=message))
            try:
                self.core.step()  # takes the aborts' outputs (nobody listens any more); no request is left to run
            except Exception:
                logger.exception("the engine core cannot step after failing its requests")

    def has_work(self) -> bool:
        return bool(self._pending or self._aborts or self._outbox) or self.core.has_unfinished()

    def has_request(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._sinks

    def step_until(self, done: Callable[[], bool]) -> None:
        """Step the core until done(): while another thread steps (and delivers this caller's outputs too), wait
        for it rather than for the lock, so that a short request returns as soon as it is done however long the
        stepping thread's own request runs. done() is checked under the step lock before a step, so no step runs
        for outputs that already arrived."""
        while not done():
            with self._stepping(blocking=False) as held:
                if held:
                    if not done():
                        if not self.has_work():  # nothing left that could make it done: say so, do not spin
                            raise GenerationError("internal error: a request's outputs were lost (the engine has "
                                                  "no work left for it)")
                        self.step_locked()
                    continue
            self._wait_for_the_stepping_thread(done)

    def step(self) -> bool:
        """One step if there is work; whether one ran."""
        with self._stepping():
            if not self.has_work():
                return False
            self.step_locked()
            return True

    def step_locked(self) -> None:
        """One core step and the delivery of its outputs; the caller holds the step lock."""
        self._apply_pending()
        self._deliver()  # what an interrupted delivery left
        self._outbox.extend(self.core.step())  # if the step raises, the core keeps what it made for the next one
        self._deliver()

    def _deliver(self) -> None:
        """Hand the outbox's outputs to their sinks, in order; if one raises (an interrupt), the rest stay for the
        next step (a caller waiting for them would otherwise wait for ever)."""
        while self._outbox:
            output = self._outbox.popleft()
            with self._lock:
                sink = self._sinks.pop(output.request_id, None) if output.finished else self._sinks.get(output.request_id)
            if sink is not None:
                sink(output)

    def _apply_pending(self) -> None:
        """Queued requests into the core, then queued aborts (which may name a request just queued)."""
        if self._applied == self._queued:  # nothing queued (one queued meanwhile waits for the next step): no lock
            return
        with self._lock:  # swapped, not copied and cleared: an abort queued meanwhile (by the collector) stays
            requests, aborts, self._pending, self._aborts = self._pending, self._aborts, deque(), deque()
            upto = self._queued
        for request in requests:
            self.core.enqueue(request)
        for request_id in aborts:
            self.core.abort(request_id)
        self._applied = upto

    def run_exclusive(self, function: Callable[[], object]) -> object:
        """Run function() while no step runs (e.g. score() borrowing pool blocks)."""
        with self._stepping():
            return function()

    def _wait_for_the_stepping_thread(self, done: Callable[[], bool]) -> None:
        """Return once done(), or once the thread holding the step lock lets go of it (at once if none holds it)."""
        with self._released:
            if not done() and self._step_lock.locked():
                self._released.wait(timeout=1.0)  # (the timeout only bounds a missed wake-up)

    @contextmanager
    def _stepping(self, blocking: bool = True) -> Iterator[bool]:
        """Hold the step lock (without blocking: if it is free; yields whether it is held), and once it is let go
        wake the callers waiting in step_until."""
        held = self._step_lock.acquire(blocking)
        if not held:
            yield False
            return
        with ctrl_c_after():  # a step is never cut in two by Ctrl-C; it is raised once the lock is let go
            try:
                yield True
            finally:
                self._step_lock.release()
                with self._released:
                    self._released.notify_all()


def _first_repeated(ids: list[str]) -> str | None:
    """The first id that occurs a second time in `ids`, or None."""
    seen: set[str] = set()
    for request_id in ids:
        if request_id in seen:
            return request_id
        seen.add(request_id)
    return None


def _discard(output: RequestOutput) -> None:
    """The sink of a request aborted without notice: what it still outputs goes nowhere. It holds the request's id
    until the core's final output for it has passed, so that a new request of that id does not receive it."""
