"""Reading HTTP/1.1 responses off a raw socket, for tests that must send what no client library sends (a short
body, a HEAD, a request on a connection a bug answered)."""

from __future__ import annotations

import socket


def read_head(sock: socket.socket, buffered: bytes = b"") -> tuple[int, dict[str, str], bytes]:
    """The status and headers (lower-case names) of the next response on `sock`, and the bytes read past them."""
    data = buffered
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"the server closed the connection before answering: {data!r}")
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {name.strip().lower(): value.strip() for name, _, value in (line.partition(":") for line in lines[1:])}
    return int(lines[0].split()[1]), headers, rest


def read_body(sock: socket.socket, headers: dict[str, str], rest: bytes) -> tuple[bytes, bytes]:
    """The body announced by `headers`' Content-Length, and the bytes read past it."""
    length = int(headers["content-length"])
    while len(rest) < length:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("the server closed the connection mid-answer")
        rest += chunk
    return rest[:length], rest[length:]
