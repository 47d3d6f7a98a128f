"""Server-sent events as the OpenAI API streams them: one `data: {json}` event per chunk, a `data: {"error": ...}`
event if the generation fails midway (the status line has been sent by then), and `data: [DONE]` last.

A client that stops reading a stream without closing it (or vanishes without a FIN) is dropped once one chunk could
not be written for STALLED_SEND_SECONDS: the server stops writing to a connection whose buffers are full, and the
stream's undelivered outputs (n choices × max_tokens, with their logprobs) stayed in memory for as long as the
connection stayed open, i.e. forever; a few such requests could exhaust the server's memory. A client reading slower
than the tokens come is not dropped: only a write that makes no progress for that long is.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from fxllm.serving.errors import APIError, internal_error

logger = logging.getLogger("fxllm.serving")

DONE = "data: [DONE]\n\n"
STALLED_SEND_SECONDS = 60.0  # how long one chunk may wait for the client to read before the stream is dropped


def event(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


def error_event(error: APIError) -> str:
    return event(error.body())


class EventStream(StreamingResponse):
    """A text/event-stream response that closes its GenerationRun however the response ends: finished, failed, or
    cancelled because the client disconnected (Starlette cancels the stream then), which aborts the unfinished
    engine requests and frees their KV blocks at once."""

    def __init__(self, events: AsyncIterator[str], run):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.run = run

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        seconds = STALLED_SEND_SECONDS

        async def timed_send(message) -> None:
            try:
                await _within(seconds, send(message))
            except asyncio.TimeoutError:
                raise ClientStalled() from None

        try:
            await super().__call__(scope, receive, timed_send)
        except Exception as exc:
            if not _stalled(exc):
                raise
            # returning with the response incomplete has uvicorn close the connection (and log one line)
            logger.warning("dropped a stream whose client read nothing for %g seconds", seconds)
        finally:
            self.run.close()


class ClientStalled(Exception):
    """A chunk could not be written for STALLED_SEND_SECONDS."""


def _stalled(exc: BaseException) -> bool:
    """ClientStalled, alone or as the only kind of exception in a group (Starlette's task group may wrap it)."""
    inner = getattr(exc, "exceptions", None)
    return isinstance(exc, ClientStalled) or (inner is not None and all(_stalled(e) for e in inner))


async def _within(seconds: float, awaitable) -> None:
    """`await awaitable`, or asyncio.TimeoutError after `seconds` (asyncio.timeout where there is one: no task)."""
    if hasattr(asyncio, "timeout"):  # Python 3.11+
        async with asyncio.timeout(seconds):
            await awaitable
    else:
        await asyncio.wait_for(awaitable, seconds)


async def respond(writer, run, stream: bool):
    """A started run's response: an EventStream of the writer's chunks, or (not streaming) the writer's response
    once every choice has finished. `writer` has `events(run)`, `add(index, output)` and `response()`."""
    if stream:
        return EventStream(with_errors(writer.events(run)), run)
    try:
        async for index, output in run:
            writer.add(index, output)
    finally:
        run.close()
    return writer.response()


async def with_errors(chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """The chunks, then [DONE]; a failure midway becomes an error event before [DONE]: an APIError as itself, any
    other exception (a bug) as a 500 with a one-line message (the server log has the traceback)."""
    try:
        async for chunk in chunks:
            yield chunk
    except APIError as exc:
        yield error_event(exc)
    except Exception as exc:
        logger.error("internal error while streaming a response", exc_info=exc)
        yield error_event(internal_error(exc))
    yield DONE
