"""Where an artifact's decode step spends its time in ONNX Runtime: per op type, from ORT's own profiler.

Loads each artifact with fxllm (the same session options the runtime uses), swaps in a profiling session over the
same model file, generates --new-tokens tokens after a prompt of about --context tokens (batch 1, greedy) and
prints, per artifact, a table of the decode steps' time by ONNX Runtime op type (after ORT's graph optimizations,
so fused nodes such as MatMulNBits show up under their own names): microseconds per step, share of the step, and
nodes per step. The node count matters on CPU: every node costs a few microseconds of dispatch on top of its math.

    .venv/bin/python benchmarks/ort_profile.py ARTIFACT [ARTIFACT...] --context 1024 --new-tokens 16
    .venv/bin/python benchmarks/ort_profile.py A B --rounds 3 --top 25 --json profile.json   # A B A B A B

The profiler adds its own overhead per node, so absolute step times here are above benchmarks/decode.py's;
compare shares and per-op times between artifacts of one run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

import fxllm
from decode import DEFAULT_PROMPT, quiet_libraries


def profiled_engine(artifact: Path, threads: int, directory: str, int8_activations: bool | None):
    """An engine whose ONNX Runtime session writes a profile (the runtime's session options, plus profiling)."""
    import onnxruntime as ort

    # one prefill call for any prompt (a paged engine would otherwise prefill in chunks, counted as steps here)
    engine = fxllm.load(artifact, threads=threads, int8_activations=int8_activations, max_tokens_per_step=1 << 16)
    engine.eos_token_ids = set()
    backend = engine.backend
    old = backend.session
    options = old.get_session_options()
    options.enable_profiling = True
    options.profile_file_prefix = os.path.join(directory, artifact.name)
    backend.use_session(ort.InferenceSession(str(engine.manifest.model_file), options, providers=old.get_providers()))
    return engine


def prompt_ids(tokenizer, prompt: str, context: int) -> list[int]:
    """The prompt's ids, the prompt repeated until they are at least `context` long (like decode.py's)."""
    ids = tokenizer.encode(prompt)
    if len(ids) < context:
        ids = tokenizer.encode(" ".join([prompt] * -(-context // len(ids))))
    return ids


def op_table(events: list[dict[str, Any]], skip_runs: int) -> tuple[dict[str, tuple[float, float]], float, int]:
    """{op type: (µs per step, nodes per step)} over the runs after the first `skip_runs`; mean step µs; steps."""
    runs = [e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"]
    runs.sort(key=lambda e: e["ts"])
    kept = runs[skip_runs:]
    if not kept:
        return {}, 0.0, 0
    windows = [(r["ts"], r["ts"] + r["dur"]) for r in kept]
    totals: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for event in events:
        if event.get("cat") != "Node" or not event.get("name", "").endswith("_kernel_time"):
            continue
        ts = event["ts"]
        if not any(start <= ts <= end for start, end in windows):
            continue
        op = event.get("args", {}).get("op_name", "?")
        totals[op] += event["dur"]
        counts[op] += 1
    steps = len(kept)
    table = {op: (totals[op] / steps, counts[op] / steps) for op in totals}
    return table, statistics.mean(r["dur"] for r in kept), steps


def profile(artifact: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One profiled generation of `artifact` (a fresh engine)."""
    with tempfile.TemporaryDirectory() as directory:
        engine = profiled_engine(artifact, args.threads, directory, args.int8_activations)
        ids = prompt_ids(engine.tokenizer, args.prompt, args.context)
        engine.generate_ids([ids], max_new_tokens=args.new_tokens)
        path = engine.backend.session.end_profiling()
        events = json.loads(Path(path).read_text())
    # runs: load-time checks may run none; the first run of generate is the prefill, the rest decode steps
    table, step_us, steps = op_table(events, skip_runs=1)
    return {"artifact": str(artifact), "prompt_tokens": len(ids), "steps": steps, "step_us": step_us,
            "ops": {op: {"us_per_step": us, "nodes_per_step": n} for op, (us, n) in table.items()}}


def merge(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One artifact's rounds → per op its smallest µs/step (and the smallest step time)."""
    merged = dict(results[0])
    ops = {op for result in results for op in result["ops"]}
    merged["ops"] = {op: min((r["ops"][op] for r in results if op in r["ops"]), key=lambda v: v["us_per_step"])
                     for op in ops}
    merged["step_us"] = min(r["step_us"] for r in results)
    merged["rounds"] = len(results)
    return merged


def print_profile(result: dict[str, Any], top: int) -> None:
    ops = sorted(result["ops"].items(), key=lambda item: -item[1]["us_per_step"])
    kernel = sum(v["us_per_step"] for _, v in ops)
    nodes = sum(v["nodes_per_step"] for _, v in ops)
    print(f"\n{result['artifact']}: prompt {result['prompt_tokens']} tokens, {result['steps']} decode steps, "
          f"fastest of {result.get('rounds', 1)} round(s), "
          f"{result['step_us'] / 1e3:.2f} ms per step (profiled), kernels {kernel / 1e3:.2f} ms, {nodes:.0f} nodes")
    print("| op | µs/step | share | nodes/step |")
    print("|---|---:|---:|---:|")
    for op, value in ops[:top]:
        print(f"| {op} | {value['us_per_step']:.0f} | {value['us_per_step'] / kernel:.1%} | "
              f"{value['nodes_per_step']:.0f} |")


def main() -> None:
    quiet_libraries()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifacts", type=Path, nargs="+")
    parser.add_argument("--context", type=int, default=64, help="prompt repeated to about this many tokens")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt", default=DEFAULT_PROMPT)
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--int8-activations", action="store_true", default=None)
    parser.add_argument("--rounds", type=int, default=1,
                        help="profile the artifacts in turn this many times (A B, A B, ...) and keep each op's "
                             "fastest round: a busy machine's slow spells inflate single runs")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rounds = [[profile(artifact, args) for artifact in args.artifacts] for _ in range(args.rounds)]
    results = [merge(list(per_artifact)) for per_artifact in zip(*rounds)]
    for result in results:
        print_profile(result, args.top)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
