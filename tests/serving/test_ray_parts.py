"""Parts of the Ray Serve application that need no cluster: the artifact copy from a URI (over real HTTP on
loopback, and file://) into a checksummed per-node cache, and the engine health check on a real engine (stopped,
stalled, failing every model call)."""

from __future__ import annotations

import asyncio
import functools
import http.server
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import fxllm
from fxllm.errors import ArtifactError
from fxllm.runtime.async_engine import AsyncEngine
from fxllm.runtime.request import SamplingParams
from fxllm.serving.ray.artifacts import COMPLETE, local_artifact
from fxllm.serving.ray.health import EngineHealth, EngineUnhealthy
from fxllm.serving.service import OpenAIService, ServingConfig
from tests.test_engine_core import FailingBackend


class CountingHandler(http.server.SimpleHTTPRequestHandler):
    requested: list[str] = []

    def do_GET(self):
        CountingHandler.requested.append(self.path)
        return super().do_GET()

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def http_root(tmp_path):
    """A directory served over HTTP on loopback; (directory, base URL)."""
    root = tmp_path / "store"
    root.mkdir()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(CountingHandler, directory=str(root)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    CountingHandler.requested = []
    try:
        yield root, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_uri_artifact_is_copied_once_and_verified(serve_artifact, engine, http_root, tmp_path):
    root, url = http_root
    shutil.copytree(serve_artifact, root / "tiny")
    cache = tmp_path / "cache"
    copy = local_artifact(f"{url}/tiny", cache)
    assert (copy / COMPLETE).is_file() and copy.parent == cache
    for name in ("manifest.json", "model.onnx", "tokenizer/tokenizer.json"):
        assert (copy / name).read_bytes() == (Path(serve_artifact) / name).read_bytes()
    fetched = len(CountingHandler.requested)
    assert local_artifact(f"{url}/tiny/", cache) == copy  # the second time: only the manifest is read
    assert CountingHandler.requested[fetched:] == ["/tiny/manifest.json"]
    loaded = fxllm.load(copy)
    assert loaded.generate("Paris is", max_new_tokens=6).text == engine.generate("Paris is", max_new_tokens=6).text
    assert local_artifact(f"file://{root / 'tiny'}", tmp_path / "cache2").name == copy.name


def test_a_corrupt_or_missing_file_fails_and_leaves_no_copy(serve_artifact, http_root, tmp_path):
    root, url = http_root
    shutil.copytree(serve_artifact, root / "bad")
    data = root / "bad" / "model.onnx.data"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # same size, one byte changed
    data.write_bytes(bytes(raw))
    cache = tmp_path / "cache"
    with pytest.raises(ArtifactError, match="model.onnx.data.*does not match the checksum"):
        local_artifact(f"{url}/bad", cache)
    assert [p.name for p in cache.iterdir() if p.is_dir()] == []
    with pytest.raises(ArtifactError, match="HTTP 404") as missing:
        local_artifact(f"{url}/nowhere", cache)
    assert "\n" not in str(missing.value)
    with pytest.raises(ArtifactError) as unknown:
        local_artifact("nosuchscheme://bucket/artifact", cache)
    assert "\n" not in str(unknown.value)


def test_a_copy_killed_midway_is_cleaned_up_by_the_next(serve_artifact, tmp_path):
    """A replica SIGKILLed (the OOM killer) while it copies leaves its hidden staging directory; the next replica to
    copy that artifact removes it, and the copy it makes is complete."""
    cache = tmp_path / "cache"
    source = f"file://{serve_artifact}"
    code = (
        "import os, sys\n"
        "import fxllm.serving.ray.artifacts as artifacts\n"
        "real = artifacts._fetch_checked\n"
        "def fetch(*args):\n"
        "    real(*args)\n"
        "    os.kill(os.getpid(), 9)  # after the first file\n"
        "artifacts._fetch_checked = fetch\n"
        "artifacts.local_artifact(sys.argv[1], artifacts.Path(sys.argv[2]))\n"
    )
    killed = subprocess.run([sys.executable, "-c", code, source, str(cache)], capture_output=True, timeout=120)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    [left] = [p for p in cache.iterdir() if p.is_dir()]
    assert left.name.startswith(".") and any(left.rglob("*"))
    copy = local_artifact(source, cache)
    assert (copy / COMPLETE).is_file()
    assert [p.name for p in cache.iterdir() if p.is_dir()] == [copy.name]


@pytest.fixture
def service(serve_artifact):
    engine = fxllm.load(serve_artifact, threads=1)
    return OpenAIService(AsyncEngine(engine), ServingConfig(("m",)))


def test_health_fails_a_stopped_or_stalled_engine(service):
    """Healthy while idle and while it steps; unhealthy when it has work and no step finishes for stall_timeout
    (its stepping is blocked), and once the engine core has stopped."""
    health = EngineHealth(service, stall_timeout=1.0)
    held, release = threading.Event(), threading.Event()
    blocker = threading.Thread(target=service.engine.driver.run_exclusive,
                               args=(lambda: (held.set(), release.wait()),))

    async def main():
        health.check()
        outputs = service.engine.generate([1, 2, 3], SamplingParams(max_tokens=4), "r")
        first = asyncio.ensure_future(outputs.__anext__())
        await asyncio.sleep(0.1)
        health.check()  # work arrived just now
        await asyncio.sleep(1.5)
        with pytest.raises(EngineUnhealthy, match="finished no step"):
            health.check()
        release.set()
        await first
        async for _ in outputs:
            pass
        health.check()
        await service.engine.shutdown(drain_timeout=1)

    blocker.start()
    assert held.wait(30)  # the blocker holds the step lock
    try:
        asyncio.run(main())
    finally:
        release.set()
        blocker.join()
    with pytest.raises(EngineUnhealthy, match="stopped"):
        health.check()


class AlwaysFailing(FailingBackend):
    def run(self, feeds):
        raise RuntimeError("device lost")


def test_health_fails_an_engine_whose_model_calls_all_fail(serve_artifact):
    engine = fxllm.load(serve_artifact, threads=1)
    service = OpenAIService(AsyncEngine(engine), ServingConfig(("m",)))
    health = EngineHealth(service, max_error_streak=3)
    engine.runner.backend = AlwaysFailing(engine.runner.backend)

    async def main():
        from fxllm.serving.protocol import CompletionRequest

        for i in range(3):
            health.check()
            with pytest.raises(Exception, match="device lost"):
                await service.completion(CompletionRequest(model="m", prompt=f"x {i}", max_tokens=2))
        with pytest.raises(EngineUnhealthy, match="last 3 requests all failed"):
            health.check()
        await service.engine.shutdown(drain_timeout=0)

    asyncio.run(main())


@pytest.mark.parametrize("seconds", [float("nan"), -1.0])
def test_the_ray_app_refuses_a_drain_timeout_serve_refuses(seconds):
    """build_app's options (the Python API) and `fxllm serve` read the drain timeout with one check."""
    from fxllm.errors import FxllmError
    from fxllm.serving.ray.app import check_options

    with pytest.raises(FxllmError, match=f"--drain-timeout must be >= 0 seconds, got {seconds}"):
        check_options(1, None, 1.0, 0.0, "default", None, seconds)
