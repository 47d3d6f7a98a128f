"""One model call of several artifacts, timed against each other: the graph's cost without the decode loop's noise.

Each artifact's engine generates a few tokens after a prompt of --context token ids and records the inputs of one
of its calls (--call: the prefill, or the last decode step); then every artifact's call is repeated through its own
backend (the runtime's binding path: the same arrays, bound outputs), --calls times per round, the artifacts
alternating A B C, A B C, ... for --rounds rounds. Repeating a recorded call is idempotent: a contiguous step
rewrites the same cache rows, a paged step writes its new K/V into the same staging arrays.

All artifacts live in this one process, so each one's timing includes the others' idle sessions (benchmarks/decode.py
measures each row in a process of its own); compare the artifacts with each other here, not with decode.py.

    .venv/bin/python benchmarks/step_ab.py FP32 PAGED --context 90            # one decode step at ~90 tokens
    .venv/bin/python benchmarks/step_ab.py FP32 VARIANT --context 23 --call prefill
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Any

from decode import script_main
from fxllm_measure import engine_for


def recorded_call(artifact: Path, context: int, call: str, threads: int,
                  int8_activations: bool | None = None) -> tuple[Any, Any]:
    """(backend, feeds) of the artifact's prefill or last decode call after a --context-token prompt."""
    engine = engine_for(artifact, threads, int8_activations)
    backend = engine.backend
    calls: list[Any] = []
    run = backend.run

    def recording(feeds):
        calls.append(feeds)
        return run(feeds)

    backend.run = recording
    engine.generate_ids([list(range(100, 100 + context))], max_new_tokens=3)
    backend.run = run
    return backend, calls[0] if call == "prefill" else calls[-1]


def main_run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    if args.rounds < 1 or args.calls < 1 or args.context < 1:
        parser.error("--rounds, --calls and --context must be at least 1")
    calls = [recorded_call(artifact, args.context, args.call, args.threads, args.int8_activations)
             for artifact in args.artifacts]
    for backend, feeds in calls:  # warm-up
        for _ in range(3):
            backend.run(feeds)
    times: list[list[float]] = [[] for _ in calls]
    for _ in range(args.rounds):
        for index, (backend, feeds) in enumerate(calls):
            start = time.perf_counter()
            for _ in range(args.calls):
                backend.run(feeds)
            times[index].append((time.perf_counter() - start) / args.calls * 1e3)
    base = statistics.median(times[0])
    print(f"one {args.call} call after {args.context} prompt tokens, {args.threads} threads, {args.rounds} alternating "
          f"rounds of {args.calls} calls")
    print("| artifact | median ms | min ms | vs first |\n|---|---:|---:|---:|")
    for artifact, measured in zip(args.artifacts, times):
        median = statistics.median(measured)
        print(f"| {os.path.basename(os.path.normpath(artifact))} | {median:.2f} | {min(measured):.2f} | "
              f"{median / base:.3f} |")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifacts", type=Path, nargs="+", help="compiled artifacts; the first is the reference")
    parser.add_argument("--context", type=int, default=64, help="prompt token ids (100, 101, ...)")
    parser.add_argument("--call", choices=("decode", "prefill"), default="decode")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=10, help="calls per artifact per round")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--int8-activations", action="store_true", default=None,
                        help="quantized artifacts: int8 matmul activations (default: what each artifact recommends)")
    return parser


def main() -> None:
    script_main(main_run, build_parser, "step_ab.py")


if __name__ == "__main__":
    main()
