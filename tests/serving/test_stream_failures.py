"""A stream that fails after it has started (the 200 status line is sent): the client gets an OpenAI error event
and then `data: [DONE]`, the connection ends cleanly, the request's KV blocks are freed, and the server keeps
serving. Two kinds of failure: the model call fails midway (a backend that raises on its third call), and a bug in
the server's own code (a token text lookup that raises). The app runs in this process (httpx's ASGI transport), so
that the engine's backend can be wrapped."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

import fxllm
from fxllm.runtime.async_engine import AsyncEngine
from fxllm.serving.app import create_app
from fxllm.serving.service import OpenAIService, ServingConfig
from tests.conftest import PROMPTS
from tests.test_engine_core import FailingBackend


class FailingOnCall(FailingBackend):
    """Raises on the `call`-th model call from when it is armed (counting from 1)."""

    def arm_call(self, call: int) -> None:
        self.calls_left = call

    def run(self, feeds):
        if getattr(self, "calls_left", None) is not None:
            self.calls_left -= 1
            if self.calls_left == 0:
                self.calls_left = None
                raise RuntimeError("injected backend failure")
        return self.inner.run(feeds)


class RaisingTexts:
    """A token-text table whose `after`-th lookup raises (a bug in the server's own code)."""

    def __init__(self, inner, after: int):
        self.inner, self.left = inner, after

    def bytes(self, token_id: int) -> bytes:
        return self.inner.bytes(token_id)

    def text(self, token_id: int) -> str:
        self.left -= 1
        if self.left == 0:
            raise KeyError(token_id)
        return self.inner.text(token_id)


@pytest.fixture
def served(serve_artifact):
    engine = fxllm.load(serve_artifact, threads=1)
    engine.runner.backend = FailingOnCall(engine.runner.backend)
    return engine


def events_of(body: str) -> list[str]:
    return [line[len("data: "):] for line in body.splitlines() if line.startswith("data: ")]


async def exchange(engine, arm, requests: list[dict]) -> tuple[list[httpx.Response], dict]:
    """Start a service on `engine`, call arm(service), post the chat requests one after another; the responses and
    the engine's stats at the end."""
    service = OpenAIService(AsyncEngine(engine), ServingConfig(("m",)))
    arm(service)
    transport = httpx.ASGITransport(app=create_app(lambda: service))
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as client:
            responses = [await client.post("/v1/chat/completions", json=body) for body in requests]
        stats = service.engine.stats()
    finally:
        await service.engine.shutdown(drain_timeout=0)
    return responses, stats


def chat(max_tokens: int, stream: bool = True, **extra) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": max_tokens,
            "temperature": 0, "stream": stream, **extra}


def test_model_failure_mid_stream_ends_with_an_error_event(served):
    """Prefill and two decode steps run, the next decode raises: the stream has its role chunk and content, then an
    engine_error event (500 in its body), then [DONE]; the next request is served normally."""
    expected = served.generate(PROMPTS[0], max_new_tokens=6, chat=True).text
    responses, stats = asyncio.run(exchange(served, lambda s: served.runner.backend.arm_call(4),
                                            [chat(30), chat(6, stream=False)]))
    failed, after = responses
    assert failed.status_code == 200
    events = events_of(failed.text)
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "engine_error" and error["type"] == "server_error"
    assert "injected backend failure" in error["message"] and "\n" not in error["message"]
    chunks = [json.loads(e) for e in events[:-2]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert any(c["choices"][0]["delta"].get("content") for c in chunks[1:])
    assert after.status_code == 200 and after.json()["choices"][0]["message"]["content"] == expected
    assert stats.kv_blocks_used == 0 and stats.running == 0


def test_server_bug_mid_stream_ends_with_an_error_event(served):
    """A non-APIError raised while the response is streamed (here: the third token text lookup of streamed
    logprobs) becomes a 500 internal-error event and [DONE], never a cut connection; its request is aborted (blocks
    freed) and the server keeps serving."""

    def break_texts(service):
        service.token_texts = RaisingTexts(service.token_texts, after=3)

    responses, stats = asyncio.run(exchange(served, break_texts, [chat(30, logprobs=True), chat(4, stream=False)]))
    failed, after = responses
    assert failed.status_code == 200
    events = events_of(failed.text)
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["type"] == "server_error" and error["message"].startswith("internal server error: KeyError")
    assert after.status_code == 200 and after.json()["choices"][0]["finish_reason"] == "length"
    assert stats.kv_blocks_used == 0 and stats.running == 0
