"""Shared by the serving tests: the tiny paged artifact (compiled once per session), `fxllm serve` processes on
127.0.0.1 with a free port (a real uvicorn server in a subprocess), and the in-process engine to compare with."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import select
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

import fxllm

API_KEY = "sk-fxllm-test"
MODEL = "tiny"
FXLLM = str(Path(sys.executable).with_name("fxllm"))


class ServerProcess:
    """`fxllm serve ARTIFACT --port 0 ...` in a subprocess; `url` is the printed base URL (…/v1)."""

    def __init__(self, artifact: Path, *options: str, log: Path, env: dict | None = None, timeout: float = 120):
        self.log = log
        with open(log, "w") as stderr:
            self.proc = subprocess.Popen([FXLLM, "serve", str(artifact), "--port", "0", *options], env=env,
                                         stdout=subprocess.PIPE, stderr=stderr, text=True)
        line = self._first_line(timeout)
        match = re.search(r"http://\S+/v1", line)
        if match is None:
            self.proc.kill()
            raise RuntimeError(f"the server did not start: {line!r}\n{log.read_text()}")
        self.url = match.group(0)
        self.root = self.url[:-len("/v1")]

    def _first_line(self, timeout: float) -> str:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        return self.proc.stdout.readline() if ready else ""

    @property
    def pid(self) -> int:
        return self.proc.pid

    def rss_bytes(self) -> int:
        status = Path(f"/proc/{self.pid}/status").read_text()
        return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) * 1024

    def terminate(self, timeout: float = 60) -> int:
        """SIGTERM; the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise

    def metrics(self) -> dict[str, float]:
        """/metrics as {series: value}; a series is its name, followed by its labels other than model_name as
        `{key=value,...}` when it has any (e.g. `fxllm_requests_total{finish_reason=abort}`)."""
        import httpx

        text = httpx.get(f"{self.root}/metrics", timeout=10).text
        values = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                series, value = line.rsplit(" ", 1)
                name, _, labels = series.partition("{")
                pairs = [pair.replace('"', "") for pair in labels.rstrip("}").split(",") if pair]
                pairs = [pair for pair in pairs if not pair.startswith("model_name=")]
                values[name + (f"{{{','.join(pairs)}}}" if pairs else "")] = float(value)
        return values


# Installed through PYTHONPATH as `sitecustomize` of a server process: every model call takes at least
# FXLLM_TEST_STEP_SECONDS. The tiny model makes 200 tokens in ~0.12 s on an idle machine, so a test that needs a
# request still running after a client round trip (a disconnect, a full queue, a drain) had only ~0.1-0.3 s of slack
# on a loaded 2-core CI machine; at 15 ms a step the same request runs for 3 s.
SLOW_STEPS = textwrap.dedent('''
    import os, time
    from fxllm.runtime.backend_ort import OrtBackend

    _run, _seconds = OrtBackend.run, float(os.environ["FXLLM_TEST_STEP_SECONDS"])

    def run(self, feeds):
        time.sleep(_seconds)
        return _run(self, feeds)

    OrtBackend.run = run
''')


def slow_steps_env(directory: Path, seconds: float = 0.015) -> dict[str, str]:
    """An environment for ServerProcess whose server takes at least `seconds` per model call (SLOW_STEPS)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "sitecustomize.py").write_text(SLOW_STEPS)
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(directory), os.environ.get("PYTHONPATH", "")]),
            "FXLLM_TEST_STEP_SECONDS": str(seconds), "FXLLM_API_KEY": ""}


def wait_until(condition, timeout: float = 10.0, interval: float = 0.02):
    """Poll until condition() is truthy; returns it (or the last falsy value after the timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)


@pytest.fixture(scope="session")
def serve_artifact(tiny_paged_artifact) -> Path:
    """The suite's tiny random-weight Llama with SmolLM2's tokenizer, compiled paged (continuous batching)."""
    return tiny_paged_artifact


@pytest.fixture(scope="session")
def engine(serve_artifact):
    """The in-process engine on the same artifact: what HTTP results are compared with."""
    return fxllm.load(serve_artifact)


# The shared server's options: API key set, 16 requests decoded at once plus 48 queued, a small KV pool (2 MB: the
# memory test touches all of it in its warm-up rounds).
SHARED_SERVER_OPTIONS = ("--served-model-name", MODEL, "--api-key", API_KEY, "--max-batch", "16", "--max-queue", "48",
                         "--kv-cache-memory", "2MB", "--threads", "1")


@pytest.fixture(scope="session")
def server(serve_artifact, tmp_path_factory):
    """The shared server (SHARED_SERVER_OPTIONS)."""
    process = ServerProcess(serve_artifact, *SHARED_SERVER_OPTIONS,
                            log=tmp_path_factory.mktemp("server") / "stderr.log",
                            env={**os.environ, "FXLLM_API_KEY": ""})
    yield process
    assert process.terminate() == 0, process.log.read_text()


LONG_CONTEXT_PASSES = "cleanup,gqa,fuse-projections,select-logits,kv-cache,paged:block_size=16"


@pytest.fixture(scope="session")
def long_context_artifact(tmp_path_factory, tokenizer) -> Path:
    """The tiny Llama with a 1024-token context (room for 256-token system prompts), paged in blocks of 16: what
    the Ray Serve tests serve."""
    import torch
    from transformers import AutoModelForCausalLM

    from tests.conftest import tiny_config

    torch.manual_seed(0)
    config = tiny_config("llama")
    config.max_position_embeddings = 1024
    model_dir = tmp_path_factory.mktemp("tiny-llama-1024")
    AutoModelForCausalLM.from_config(config).eval().save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    output = tmp_path_factory.mktemp("artifact-llama-1024") / "artifact"
    fxllm.compile(model_dir, output, passes=LONG_CONTEXT_PASSES)
    return output


RUN_TAG = "FXLLM_TEST_RUN"


def ray_processes(tag: str | None = None) -> set[int]:
    """PIDs of this user's Ray processes (GCS, raylet, workers, agents), from /proc; with `tag`, only those whose
    environment carries `FXLLM_TEST_RUN=tag` (inherited from a command started with `tagged_environment(tag)`), so
    Ray processes of other tests running at the same time (pytest -n) do not count."""
    pids = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if entry.stat().st_uid != os.getuid():
                continue
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
            if tag is not None and f"{RUN_TAG}={tag}".encode() not in (entry / "environ").read_bytes().split(b"\0"):
                continue
        except OSError:
            continue
        if b"ray/core/src/ray" in command or command.startswith(b"ray::") or b"ray/dashboard/agent.py" in command \
                or b"ray/_private/workers/default_worker.py" in command or b"runtime_env/agent/main.py" in command:
            pids.add(int(entry.name))
    return pids


def tagged_environment(tag: str) -> dict[str, str]:
    """This process's environment plus the tag `ray_processes(tag)` looks for."""
    return {**os.environ, RUN_TAG: tag}


@contextlib.contextmanager
def app_on_uvicorn(engine, name: str, listener, http="auto"):
    """The OpenAI app over `engine` (served as model `name`) on a real uvicorn in a thread of this process, listening
    on `listener` (a bound, listening socket), so that a test can reach into the engine or the service; `http` is
    uvicorn's protocol (or `fxllm serve`'s guarded one). Yields the service; the server stops on exit."""
    import uvicorn

    from fxllm.runtime.async_engine import AsyncEngine
    from fxllm.serving.app import create_app
    from fxllm.serving.service import OpenAIService, ServingConfig

    state: dict = {}

    async def main() -> None:
        state["service"] = service = OpenAIService(AsyncEngine(engine), ServingConfig((name,)))
        state["server"] = server = uvicorn.Server(uvicorn.Config(create_app(lambda: service), lifespan="off",
                                                                 log_level="critical", http=http))
        try:
            await server.serve(sockets=[listener])
        finally:
            await service.engine.shutdown(drain_timeout=0)

    thread = threading.Thread(target=asyncio.run, args=(main(),), daemon=True)
    thread.start()
    try:
        assert wait_until(lambda: "server" in state and state["server"].started, timeout=60)
        yield state["service"]
    finally:
        if "server" in state:
            state["server"].should_exit = True
        thread.join(30)
