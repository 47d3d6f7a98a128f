"""`fxllm serve`: one artifact behind the OpenAI API on uvicorn.

The socket is bound first (a port in use is a one-line error before a long load), then the engine is loaded (a bad
artifact or option is a one-line error; connections made meanwhile wait in the listen backlog), then uvicorn serves
the app; the URL is printed on stdout once requests are accepted. A request's head (its line and headers) must
arrive within the body timeout too, and be at most 64 KiB (connections.py). SIGTERM (or Ctrl-C) at once turns the
service off (a request still arriving on an open connection gets 503, /health says "shutting down"), stops accepting
connections, lets running requests finish for up to `drain_timeout` seconds, aborts what is left (their clients
get a 503, or an error event and [DONE] in a stream), and returns 0 (Ctrl-C: the CLI's 130).
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import signal
import socket
from dataclasses import dataclass
from pathlib import Path

from fxllm.errors import FxllmError

logger = logging.getLogger("fxllm.serving")


@dataclass
class ServeOptions:
    artifact: str
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    api_key: str | None = None
    max_queue: int | None = 256
    drain_timeout: float = 30.0
    access_log: bool = False
    log_level: str = "warning"
    body_timeout: float = 30.0
    allowed_origins: tuple[str, ...] = ()

    def check(self) -> None:
        """FxllmError (one line) for an option no server can take; before anything loads."""
        if not 0 <= self.port <= 65535:
            raise FxllmError(f"--port must be between 0 and 65535, got {self.port}")
        check_drain_timeout(self.drain_timeout)
        if not (self.body_timeout > 0 and math.isfinite(self.body_timeout)):
            raise FxllmError(f"--body-timeout must be a number of seconds > 0, got {self.body_timeout}")
        if self.api_key is not None:
            from fxllm.serving.middleware import check_api_key

            check_api_key(self.api_key)


_ORIGIN = re.compile(r"[a-z][a-z0-9+.-]*://[^/?#\s]+", re.IGNORECASE)


def parse_origins(text: str) -> tuple[str, ...]:
    """`--allowed-origins`: comma-separated origins (`scheme://host[:port]`, as browsers send them) or `*`; an empty
    list, or an entry with a path (a trailing slash never matches), is a one-line FxllmError."""
    origins = tuple(origin.strip() for origin in text.split(",") if origin.strip())
    if not origins:
        raise FxllmError("--allowed-origins is empty; give origins such as http://localhost:3000, or *")
    for origin in origins:
        if origin != "*" and not _ORIGIN.fullmatch(origin):
            raise FxllmError(f"--allowed-origins: '{origin}' is not an origin (scheme://host[:port], without a path "
                             "or a trailing slash) or *")
    return origins


def check_drain_timeout(seconds: float) -> None:
    """FxllmError unless `seconds` is >= 0 (NaN is not): `fxllm serve`'s and the Ray Serve app's drain."""
    if not seconds >= 0:
        raise FxllmError(f"--drain-timeout must be >= 0 seconds, got {seconds}")


def serve(options: ServeOptions, **engine_options) -> int:
    """Load the artifact (engine_options go to fxllm.load), serve until SIGTERM/SIGINT, return the exit status."""
    import uvicorn

    import fxllm
    from fxllm.runtime.async_engine import AsyncEngine
    from fxllm.serving.app import create_app
    from fxllm.serving.connections import guarded_protocol
    from fxllm.serving.service import OpenAIService, ServingConfig

    options.check()
    name = options.served_model_name or Path(options.artifact).resolve().name
    config = ServingConfig((name,), options.max_queue)
    sock = _bind(options.host, options.port)  # first: a port in use fails before a long load
    try:
        engine = fxllm.load(options.artifact, **engine_options)
    except BaseException:
        sock.close()
        raise
    service = OpenAIService(AsyncEngine(engine), config)
    app = create_app(lambda: service, api_key=options.api_key, body_timeout=options.body_timeout,
                     allowed_origins=options.allowed_origins)
    # the head of a request (its line and headers) gets the body's deadline: see connections.py
    # ws="none": with the `websockets` package installed uvicorn took a WebSocket upgrade and, the app having no
    # WebSocket route, refused it itself (a bare text/plain 403); now it is a plain request, answered as any other.
    uvicorn_config = uvicorn.Config(app, log_level=options.log_level, access_log=options.access_log, lifespan="off",
                                    http=guarded_protocol(options.body_timeout), ws="none",
                                    timeout_graceful_shutdown=options.drain_timeout + ABORT_GRACE)
    if options.access_log:  # uvicorn gives its access logger log_level, which without -v (warning) hid every line
        logging.getLogger("uvicorn.access").setLevel(logging.INFO)
    server = _draining_server(service, uvicorn_config, options.drain_timeout)
    # uvicorn re-raises the signal that stopped it once it has drained; with this handler in place beforehand, a
    # SIGTERM then ends the process normally (exit 0) instead of killing it.
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        asyncio.run(_run(server, service, sock, name))
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0


ABORT_GRACE = 5.0  # seconds uvicorn waits after the drain timeout, for the aborted requests' answers to be written


def _draining_server(service, config, drain_timeout: float):
    """A uvicorn.Server whose exit signal first stops the service accepting requests (before uvicorn drains), and
    `drain_timeout` seconds later aborts the engine requests still running, so that their clients get the OpenAI
    error (503, or an error event and [DONE] in a stream) before uvicorn cancels what is left after ABORT_GRACE
    (which would answer a plain-text 500 or cut a stream). A second Ctrl-C during the drain aborts them at once
    (uvicorn's own second Ctrl-C is that cancellation); a third is uvicorn's force exit."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        loop: asyncio.AbstractEventLoop | None = None  # set by _run
        _aborting: asyncio.TimerHandle | None = None

        _aborted_at_once = False

        def handle_exit(self, sig, frame) -> None:
            service.stop_accepting()
            if self.should_exit and sig == signal.SIGINT and not self._aborted_at_once and self.loop is not None:
                # uvicorn's force exit would cancel the handlers: tracebacks, a plain-text 500, streams cut short
                self._aborted_at_once = True
                self._captured_signals.append(sig)  # uvicorn raises it again once stopped: Ctrl-C exits 130
                logger.warning("Ctrl-C again: aborting the running requests now (once more forces the exit)")
                self.loop.call_soon_threadsafe(self._abort)
                return
            if self.loop is not None and self._aborting is None:
                self.loop.call_soon_threadsafe(self._abort_later)
            super().handle_exit(sig, frame)

        def _abort_later(self) -> None:
            if self._aborting is None:
                self._aborting = self.loop.call_later(drain_timeout, self._abort)

        def _abort(self) -> None:
            task = self.loop.create_task(service.engine.shutdown(drain_timeout=0))
            _PENDING.add(task)
            task.add_done_callback(_PENDING.discard)

    return DrainingServer(config)


_PENDING: set[asyncio.Task] = set()  # strong references to the abort tasks: the event loop keeps only weak ones


async def _run(server, service, sock: socket.socket, name: str) -> None:
    server.loop = asyncio.get_running_loop()
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not serving.done():
        await asyncio.sleep(0.02)
    if server.started:
        host, port = sock.getsockname()[:2]
        shown = f"[{host}]" if ":" in host else host
        print(f"fxllm: serving '{name}' at http://{shown}:{port}/v1 (OpenAI API; SIGTERM or Ctrl-C stops)",
              flush=True)
    try:
        await serving
    finally:
        aborted = await service.engine.shutdown(drain_timeout=0)  # uvicorn has drained: abort anything left
        if aborted:
            logger.warning("aborted %d unfinished requests at shutdown", aborted)


def _bind(host: str, port: int) -> socket.socket:
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError as exc:
        raise FxllmError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.setblocking(False)
    return sock
