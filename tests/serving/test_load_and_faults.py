"""The server under load and faults: clients that disconnect mid-stream (their requests are aborted and their KV
blocks freed, the others complete correctly, memory stays flat over rounds), a full queue (429), SIGTERM (stop
accepting, drain running requests within the timeout, exit 0), and a bug in a route (a one-line 500 on a connection
that keeps serving)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import statistics
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.conftest import PROMPTS
from tests.serving.conftest import API_KEY, MODEL, SHARED_SERVER_OPTIONS, ServerProcess, slow_steps_env, wait_until
from tests.serving.raw_http import read_body, read_head

STREAMS, CLOSED = 40, 10  # per round; every 4th stream is closed by its client after 3 chunks
ROUND_PROMPTS = [(prompt + " ") * (1 + i % 3) + str(i) for i, prompt in enumerate(PROMPTS * 10)]  # 5-55 tokens
# The streams that get closed ask for many tokens, so that the server is still generating them when their client
# closes them; the others for fewer, to keep the client's work small.
MAX_TOKENS = [200 if i % 4 == 3 else 48 for i in range(STREAMS)]
WARM_UP_ROUNDS, ROUNDS = 2, 5
# The median growth of a measured round, under half of what the smallest leak this test must catch would add every
# round (70 KB per aborted request, CLOSED a round): a median, since an allocator can step once by a few MiB (an arena,
# a thread's stack: +3.1 MiB in one round of a CI-like run, flat after), which is no leak.
RSS_GROWTH_PER_ROUND = 350 << 10


async def streams(url: str, indices: list[int]) -> list[tuple[str, str] | None]:
    """Concurrent completion streams; those with i % 4 == 3 are closed after 3 chunks (None), the others read to
    the end: (text, finish_reason)."""
    async with openai.AsyncOpenAI(base_url=url, api_key=API_KEY, max_retries=0, timeout=120) as client:
        async def stream(i: int):
            response = await client.completions.create(model=MODEL, prompt=ROUND_PROMPTS[i],
                                                       max_tokens=MAX_TOKENS[i], temperature=0, stream=True)
            text, finish, chunks = [], None, 0
            async for chunk in response:
                chunks += 1
                text.append(chunk.choices[0].text)
                finish = chunk.choices[0].finish_reason
                if i % 4 == 3 and chunks == 3:
                    await response.close()
                    return None
            return "".join(text), finish

        return await asyncio.gather(*[stream(i) for i in indices])


def one_round(url: str) -> list[tuple[str, str] | None]:
    """The 40 streams at once: the 10 to be closed run on a thread and event loop of their own, so that parsing the
    other 30 streams cannot delay their close until after the server has finished them."""
    closing = [i for i in range(STREAMS) if i % 4 == 3]
    with ThreadPoolExecutor(1) as pool:
        closed = pool.submit(asyncio.run, streams(url, closing))
        results = dict(zip([i for i in range(STREAMS) if i % 4 != 3],
                           asyncio.run(streams(url, [i for i in range(STREAMS) if i % 4 != 3]))))
        results.update(zip(closing, closed.result()))
    return [results[i] for i in range(STREAMS)]


def idle(server) -> bool:
    m = server.metrics()
    return all(m[name] == 0 for name in ("fxllm_kv_blocks_used", "fxllm_num_requests_running",
                                         "fxllm_num_requests_waiting", "fxllm_num_requests_admitted"))


@pytest.fixture(scope="module")
def slow_server(serve_artifact, tmp_path_factory):
    """A server whose model calls take 15 ms (slow_steps_env): a 200-token request runs for 3 s, so the disconnect
    tests close their client while it surely still generates."""
    directory = tmp_path_factory.mktemp("slow")
    process = ServerProcess(serve_artifact, "--served-model-name", MODEL, "--api-key", API_KEY, "--threads", "1",
                            log=directory / "stderr.log", env=slow_steps_env(directory / "site"))
    yield process
    assert process.terminate() == 0, process.log.read_text()


@pytest.fixture(scope="module")
def load_server(serve_artifact, tmp_path_factory):
    """The shared server's settings (16 requests decoded at once plus 48 queued, a 2 MB KV pool) with model calls of
    15 ms (slow_steps_env): a stream to be closed (200 tokens) then runs for 3 s, so its client closes it while it
    surely still generates even when the machine starves the client (CI's 2 cores beside other work; at full speed
    the tiny model finished all 10 before a starved client closed them, and no abort was counted)."""
    directory = tmp_path_factory.mktemp("load")
    process = ServerProcess(serve_artifact, *SHARED_SERVER_OPTIONS, log=directory / "stderr.log",
                            env=slow_steps_env(directory / "site"))
    yield process
    assert process.terminate() == 0, process.log.read_text()


def test_one_disconnect_frees_its_blocks_at_once(slow_server):
    """A lone stream closed after 3 chunks: its KV blocks are free (and its abort counted) well before it could
    have generated its 200 tokens."""
    assert wait_until(lambda: idle(slow_server))
    aborts = slow_server.metrics().get("fxllm_requests_total{finish_reason=abort}", 0)
    with httpx.Client(base_url=slow_server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as client:
        body = {"model": MODEL, "prompt": PROMPTS[3], "max_tokens": 200, "temperature": 0, "stream": True}
        with client.stream("POST", "/completions", json=body) as response:
            events = (line for line in response.iter_lines() if line)
            assert [next(events) for _ in range(3)]
            assert slow_server.metrics()["fxllm_kv_blocks_used"] > 0
        closed = time.monotonic()
    assert wait_until(lambda: idle(slow_server), timeout=5)
    freed = time.monotonic() - closed
    assert slow_server.metrics()["fxllm_requests_total{finish_reason=abort}"] - aborts == 1
    print(f"blocks free {freed * 1e3:.0f} ms after the client closed its stream")


def test_disconnects_abort_and_free_everything(load_server, engine):
    """Per round: the 10 closed streams are aborted (the server counts 10 aborts), the 30 others equal the
    in-process engine's greedy text, and afterwards no KV block, engine request or admission is left.

    Memory: after two warm-up rounds (they touch the whole 2 MB KV pool and settle the allocators; RSS grew ~1.7 MiB
    over the first five rounds of a 10-round trial, then < 50 KiB per round), the median growth of the five measured
    rounds is under RSS_GROWTH_PER_ROUND. A leak of 70 KB per aborted request (10 per round) would cross that in every
    round."""
    expected = [(r.text, "length" if r.finish_reason in ("length", "context") else "stop")
                for r in engine.generate(ROUND_PROMPTS, max_new_tokens=48)]
    rss = []
    for round_index in range(WARM_UP_ROUNDS + ROUNDS):
        aborts = load_server.metrics().get("fxllm_requests_total{finish_reason=abort}", 0)
        results = one_round(load_server.url)
        start = time.monotonic()
        assert wait_until(lambda: idle(load_server), timeout=10), load_server.metrics()
        freed_after = time.monotonic() - start
        assert sum(r is None for r in results) == CLOSED
        for i, result in enumerate(results):
            if result is not None:
                assert result == expected[i], i
        assert load_server.metrics()["fxllm_requests_total{finish_reason=abort}"] - aborts == CLOSED
        rss.append(load_server.rss_bytes())
        print(f"round {round_index}: idle {freed_after * 1e3:.0f} ms after the last stream, RSS {rss[-1] >> 10} KiB")
    growth = [later - earlier for earlier, later in zip(rss[WARM_UP_ROUNDS - 1:], rss[WARM_UP_ROUNDS:])]
    assert statistics.median(growth) < RSS_GROWTH_PER_ROUND, [r >> 10 for r in rss]


def test_non_streamed_disconnect_aborts(slow_server):
    """A non-streamed request whose client goes away while it generates is aborted (counted as an abort, not
    finished) and its KV blocks are freed at once."""
    assert wait_until(lambda: idle(slow_server))
    before = slow_server.metrics()
    host, port = slow_server.root.removeprefix("http://").split(":")
    body = json.dumps({"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 200, "temperature": 0}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {API_KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(head + body)
        assert wait_until(lambda: slow_server.metrics()["fxllm_kv_blocks_used"] > 0, timeout=10)
    closed = time.monotonic()
    assert wait_until(lambda: idle(slow_server), timeout=5)
    freed = time.monotonic() - closed
    after = slow_server.metrics()
    abort, length = "fxllm_requests_total{finish_reason=abort}", "fxllm_requests_total{finish_reason=length}"
    assert after.get(abort, 0) - before.get(abort, 0) == 1
    assert after.get(length, 0) == before.get(length, 0)
    print(f"blocks free {freed * 1e3:.0f} ms after the client of a non-streamed request closed its connection")


@pytest.fixture(scope="module")
def small_server(serve_artifact, tmp_path_factory):
    """One request decoded at a time and one queued: the third at once gets 429. Its model calls take 15 ms
    (slow_steps_env): a 200-token request runs for 3 s, well past the tests' client round trips."""
    directory = tmp_path_factory.mktemp("small")
    process = ServerProcess(serve_artifact, "--served-model-name", MODEL, "--api-key", API_KEY, "--max-batch", "1",
                            "--max-queue", "1", "--threads", "1", log=directory / "stderr.log",
                            env=slow_steps_env(directory / "site"))
    yield process
    process.terminate()


def open_chat_stream(client: httpx.Client, max_tokens: int, model: str = MODEL):
    """A streamed chat request; returns (response, line iterator) once its first chunk (the role) has arrived,
    which the server sends as soon as it has admitted the request."""
    body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True}
    response = client.send(client.build_request("POST", "/chat/completions", json=body), stream=True)
    assert response.status_code == 200, response.read()
    lines = response.iter_lines()
    assert '"role":"assistant"' in next(line for line in lines if line)
    return response, lines


def rest_of(lines) -> list[str]:
    return [line for line in lines if line]


def test_full_queue_answers_429(small_server):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    openai_client = openai.OpenAI(base_url=small_server.url, api_key=API_KEY, max_retries=0)
    with httpx.Client(base_url=small_server.url, headers=headers, timeout=60) as client:
        running, queued = open_chat_stream(client, 200), open_chat_stream(client, 200)
        refused = client.post("/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
        with pytest.raises(openai.RateLimitError):
            openai_client.completions.create(model=MODEL, prompt="x", max_tokens=2)
        for _, lines in (running, queued):
            assert rest_of(lines)[-1] == "data: [DONE]"
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["type"] == "rate_limit_error"
        assert client.post("/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2}).status_code == 200


def refused_connection(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return False
    except OSError:
        return True


def test_sigterm_stops_accepting_drains_and_exits_0(small_server):
    """SIGTERM while one stream runs and one waits: new connections are refused at once, both streams still
    complete (200 tokens, [DONE]), then the process exits 0."""
    port = int(small_server.url.rsplit(":", 1)[1].split("/")[0])
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=small_server.url, headers=headers, timeout=60) as client:
        streams = [open_chat_stream(client, 200), open_chat_stream(client, 200)]
        small_server.proc.send_signal(signal.SIGTERM)
        assert wait_until(lambda: refused_connection(port), timeout=5)
        assert small_server.proc.poll() is None  # still draining
        for _, lines in streams:
            events = rest_of(lines)
            assert events[-1] == "data: [DONE]" and '"finish_reason":"length"' in events[-2]
    assert small_server.proc.wait(30) == 0


def test_sigterm_turns_new_requests_away_while_draining(serve_artifact, tmp_path):
    """From the SIGTERM on, the server is shutting down: a request that was still arriving on an open connection (its
    headers parsed before the signal, its body sent after) gets 503 with the OpenAI error body, while the stream
    that was running still completes; then exit 0. (uvicorn closes the listening socket at once, so a request that
    arrives later cannot even connect.)"""
    with one_at_a_time_server(serve_artifact, tmp_path) as process:
        turned_away_while_draining(process)


@contextlib.contextmanager
def one_at_a_time_server(serve_artifact, tmp_path, *options: str) -> Iterator[ServerProcess]:
    """`fxllm serve --max-batch 1` whose model calls take 15 ms (slow_steps_env); killed on the way out, so that a
    failing test leaves no server behind (a no-op once it exited)."""
    process = ServerProcess(serve_artifact, "--max-batch", "1", *options, log=tmp_path / "stderr.log",
                            env=slow_steps_env(tmp_path / "site"))
    try:
        yield process
    finally:
        process.proc.kill()


def turned_away_while_draining(process: ServerProcess) -> None:
    host, port = process.root.removeprefix("http://").split(":")
    body = json.dumps({"model": "artifact", "prompt": "x", "max_tokens": 2}).encode()
    late = socket.create_connection((host, int(port)))
    late.sendall((f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {len(body)}\r\n\r\n").encode())
    with httpx.Client(base_url=process.url, timeout=60) as client:
        running = open_chat_stream(client, 200, model="artifact")
        time.sleep(0.2)  # the connections above are accepted and their headers parsed
        process.proc.send_signal(signal.SIGTERM)
        assert wait_until(lambda: refused_connection(int(port)), timeout=5)
        late.sendall(body)
        status, error = read_response(late)
        events = rest_of(running[1])
    assert events[-1] == "data: [DONE]" and '"finish_reason":"length"' in events[-2]
    assert status == 503 and error["error"]["type"] == "service_unavailable", (status, error)
    assert "shutting down" in error["error"]["message"]
    assert process.proc.wait(30) == 0


def read_response(sock: socket.socket) -> tuple[int, dict]:
    """One HTTP/1.1 response with a Content-Length: (status, JSON body); the socket is closed."""
    status, headers, rest = read_head(sock)
    body, _ = read_body(sock, headers, rest)
    sock.close()
    return status, json.loads(body)


def test_drain_timeout_bounds_the_shutdown(serve_artifact, tmp_path):
    """With --drain-timeout 0, SIGTERM aborts at once a running stream (an OpenAI error event, then [DONE]) and a
    queued non-streamed request (503 with the error body, not uvicorn's plain-text 500), and the process exits 0."""
    with one_at_a_time_server(serve_artifact, tmp_path, "--drain-timeout", "0") as process:
        running_requests_answered_at_shutdown(process)


def running_requests_answered_at_shutdown(process: ServerProcess, signals: tuple[int, ...] = (signal.SIGTERM,),
                                          exit_code: int = 0) -> None:
    """A running stream and a queued non-streamed request, then `signals` (each after the listener closed): both
    get the OpenAI error (an error event and [DONE]; 503 with the body) and the process exits within 10 s."""
    port = int(process.root.rsplit(":", 1)[1])
    body = {"model": "artifact", "prompt": "Hi", "max_tokens": 240, "temperature": 0, "ignore_eos": True}
    with httpx.Client(base_url=process.url, timeout=60) as client, ThreadPoolExecutor(1) as pool:
        with client.stream("POST", "/completions", json={**body, "stream": True}) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line).startswith("data: {")
            queued = pool.submit(httpx.post, f"{process.url}/completions", json=body, timeout=60)
            assert wait_until(lambda: process.metrics()["fxllm_num_requests_waiting"] == 1)
            start = time.monotonic()
            for index, signum in enumerate(signals):
                if index:
                    assert wait_until(lambda: refused_connection(port), timeout=5)
                    start = time.monotonic()
                process.proc.send_signal(signum)
            events = rest_of(lines)
        answer = queued.result()
    assert events[-1] == "data: [DONE]" and "shutting down" in json.loads(events[-2].removeprefix("data: "))["error"][
        "message"], events[-3:]
    assert answer.status_code == 503 and "shutting down" in answer.json()["error"]["message"], answer.text
    assert process.proc.wait(30) == exit_code
    assert time.monotonic() - start < 10


@pytest.mark.parametrize("first", [signal.SIGINT, signal.SIGTERM])
def test_a_second_ctrl_c_aborts_the_running_requests_at_once(serve_artifact, tmp_path, first):
    """A second Ctrl-C during the drain was uvicorn's force exit: it cancelled the handlers, so the log held an
    'Exception in ASGI application' traceback per request, a queued non-streamed client got a plain-text 500 and a
    running stream was cut without an error event. Now it aborts the running requests at once: the OpenAI error
    (503, an error event and [DONE]), no traceback, exit 130 within seconds (the drain would take 30), after a
    SIGTERM's drain too."""
    with one_at_a_time_server(serve_artifact, tmp_path) as process:
        running_requests_answered_at_shutdown(process, (first, signal.SIGINT), exit_code=130)
    log = (tmp_path / "stderr.log").read_text()
    assert "Traceback" not in log and "Ctrl-C again: aborting the running requests now" in log, log[-2000:]


# Installed as `sitecustomize` of a server process: the model card raises, a bug in the server's own code.
BUGGY_CARD = '''
from fxllm.serving.service import OpenAIService


async def card(self, name):
    raise RuntimeError("injected bug")


OpenAIService.card = card
'''


def next_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 response with a Content-Length from `sock`, which stays open (unlike read_response): status,
    headers (lower-case names), body; status 0 when the server closed the connection instead."""
    try:
        status, headers, rest = read_head(sock)
    except ConnectionError:
        return 0, {}, b""
    return status, headers, read_body(sock, headers, rest)[0]


def test_a_bug_is_one_line_500_and_the_connection_keeps_serving(serve_artifact, tmp_path):
    """A bug in a route (the model card raises) is the one-line OpenAI 500, logged once, and the keep-alive connection
    it came on serves the client's next request (Starlette's outermost middleware would answer the same 500 but
    re-raise the exception to uvicorn, which then closes the connection without `Connection: close`)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BUGGY_CARD)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
           "FXLLM_API_KEY": ""}
    server = ServerProcess(serve_artifact, "--threads", "1", log=tmp_path / "stderr.log", env=env)
    try:
        host, port = server.root.removeprefix("http://").rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=30) as sock:
            sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: fxllm\r\n\r\n")
            status, headers, body = next_response(sock)
            assert status == 500 and headers.get("connection") != "close", (status, headers, body)
            error = json.loads(body)["error"]
            assert error["message"] == "internal server error: RuntimeError (details are in the server log)"
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: fxllm\r\n\r\n")
            assert next_response(sock)[0] == 200
    finally:
        assert server.terminate() == 0
    log = server.log.read_text()
    assert log.count("RuntimeError: injected bug") == 1 and "Exception in ASGI application" not in log, log
