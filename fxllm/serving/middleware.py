"""Guards in front of the routes, as plain ASGI middleware so that they act before the body is read or parsed: the
API key (401 for /v1/ routes without `Authorization: Bearer KEY`; compared in constant time), the body size limit
(413 from the Content-Length header, or once the bytes received pass it), and the answer to a bug (BugGuard)."""

from __future__ import annotations

import hmac

from fastapi import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from fxllm.serving.errors import APIError, internal_error, logger

PROTECTED_PREFIX = "/v1/"


class APIKeyGuard:
    def __init__(self, app: ASGIApp, api_key: str):
        self.app = app
        self.expected = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(PROTECTED_PREFIX):
            given = _header(scope, b"authorization")
            if given is None or not self._accepts(given):
                reason = "missing" if given is None else "wrong"
                error = APIError(401, f"{reason} API key: send the header 'Authorization: Bearer <key>' with the "
                                      "key the server was started with", code="invalid_api_key")
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _accepts(self, header: bytes) -> bool:
        """`Bearer KEY`, the scheme in any case (RFC 7235), the key compared in constant time."""
        scheme, _, key = header.strip().partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(key.strip(), self.expected)


class BodySizeLimit:
    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _header(scope, b"content-length")
        if declared is not None and not declared.isdigit():
            await APIError(400, "the Content-Length header is not a number").response()(scope, receive, send)
            return
        if declared is not None and int(declared) > self.max_bytes:
            await self._too_large().response()(scope, receive, send)
            return
        received = 0

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:  # a chunked body with no length: the error handlers answer 413
                    raise HTTPException(413, self._too_large().message)
            return message

        await self.app(scope, counting_receive, send)

    def _too_large(self) -> APIError:
        return APIError(413, f"the request body is larger than the server's limit of {self.max_bytes:,} bytes",
                        code="request_too_large")


class BugGuard:
    """Answers an exception that no handler took (a bug) with the one-line 500 itself. Left to Starlette's outermost
    middleware, the client gets the same answer but the exception is then raised on to the server: uvicorn logs the
    traceback a second time and closes the keep-alive connection without having said so (no `Connection: close`),
    so the client's next request on it fails. A response already started (a stream) cannot be answered again: its
    exception goes on (the streams' own failures are error events; see streaming.py)."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def watched_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watched_send)
        except Exception as exc:
            if started:
                raise
            logger.error("internal error on %s %s", scope.get("method"), scope.get("path"), exc_info=exc)
            await internal_error(exc).response()(scope, receive, send)


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return value
    return None
