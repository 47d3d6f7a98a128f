"""`fxllm serve` on a runtime-only install: the compiler's packages (torch, transformers, ...) cannot be imported
in the server process (the thin-runtime test's import blocker), and the server answers exactly as the in-process
engine does. Without the `serve` extra, `fxllm serve` says in one line what to install."""

from __future__ import annotations

import openai

from fxllm.extras import COMPILE_MODULES, SERVE_MODULES
from tests.conftest import PROMPTS
from tests.serving.conftest import ServerProcess
from tests.test_thin_runtime import COMPILER, Blocked

TOKENS_PER_STEP = 5
KV_BLOCKS = 40  # of 4 tokens: a pool of 160 tokens, under the context of 256


def test_serve_runs_without_the_compiler(serve_artifact, engine, tmp_path):
    blocked = Blocked(tmp_path / "no-compiler", COMPILE_MODULES + ("tqdm",) + COMPILER)
    process = ServerProcess(serve_artifact, "--served-model-name", "m", "--max-tokens-per-step", str(TOKENS_PER_STEP),
                            "--kv-blocks", str(KV_BLOCKS), log=tmp_path / "stderr.log", env=blocked.env)
    try:
        client = openai.OpenAI(base_url=process.url, api_key="unused", max_retries=0)
        response = client.completions.create(model="m", prompt=PROMPTS[:2], max_tokens=8, temperature=0)
        chat = client.chat.completions.create(model="m", messages=[{"role": "user", "content": PROMPTS[0]}],
                                              max_tokens=8, temperature=0)
        # no max_tokens: what the pool (160 tokens) leaves after the prompt, not the context (256)
        unbounded = client.chat.completions.create(model="m", messages=[{"role": "user", "content": PROMPTS[1]}],
                                                   temperature=0, extra_body={"ignore_eos": True})
        metrics = process.metrics()
    finally:
        assert process.terminate() == 0
    # the prompts went in calls of at most TOKENS_PER_STEP tokens, and the answers are one call's all the same
    computed, calls = metrics["fxllm_prefill_computed_tokens_total"], metrics["fxllm_model_calls_total{kind=prefill}"]
    assert computed > 2 * TOKENS_PER_STEP and calls >= computed / TOKENS_PER_STEP, metrics
    assert metrics["fxllm_model_calls_total{kind=decode}"] >= 7
    assert [c.text for c in response.choices] == [r.text for r in engine.generate(PROMPTS[:2], max_new_tokens=8)]
    assert chat.choices[0].message.content == engine.generate(PROMPTS[0], max_new_tokens=8, chat=True).text
    assert blocked.attempts_by_fxllm() == []
    assert unbounded.choices[0].finish_reason == "length" and unbounded.usage.total_tokens == KV_BLOCKS * 4


def test_serve_without_the_extra_names_it(serve_artifact, tmp_path):
    blocked = Blocked(tmp_path / "no-server", SERVE_MODULES)
    proc = blocked.cli("serve", str(serve_artifact), "--port", "0")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr
    assert "pip install 'fxllm[serve]'" in lines[0] and "fastapi" in lines[0]


def test_serve_bad_input_is_one_line(serve_artifact, tmp_path):
    """A missing artifact, a port in use, a bad option: exit 1 with one line."""
    import socket
    import subprocess

    from tests.serving.conftest import FXLLM

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        for argv, expected in [((str(tmp_path / "missing"), "--port", "0"), "does not exist"),
                               ((str(serve_artifact), "--port", str(port)), f"cannot listen on 127.0.0.1:{port}"),
                               ((str(serve_artifact), "--port", "0", "--max-queue", "-1"), "max_queue"),
                               ((str(serve_artifact), "--port", "0", "--max-tokens-per-step", "0"),
                                "max_tokens_per_step must be >= 1, got 0"),
                               ((str(serve_artifact), "--port", "0", "--drain-timeout", "nan"),
                                "--drain-timeout must be >= 0 seconds, got nan"),
                               ((str(serve_artifact), "--port", "0", "--api-key", ""),  # "$UNSET": not served open
                                "--api-key is empty")]:
            proc = subprocess.run([FXLLM, "serve", *argv], capture_output=True, text=True, timeout=120)
            lines = proc.stderr.strip().splitlines()
            assert proc.returncode == 1 and len(lines) == 1 and expected in lines[0], (argv, proc.stderr)
    finally:
        taken.close()
