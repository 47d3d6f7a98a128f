"""A client that starts a stream and then reads nothing, without closing the connection, is dropped once a chunk
could not be written for STALLED_SEND_SECONDS (its generation aborted, the connection closed); so is a client that
reads nothing of a large non-streamed response (`fxllm serve`'s protocol, connections.py). Before, what they had not
read stayed in the server's memory for as long as the connection stayed open. The app runs on a real uvicorn in this
process, on a socket with small buffers (accepted sockets inherit them), so that a few KiB fill them."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

import fxllm
from fxllm.serving import streaming
from fxllm.serving.connections import guarded_protocol
from tests.serving.conftest import app_on_uvicorn, wait_until

NAME = "tiny"
STALL_SECONDS = 1.0
# 8 choices × 200 tokens with 20 logprobs each: megabytes of chunks, far more than the buffers hold
STREAM = {"model": NAME, "prompt": "Hi", "max_tokens": 200, "n": 8, "logprobs": 20, "ignore_eos": True,
          "stream": True}


@pytest.fixture
def served(serve_artifact, monkeypatch, request):
    """(base URL, service) of the app on uvicorn in a thread, with STALLED_SEND_SECONDS = STALL_SECONDS; on
    uvicorn's own protocol, or (parametrized "guarded") on `fxllm serve`'s, whose writes stall after STALL_SECONDS."""
    guarded = getattr(request, "param", None) == "guarded"
    monkeypatch.setattr(streaming, "STALLED_SEND_SECONDS", STALL_SECONDS, raising=False)
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    engine = fxllm.load(serve_artifact, threads=1)
    protocol = guarded_protocol(30, stall_seconds=STALL_SECONDS) if guarded else "auto"
    with app_on_uvicorn(engine, NAME, listener, http=protocol) as service:
        host, port = listener.getsockname()
        yield f"http://{host}:{port}", service
    listener.close()


def post_without_reading(root: str, request: dict) -> socket.socket:
    """A connection with a small receive buffer that has sent `request` to /v1/completions and reads nothing yet."""
    body = json.dumps(request).encode()
    client = socket.socket()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    host, port = root.removeprefix("http://").rsplit(":", 1)
    client.connect((host, int(port)))
    client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: fxllm\r\nContent-Type: application/json\r\n"
                   b"Content-Length: %d\r\n\r\n" % len(body) + body)
    return client


def read_to_the_end(client: socket.socket) -> bytes:
    """What the buffers held, then the server's close (a reset, when it dropped unsent bytes)."""
    client.settimeout(30)
    received = b""
    try:
        while chunk := client.recv(1 << 20):
            received += chunk
    except ConnectionResetError:
        pass
    return received


def test_a_client_that_stops_reading_a_stream_is_dropped(served):
    root, service = served
    with post_without_reading(root, STREAM) as client:
        # reads nothing: the server's writes stall, and after STALL_SECONDS the stream is dropped
        assert wait_until(lambda: service.admitted == 0, timeout=60), service.admitted
        time.sleep(STALL_SECONDS + 1)
        received = read_to_the_end(client)
    assert received.startswith(b"HTTP/1.1 200"), received[:100]
    assert b"data: [DONE]" not in received, "the stream was written to the end: the client was not dropped"
    assert httpx.post(f"{root}/v1/completions", json={"model": NAME, "prompt": "Hi", "max_tokens": 2},
                      timeout=30).status_code == 200


@pytest.mark.parametrize("served", ["guarded"], indirect=True)
def test_a_client_that_reads_nothing_of_a_large_response_is_dropped(served):
    root, service = served
    with post_without_reading(root, {**STREAM, "stream": False}) as client:
        client.settimeout(60)
        client.recv(1, socket.MSG_PEEK)  # the response has begun (peeking frees no room in the buffers)
        time.sleep(STALL_SECONDS + 1)
        received = read_to_the_end(client)
    head, _, body = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length"))
    assert len(body) < length, "the whole response was kept for the client: it was not dropped"
    assert httpx.post(f"{root}/v1/completions", json={"model": NAME, "prompt": "Hi", "max_tokens": 2},
                      timeout=30).status_code == 200
