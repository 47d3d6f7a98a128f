"""`build_app(artifact, ...)`: an fxllm artifact as a Ray Serve application, for `serve.run(app)`, `serve run
fxllm.serving.ray:app_builder artifact=...` (and KubeRay's RayService, which runs the same import path) or
`fxllm serve ARTIFACT --ray`.

Three deployments:

| deployment | replicas | resources | what |
| --- | --- | --- | --- |
| `FxllmEngine` | `replicas`, or autoscaled in `autoscale` = (min, max) | `replica_cpus` CPUs, `replica_gpus` GPUs each | one engine core each (engine.py) |
| `FxllmIngress` | 1 | none reserved | the OpenAI app (ingress.py), forwarding to the engines |
| `FxllmMetrics` | 1 | none reserved | the metrics board (board.py) |

Routing between the ingress and the engines is Serve's own router (power of two choices on ongoing requests), or
with `router="prefix"` the prefix-aware one (router.py). Autoscaling follows Serve's autoscaler on ongoing
requests per engine replica (`target_ongoing_requests`, default the engine's batch size). Each engine replica takes
at most `max_batch + max_queue` requests at once (Serve's `max_ongoing_requests`); more wait in Serve's queue, and
a request finding `max_queue` waiting gets 429.
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath
from urllib.parse import urlsplit

from fxllm.errors import FxllmError
from fxllm.serving.ray.engine import EngineSettings
from fxllm.serving.server import check_drain_timeout

ROUTERS = ("default", "prefix")
INGRESS_DEPLOYMENT = "FxllmIngress"
DEFAULT_MAX_BATCH = 64


def build_app(artifact: str, *, served_model_name: str | None = None, api_key: str | None = None,
              replicas: int = 1, autoscale: tuple[int, int] | None = None,
              target_ongoing_requests: float | None = None, replica_cpus: float = 1.0, replica_gpus: float = 0.0,
              router: str = "default", max_queue: int | None = 256, drain_timeout: float = 30.0,
              health_check_period: float = 10.0, stall_timeout: float = 60.0, autoscaling_options: dict | None = None,
              **engine_options):
    """The Ray Serve application (an `Application` for serve.run). `artifact`: a path every node can read or a URI
    (see artifacts.py); `engine_options` go to fxllm.load in each replica (`threads` defaults to `replica_cpus`);
    `autoscaling_options` are more fields of Serve's AutoscalingConfig (e.g. upscale_delay_s, downscale_delay_s).
    Raises FxllmError (one line) for a bad option; nothing starts until the application is run."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from fxllm.serving.ray.board import MetricsBoard
    from fxllm.serving.ray.engine import EngineReplica
    from fxllm.serving.ray.ingress import Ingress

    check_options(replicas, autoscale, replica_cpus, replica_gpus, router, max_queue, drain_timeout)
    name = served_model_name or artifact_name(artifact)
    if "://" not in artifact and Path(artifact).exists():
        artifact = str(Path(artifact).resolve())  # replicas do not share this process's working directory
    if engine_options.get("threads") is None:
        engine_options["threads"] = max(1, int(replica_cpus))  # a replica's share of the cores, no more
    max_batch = engine_options.get("max_batch") or DEFAULT_MAX_BATCH
    settings = EngineSettings(artifact, (name,), max_queue, engine_options, drain_timeout, stall_timeout)
    scaling = ({"num_replicas": replicas} if autoscale is None else
               {"autoscaling_config": {"min_replicas": autoscale[0], "max_replicas": autoscale[1],
                                       "initial_replicas": max(autoscale[0], 1),
                                       "target_ongoing_requests": target_ongoing_requests or max_batch,
                                       **(autoscaling_options or {})}})
    routing = {}
    if router == "prefix":
        from fxllm.serving.ray.router import PrefixAwareRouter

        routing["request_router_config"] = RequestRouterConfig(request_router_class=PrefixAwareRouter)
    actor_options = {"num_cpus": replica_cpus, "num_gpus": replica_gpus}
    engine = serve.deployment(
        EngineReplica, name="FxllmEngine", ray_actor_options=actor_options,
        max_ongoing_requests=max_batch + (max_queue if max_queue is not None else 4 * max_batch),
        max_queued_requests=-1 if max_queue is None else max_queue, graceful_shutdown_timeout_s=drain_timeout,
        graceful_shutdown_wait_loop_s=0.5, health_check_period_s=health_check_period,
        health_check_timeout_s=max(30.0, health_check_period), max_constructor_retry_count=3, **scaling,
        **routing)
    board = serve.deployment(MetricsBoard, name="FxllmMetrics", num_replicas=1, ray_actor_options={"num_cpus": 0})
    ingress = serve.deployment(serve.ingress()(Ingress), name=INGRESS_DEPLOYMENT, num_replicas=1,
                               ray_actor_options={"num_cpus": 0}, max_ongoing_requests=100_000,
                               graceful_shutdown_timeout_s=drain_timeout + 5)
    metrics = board.bind()
    return ingress.bind(engine.bind(settings, metrics), metrics, (name,), api_key)


def app_builder(args: dict):
    """For `serve run fxllm.serving.ray:app_builder artifact=PATH_OR_URI [replicas=2] [router=prefix] ...` and
    KubeRay's RayService (`import_path: fxllm.serving.ray:app_builder`, `args:`): build_app with the options as
    strings or numbers (autoscale as "MIN:MAX")."""
    args = dict(args)
    try:
        artifact = args.pop("artifact")
    except KeyError:
        raise FxllmError("app_builder needs artifact=PATH_OR_URI") from None
    numbers = {"replicas": int, "replica_cpus": float, "replica_gpus": float, "max_queue": int,
               "drain_timeout": float, "target_ongoing_requests": float, "threads": int, "max_batch": int,
               "kv_blocks": int}
    for key, kind in numbers.items():
        if key in args:
            args[key] = kind(args[key])
    if "autoscale" in args:
        args["autoscale"] = parse_autoscale(str(args["autoscale"]))
    return build_app(artifact, **args)


def check_options(replicas: int, autoscale: tuple[int, int] | None, replica_cpus: float, replica_gpus: float,
                  router: str, max_queue: int | None, drain_timeout: float) -> None:
    """FxllmError (one line) for options Serve would refuse later, or with a worse message."""
    if autoscale is None and (isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1):
        raise FxllmError(f"--replicas must be an integer >= 1, got {replicas!r}")
    if autoscale is not None:
        low, high = autoscale
        if not 0 <= low <= high or high < 1:
            raise FxllmError(f"--autoscale MIN:MAX needs 0 <= MIN <= MAX and MAX >= 1, got {low}:{high}")
    if not replica_cpus > 0:
        raise FxllmError(f"--replica-cpus must be > 0, got {replica_cpus}")
    if not replica_gpus >= 0:
        raise FxllmError(f"--replica-gpus must be >= 0, got {replica_gpus}")
    if router not in ROUTERS:
        raise FxllmError(f"router must be one of {', '.join(ROUTERS)}, got {router!r}")
    if max_queue is not None and (isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 0):
        raise FxllmError(f"--max-queue must be an integer >= 0, got {max_queue!r}")
    check_drain_timeout(drain_timeout)


def parse_autoscale(text: str) -> tuple[int, int]:
    low, sep, high = text.partition(":")
    try:
        if not sep:
            raise ValueError
        return int(low), int(high)
    except ValueError:
        raise FxllmError(f"--autoscale takes MIN:MAX replicas (e.g. 1:4), got {text!r}") from None


def artifact_name(artifact: str) -> str:
    """The model name a path or URI is served under by default: its last path segment."""
    if "://" not in artifact:
        return Path(artifact).resolve().name
    return PurePosixPath(urlsplit(artifact).path.rstrip("/")).name or "artifact"
