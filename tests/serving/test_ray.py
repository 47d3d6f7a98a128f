"""The Ray Serve application on a real local cluster (`ray.init` with 2 CPUs, no dashboard; one cluster for the
module, shut down at its end, no Ray process left): two engine replicas of the 1024-token tiny artifact, driven by
the official `openai` client.

- both replicas serve (the x-fxllm-replica header, and each replica's series on /metrics), greedy text equals
  the in-process engine's, streamed and not, completions and chat;
- a bounded load of 60 requests during which one engine replica's actor is killed loses none (each completes, or
  gets a retryable error and its one retry completes, with the engine's text), and Serve replaces the replica;
- autoscaling on ongoing requests: a second replica under load, back to one after it;
- 4 groups of 4 chat requests, each group sharing a 256-token system prompt, over 2 replicas: the prefix-aware
  router reaches a higher aggregate prefix-cache hit rate than Serve's default router (both printed); the
  prefix-aware app gets its artifact from an http:// URI, copied once into the node's cache.
"""

from __future__ import annotations

import asyncio
import functools
import http.server
import os
import socket
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

import fxllm
from fxllm.runtime.request import SamplingParams
from tests.conftest import PROMPTS
from tests.serving.conftest import ray_processes, wait_until

ray = pytest.importorskip("ray", reason="the `ray` extra is not installed (scripts/setup.sh --test installs it)")
from ray import serve  # noqa: E402

from fxllm.serving.ray import build_app  # noqa: E402

MODEL = "tiny"
LOGGING = {"enable_access_log": False, "log_level": "WARNING"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A local Ray cluster with Serve's proxy on a free loopback port; its root URL. Everything is shut down at the
    end and no Ray process of it is left."""
    before = ray_processes()
    cache = tmp_path_factory.mktemp("artifact-cache")
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    os.environ["FXLLM_ARTIFACT_CACHE"] = str(cache)  # the replicas' processes inherit it
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield f"http://127.0.0.1:{port}", cache
    finally:
        serve.shutdown()
        ray.shutdown()
        os.environ.pop("FXLLM_ARTIFACT_CACHE", None)
    assert wait_until(lambda: not (ray_processes() - before), timeout=30), ray_processes() - before


def deploy(artifact, **options):
    """Replace the running application with a fresh one (cold replicas; 2 unless options say otherwise)."""
    serve.delete("fxllm")
    serve.run(build_app(str(artifact), served_model_name=MODEL, **{"replicas": 2, **options}), name="fxllm",
              route_prefix="/", logging_config=LOGGING)


@pytest.fixture(scope="module")
def two_replicas(cluster, long_context_artifact):
    deploy(long_context_artifact, health_check_period=2.0)
    return cluster[0]


@pytest.fixture(scope="module")
def engine(long_context_artifact):
    return fxllm.load(long_context_artifact)


def metric_values(root: str, name: str) -> dict[str, float]:
    """A counter or gauge of /metrics, per replica."""
    text = httpx.get(f"{root}/metrics", timeout=30).text
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                values[sample.labels["replica"]] = sample.value
    return values


def engine_replica_actors() -> list[str]:
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if "#FxllmEngine#" in a["name"])


def test_both_replicas_serve_greedy_equal_to_the_engine(two_replicas, engine):
    root = two_replicas
    prompts = [f"{prompt} ({i})" for i in range(3) for prompt in PROMPTS]

    async def main():
        async with openai.AsyncOpenAI(base_url=f"{root}/v1", api_key="unused", max_retries=0, timeout=120) as client:
            async def complete(prompt):
                raw = await client.completions.with_raw_response.create(model=MODEL, prompt=prompt, max_tokens=12,
                                                                        temperature=0)
                return raw.headers["x-fxllm-replica"], raw.parse().choices[0].text

            async def chat(prompt):
                stream = await client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=12, temperature=0,
                    stream=True)
                return "".join([c.choices[0].delta.content or "" async for c in stream])

            return await asyncio.gather(*[complete(p) for p in prompts]), await asyncio.gather(*[chat(p)
                                                                                                 for p in PROMPTS])

    completions, chats = asyncio.run(main())
    assert [text for _, text in completions] == [r.text for r in engine.generate(prompts, max_new_tokens=12)]
    assert chats == [engine.generate(p, max_new_tokens=12, chat=True).text for p in PROMPTS]
    served_by = {replica for replica, _ in completions}
    assert len(served_by) == 2, served_by
    expected_tokens = sum(len(r.token_ids) for r in engine.generate(prompts, max_new_tokens=12)) + \
        sum(len(engine.generate(p, max_new_tokens=12, chat=True).token_ids) for p in PROMPTS)
    assert wait_until(lambda: sum(metric_values(root, "fxllm_generation_tokens_total").values()) == expected_tokens,
                      timeout=15)
    per_replica = metric_values(root, "fxllm_generation_tokens_total")
    assert set(per_replica) == served_by and all(v > 0 for v in per_replica.values()), per_replica
    print(f"requests per replica: { {r: sum(1 for s, _ in completions if s == r) for r in served_by} }, "
          f"generated tokens per replica (from /metrics): {per_replica}")


STREAMED_TOKENS = 160  # long enough that the stream is still being generated when its replica is killed


def test_killing_a_replica_loses_no_request(two_replicas, engine):
    """60 requests, 8 at a time, every other one streamed (160 tokens, ignoring EOS). Once 12 have completed, the
    replica serving the next stream to start is killed (its actor, as a crash would) at that stream's first chunk.
    Every request completes with the engine's greedy text, at most after one retry of a retryable error (the cut
    stream gets one); Serve starts a replacement replica."""
    root = two_replicas
    prompts = [f"Request {i}: {PROMPTS[i % len(PROMPTS)]}" for i in range(60)]
    long = SamplingParams(max_tokens=STREAMED_TOKENS, ignore_eos=True)
    expected = [r.text for r in engine.generate(prompts, max_new_tokens=48)]
    for i in range(1, 60, 2):
        expected[i] = "".join(out.text_delta for out in engine.stream_outputs(engine.encode(prompts[i]), long))
    before = engine_replica_actors()
    assert len(before) == 2
    done, retried, killed = [], [], []

    def kill(replica: str) -> None:
        name = next(actor for actor in before if actor.endswith(f"#{replica}"))
        killed.append(name)
        ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)

    async def one(client, i: int, gate: asyncio.Semaphore) -> str:
        async with gate:
            for attempt in (0, 1):
                try:
                    if i % 2:
                        raw = await client.completions.with_raw_response.create(
                            model=MODEL, prompt=prompts[i], max_tokens=STREAMED_TOKENS, temperature=0, stream=True,
                            extra_body={"ignore_eos": True})
                        pieces = []
                        async for chunk in raw.parse():
                            if not pieces and len(done) >= 12 and not killed:  # its first chunk: tokens remain
                                kill(raw.headers["x-fxllm-replica"])
                            pieces.append(chunk.choices[0].text)
                        text = "".join(pieces)
                    else:
                        response = await client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=48,
                                                                   temperature=0)
                        text = response.choices[0].text
                    done.append(i)
                    return text
                except (openai.APIStatusError, openai.APIConnectionError, openai.APIError) as exc:
                    if attempt == 1:
                        raise
                    retried.append((i, type(exc).__name__, str(exc)[:90]))
        raise AssertionError("unreachable")

    async def main():
        gate = asyncio.Semaphore(8)
        async with openai.AsyncOpenAI(base_url=f"{root}/v1", api_key="unused", max_retries=0, timeout=120) as client:
            return await asyncio.gather(*[one(client, i, gate) for i in range(60)])

    start = time.monotonic()
    texts = asyncio.run(main())
    took = time.monotonic() - start
    print(f"60 requests in {took:.1f} s; killed {killed}; retried once by the client: {retried}")
    assert len(killed) == 1 and texts == expected
    assert retried, "the stream whose replica was killed should have been cut"

    def replaced() -> bool:
        status = serve.status().applications["fxllm"].deployments["FxllmEngine"]
        actors = engine_replica_actors()
        return len(actors) == 2 and killed[0] not in actors and status.status == "HEALTHY"

    assert wait_until(replaced, timeout=90, interval=0.5), (engine_replica_actors(), serve.status())
    client = openai.OpenAI(base_url=f"{root}/v1", api_key="unused", max_retries=0, timeout=120)
    assert client.completions.create(model=MODEL, prompt=prompts[0], max_tokens=48,
                                     temperature=0).choices[0].text == expected[0]


def engine_replicas_running() -> int:
    status = serve.status().applications["fxllm"].deployments["FxllmEngine"]
    return status.replica_states.get("RUNNING", 0)


def test_autoscaling_follows_ongoing_requests(cluster, long_context_artifact):
    """autoscale (1, 2) with a target of 1 ongoing request per replica (and Serve's delays shortened): 4 streams at
    a time bring a second replica up; once they stop, it goes away again. The load is bounded (90 s at most)."""
    root = cluster[0]
    deploy(long_context_artifact, autoscale=(1, 2), target_ongoing_requests=1,
           autoscaling_options={"upscale_delay_s": 0.5, "downscale_delay_s": 2.0, "metrics_interval_s": 0.5,
                                "look_back_period_s": 1.0})
    assert engine_replicas_running() == 1
    stop, served_by, failures = threading.Event(), set(), []

    async def load():
        async with openai.AsyncOpenAI(base_url=f"{root}/v1", api_key="unused", max_retries=0, timeout=120) as client:
            async def stream(i: int):
                while not stop.is_set():
                    raw = await client.completions.with_raw_response.create(
                        model=MODEL, prompt=PROMPTS[i], max_tokens=200, temperature=0, stream=True,
                        extra_body={"ignore_eos": True})
                    served_by.add(raw.headers["x-fxllm-replica"])
                    async for _ in raw.parse():
                        pass

            try:
                await asyncio.gather(*[stream(i) for i in range(4)])
            except Exception as exc:
                failures.append(exc)
                stop.set()

    loader = threading.Thread(target=asyncio.run, args=(load(),))
    loader.start()
    try:
        scaled_up = wait_until(lambda: stop.is_set() or (engine_replicas_running() == 2 and len(served_by) == 2),
                               timeout=90, interval=0.5)
    finally:
        stop.set()
        loader.join()
    assert not failures and scaled_up, (failures, serve.status().applications["fxllm"].deployments["FxllmEngine"],
                                        served_by)
    assert wait_until(lambda: engine_replicas_running() == 1 and len(engine_replica_actors()) == 1, timeout=60,
                      interval=0.5), serve.status().applications["fxllm"].deployments["FxllmEngine"]


@pytest.fixture
def artifact_url(long_context_artifact):
    """The artifact directory served over HTTP on loopback (as an object store or web server would serve it)."""
    handler = functools.partial(_QuietHandler, directory=str(Path(long_context_artifact).parent))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/{Path(long_context_artifact).name}"
    finally:
        server.shutdown()
        server.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


def system_prompts(engine, count: int, tokens: int) -> list[str]:
    """`count` different texts of `tokens` tokens each (consecutive windows of a real text)."""
    import pydoc_data.topics

    text = " ".join(pydoc_data.topics.topics[name] for name in sorted(pydoc_data.topics.topics)[:40])
    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    return [engine.tokenizer.decode(ids[i * tokens:(i + 1) * tokens]) for i in range(count)]


def grouped_workload(root: str, prompts: list[str]) -> tuple[dict[int, set[str]], int]:
    """4 rounds; in each, one request of every group at once (each its own question after its group's system
    prompt). Returns the replicas each group reached and the tokens generated."""

    async def main():
        served, tokens = {g: set() for g in range(len(prompts))}, 0
        async with openai.AsyncOpenAI(base_url=f"{root}/v1", api_key="unused", max_retries=0, timeout=120) as client:
            async def ask(group: int, turn: int):
                messages = [{"role": "system", "content": prompts[group]},
                            {"role": "user", "content": f"Question {turn} of group {group}: what is item {turn}?"}]
                raw = await client.chat.completions.with_raw_response.create(model=MODEL, messages=messages,
                                                                             max_tokens=4, temperature=0)
                return group, raw.headers["x-fxllm-replica"], raw.parse().usage.completion_tokens

            for turn in range(4):
                for group, replica, count in await asyncio.gather(*[ask(g, turn) for g in range(len(prompts))]):
                    served[group].add(replica)
                    tokens += count
        return served, tokens

    return asyncio.run(main())


def aggregate_hit_rate(root: str, tokens: int) -> float:
    """Prefix-cache hits / lookups summed over the replicas, once /metrics covers all `tokens` generated."""
    assert wait_until(lambda: sum(metric_values(root, "fxllm_generation_tokens_total").values()) == tokens,
                      timeout=15)
    hits = sum(metric_values(root, "fxllm_prefix_cache_hits_total").values())
    queries = sum(metric_values(root, "fxllm_prefix_cache_queries_total").values())
    return hits / queries


def test_prefix_aware_routing_beats_the_default(cluster, long_context_artifact, engine, artifact_url):
    root, cache = cluster
    prompts = system_prompts(engine, 4, 256)
    deploy(long_context_artifact)
    default_served, tokens = grouped_workload(root, prompts)
    default_rate = aggregate_hit_rate(root, tokens)
    deploy(artifact_url, router="prefix")
    prefix_served, tokens = grouped_workload(root, prompts)
    prefix_rate = aggregate_hit_rate(root, tokens)
    print(f"aggregate prefix-cache hit rate over 2 replicas, 4 groups x 4 requests sharing 256-token system "
          f"prompts: default router {default_rate:.3f}, prefix-aware router {prefix_rate:.3f}; replicas per group: "
          f"default {[len(s) for s in default_served.values()]}, prefix-aware {[len(s) for s in prefix_served.values()]}")
    assert prefix_rate > default_rate
    assert all(len(replicas) == 1 for replicas in prefix_served.values()), prefix_served
    copies = [p for p in cache.iterdir() if p.is_dir()]
    assert len(copies) == 1 and (copies[0] / "manifest.json").read_bytes() == \
        (Path(long_context_artifact) / "manifest.json").read_bytes()
