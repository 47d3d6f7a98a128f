"""The ingress deployment: the same FastAPI app as `fxllm serve` (fxllm/serving/app.py: routes, OpenAI errors, API
key, body limit, disconnects), whose served object — RemoteModel — forwards each request to the engine
deployment over a DeploymentHandle (so Serve's request router, or the prefix-aware one, sees the parsed request).

Replica failures: a request whose engine replica dies before anything was sent to the client (a non-streamed
request, or a stream before its first event) is sent once more, to another replica, transparently; a stream cut
later ends with an OpenAI error event (`service_unavailable`, code `replica_unavailable`: retry the request) and
`[DONE]`. Serve's back pressure (`max_queued_requests` waiting for a replica) is a 429.

Every reply names the engine replica that served it in the `x-fxllm-replica` header. `/metrics` is the metrics
board's merge of every replica's metrics; `/health` asks one engine replica.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import AsyncIterator, Callable

from fastapi.responses import JSONResponse
from starlette.responses import StreamingResponse

from fxllm.serving.errors import APIError, not_accepting
from fxllm.serving.protocol import ModelCard
from fxllm.serving.ray.engine import ReplyHead
from fxllm.serving.service import check_model_name
from fxllm.serving.streaming import DONE, error_event

logger = logging.getLogger("fxllm.serving")
REPLICA_HEADER = "x-fxllm-replica"
HEALTH_TIMEOUT = 5.0


def _replica_errors() -> tuple[type[BaseException], ...]:
    """Errors of a call whose replica died or went away (retrying elsewhere may succeed)."""
    from ray.exceptions import RayActorError
    from ray.serve.exceptions import ReplicaUnavailableError

    return RayActorError, ReplicaUnavailableError


class RemoteModel:
    """The served object of the ingress app: what OpenAIService offers the routes, answered by engine replicas."""

    def __init__(self, engine, board, model_names: tuple[str, ...]):
        self.engine, self.board, self.model_names = engine, board, model_names
        self._info: dict | None = None
        self.draining = False  # shutting down: new requests get 503, /health says so
        self.running = 0  # requests forwarded and not yet answered (a stream: until its last event)

    def check_model(self, name: str) -> None:
        check_model_name(self.model_names, name)

    async def card(self, name: str) -> ModelCard:
        if self._info is None:
            self._info = await self.engine.info.remote()
        return ModelCard(id=name, created=self._info["created"], max_model_len=self._info["max_model_len"])

    async def health(self) -> str:
        """One engine replica's status, or "unavailable" when none answers within HEALTH_TIMEOUT seconds; "shutting
        down" once draining."""
        if self.draining:
            return "shutting down"
        try:
            return await asyncio.wait_for(self.engine.status.remote(), HEALTH_TIMEOUT)
        except (asyncio.TimeoutError, *_replica_errors()):
            return "unavailable"

    async def render_metrics(self) -> tuple[bytes, str]:
        return await self.board.render.remote()

    async def completion(self, request):
        self.check_model(request.model)
        return await self._forward("completions", request)

    async def chat_completion(self, request):
        self.check_model(request.model)
        return await self._forward("chat", request)

    async def _forward(self, route: str, request):
        if self.draining:
            raise not_accepting()
        self.running += 1
        released = []

        def release() -> None:  # once: a stream's relay ends, or is dropped unstarted (a client gone before it)
            if not released:
                released.append(True)
                self.running -= 1

        try:
            reply = await self._call(route, request, release)
        except BaseException:
            release()
            raise
        if isinstance(reply, StreamingResponse):
            weakref.finalize(reply.body_iterator, release)
        else:
            release()
        return reply

    async def _call(self, route: str, request, release: Callable[[], None]):
        from ray.serve.exceptions import BackPressureError

        for attempt in (1, 2):
            call = self.engine.options(stream=True).respond.remote(route, request)
            try:
                head: ReplyHead = await call.__anext__()
                break
            except BackPressureError:
                raise APIError(429, "every engine replica is busy and the queue for them is full; retry later",
                               code="queue_full") from None
            except _replica_errors() as exc:
                if attempt == 2:
                    raise APIError(503, f"no engine replica could take the request ({type(exc).__name__}); retry",
                                   code="replica_unavailable") from None
                logger.warning("engine replica failed before replying (%s); sending the request again",
                               type(exc).__name__)
            except BaseException:
                call.cancel()
                raise
        headers = {REPLICA_HEADER: head.replica, **head.headers}
        if head.body is not None:
            return JSONResponse(head.body, status_code=head.status, headers=headers)
        return StreamingResponse(_relay(call, release), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers})


async def _relay(call, release: Callable[[], None]) -> AsyncIterator[str]:
    """A stream's events as the engine replica sends them; if the replica dies midway, an error event and [DONE].
    Closing the response (the client went away) cancels the call, which aborts its engine requests. `release` is
    called when it ends: the stream counts as running until then."""
    finished = False
    try:
        async for events in call:
            yield events
        finished = True
    except _replica_errors() as exc:
        finished = True
        yield error_event(APIError(503, f"the engine replica serving this stream stopped ({type(exc).__name__}); "
                                        "retry the request", code="replica_unavailable"))
        yield DONE
    finally:
        release()
        if not finished:
            call.cancel()


class Ingress:
    """The user class of the ingress deployment (app.py wraps it with serve.deployment and serve.ingress)."""

    def __init__(self, engine, board, model_names: tuple[str, ...], api_key: str | None = None):
        self.remote = RemoteModel(engine, board, tuple(model_names))
        self.api_key = api_key

    def begin_drain(self) -> int:
        """Shutting down (called before the app is deleted, which drops its route at once: a request then got the
        proxy's plain-text 404): new requests get 503 with the OpenAI body, /health says "shutting down".
        Returns how many requests are still running."""
        self.remote.draining = True
        return self.remote.running

    def running(self) -> int:
        """How many requests are still running (begin_drain's count, now)."""
        return self.remote.running

    def __serve_build_asgi_app__(self):
        from fxllm.serving.app import create_app

        return create_app(lambda: self.remote, api_key=self.api_key)
