"""The engine requests of one HTTP request, running together: `n` choices over one or more prompts fan out into
separate engine requests (continuous batching puts them in the same steps), and their outputs come back merged in
the order the engine produced them.

Each choice is pumped by its own task through `AsyncEngine.generate`; `close()` cancels the unfinished ones, which
aborts their engine requests (their KV blocks are freed at once) — the route calls it when the response ends, the
client disconnects, or anything fails. Latency metrics are observed here, as outputs reach the server.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from fxllm.runtime.request import RequestOutput
from fxllm.serving.errors import APIError

_RUNNING: set[asyncio.Task] = set()  # strong references: the event loop keeps only weak ones


class GenerationRun:
    def __init__(self, service, choices, request_id: str):
        self.service = service
        self.arrival = time.monotonic()
        self._queue: asyncio.Queue = asyncio.Queue()
        self._open = len(choices)
        self._tasks = []
        for choice in choices:
            task = asyncio.get_running_loop().create_task(self._pump(choice, f"{request_id}-{choice.index}"))
            _RUNNING.add(task)
            task.add_done_callback(self._done)
            self._tasks.append(task)

    async def _pump(self, choice, request_id: str) -> None:
        metrics, last = self.service.metrics, None
        try:
            async for output in self.service.engine.generate(choice.prompt_ids, choice.params, request_id):
                now = time.monotonic()
                if output.new_token_ids:
                    if last is None:
                        metrics.time_to_first_token.observe(now - self.arrival)
                    else:
                        metrics.inter_token_latency.observe((now - last) / len(output.new_token_ids))
                    last = now
                if output.finished:
                    metrics.finished(output.finish_reason or "unknown")
                    metrics.e2e_latency.observe(now - self.arrival)
                self._queue.put_nowait((choice.index, output))
        except asyncio.CancelledError:  # close(): generate() has aborted the engine request on the way out
            metrics.finished("abort")
            raise
        except Exception as exc:  # a submit the engine refused after all (e.g. shutting down): the consumer raises it
            self._queue.put_nowait((choice.index, exc))

    def _done(self, task: asyncio.Task) -> None:
        # A done callback, not a `finally`: a task cancelled before its first step never runs its body.
        _RUNNING.discard(task)
        self.service.release()

    def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        return self

    async def __anext__(self) -> tuple[int, RequestOutput]:
        """The next output of any choice, as (choice index, output); ends when every choice has finished. A choice
        that failed raises an APIError."""
        if self._open == 0:
            raise StopAsyncIteration
        index, item = await self._queue.get()
        if isinstance(item, Exception):
            raise failure_error("abort" if not self.service.engine.accepting else None, str(item))
        if item.finished:
            self._open -= 1
            if item.finish_reason in ("abort", "error"):
                raise failure_error(item.finish_reason, item.error)
        return index, item

    def close(self) -> None:
        """Abort every unfinished choice (idempotent; safe to call while being cancelled: nothing is awaited)."""
        for task in self._tasks:
            if not task.done():
                task.cancel()


def failure_error(finish_reason: str | None, message: str | None) -> APIError:
    """An engine request that ended without a result: aborted (only the server aborts: it is shutting down) → 503;
    failed (a model call raised, or the engine refused it late) → 500 with the engine's one-line message."""
    if finish_reason == "abort":
        return APIError(503, "the request was aborted: the server is shutting down")
    return APIError(500, f"generation failed: {message or 'unknown error'}", code="engine_error")
