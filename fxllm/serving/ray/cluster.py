"""`fxllm serve ARTIFACT --ray`: run the artifact as a Ray Serve application until SIGTERM or Ctrl-C.

Without `--ray-address` a Ray cluster of this machine alone is started (and stopped at the end); with one, the
cluster there is joined (`host:port` of its GCS, `ray://host:10001`, or `auto`) and only the application is removed
at the end (the cluster, and Serve on it, are the user's). Checked before anything starts, each a one-line error
(exit 1) that leaves nothing running: the options, the `ray` extra, a local artifact, a reachable address, a free
port. A deployment that fails (a replica's constructor raises) is one line too, with everything stopped.

Shutdown: the application is deleted, which drains it (Serve stops routing to its replicas, lets running requests
finish for up to `--drain-timeout` seconds, then each engine replica aborts what is left); then Serve and Ray are
shut down when they were started here.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from fxllm.errors import FxllmError, MissingDependencyError
from fxllm.runtime.request_validation import check_engine_options
from fxllm.serving.ray.app import INGRESS_DEPLOYMENT, artifact_name, build_app, check_options, parse_autoscale
from fxllm.serving.ray.artifacts import is_uri
from fxllm.serving.server import ServeOptions

logger = logging.getLogger("fxllm.serving")
APP_NAME = "fxllm"
RAY_MODULES = ("ray", "ray.serve")
LOGGING = {"enable_access_log": False, "log_level": "WARNING"}


@dataclass
class RayServeOptions:
    server: ServeOptions  # what plain `fxllm serve` takes: host, port, names, API key, queue, drain, logging
    replicas: int | None = None  # None: 1, or autoscaled
    autoscale: str | None = None  # "MIN:MAX"
    ray_address: str | None = None
    replica_cpus: float = 1.0
    replica_gpus: float = 0.0
    router: str = "default"


def require_ray() -> None:
    """MissingDependencyError unless Ray Serve is installed (the `ray` extra)."""
    from fxllm.extras import missing_modules

    missing = missing_modules(RAY_MODULES[:1]) or missing_modules(RAY_MODULES[1:])
    if missing:
        raise MissingDependencyError(
            f"`fxllm serve --ray` needs Ray Serve, which is not installed (missing {', '.join(missing)}); install it "
            "with `pip install 'fxllm[ray]'`")


def serve_on_ray(options: RayServeOptions, **engine_options) -> int:
    """Run until SIGTERM (returns 0) or Ctrl-C (KeyboardInterrupt, after the same shutdown)."""
    server = options.server
    if options.replicas is not None and options.autoscale is not None:
        raise FxllmError("give either --replicas or --autoscale, not both")
    autoscale = parse_autoscale(options.autoscale) if options.autoscale is not None else None
    replicas = 1 if options.replicas is None else options.replicas
    check_options(replicas, autoscale, options.replica_cpus, options.replica_gpus, options.router, server.max_queue,
                  server.drain_timeout)
    check_engine_options(threads=engine_options.get("threads"), kv_blocks=engine_options.get("kv_blocks"),
                         kv_cache_memory=engine_options.get("kv_cache_memory"),
                         max_batch=engine_options.get("max_batch", 64),
                         max_tokens_per_step=engine_options.get("max_tokens_per_step"),
                         spec_k=engine_options.get("spec_k"))
    server.check()
    require_ray()
    local = options.ray_address is None
    if not is_uri(server.artifact) and (local or Path(server.artifact).exists()):
        from fxllm.runtime.manifest import load_manifest

        load_manifest(server.artifact, verify=False)  # a bad path is one line now; replicas verify checksums
    if not local:
        check_reachable(options.ray_address)
    port = free_port(server.host, server.port) if local else (server.port or 8000)
    app = build_app(server.artifact, served_model_name=server.served_model_name, api_key=server.api_key,
                    replicas=replicas, autoscale=autoscale, replica_cpus=options.replica_cpus,
                    replica_gpus=options.replica_gpus, router=options.router, max_queue=server.max_queue,
                    drain_timeout=server.drain_timeout, **engine_options)
    stop, received = threading.Event(), []

    def on_signal(signum, frame) -> None:
        received.append(signum)
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        with _RaySession(options.ray_address, verbose=server.log_level == "info") as serve:
            for sig in previous:  # again: ray.init puts its own SIGTERM handler in place (it aborts the process)
                signal.signal(sig, on_signal)
            if not stop.is_set():
                _run(serve, app, options, port, stop)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if received and received[0] == signal.SIGINT:
        raise KeyboardInterrupt
    return 0


def _run(serve, app, options: RayServeOptions, port: int, stop: threading.Event) -> None:
    server = options.server
    if options.ray_address is None:
        check_room(options)
    serve.start(http_options={"host": server.host, "port": port})
    started = False
    try:
        started = _start_app(serve, app, server, stop)
        if not started:
            return
        shown = f"[{server.host}]" if ":" in server.host else server.host
        name = server.served_model_name or artifact_name(server.artifact)
        count = options.replicas or 1
        scaling = f"autoscaled {options.autoscale}" if options.autoscale else f"{count} replica{'s' * (count != 1)}"
        print(f"fxllm: serving '{name}' on Ray Serve ({scaling}, {options.router} routing) at "
              f"http://{shown}:{port}/v1 (OpenAI API; SIGTERM or Ctrl-C stops)", flush=True)
        while not stop.wait(1.0):
            pass
    finally:
        if started:
            _drain_ingress(serve, server.drain_timeout)
        serve.delete(APP_NAME)  # drains the engine replicas: what still runs finishes within --drain-timeout


def _drain_ingress(serve, timeout: float) -> None:
    """New requests get 503 with the OpenAI body (and /health says "shutting down") while the running ones finish,
    for up to `timeout` seconds: deleting the app drops its route from Serve's proxy at once, so a request arriving
    during Serve's own drain got the proxy's plain-text 404, which clients do not retry."""
    try:
        ingress = serve.get_deployment_handle(INGRESS_DEPLOYMENT, app_name=APP_NAME)
        running = ingress.begin_drain.remote().result(timeout_s=10)
        deadline = time.monotonic() + timeout
        while running and time.monotonic() < deadline:
            time.sleep(0.25)
            running = ingress.running.remote().result(timeout_s=10)
    except Exception as exc:  # noqa: BLE001 - the ingress is gone or stuck: Serve's own drain still follows
        logger.warning("the ingress did not drain (%s); deleting the app", _last_line(exc))


def check_room(options: RayServeOptions) -> None:
    """FxllmError when the cluster started here cannot place the engine replicas it starts with (Serve would wait
    for them forever: a cluster of this machine never grows). A joined cluster may autoscale: _start_app warns."""
    import ray

    replicas = options.replicas or 1
    if options.autoscale is not None:
        replicas = max(parse_autoscale(options.autoscale)[0], 1)
    total = ray.cluster_resources()
    for resource, each, flag in (("CPU", options.replica_cpus, "--replica-cpus"),
                                 ("GPU", options.replica_gpus, "--replica-gpus")):
        have = total.get(resource, 0.0)
        if replicas * each > have + 1e-9:
            count = "--replicas" if options.autoscale is None else "the --autoscale minimum"
            raise FxllmError(f"{replicas} engine replica{'s' if replicas != 1 else ''} x {flag} {each:g} = "
                             f"{replicas * each:g} {resource}, but this machine's Ray cluster has {have:g} (lower "
                             f"{flag} or {count}, or join a larger cluster with --ray-address)")


def _start_app(serve, app, server: ServeOptions, stop: threading.Event) -> bool:
    """serve.run in a thread of its own, since it waits for every replica without a deadline: a signal ends the
    wait here (False: stopped before the app ran), and a replica that cannot be placed is said once (Serve's
    message: what each needs, what the cluster has). FxllmError (one line) when a replica failed to start."""
    failure: list[BaseException] = []

    def run() -> None:
        try:
            serve.run(app, name=APP_NAME, route_prefix="/",
                      logging_config={**LOGGING, "enable_access_log": server.access_log})
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
            failure.append(exc)

    thread = threading.Thread(target=run, name="fxllm-serve-run", daemon=True)
    thread.start()
    warned = False
    while thread.is_alive():
        if stop.wait(0.5):
            return False
        if not warned and "to be scheduled" in (waiting := _status_messages(serve)):
            warned = True
            logger.warning("waiting for Ray to place the engine replicas: %s",
                           next(line for line in waiting.splitlines() if "to be scheduled" in line))
    if failure:  # a replica failed to start: its traceback is in the deployment's status message
        raise FxllmError(f"the Ray Serve application failed to start: "
                         f"{_cause(failure[0], _status_messages(serve))}") from None
    return True


class _RaySession:
    """Ray (and Serve) for the run: a cluster started here is shut down at the end, however the run ends; a joined
    one is only disconnected from."""

    def __init__(self, address: str | None, verbose: bool):
        self.address, self.verbose = address, verbose

    def __enter__(self):
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        import ray
        from ray import serve

        self.serve = serve
        if not self.verbose:  # Serve logs its progress at INFO on this process's stderr
            logging.getLogger("ray.serve").setLevel(logging.WARNING)
        try:
            ray.init(address=self.address or "local", include_dashboard=False if self.address is None else None,
                     log_to_driver=self.verbose, logging_level=logging.INFO if self.verbose else logging.ERROR)
        except (ConnectionError, ValueError, RuntimeError) as exc:
            self._shutdown_ray()
            raise FxllmError(f"cannot connect to the Ray cluster at {self.address or 'this machine'}: "
                             f"{_last_line(exc)}") from None
        except BaseException:
            self._shutdown_ray()
            raise
        return serve

    def __exit__(self, *exc_info) -> None:
        try:
            if self.address is None:
                self.serve.shutdown()
        finally:
            self._shutdown_ray()

    def _shutdown_ray(self) -> None:
        import ray

        if ray.is_initialized():
            ray.shutdown()


def check_reachable(address: str, timeout: float = 5.0) -> None:
    """FxllmError unless something listens at the address's host:port (`auto` is left to Ray)."""
    if address in ("auto", "local"):
        return
    target = address.removeprefix("ray://")
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit():
        raise FxllmError(f"--ray-address takes HOST:PORT (the head node's GCS, e.g. 10.0.0.5:6379), "
                         f"ray://HOST:PORT or auto, got {address!r}")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as exc:
        reason = "timed out" if isinstance(exc, TimeoutError) else (exc.strerror or str(exc))
        raise FxllmError(f"cannot reach the Ray cluster at {address}: {reason} (start one with `ray start --head`, "
                         "or leave out --ray-address to run a cluster of this machine)") from None


def free_port(host: str, port: int) -> int:
    """`port` if it can be listened on here (0: any free port), else FxllmError."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind((host, port))
            return probe.getsockname()[1]
    except OSError as exc:
        raise FxllmError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None


def _status_messages(serve) -> str:
    try:
        application = serve.status().applications.get(APP_NAME)
    except Exception:  # Serve itself is in trouble: the exception's own message is all there is
        return ""
    if application is None:
        return ""
    return "\n".join([application.message, *(d.message for d in application.deployments.values())])


def _cause(exc: BaseException, details: str = "") -> str:
    """The error that a replica's traceback (in `details` or the exception's message) ends with: an fxllm error's
    message as it is, anything else as `Type: message`; else the exception's last line."""
    raised = [match for match in _RAISED.finditer(f"{exc}\n{details}")]
    ours = [m for m in raised if m.group(1).startswith("fxllm.")]
    if ours:
        return ours[-1].group(3).strip()
    if raised:
        return f"{raised[-1].group(2)}: {raised[-1].group(3).strip()}"
    return _last_line(exc)


_RAISED = re.compile(r"^\s*((?:[\w]+\.)*(\w+(?:Error|Exception))): (.+)$", re.MULTILINE)


def _last_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    return lines[-1] if lines else type(exc).__name__
