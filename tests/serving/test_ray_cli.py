"""`fxllm serve ARTIFACT --ray` as a user runs it: a cluster of this machine is started, the app answers the
official client, SIGTERM drains it (a running stream completes, a new request gets 503) and exits 0 with no Ray
process left; bad input (`--ray` without the extra, an
unreachable `--ray-address`, `--replicas 0`, ...) is one line on stderr, exit 1, nothing started."""

from __future__ import annotations

import signal
import socket
import subprocess
import uuid

import httpx
import openai
import pytest

from tests.conftest import PROMPTS
from tests.serving.conftest import (FXLLM, ServerProcess, ray_processes, slow_steps_env, tagged_environment,
                                    wait_until)
from tests.test_thin_runtime import Blocked

pytest.importorskip("ray", reason="the `ray` extra is not installed (scripts/setup.sh --test installs it)")


def test_cli_serves_on_a_local_cluster_and_stops_it(long_context_artifact, tmp_path):
    tag = uuid.uuid4().hex
    process = ServerProcess(long_context_artifact, "--ray", "--replicas", "1", "--served-model-name", "tiny",
                            "--api-key", "sk-ray", log=tmp_path / "stderr.log", timeout=240,
                            env={**slow_steps_env(tmp_path / "site"), **tagged_environment(tag)})
    try:
        assert ray_processes(tag)  # the cluster runs, and its processes carry the tag
        client = openai.OpenAI(base_url=process.url, api_key="sk-ray", max_retries=0, timeout=120)
        chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPTS[0]}],
                                              max_tokens=8, temperature=0)
        assert chat.choices[0].finish_reason in ("stop", "length") and chat.usage.completion_tokens > 0
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=process.url, api_key="wrong", max_retries=0).models.list()
        stream = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=600, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        first = next(iter(stream))
        process.proc.send_signal(signal.SIGTERM)  # drain: the running stream still completes
        # meanwhile a new request is turned away with 503 and the OpenAI body (it got Serve's plain-text 404)
        assert wait_until(lambda: health_status(process.root) == 503, timeout=15)
        with pytest.raises(openai.InternalServerError, match="shutting down") as refused:
            client.completions.create(model="tiny", prompt="x", max_tokens=2)
        assert refused.value.status_code == 503
        rest = list(stream)
        assert len(rest) >= 1 and rest[-1].choices[0].finish_reason == "length"
        assert len(first.choices[0].text + "".join(c.choices[0].text for c in rest)) > 0
    finally:
        status = process.terminate(timeout=120)
    assert status == 0, process.log.read_text()
    assert wait_until(lambda: not ray_processes(tag), timeout=30), ray_processes(tag)


def health_status(root: str) -> int:
    try:
        return httpx.get(f"{root}/health", timeout=5).status_code
    except httpx.HTTPError:
        return 0


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]  # nothing listens there once the probe is closed


@pytest.mark.parametrize("options, expected", [
    (("--replicas", "0"), "--replicas must be an integer >= 1"),
    (("--autoscale", "3:1"), "--autoscale MIN:MAX needs"),
    (("--autoscale", "two"), "--autoscale takes MIN:MAX"),
    (("--replicas", "2", "--autoscale", "1:2"), "either --replicas or --autoscale"),
    (("--replica-cpus", "0"), "--replica-cpus must be > 0"),
    (("--ray-address", f"127.0.0.1:{closed_port()}"), "cannot reach the Ray cluster at 127.0.0.1:"),
    (("--ray-address", "nonsense"), "--ray-address takes HOST:PORT"),
    (("--max-tokens-per-step", "0"), "max_tokens_per_step must be >= 1, got 0"),  # engine options: before any replica
    (("--max-batch", "0"), "max_batch must be >= 1, got 0"),
    (("--spec-k", "99"), "spec_k must be between 1 and 16, got 99"),  # was refused by each replica, after its load
    (("--kv-cache-memory", "lots"), "cannot read 'lots' as a memory size"),
    (("--drain-timeout", "nan"), "--drain-timeout must be >= 0 seconds, got nan"),
])
def test_bad_ray_options_are_one_line(long_context_artifact, options, expected):
    tag = uuid.uuid4().hex
    proc = subprocess.run([FXLLM, "serve", str(long_context_artifact), "--ray", "--port", "0", *options],
                          capture_output=True, text=True, timeout=120, env=tagged_environment(tag))
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1 and expected in lines[0], (options, proc.stderr)
    assert not ray_processes(tag)


@pytest.mark.parametrize("options, expected", [
    (("--replicas", "64"), "64 engine replicas x --replica-cpus 1 = 64 CPU, but this machine's Ray cluster has"),
    (("--replica-gpus", "64"), "1 engine replica x --replica-gpus 64 = 64 GPU, but this machine's Ray cluster has"),
])
def test_replicas_the_local_cluster_cannot_place_are_one_line(long_context_artifact, options, expected):
    """Serve waits without a deadline for a replica it cannot place, and `fxllm serve --ray` waited with it: no
    word for minutes, deaf to SIGTERM and Ctrl-C (only SIGKILL ended it, leaving the cluster running). A cluster of
    this machine never grows, so what it cannot hold is refused at once, the cluster stopped."""
    tag = uuid.uuid4().hex
    proc = subprocess.run([FXLLM, "serve", str(long_context_artifact), "--ray", "--port", "0", *options],
                          capture_output=True, text=True, timeout=120, env=tagged_environment(tag))
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1 and expected in lines[0], (options, proc.stderr)
    assert wait_until(lambda: not ray_processes(tag), timeout=30), ray_processes(tag)


def test_ray_options_without_ray_and_a_missing_artifact(long_context_artifact, tmp_path):
    for argv, expected in [((str(long_context_artifact), "--replicas", "2"), "--replicas only apply with --ray"),
                           ((str(tmp_path / "missing"), "--ray"), "does not exist")]:
        proc = subprocess.run([FXLLM, "serve", *argv, "--port", "0"], capture_output=True, text=True, timeout=120)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 1 and len(lines) == 1 and expected in lines[0], (argv, proc.stderr)


def test_ray_without_the_extra_names_it(long_context_artifact, tmp_path):
    blocked = Blocked(tmp_path / "no-ray", ("ray",))
    proc = blocked.cli("serve", str(long_context_artifact), "--ray", "--port", "0")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr
    assert "pip install 'fxllm[ray]'" in lines[0] and "missing ray" in lines[0]


def test_a_replica_that_cannot_start_stops_everything(long_context_artifact, tmp_path):
    """A corrupt weights file (one byte changed; the manifest itself is fine): the replicas refuse it at load, and
    the command stops with one line, exit 1, leaving no Ray process."""
    import shutil

    corrupt = tmp_path / "corrupt"
    shutil.copytree(long_context_artifact, corrupt)
    data = corrupt / "model.onnx.data"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 3] ^= 0x01
    data.write_bytes(bytes(raw))
    tag = uuid.uuid4().hex
    proc = subprocess.run([FXLLM, "serve", str(corrupt), "--ray", "--port", "0"], capture_output=True, text=True,
                          timeout=300, env=tagged_environment(tag))
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1, proc.stderr
    assert len(lines) == 1 and "failed to start" in lines[0] and "checksum" in lines[0], proc.stderr
    assert wait_until(lambda: not ray_processes(tag), timeout=30), ray_processes(tag)
