"""AsyncEngine: the engine core for asyncio programs (a server). Steps run on ONE background thread; coroutines
submit requests and read their outputs without ever blocking the event loop on a model call.

    engine = AsyncEngine(fxllm.load(path))          # or AsyncEngine.load(path, **load options)
    async for out in engine.generate("Hello", SamplingParams(max_tokens=32), "req-1"):
        print(out.text_delta, end="")

`generate` checks the request at once (GenerationError before the first output); cancelling or closing the
iterator (a client that disconnects) aborts the request and frees its KV blocks. A model call that fails ends
only its own requests (finish_reason "error"); the loop keeps serving the others. `shutdown(drain_timeout)` stops
accepting requests, lets running ones finish for up to drain_timeout seconds, aborts the rest and stops the thread.
The blocking Engine API may be used at the same time: both drive the same core through its CoreDriver.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator

from fxllm.runtime.driver import CoreDriver
from fxllm.runtime.metrics import EngineStats
from fxllm.runtime.request import RequestOutput, SamplingParams

logger = logging.getLogger("fxllm.engine")


class AsyncEngine:
    def __init__(self, engine):
        self.engine = engine  # runtime.engine.Engine
        self.driver: CoreDriver = engine.driver
        self._wake = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="fxllm-engine-core", daemon=True)
        self._thread.start()

    @classmethod
    def load(cls, path, **options) -> AsyncEngine:
        from fxllm.runtime.engine import Engine

        return cls(Engine.load(path, **options))

    async def generate(self, prompt: str | list[int], params: SamplingParams,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        """One request's outputs, in order, the last with finished=True."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()

        def sink(output: RequestOutput) -> None:  # on a stepping thread, under the driver's step lock
            try:
                loop.call_soon_threadsafe(queue.put_nowait, output)
            except RuntimeError:  # the event loop is closed: nobody is listening any more
                pass

        self.driver.submit([(request_id, prompt, params)], [sink])
        self._notify()
        finished = False
        try:
            while not finished:
                output = await queue.get()
                finished = output.finished
                yield output
        finally:
            if not finished:  # cancelled, or the consumer stopped reading: free the request's blocks
                self.driver.queue_abort(request_id, notify=False)  # at once: before any later request's step
                await asyncio.get_running_loop().run_in_executor(None, self.driver.flush)  # blocks freed on return
                self._notify()

    async def abort(self, request_id: str) -> None:
        """Abort a request: its blocks are free when this returns; its generate() iterator ends with an "abort"
        output. An unknown or finished id is a no-op (logged)."""
        # The driver waits for a running step to end: do that off the event loop.
        await asyncio.get_running_loop().run_in_executor(None, self.driver.abort, request_id, True)
        self._notify()

    def stats(self) -> EngineStats:
        return self.driver.core.stats()

    @property
    def accepting(self) -> bool:
        return self.driver.accepting

    async def shutdown(self, drain_timeout: float = 30.0) -> int:
        """Stop accepting requests, wait up to drain_timeout seconds for unfinished ones, abort those still
        running, and stop the loop thread. Returns how many were aborted."""
        self.driver.accepting = False
        deadline = time.monotonic() + max(drain_timeout, 0.0)
        while self.driver.has_work() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        aborted = self.driver.queue_abort_all()
        self._notify()
        while self.driver.has_work():  # deliver the abort outputs
            await asyncio.sleep(0.01)
        with self._wake:
            self._stopping = True
            self._wake.notify()
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join)
        return aborted

    # -- the loop thread --------------------------------------------------------------------------------------------

    def _notify(self) -> None:
        with self._wake:
            self._wake.notify()

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._stopping and not self.driver.has_work():
                    self._wake.wait(timeout=1.0)
                if self._stopping and not self.driver.has_work():
                    return
            try:
                self.driver.step()
            except Exception:  # a bug in a step (model failures are request errors): keep the loop alive
                logger.exception("engine step failed; failing the unfinished requests")
                self.driver.fail_all("internal error in the engine step (see the log)")
