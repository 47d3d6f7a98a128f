"""An fxllm artifact as a Ray Serve application (`fxllm serve ARTIFACT --ray`, the `ray` extra): the same OpenAI
app as `fxllm serve`, in front of replicas that each own one engine core. See docs/ray.md.

    from ray import serve
    from fxllm.serving.ray import build_app
    serve.run(build_app("artifacts/smollm2-paged", replicas=2, router="prefix"), route_prefix="/")

| module | what |
| --- | --- |
| `app.py` | `build_app` / `app_builder`: the deployments and their Serve options |
| `engine.py` | the engine deployment: one OpenAIService per replica, replies as a head plus events |
| `ingress.py` | the ingress deployment: fxllm/serving/app.py's app forwarding to the engines, retries |
| `router.py` | the prefix-aware request router |
| `board.py` | the metrics board merging every replica's Prometheus metrics |
| `health.py` | the engine health check (stopped, stalled, failing model calls) |
| `artifacts.py` | a path every node reads, or a URI copied once per node into a checksummed cache |
| `cluster.py` | the CLI: start or join a cluster, run the app, drain and shut everything down |
"""

from fxllm.serving.ray.app import app_builder, build_app

__all__ = ["app_builder", "build_app"]
