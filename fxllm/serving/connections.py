"""uvicorn's HTTP/1.1 protocol, guarded: a deadline and a size limit on each request's head (request line and
headers), a limit on how long a write may stall, and the OpenAI error body for bytes that are not HTTP.

uvicorn bounds the idle time between requests (its keep-alive timeout) and the app bounds the body
(middleware.BodyReadTimeout), but nothing bounds the head: a client that connects and sends nothing, or trickles a
header line every few seconds (slowloris), held its connection forever, and with httptools a head of any size was
read into memory (100 MB of headers were accepted). Enough such connections exhaust the server's file descriptors
or memory. Here a head must be complete `seconds` after the connection opened or its first byte arrived (408, the
connection closed), and hold at most `max_bytes` (431, closed; with httptools the bytes are counted over the reads
that leave the head incomplete, so a head may hold `max_bytes` plus one read); both answers are the OpenAI error
body, as is the 400 for bytes that are not HTTP/1.1 (uvicorn's own is plain text).

Writes are bounded too: a connection whose client reads nothing while the server has more than the transport's
high-water mark to send (its buffers full) for `stall_seconds` is aborted. A non-streamed response is written into
the transport at once, so a client that never read a large one (n choices with logprobs) held it in the server's
memory for as long as it kept the connection open. (Streams are also dropped by streaming.EventStream, which aborts
their generation, and which the Ray Serve ingress has too.)

    uvicorn.Config(app, http=guarded_protocol(seconds=30, max_bytes=MAX_HEAD_BYTES))
"""

from __future__ import annotations

import asyncio
import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from fxllm.serving.errors import APIError

MAX_HEAD_BYTES = 64 * 1024  # nginx's default allows 4 header buffers of 8 KiB; h11's own limit is 16 KiB
LINGER_SECONDS = 2.0  # how long a refused connection stays open for the client to read the answer


def guarded_protocol(seconds: float, max_bytes: int = MAX_HEAD_BYTES,
                     stall_seconds: float | None = None) -> type[asyncio.Protocol]:
    """The protocol class uvicorn would pick itself (httptools if installed, else h11), guarded as the module says
    (`stall_seconds`: streaming.STALLED_SEND_SECONDS unless given)."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    from fxllm.serving.streaming import STALLED_SEND_SECONDS

    base = _GuardedH11 if issubclass(AutoHTTPProtocol, H11Protocol) else _guarded_httptools()
    stall = STALLED_SEND_SECONDS if stall_seconds is None else stall_seconds
    return type(base.__name__, (base,), {"head_seconds": seconds, "max_head_bytes": max_bytes,
                                         "stall_seconds": stall})


class _ConnectionGuard:
    """The guards, for either of uvicorn's protocols (they use its internals: `cycle`, `send_400_response`, the
    parser's state; checked with uvicorn 0.55, h11 and httptools). The head's deadline is armed when a head is
    awaited (the connection is new, or a head's first byte came) and no deadline runs, and cleared once no head is
    pending (`_head_pending()` says which); the stall timer runs while the transport has paused writing."""

    head_seconds: float
    max_head_bytes: int
    stall_seconds: float
    _head_timer: asyncio.TimerHandle | None = None
    _stall_timer: asyncio.TimerHandle | None = None
    _refused = False  # answered 408 or 431: what else the client sends is dropped until the connection closes

    def _unsupported_upgrade_warning(self) -> None:
        """Say nothing: the server speaks no upgrade (uvicorn runs with ws="none") and answers a request asking
        for one as the plain request it also is. uvicorn logged two warnings for each, the second advising to
        install a WebSocket library, and any client could fill the log with them."""

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm_head_deadline()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        super().data_received(data)
        if self.transport.is_closing():
            self._clear_head_deadline()
        elif self._head_pending():
            self._arm_head_deadline()
        else:
            self._clear_head_deadline()

    def connection_lost(self, exc) -> None:
        self._clear_head_deadline()
        self._clear_stall_timer()
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._stall_timer is None:
            self._stall_timer = self.loop.call_later(self.stall_seconds, self._stalled)

    def resume_writing(self) -> None:
        self._clear_stall_timer()
        super().resume_writing()

    def _clear_stall_timer(self) -> None:
        self._stall_timer = _cancelled(self._stall_timer)

    def _stalled(self) -> None:
        """The client read nothing for stall_seconds while the buffers were full: drop what is left unsent."""
        self._stall_timer = None
        self.transport.abort()

    def _head_pending(self) -> bool:
        raise NotImplementedError

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to bytes its parser refuses, in plain text: the OpenAI error instead."""
        self._clear_head_deadline()
        self._refuse(APIError(400, "the request is not valid HTTP/1.1 (a malformed request line or header, or a "
                                   "body length given twice: Content-Length with Transfer-Encoding, or two "
                                   "Content-Lengths)"))

    def _arm_head_deadline(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.head_seconds, self._head_too_late)

    def _clear_head_deadline(self) -> None:
        self._head_timer = _cancelled(self._head_timer)

    def _head_too_late(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or not self._head_pending():
            return
        self._refuse(APIError(408, f"the request's headers did not arrive within {self.head_seconds:g} seconds",
                              code="request_timeout"))

    def _refuse(self, error: APIError) -> None:
        """Answer `error` and close. Bytes that break the body of the request being read (a chunk size that is not
        hex, a chunk longer than its size) are answered at once, the request's app told its client has gone (it
        waited for the rest of the body until --body-timeout, then answered 408). While an earlier (pipelined)
        request's response is being written, or this one's has started, nothing can be answered: the connection
        closes once that response is done."""
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            if cycle.response_started or not cycle.more_body or getattr(self, "pipeline", None):
                cycle.keep_alive = False
                return
            cycle.disconnected = True  # its app's receive() answers http.disconnect, its send() writes nothing
            cycle.message_event.set()
        self._refused = True
        self.transport.write(raw_response(error))
        # Closed at once, a socket with unread bytes (the rest of a 1 MB head) is reset, and the reset can discard
        # the answer before the client reads it: end the answer with a FIN, drop the input, and close a bit later.
        try:
            if self.transport.can_write_eof():
                self.transport.write_eof()
        except OSError:  # the client has gone already
            self.transport.close()
            return
        self.loop.call_later(LINGER_SECONDS, self.transport.close)


def _cancelled(timer: asyncio.TimerHandle | None) -> None:
    """Cancel `timer` if it runs; None, for the attribute that held it."""
    if timer is not None:
        timer.cancel()


def raw_response(error: APIError) -> bytes:
    """`error` as a whole HTTP/1.1 response that closes the connection (written before any request is parsed)."""
    body = json.dumps(error.body(), separators=(",", ":")).encode()
    head = (f"HTTP/1.1 {error.status} {_REASONS[error.status]}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n")
    return head.encode("latin-1") + body


_REASONS = {400: "Bad Request", 408: "Request Timeout", 431: "Request Header Fields Too Large"}


def _too_large(max_bytes: int) -> APIError:
    return APIError(431, f"the request's line and headers are larger than the server's limit of {max_bytes:,} "
                         "bytes", code="request_header_too_large")


class _GuardedH11(_ConnectionGuard, H11Protocol):
    """h11 limits the head's size itself (a 400); a head is pending while h11 waits for a request (IDLE)."""

    def _head_pending(self) -> bool:
        return self.conn.their_state is h11.IDLE


def _guarded_httptools() -> type:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class _GuardedHttpTools(_ConnectionGuard, HttpToolsProtocol):
        """A head is pending from the connection (or a message's first byte) until its headers are complete; the
        bytes received meanwhile are counted (whole reads: a read that completes a head is not)."""

        _in_head = True  # a new connection awaits its first head
        _head_bytes = 0

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._in_head, self._head_bytes = True, 0

        def on_headers_complete(self) -> None:
            self._in_head = False
            super().on_headers_complete()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._in_head and not self._refused and not self.transport.is_closing():
                self._head_bytes += len(data)
                if self._head_bytes > self.max_head_bytes:
                    self._clear_head_deadline()
                    self._refuse(_too_large(self.max_head_bytes))
                    if not self.transport.is_closing():  # behind a pipelined response: read no more of it
                        self.flow.pause_reading()

        def _head_pending(self) -> bool:
            return self._in_head

    return _GuardedHttpTools
