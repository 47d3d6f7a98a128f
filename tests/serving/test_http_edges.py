"""HTTP edges a load balancer, a browser or a hostile client reaches, against a real `fxllm serve`: HEAD answered as
GET without the body, a compressed body refused with 415 naming its encoding, a body or a head that never arrives
answered 408 within --body-timeout (the connection freed), a head over the size limit 431, the server serving
normally after each; CORS for --allowed-origins only."""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import socket
import subprocess
import time

import httpx
import pytest

from fxllm.serving.app import create_app
from tests.serving.conftest import API_KEY, FXLLM, MODEL, ServerProcess, slow_steps_env
from tests.serving.raw_http import read_body, read_head

BODY_TIMEOUT = 2.0
ORIGINS = ("http://app.example", "https://b.example:8443")
AUTH = {"Authorization": f"Bearer {API_KEY}"}
OK = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
STEP_SECONDS = 0.02  # LONG's 200 model calls take 4 s: longer than BODY_TIMEOUT
LONG = {"model": MODEL, "prompt": "Hi", "max_tokens": 200, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def edge_server(serve_artifact, tmp_path_factory):
    """A server with a BODY_TIMEOUT of 2 s and CORS for ORIGINS, whose model calls take STEP_SECONDS at least."""
    directory = tmp_path_factory.mktemp("edges")
    process = ServerProcess(serve_artifact, "--served-model-name", MODEL, "--api-key", API_KEY, "--threads", "1",
                            "--body-timeout", str(BODY_TIMEOUT), "--allowed-origins", ", ".join(ORIGINS),
                            log=directory / "stderr.log", env=slow_steps_env(directory / "site", STEP_SECONDS))
    yield process
    assert process.terminate() == 0, process.log.read_text()


def connect(server: ServerProcess) -> socket.socket:
    host, port = server.root.removeprefix("http://").rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=30)


def error_of(body: bytes) -> dict:
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and "\n" not in error["message"], error
    return error


def test_the_access_log_logs_each_request_without_verbose(serve_artifact, tmp_path):
    """--access-log logged nothing unless -v raised uvicorn's log level too; its lines go to stdout, as uvicorn's."""
    import select

    server = ServerProcess(serve_artifact, "--threads", "1", "--access-log", log=tmp_path / "stderr.log")
    try:
        assert httpx.get(server.root + "/health?probe", timeout=30).status_code == 200
        ready, _, _ = select.select([server.proc.stdout], [], [], 10)
        line = server.proc.stdout.readline() if ready else ""
    finally:
        assert server.terminate() == 0, server.log.read_text()
    assert '"GET /health?probe HTTP/1.1" 200' in line, (line, server.log.read_text())


@pytest.mark.parametrize("path, headers", [("/health", {}), ("/metrics", {}), ("/v1/models", AUTH),
                                           (f"/v1/models/{MODEL}", AUTH)])
def test_head_is_answered_as_get_without_the_body(edge_server, path, headers):
    """HEAD (load balancers', Kubernetes' probes) gets the GET's status and headers, Content-Length included, and no
    body: on the same keep-alive connection the next response starts right after the HEAD's headers."""
    get = httpx.get(edge_server.root + path, headers=headers, timeout=30)
    sent = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
    with connect(edge_server) as sock:
        sock.sendall(f"HEAD {path} HTTP/1.1\r\nHost: fxllm\r\n{sent}\r\n".encode()
                     + b"GET /health HTTP/1.1\r\nHost: fxllm\r\n\r\n")
        status, head_headers, rest = read_head(sock)
        assert status == get.status_code == 200, status
        assert head_headers["content-type"] == get.headers["content-type"]
        if path != "/metrics":  # the metrics' text changes between two scrapes
            assert int(head_headers["content-length"]) == len(get.content)
        status, health_headers, rest = read_head(sock, rest)  # no body came in between
        assert status == 200 and json.loads(read_body(sock, health_headers, rest)[0]) == {"status": "ok"}


@pytest.mark.parametrize("encoding", ["gzip", "br", "identity, gzip", "GZIP"])
def test_a_compressed_body_is_415_naming_its_encoding(edge_server, encoding):
    """A body with a Content-Encoding other than identity is refused in one line (it had failed as "not UTF-8 text
    (byte 1)"); the server is not asked to inflate what could be a zip bomb."""
    body = gzip.compress(json.dumps(OK).encode())
    answer = httpx.post(f"{edge_server.url}/completions", content=body, timeout=30,
                        headers={**AUTH, "Content-Type": "application/json", "Content-Encoding": encoding})
    assert answer.status_code == 415, answer.text
    error = error_of(answer.content)
    assert error["message"] == f"Content-Encoding '{encoding}' is not supported; send the JSON body uncompressed"
    assert (error["type"], error["code"]) == ("invalid_request_error", "unsupported_content_encoding")
    plain = httpx.post(f"{edge_server.url}/completions", json=OK, timeout=60,
                       headers={**AUTH, "Content-Encoding": "identity"})
    assert plain.status_code == 200, plain.text


def test_a_body_that_never_arrives_is_408_and_frees_the_connection(edge_server):
    """Content-Length 1000 and 10 bytes sent: after --body-timeout the client gets the OpenAI 408 with `Connection:
    close` and the connection is closed (uvicorn alone would hold it forever). The timeout bounds the body's arrival
    only: afterwards a body sent in two parts within it is served, and requests that generate for longer than it once
    their body is in (the routes then wait on the connection for a disconnect) finish normally, streamed or not."""
    with connect(edge_server) as sock:
        start = time.monotonic()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: fxllm\r\nAuthorization: Bearer " + API_KEY.encode()
                     + b"\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"model\": ")
        status, headers, rest = read_head(sock)
        waited = time.monotonic() - start
        body, rest = read_body(sock, headers, rest)
        assert status == 408 and headers.get("connection") == "close", (status, headers, body)
        assert BODY_TIMEOUT * 0.9 <= waited < BODY_TIMEOUT + 10, waited
        error = error_of(body)
        assert error["message"] == f"the request body did not arrive within {BODY_TIMEOUT:g} seconds"
        assert error["code"] == "request_timeout"
        assert rest == b"" and sock.recv(1) == b""  # closed by the server
    payload = json.dumps(LONG).encode()
    with connect(edge_server) as sock:
        start = time.monotonic()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: fxllm\r\nAuthorization: Bearer " + API_KEY.encode()
                     + b"\r\nContent-Type: application/json\r\nContent-Length: " + str(len(payload)).encode()
                     + b"\r\n\r\n" + payload[:5])
        time.sleep(BODY_TIMEOUT / 4)
        sock.sendall(payload[5:])
        status, headers, rest = read_head(sock)
        body = json.loads(read_body(sock, headers, rest)[0])
    assert status == 200 and body["choices"][0]["finish_reason"] == "length", body
    assert time.monotonic() - start > BODY_TIMEOUT
    with httpx.stream("POST", f"{edge_server.url}/completions", json={**LONG, "stream": True}, headers=AUTH,
                      timeout=60) as streamed:
        events = [line for line in streamed.iter_lines() if line]
    assert events[-1] == "data: [DONE]" and '"finish_reason":"length"' in events[-2], events[-3:]


def refused(sock: socket.socket) -> tuple[int, dict[str, str], dict, float]:
    """The answer to a request the server refuses before reading it (status, headers, error, seconds it took), once
    the server has closed the connection after it."""
    start = time.monotonic()
    status, headers, rest = read_head(sock)
    waited = time.monotonic() - start
    body, rest = read_body(sock, headers, rest)
    assert headers.get("connection") == "close" and rest == b"" and sock.recv(1) == b"", (headers, rest)
    return status, headers, error_of(body), waited


@pytest.mark.parametrize("trickle", [False, True])
def test_a_head_that_never_completes_is_408_and_frees_the_connection(edge_server, trickle):
    """A client that connects and sends nothing, or trickles a header line every BODY_TIMEOUT / 4 (slowloris), held
    its connection forever (uvicorn bounds only the idle time after a response): enough of them exhaust the
    server's connections. The head now gets --body-timeout too: then the OpenAI 408 and the connection is closed."""
    with connect(edge_server) as sock:
        start = time.monotonic()
        if trickle:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: fxllm\r\n")
            for i in range(3):
                time.sleep(BODY_TIMEOUT / 4)
                sock.sendall(b"X-Trickle-%d: 1\r\n" % i)
        status, _, error, _ = refused(sock)
        waited = time.monotonic() - start
    assert status == 408 and error["code"] == "request_timeout", error
    assert error["message"] == f"the request's headers did not arrive within {BODY_TIMEOUT:g} seconds"
    assert BODY_TIMEOUT * 0.9 <= waited < BODY_TIMEOUT + 10, waited
    assert httpx.get(f"{edge_server.root}/health", timeout=10).status_code == 200


def test_a_head_over_the_limit_is_431(edge_server):
    """Request headers of 1 MiB (any size was read into memory: 100 MB were accepted) are refused past MAX_HEAD_BYTES
    with the OpenAI 431, which the client gets to read although it is still sending (the rest is dropped); a head
    just under the limit is served."""
    from fxllm.serving.connections import MAX_HEAD_BYTES

    with connect(edge_server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: fxllm\r\nX-Big: ")
        try:
            for _ in range(16):
                sock.sendall(b"a" * 65536)
        except OSError:  # the server may close before all of it is sent; its answer is still there to read
            pass
        status, _, error, _ = refused(sock)
    assert status == 431 and error["code"] == "request_header_too_large", error
    assert error["message"] == (f"the request's line and headers are larger than the server's limit of "
                                f"{MAX_HEAD_BYTES:,} bytes")
    near = httpx.get(f"{edge_server.root}/health", headers={"X-Big": "a" * (MAX_HEAD_BYTES - 1024)}, timeout=10)
    assert near.status_code == 200, near.text


@pytest.mark.parametrize("request_bytes", [
    b"GARBAGE\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: fxllm\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: fxllm\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}",
    b"GET /health HTTP/1.1\r\nHost: fxllm\r\nBad Header\r\n\r\n",
])
def test_bytes_that_are_not_http_are_an_openai_400(edge_server, request_bytes):
    """uvicorn answered these (a smuggling attempt among them) with a plain-text "Invalid HTTP request received.";
    now the OpenAI error body, the connection closed, and the server serves on."""
    with connect(edge_server) as sock:
        sock.sendall(request_bytes)
        status, headers, error, _ = refused(sock)
    assert status == 400 and headers["content-type"] == "application/json", headers
    assert error["message"].startswith("the request is not valid HTTP/1.1"), error
    assert httpx.get(f"{edge_server.root}/health", timeout=10).status_code == 200


@pytest.mark.parametrize("path, status", [("/v1/chat/completions", 405), ("/health", 200), ("/nowhere", 404)])
def test_a_websocket_upgrade_is_answered_as_a_plain_request(edge_server, path, status):
    """With the `websockets` package installed, uvicorn accepted the upgrade and refused it itself, on every path:
    a bare text/plain 403. The server speaks no WebSocket; the request is answered as the plain GET it also is,
    without a warning in the log."""
    import importlib.util

    if not any(importlib.util.find_spec(library) for library in ("websockets", "wsproto")):
        pytest.skip("uvicorn takes a WebSocket upgrade only with `websockets` or `wsproto` installed")
    with connect(edge_server) as sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: fxllm\r\nAuthorization: Bearer {API_KEY}\r\n"
                     "Connection: Upgrade\r\nUpgrade: websocket\r\n"
                     "Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n".encode())
        answer, headers, rest = read_head(sock)
        body, _ = read_body(sock, headers, rest)
    assert answer == status and headers["content-type"] == "application/json", (answer, headers)
    if status != 200:
        error_of(body)
    assert "upgrade" not in edge_server.log.read_text().lower()


@pytest.mark.parametrize("body", [b"ZZ\r\n", b'5\r\n{"mod\r\nZZ\r\n', b"3\r\nabcdef\r\n"])
def test_a_malformed_chunked_body_is_an_openai_400_at_once(edge_server, body):
    """A chunk size that is not hex, or a chunk longer than its size, after a valid head: the request waited for the
    rest of its body until --body-timeout and was answered 408; now the 400 for bytes that are not HTTP, at once."""
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: fxllm\r\nAuthorization: Bearer " + API_KEY.encode()
            + b"\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
    with connect(edge_server) as sock:
        sock.sendall(head + body)
        status, headers, error, waited = refused(sock)
    assert status == 400 and error["message"].startswith("the request is not valid HTTP/1.1"), error
    assert waited < BODY_TIMEOUT / 2, waited
    assert httpx.post(f"{edge_server.root}/v1/completions", json=OK, headers=AUTH, timeout=30).status_code == 200


def test_a_keep_alive_connection_outlives_the_head_deadline(edge_server):
    """The head deadline runs only while a head is awaited: a request generating for longer than --body-timeout,
    then another on the same connection, are both served."""
    payload = json.dumps(LONG).encode()
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: fxllm\r\nAuthorization: Bearer " + API_KEY.encode()
               + b"\r\nContent-Type: application/json\r\nContent-Length: " + str(len(payload)).encode() + b"\r\n\r\n"
               + payload)
    with connect(edge_server) as sock:
        start = time.monotonic()
        sock.sendall(request)
        status, headers, rest = read_head(sock)
        body, rest = read_body(sock, headers, rest)
        assert status == 200 and time.monotonic() - start > BODY_TIMEOUT, body
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: fxllm\r\n\r\n")
        status, headers, rest = read_head(sock, rest)
        assert status == 200 and read_body(sock, headers, rest)[0] == b'{"status":"ok"}'


def test_cors_answers_the_allowed_origins_only(edge_server):
    """A browser's preflight from an allowed origin (no API key: browsers send none) is allowed with the headers it
    asks for, and the answers to it, errors included, carry its origin; another origin gets no CORS header (its
    preflight an OpenAI error body), and an app made without `allowed_origins` sends none at all (as before the
    option)."""
    preflight = {"Origin": ORIGINS[1], "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type,x-stainless-os"}
    allowed = httpx.options(f"{edge_server.url}/chat/completions", headers=preflight, timeout=30)
    assert allowed.status_code == 200, allowed.text
    assert allowed.headers["access-control-allow-origin"] == ORIGINS[1]
    assert "POST" in allowed.headers["access-control-allow-methods"]
    assert allowed.headers["access-control-allow-headers"] == "authorization,content-type,x-stainless-os"
    answer = httpx.post(f"{edge_server.url}/completions", json=OK, headers={**AUTH, "Origin": ORIGINS[0]}, timeout=60)
    assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == ORIGINS[0]
    refused = httpx.get(f"{edge_server.url}/models", headers={"Origin": ORIGINS[0]}, timeout=30)
    assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == ORIGINS[0]
    other = httpx.get(f"{edge_server.root}/health", headers={"Origin": "http://evil.example"}, timeout=30)
    assert other.status_code == 200 and "access-control-allow-origin" not in other.headers
    disallowed = httpx.options(f"{edge_server.url}/chat/completions", timeout=30,
                               headers={**preflight, "Origin": "http://evil.example"})
    assert disallowed.status_code == 400 and "access-control-allow-origin" not in disallowed.headers
    assert disallowed.json()["error"]["message"].startswith("Disallowed CORS origin: "), disallowed.text

    async def default_app() -> httpx.Response:
        transport = httpx.ASGITransport(app=create_app(lambda: None))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.options("/v1/chat/completions", headers=preflight)

    default = asyncio.run(default_app())
    assert default.status_code == 405 and not any(name.startswith("access-control-") for name in default.headers)


@pytest.mark.parametrize("options, message", [
    (["--body-timeout", "0"], "--body-timeout must be a number of seconds > 0, got 0.0"),
    (["--body-timeout", "nan"], "--body-timeout must be a number of seconds > 0, got nan"),
    (["--body-timeout", "5", "--ray"], "--body-timeout only applies without --ray"),
    (["--allowed-origins", "http://localhost:3000/"], "--allowed-origins: 'http://localhost:3000/' is not an origin"),
    (["--allowed-origins", " , "], "--allowed-origins is empty"),
    (["--allowed-origins", "*", "--ray"], "--allowed-origins only applies without --ray"),
])
def test_a_bad_option_is_one_line(serve_artifact, options, message):
    done = subprocess.run([FXLLM, "serve", str(serve_artifact), "--port", "0", *options], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "FXLLM_API_KEY": ""})
    assert done.returncode == 1 and message in done.stderr and len(done.stderr.strip().splitlines()) == 1, done
