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
