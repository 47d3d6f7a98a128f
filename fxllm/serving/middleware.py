"""Guards in front of the routes, as plain ASGI middleware so that they act before the body is read or parsed: the
API key (401 for /v1/ routes without `Authorization: Bearer KEY`; compared in constant time), the body size limit
(413 from the Content-Length header, or once the bytes received pass it), a compressed body (415), a body that does
not arrive in time (408), HEAD answered as GET without the body, a path's trailing slash ignored, the answer to a bug
(BugGuard), and CORS whose refused preflight is an error body like any other (OpenAICORS)."""

from __future__ import annotations

import asyncio
import hmac

from fastapi import HTTPException
from fastapi.middleware.cors import CORSMiddleware
from starlette.datastructures import Headers
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from fxllm.errors import FxllmError
from fxllm.serving.errors import APIError, internal_error, logger, shown

PROTECTED_PREFIX = "/v1/"


def check_api_key(api_key: str) -> None:
    """FxllmError (one line, without the key) for a key no client can send: HTTP strips a header value's surrounding
    whitespace and forbids control characters, so a key read with its file's newline (`$FXLLM_API_KEY` from a
    secret) had the server refuse every request as a "wrong API key"."""
    if api_key != api_key.strip():
        flaw = "starts or ends with whitespace (a newline read from a file?)"
    elif any(ord(c) < 0x20 or ord(c) == 0x7f for c in api_key):
        flaw = "holds a control character"
    else:
        return
    raise FxllmError(f"the API key (--api-key or $FXLLM_API_KEY) {flaw}, which no HTTP header can carry: every "
                     "request would be refused as a wrong key")


class APIKeyGuard:
    def __init__(self, app: ASGIApp, api_key: str):
        self.app = app
        self.expected = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(PROTECTED_PREFIX):
            given = [value for key, value in scope["headers"] if key == b"authorization"]
            if len(given) != 1 or not self._accepts(given[0]):
                # two headers are refused, whichever holds the key: a proxy in front may check the other one
                reason = ("missing" if not given else "wrong" if len(given) == 1
                          else "ambiguous (two Authorization headers)")
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


class IdentityEncodingOnly:
    """415 for a request that declares a Content-Encoding other than `identity` (a gzip body would otherwise fail as
    "not UTF-8 text"). Refused rather than decompressed: a few KiB of gzip can inflate past the body size limit."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            declared = b", ".join(value for key, value in scope["headers"] if key == b"content-encoding")
            if any(token.strip().lower() not in (b"", b"identity") for token in declared.split(b",")):
                encoding = shown(declared.decode("latin-1"))
                error = APIError(415, f"Content-Encoding '{encoding}' is not supported; send the JSON body "
                                      "uncompressed", code="unsupported_content_encoding")
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyReadTimeout:
    """408 (with `Connection: close`, which frees the connection) when the app waits for body bytes more than
    `seconds` after the request began: a Content-Length that promises more than the client sends would otherwise
    hold the connection forever (uvicorn has no such timeout). Once the body is complete, `receive` is no longer
    timed: the routes then wait on it for the client's disconnect for as long as they generate."""

    def __init__(self, app: ASGIApp, seconds: float):
        self.app, self.seconds = app, seconds

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.seconds
        complete = False

        async def timed_receive() -> Message:
            nonlocal complete
            if complete:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), deadline - loop.time())
            except asyncio.TimeoutError:
                raise HTTPException(408, f"the request body did not arrive within {self.seconds:g} seconds",
                                    headers={"Connection": "close"}) from None
            complete = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        await self.app(scope, timed_receive, send)


class HeadAsGet:
    """HEAD answered as GET without the body: the same status and headers (Content-Length included), as load
    balancers' and Kubernetes' probes expect. The routes are declared for GET only, so that the OpenAPI schema has one
    operation each; the app is given a copy of the scope, so the server still knows the request was HEAD."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD":
            await self.app(scope, receive, send)
            return

        async def headers_only(message: Message) -> None:
            if message["type"] == "http.response.body":
                message = {**message, "body": b""}
            await send(message)

        await self.app({**scope, "method": "GET"}, receive, headers_only)


class TrailingSlashIgnored:
    """A path's trailing slashes are dropped before routing: `/v1/models/` is `/v1/models`. Starlette would answer a
    307 with an empty body (not an error JSON) and a Location built from the client's Host header, and a client that
    follows it with a POST may drop the body."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and len(path) > 1 and path.endswith("/"):
            scope = {**scope, "path": path.rstrip("/") or "/"}
            if "raw_path" in scope:
                scope["raw_path"] = scope["raw_path"].rstrip(b"/") or b"/"
        await self.app(scope, receive, send)


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


class OpenAICORS(CORSMiddleware):
    """Starlette's CORS middleware, whose refused preflight (an origin, method or header not allowed: Starlette's
    plain-text "Disallowed CORS origin") is a 400 with the OpenAI error body, its CORS headers kept."""

    def preflight_response(self, request_headers: Headers) -> Response:
        response = super().preflight_response(request_headers)
        if response.status_code == 200:
            return response
        refused = bytes(response.body).decode("utf-8", "replace")
        headers = {name: value for name, value in response.headers.items()
                   if name.lower() not in ("content-length", "content-type")}
        return APIError(response.status_code, f"{refused}: the server does not allow this cross-origin request "
                        "(--allowed-origins)").response(headers)
