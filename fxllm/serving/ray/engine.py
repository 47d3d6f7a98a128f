"""The engine deployment: each replica owns one engine core (an OpenAIService on its own AsyncEngine) and runs the
same route code as `fxllm serve` (create_completion / create_chat_completion) for the requests the ingress sends it.

`respond(route, request)` is a streaming call. Its first item is a ReplyHead: an error (status, OpenAI error body),
a whole non-streamed response (200, body), or the start of a stream (200, no body); a stream's server-sent events
follow as text, the events that pile up while one is sent going out together as the next item (no added latency
when idle, fewer messages under load). Cancelling the call (the client went away) aborts the engine requests.

Also: `check_health` (health.py), `record_routing_stats` (what Serve hands the request router), a push of this
replica's metrics to the metrics board every `metrics_period` seconds, and a drain at shutdown (Serve stops sending
requests, waits for the running ones up to `graceful_shutdown_timeout_s`, then calls `__del__`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fxllm.serving.errors import as_api_error
from fxllm.serving.ray.artifacts import local_artifact
from fxllm.serving.ray.health import EngineHealth

logger = logging.getLogger("fxllm.serving")
_END = object()


@dataclass
class ReplyHead:
    status: int
    body: dict | None  # the JSON body (an error, or a whole response); None: a stream follows
    replica: str  # the replica's id, sent to the client as the x-fxllm-replica header
    headers: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class EngineSettings:
    """What every replica of one deployment is built from (picklable: Serve ships it to the replicas)."""

    artifact: str  # a path every node can read, or a URI (artifacts.py)
    model_names: tuple[str, ...]
    max_queue: int | None
    engine_options: dict  # fxllm.load options (threads, kv_cache_memory, max_batch, ...)
    drain_timeout: float = 30.0
    stall_timeout: float = 60.0
    metrics_period: float = 1.0


class EngineReplica:
    """The user class of the engine deployment (app.py wraps it with serve.deployment)."""

    async def __init__(self, settings: EngineSettings, board=None):
        import fxllm
        from fxllm.runtime.async_engine import AsyncEngine
        from fxllm.serving.service import OpenAIService, ServingConfig
        from ray import serve

        self.replica = serve.get_replica_context().replica_id.unique_id
        path = await asyncio.to_thread(local_artifact, settings.artifact)
        engine = await asyncio.to_thread(fxllm.load, path, **settings.engine_options)
        labels = {"model_name": settings.model_names[0], "replica": self.replica}
        self.service = OpenAIService(AsyncEngine(engine), ServingConfig(settings.model_names, settings.max_queue),
                                     metric_labels=labels)
        self.settings = settings
        self.health = EngineHealth(self.service, stall_timeout=settings.stall_timeout)
        self.board = board
        self._pushing = asyncio.get_running_loop().create_task(self._push_metrics()) if board is not None else None

    # -- requests ---------------------------------------------------------------------------------------------------

    async def respond(self, route: str, request) -> AsyncIterator[ReplyHead | str]:
        """The reply to one request of `route` ("completions" or "chat"): a ReplyHead, then a stream's events."""
        from fxllm.serving.streaming import EventStream

        call = self.service.completion if route == "completions" else self.service.chat_completion
        try:
            result = await call(request)
        except Exception as exc:
            error = as_api_error(exc)
            yield ReplyHead(error.status, error.body(), self.replica, _retry_after(error.status))
            return
        if not isinstance(result, EventStream):
            yield ReplyHead(200, result.model_dump(mode="json"), self.replica)
            return
        yield ReplyHead(200, None, self.replica)
        async for batch in _batched(result):
            yield batch

    async def info(self) -> dict:
        return {"created": self.service.created, "max_model_len": self.service.max_sequence_tokens}

    async def status(self) -> str:
        return await self.service.health()

    # -- what Serve calls -------------------------------------------------------------------------------------------

    def check_health(self) -> None:
        self.health.check()

    def record_routing_stats(self) -> dict:
        stats = self.service.engine.stats()
        return {"running": stats.running, "waiting": stats.waiting, "kv_blocks_used": stats.kv_blocks_used,
                "kv_blocks_total": stats.kv_blocks_total}

    async def __del__(self):
        """Serve has stopped routing here and waited (up to graceful_shutdown_timeout_s, the drain timeout) for the
        running requests: abort what is left and stop the engine core."""
        if self._pushing is not None:
            self._pushing.cancel()
        self.service.stop_accepting()
        aborted = await self.service.engine.shutdown(drain_timeout=0)
        if aborted:
            logger.warning("replica %s aborted %d unfinished requests at shutdown", self.replica, aborted)
        if self.board is not None:
            try:  # the board may be stopping too (the whole app is): don't wait for it
                await asyncio.wait_for(self.board.forget.remote(self.replica), timeout=1.0)
            except Exception:
                pass

    async def _push_metrics(self) -> None:
        while True:
            try:
                await self.board.report.remote(self.replica, list(self.service.metrics.registry.collect()))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the board restarts or is stopping: try again next period
                logger.debug("metrics push failed: %s", exc)
            await asyncio.sleep(self.settings.metrics_period)


async def _batched(stream) -> AsyncIterator[str]:
    """The stream's events, joined into one item whenever several are ready; closing it aborts the run."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump() -> None:
        try:
            async for piece in stream.body_iterator:
                queue.put_nowait(piece)
        finally:
            queue.put_nowait(_END)

    task = asyncio.get_running_loop().create_task(pump())
    try:
        while True:
            pieces = [await queue.get()]
            while not queue.empty():
                pieces.append(queue.get_nowait())
            ended = pieces[-1] is _END
            if ended:
                pieces.pop()
            if pieces:
                yield "".join(pieces)
            if ended:
                return
    finally:
        task.cancel()
        stream.run.close()


def _retry_after(status: int) -> dict[str, str]:
    return {"Retry-After": "1"} if status in (429, 503) else {}
