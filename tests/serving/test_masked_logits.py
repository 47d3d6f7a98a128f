"""A model that masks tokens (logits of -inf: vocabulary padding, tokens a checkpoint never emits) gives them a
logprob of -inf, which JSON cannot carry: a non-streamed response sent it as null (the shape's "no logprob", as for
a prompt's first token) and a stream as `-Infinity`, which strict JSON parsers (JavaScript's JSON.parse) refuse.
The OpenAI layer sends -9999.0 instead, as vLLM does. The app runs on a real uvicorn in this process (its engine's model call masks a few
token ids after the real call), driven by the official `openai` client and, for the stream's bytes, by httpx."""

from __future__ import annotations

import json
import socket

import httpx
import numpy as np
import openai
import pytest

import fxllm
from fxllm.serving.logprobs import LOGPROB_FLOOR
from tests.backend_wrapper import WrappedBackend
from tests.serving.conftest import app_on_uvicorn

NAME = "masked"
MASKED = (300, 301)  # token ids the wrapped model never emits


class MaskingBackend(WrappedBackend):
    def run(self, feeds):
        outputs = self.inner.run(feeds)
        outputs["logits"][..., list(MASKED)] = -np.inf
        return outputs


def strict(text: str):
    """json.loads that refuses NaN and ±Infinity, as JSON itself does."""
    def refuse(constant: str):
        raise ValueError(f"not JSON: {constant}")
    return json.loads(text, parse_constant=refuse)


@pytest.fixture
def served(serve_artifact):
    engine = fxllm.load(serve_artifact, threads=1)
    engine.backend = MaskingBackend(engine.backend)
    engine.runner.backend = engine.backend
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    with app_on_uvicorn(engine, NAME, listener):
        host, port = listener.getsockname()
        yield f"http://{host}:{port}/v1", engine
    listener.close()


def test_a_masked_tokens_logprob_is_sent_as_a_finite_number(served):
    url, engine = served
    prompt = engine.tokenizer.encode("The quick brown fox", add_special_tokens=False)
    prompt = [prompt[0], MASKED[0], *prompt[1:]]  # an echoed prompt token the model gives -inf
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
    response = client.completions.create(model=NAME, prompt=prompt, max_tokens=4, echo=True, logprobs=2,
                                         temperature=0)
    logprobs = response.choices[0].logprobs.token_logprobs
    assert logprobs[0] is None and logprobs[1] == LOGPROB_FLOOR
    assert all(lp is None or LOGPROB_FLOOR <= lp <= 0 for lp in logprobs)

    body = {"model": NAME, "prompt": prompt, "max_tokens": 4, "echo": True, "logprobs": 2, "temperature": 0,
            "stream": True}
    with httpx.stream("POST", f"{url}/completions", json=body, timeout=60) as stream:
        assert stream.status_code == 200
        events = [line[len("data: "):] for line in stream.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [strict(event) for event in events[:-1]]
    streamed = [lp for chunk in chunks for lp in chunk["choices"][0]["logprobs"]["token_logprobs"]]
    assert streamed == logprobs
