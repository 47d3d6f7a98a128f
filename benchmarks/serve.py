"""`fxllm serve` under load, next to the in-process engine on the same workload, in one run (loopback only).

For 1, 8 and 32 concurrent streaming clients (--clients), each client sends its share of the level's requests one
after another (closed loop: 4 requests at 1 client, 2 per client otherwise). Every request is a completion of a real
text prompt of 16-160 tokens (mixed lengths, drawn once with --seed) asking for --new-tokens tokens, greedy, with
`ignore_eos` so every request emits exactly that many. Two systems run the same requests at the same concurrency:

- http: `fxllm serve` in a subprocess on 127.0.0.1, clients streaming server-sent events over httpx from this
  process (`stream_options.include_usage` gives the token count);
- in-process: an AsyncEngine on the same artifact in this process, the same closed-loop clients as coroutines;
- with --ray: `fxllm serve --ray --replicas R` (a Ray cluster of this machine, started and stopped by the server)
  for each R of --replicas, each replica reserving cpus/R CPUs (its intra-op threads), the same clients over HTTP.

All servers are started first and stay up; at each level the systems take turns for --reps repetitions, the order
rotating between repetitions (so a change in the machine's load hits them alike; an idle Ray cluster costs a few
percent of a core, which the others pay while it waits). A row reports the median output tokens/s over its repetitions and
latency percentiles over all its requests: time to first token (request sent → first text) and inter-token latency
(gaps between a request's text events, one token each; a Ray replica sends the events that are ready together, so
several can arrive at once); for the servers the mean time to first token as the client saw it next to the one the
server itself measured (its fxllm_time_to_first_token_seconds histogram: admission → first token), which separates
queueing in the engine from the cost of getting the text to the client. Errors (a non-200 answer, an error event, a
broken stream, fewer tokens than asked) must be 0. The load average is printed at the start and the end.

Targets (#12): http at 32 clients >= 90% of the in-process tokens/s, and >= 4x http at 1 client. With --ray (#13)
there is no target: on 2 cores, 2 replicas split the cores (report, don't expect 2x).

    .venv/bin/python benchmarks/serve.py             # SmolLM2-135M paged, ~5 minutes on 2 cores
    .venv/bin/python benchmarks/serve.py --ray --replicas 1,2    # plus Ray Serve with 1 and 2 replicas
    .venv/bin/python benchmarks/serve.py --quick     # smoke run: 1 repetition, 1 request per client, 16 tokens

Without --artifact, MODEL is compiled once with the paged pipeline into ~/.cache/fxllm/bench/<model>--paged (shared
with benchmarks/paged.py) and reused.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import select
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

from decode import CACHE_DIR, ensure_artifact, script_main
from fxllm.compiler.sources import resolve_source
from fxllm.runtime.async_engine import AsyncEngine
from fxllm.runtime.request import SamplingParams
from paged import CORPUS, PAGED_PASSES

PASSES = PAGED_PASSES.format(block_size=16)  # the same artifact as benchmarks/paged.py
PROMPT_TOKENS = (16, 160)
TARGET_VS_ENGINE, TARGET_SCALING = 0.90, 4.0


@dataclass
class Run:
    """One system at one level, one repetition."""

    seconds: float = 0.0
    tokens: int = 0
    errors: int = 0
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    server_ttft: tuple[float, float] = (0.0, 0.0)  # the server's TTFT histogram growth: (sum s, count)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


@dataclass
class Row:
    clients: int
    system: str
    requests: int
    runs: list[Run] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return statistics.median(r.tokens_per_s for r in self.runs)

    def percentile(self, name: str, q: float) -> float:
        values = [v for r in self.runs for v in getattr(r, name)]
        return float(np.percentile(values, q)) * 1e3 if values else float("nan")

    @property
    def errors(self) -> int:
        return sum(r.errors for r in self.runs)

    @property
    def mean_ttft_ms(self) -> float:
        values = [v for r in self.runs for v in r.ttft]
        return statistics.mean(values) * 1e3 if values else float("nan")

    @property
    def server_ttft_ms(self) -> float:
        total, count = (sum(r.server_ttft[i] for r in self.runs) for i in (0, 1))
        return total / count * 1e3 if count else float("nan")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--artifact", help="a compiled paged artifact (default: MODEL compiled into the cache)")
    parser.add_argument("--clients", default="1,8,32", help="concurrency levels (default 1,8,32)")
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens per request (default 128)")
    parser.add_argument("--reps", type=int, default=2, help="repetitions per system and level (default 2)")
    parser.add_argument("--threads", type=int, help="intra-op threads of both engines (default: all cores)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ray", action="store_true", help="also `fxllm serve --ray` (the ray extra)")
    parser.add_argument("--replicas", default="1,2", help="with --ray: replica counts to run (default 1,2)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 1 repetition, 1 request per client, 16 tokens")
    parser.add_argument("--json", help="also write the rows here")
    parser.add_argument("--recompile", action="store_true")
    return parser


def prompts_for(engine, count: int, seed: int) -> list[list[int]]:
    """`count` windows of the corpus' tokens with lengths uniform in PROMPT_TOKENS."""
    ids = engine.tokenizer.encode(CORPUS * 4, add_special_tokens=False)
    rng = np.random.default_rng(seed)
    prompts = []
    for _ in range(count):
        length = int(rng.integers(PROMPT_TOKENS[0], PROMPT_TOKENS[1] + 1))
        start = int(rng.integers(0, len(ids) - length))
        prompts.append(ids[start:start + length])
    return prompts


def requests_at(clients: int, quick: bool) -> int:
    return clients if quick else (4 if clients == 1 else 2 * clients)


# -- the two systems --------------------------------------------------------------------------------------------------


async def closed_loop(prompts: list[list[int]], clients: int, one) -> Run:
    """`clients` workers take the prompts in turn; one(prompt, run) runs a request and records into run."""
    run, queue = Run(), list(enumerate(prompts))

    async def worker():
        while queue:
            _, prompt = queue.pop(0)
            await one(prompt, run)

    start = time.perf_counter()
    await asyncio.gather(*[worker() for _ in range(clients)])
    run.seconds = time.perf_counter() - start
    return run


async def http_level(url: str, prompts: list[list[int]], clients: int, new_tokens: int) -> Run:
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=httpx.Limits(max_connections=clients + 4)) as http:
        async def one(prompt: list[int], run: Run) -> None:
            body = {"model": "bench", "prompt": prompt, "max_tokens": new_tokens, "temperature": 0, "stream": True,
                    "ignore_eos": True, "stream_options": {"include_usage": True}}
            sent, last, tokens = time.perf_counter(), None, 0
            try:
                async with http.stream("POST", "/completions", json=body) as response:
                    if response.status_code != 200:
                        run.errors += 1
                        return
                    async for line in response.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            run.errors += 1
                            return
                        if chunk.get("usage"):
                            tokens = chunk["usage"]["completion_tokens"]
                        elif chunk["choices"] and chunk["choices"][0]["text"]:
                            now = time.perf_counter()
                            (run.ttft if last is None else run.itl).append(now - (sent if last is None else last))
                            last = now
            except httpx.HTTPError:
                run.errors += 1
                return
            run.tokens += tokens
            run.errors += tokens != new_tokens

        return await closed_loop(prompts, clients, one)


async def engine_level(engine: AsyncEngine, prompts: list[list[int]], clients: int, new_tokens: int) -> Run:
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    counter = iter(range(10 ** 9))

    async def one(prompt: list[int], run: Run) -> None:
        sent, last, tokens = time.perf_counter(), None, 0
        async for output in engine.generate(prompt, params, f"bench-{next(counter)}"):
            if output.new_token_ids:
                now = time.perf_counter()
                (run.ttft if last is None else run.itl).append(now - (sent if last is None else last))
                last, tokens = now, tokens + len(output.new_token_ids)
            if output.finished and output.finish_reason not in ("length", "stop"):
                run.errors += 1
        run.tokens += tokens
        run.errors += tokens != new_tokens

    return await closed_loop(prompts, clients, one)


class Server:
    """`fxllm serve` (with `ray_options`: `fxllm serve --ray ...`) in a subprocess on 127.0.0.1 (any free port)."""

    def __init__(self, artifact: Path, threads: int | None, ray_options: tuple[str, ...] = ()):
        argv = [str(Path(sys.executable).with_name("fxllm")), "serve", str(artifact), "--port", "0",
                "--served-model-name", "bench", "--max-queue", "1024", *ray_options]
        if threads:
            argv += ["--threads", str(threads)]
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        ready, _, _ = select.select([self.proc.stdout], [], [], 300)
        match = re.search(r"http://\S+/v1", self.proc.stdout.readline() if ready else "")
        if match is None:
            self.proc.kill()
            raise SystemExit("serve.py: the server did not start")
        self.url = match.group(0)
        # One short request first: a fresh process's first model calls are slow (ONNX Runtime's first runs).
        for _ in range(2):
            httpx.post(f"{self.url}/completions", json={"model": "bench", "prompt": "Hello", "max_tokens": 4},
                       timeout=300).raise_for_status()

    def server_ttft(self) -> tuple[float, float]:
        """The server's time-to-first-token histogram, summed over its replicas: (sum in s, count)."""
        total = count = 0.0
        for line in httpx.get(self.url.removesuffix("/v1") + "/metrics", timeout=60).text.splitlines():
            if line.startswith("fxllm_time_to_first_token_seconds_sum"):
                total += float(line.rsplit(" ", 1)[1])
            elif line.startswith("fxllm_time_to_first_token_seconds_count"):
                count += float(line.rsplit(" ", 1)[1])
        return total, count

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(120)


def measured(server: Server, level, requests: int) -> Run:
    """Run one level of `requests` requests against the server, with the growth of its own TTFT histogram (one
    observation per request; Ray replicas push their metrics every second: wait for all of them)."""
    before = server.server_ttft()
    run = asyncio.run(level)
    deadline = time.monotonic() + 15
    while True:
        after = server.server_ttft()
        if after[1] - before[1] >= requests or time.monotonic() > deadline:
            break
        time.sleep(0.25)
    run.server_ttft = (after[0] - before[0], after[1] - before[1])
    return run


# -- the run ----------------------------------------------------------------------------------------------------------


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # stop the servers on the way out
    if args.quick:
        args.reps, args.new_tokens = 1, 16
    levels = [int(c) for c in args.clients.split(",")]
    if args.artifact:
        artifact = Path(args.artifact)
    else:
        artifact = CACHE_DIR / f"{resolve_source(args.model).name}--paged"
        ensure_artifact(args.model, artifact, PASSES, args.recompile)
    engine = AsyncEngine.load(artifact, threads=args.threads)
    if not engine.engine.paged:
        parser.error(f"{artifact} is not a paged artifact (compile it with --passes {PASSES})")
    engine.engine.generate("Hello", max_new_tokens=4)  # the same warm-up as each server's
    replica_counts = [int(r) for r in args.replicas.split(",")] if args.ray else []
    servers: dict[str, Server] = {}
    statuses: dict[str, int] = {}
    try:
        servers["http"] = Server(artifact, args.threads)
        for replicas in replica_counts:  # each its own Ray cluster of this machine, all up for the whole run
            cpus = (os.cpu_count() or 1) / replicas
            servers[f"ray x{replicas}"] = Server(artifact, args.threads, ("--ray", "--replicas", str(replicas),
                                                                          "--replica-cpus", f"{cpus:g}"))
        print(f"artifact {artifact}; servers {', '.join(f'{k} {v.url}' for k, v in servers.items())}; "
              f"{os.cpu_count()} CPUs, threads {args.threads or 'all'}; {args.new_tokens} new tokens per request, "
              f"prompts of {PROMPT_TOKENS[0]}-{PROMPT_TOKENS[1]} tokens; load average {load_average()}", flush=True)
        rows = []
        for clients in levels:
            prompts = prompts_for(engine.engine, requests_at(clients, args.quick), args.seed + clients)
            level_rows = [Row(clients, system, len(prompts)) for system in [*servers, "in-process"]]
            for rep in range(args.reps):
                shift = rep % len(level_rows)  # rotate the order: each system runs first, second, ... in turn
                for row in level_rows[shift:] + level_rows[:shift]:
                    if row.system == "in-process":
                        row.runs.append(asyncio.run(engine_level(engine, prompts, clients, args.new_tokens)))
                    else:
                        server = servers[row.system]
                        row.runs.append(measured(server, http_level(server.url, prompts, clients, args.new_tokens),
                                                 len(prompts)))
                    report(row, rep)
            rows += level_rows
    finally:
        for system, server in servers.items():
            statuses[system] = server.stop()
    print(f"load average at the end {load_average()}")
    print_table(rows, levels, statuses)
    if args.json:
        Path(args.json).write_text(json.dumps([{"clients": r.clients, "system": r.system, "requests": r.requests,
                                                "tokens_per_s": r.tokens_per_s, "errors": r.errors,
                                                "ttft_mean_ms": r.mean_ttft_ms, "server_ttft_mean_ms": r.server_ttft_ms,
                                                **{f"{n}_p{q}_ms": r.percentile(n, q) for n in ("ttft", "itl")
                                                   for q in (50, 99)}} for r in rows], indent=2))


def report(row: Row, rep: int) -> None:
    print(f"  {row.clients:>3} clients {row.system:<10} rep {rep}: {row.runs[-1].tokens_per_s:7.1f} tok/s",
          flush=True)


def load_average() -> str:
    return " ".join(f"{value:.1f}" for value in os.getloadavg())


def print_table(rows: list[Row], levels: list[int], statuses: dict[str, int]) -> None:
    print(f"\n{'clients':>7} {'system':<10} {'requests':>8} {'out tok/s':>9} {'vs engine':>9} {'TTFT p50':>9} "
          f"{'TTFT p99':>9} {'TTFT mean':>9} {'srv mean':>9} {'ITL p50':>8} {'ITL p99':>8} {'errors':>6}")
    engine_rate = {r.clients: r.tokens_per_s for r in rows if r.system == "in-process"}
    for r in sorted(rows, key=lambda r: (r.clients, r.system != "http", r.system != "in-process", r.system)):
        known = r.system != "in-process" and r.server_ttft_ms == r.server_ttft_ms  # (nan: none observed)
        server = f"{r.server_ttft_ms:>7.0f}ms" if known else f"{'-':>9}"
        print(f"{r.clients:>7} {r.system:<10} {r.requests:>8} {r.tokens_per_s:>9.1f} "
              f"{r.tokens_per_s / engine_rate[r.clients]:>8.2f}x {r.percentile('ttft', 50):>7.0f}ms "
              f"{r.percentile('ttft', 99):>7.0f}ms {r.mean_ttft_ms:>7.0f}ms {server} {r.percentile('itl', 50):>6.0f}ms "
              f"{r.percentile('itl', 99):>6.0f}ms {r.errors:>6}")
    rate = {(r.system, r.clients): r.tokens_per_s for r in rows}
    top, bottom = max(levels), min(levels)
    errors = sum(r.errors for r in rows)
    print(f"\nhttp at {top} clients: {rate['http', top] / engine_rate[top]:.2f}x the in-process engine "
          f"(target >= {TARGET_VS_ENGINE:.2f}x), {rate['http', top] / rate['http', bottom]:.2f}x http at {bottom} "
          f"client(s) (target >= {TARGET_SCALING:.1f}x); errors {errors} (target 0); exit status of the servers "
          f"on SIGTERM: {statuses}")
    for system in sorted({r.system for r in rows if r.system.startswith("ray")}):
        print(f"{system} at {top} clients: {rate[system, top] / rate['http', top]:.2f}x plain http, "
              f"{rate[system, top] / engine_rate[top]:.2f}x the in-process engine")


def main() -> None:
    script_main(run, build_parser, "serve.py")


if __name__ == "__main__":
    main()
