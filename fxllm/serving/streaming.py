"""Server-sent events as the OpenAI API streams them: one `data: {json}` event per chunk, a `data: {"error": ...}`
event if the generation fails midway (the status line has been sent by then), and `data: [DONE]` last."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from fxllm.serving.errors import APIError, internal_error

logger = logging.getLogger("fxllm.serving")

DONE = "data: [DONE]\n\n"


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
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.run.close()


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
