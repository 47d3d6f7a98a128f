"""An API key no client can send (a secret file's trailing newline in $FXLLM_API_KEY) is refused when the server starts,
in one line that does not show the key; before, the server started and answered every request "wrong API key"."""

from __future__ import annotations

import os
import subprocess

import pytest

from fxllm.errors import FxllmError
from fxllm.serving.app import create_app
from tests.serving.conftest import FXLLM

SECRET = "sk-fxllm-secret"


@pytest.mark.parametrize("key, flaw", [(SECRET + "\n", "starts or ends with whitespace"),
                                       (" " + SECRET, "starts or ends with whitespace"),
                                       (SECRET[:4] + "\x00" + SECRET[4:], "holds a control character")])
def test_a_key_no_header_can_carry_is_refused(key, flaw):
    with pytest.raises(FxllmError, match=flaw) as caught:
        create_app(lambda: None, api_key=key)
    assert SECRET not in str(caught.value) and "\n" not in str(caught.value)


def test_a_key_with_inner_space_is_accepted():
    """Only what HTTP cannot carry is refused: a space inside the key survives `Bearer KEY`."""
    assert create_app(lambda: None, api_key="two words") is not None


def test_serve_refuses_a_key_read_with_its_newline(serve_artifact):
    """`FXLLM_API_KEY=$(cat secret)` keeps no newline, but a Kubernetes secret or an env file does: exit 1 with one
    line, before the artifact loads."""
    env = {**os.environ, "FXLLM_API_KEY": SECRET + "\n"}
    proc = subprocess.run([FXLLM, "serve", str(serve_artifact), "--port", "0"], capture_output=True, text=True,
                          env=env, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr
    assert "the API key (--api-key or $FXLLM_API_KEY) starts or ends with whitespace" in lines[0]
    assert SECRET not in proc.stderr and proc.stdout == ""


def test_two_authorization_headers_are_refused():
    """With the right key in one of two Authorization headers the request is a 401 (the first header used to win): a
    proxy in front that checks the other one would disagree with the server about who is calling."""
    import asyncio

    import httpx

    async def models(headers: list[tuple[str, str]]) -> httpx.Response:
        transport = httpx.ASGITransport(app=create_app(lambda: None, api_key=SECRET))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.get("/v1/models", headers=headers)

    for order in ([f"Bearer {SECRET}", "Bearer wrong"], ["Bearer wrong", f"Bearer {SECRET}"]):
        answer = asyncio.run(models([("Authorization", value) for value in order]))
        assert answer.status_code == 401, answer.text
        assert answer.json()["error"]["message"].startswith("ambiguous (two Authorization headers) API key")
