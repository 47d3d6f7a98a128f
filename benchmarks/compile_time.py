"""Compile-time benchmark: `fxllm compile` of this checkout against another (a `git worktree` of an earlier commit),
alternated in one session, with every phase's time.

Each round compiles MODEL once with each checkout (before, after, before, after, ...: a busy machine's slow spells
hit both alike) in a fresh process through the same venv, the other checkout's `fxllm` package mapped in front of
the installed one; the phases come from the CLI's report (`phases:` load, capture, passes, lower; `lowering:` its
steps). Medians per phase and their ratio (after / before) at the end, with the load average before and after.

    git worktree add /tmp/fxllm-before 1454c19
    .venv/bin/python benchmarks/compile_time.py --before /tmp/fxllm-before            # SmolLM2, default pipeline
    .venv/bin/python benchmarks/compile_time.py --before /tmp/fxllm-before --rounds 3 --json compile.json
    .venv/bin/python benchmarks/compile_time.py --before /tmp/fxllm-before -- --requantize   # extra compile flags
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Runs `fxllm` from the checkout in argv[1] (its folders mapped as the package, like the editable install does).
BOOTSTRAP = """
import importlib.machinery, importlib.util, sys
root = sys.argv.pop(1)
folders = {"fxllm": "fxllm", "fxllm.compiler": "compiler", "fxllm.passes": "passes", "fxllm.runtime": "runtime"}
class Checkout:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name in folders:
            return importlib.util.spec_from_file_location(name, f"{root}/{folders[name]}/__init__.py",
                                                          submodule_search_locations=[f"{root}/{folders[name]}"])
        return None
sys.meta_path.insert(0, Checkout)
from fxllm.cli import main
sys.exit(main())
"""
PHASE_LINE = re.compile(r"^\s*(phases|lowering):\s*(.*)$")
ITEM = re.compile(r"([\w/. -]+?) ([0-9.]+)s")


def compile_once(checkout: Path, model: str, output: Path, extra: list[str]) -> dict[str, float]:
    """One `fxllm compile` with `checkout`'s code; → {phase: seconds} (lowering steps as lower/<step>), total."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", BOOTSTRAP, str(checkout), "compile", model, "-o", str(output),
                           *extra], capture_output=True, text=True, env={**os.environ, "FXLLM_QUIET": "1"})
    wall = time.perf_counter() - start
    if done.returncode:
        raise SystemExit(f"compile with {checkout} failed:\n{done.stderr[-3000:]}")
    seconds: dict[str, float] = {}
    for line in done.stdout.splitlines():
        match = PHASE_LINE.match(line)
        if match:
            prefix = "" if match.group(1) == "phases" else "lower/"
            seconds |= {prefix + name.strip(): float(value) for name, value in ITEM.findall(match.group(2))}
    seconds["total (wall)"] = wall
    return seconds


def _seconds(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, required=True, help="checkout of the earlier commit")
    parser.add_argument("--after", type=Path, default=ROOT, help="checkout to compare (default: this one)")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", type=Path)
    parser.add_argument("extra", nargs="*", help="extra `fxllm compile` arguments (after --)")
    args = parser.parse_args()
    runs: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory() as scratch:
        for round_index in range(args.rounds):
            for name, checkout in (("before", args.before), ("after", args.after)):
                seconds = compile_once(checkout, args.model, Path(scratch) / f"{name}{round_index}", args.extra)
                runs[name].append(seconds)
                print(f"round {round_index + 1} {name}: " + "  ".join(f"{k} {v:.1f}s" for k, v in seconds.items()),
                      flush=True)
    load_end = os.getloadavg()
    phases = list(dict.fromkeys(k for r in runs["before"] + runs["after"] for k in r))
    print(f"\n{args.model} {' '.join(args.extra)}: median of {args.rounds} rounds; load average "
          f"{load_start[0]:.1f} at the start, {load_end[0]:.1f} at the end ({os.cpu_count()} CPUs)")
    print("| phase | before s | after s | after / before |")
    print("|---|---:|---:|---:|")
    table = {}
    for phase in phases:
        before = [r[phase] for r in runs["before"] if phase in r]
        after = [r[phase] for r in runs["after"] if phase in r]
        b = statistics.median(before) if before else None
        a = statistics.median(after) if after else None
        table[phase] = {"before": b, "after": a}
        ratio = f"{a / b:.2f}x" if a is not None and b else "n/a"
        print(f"| {phase} | {_seconds(b)} | {_seconds(a)} | {ratio} |")
    if args.json:
        args.json.write_text(json.dumps({"runs": runs, "median": table, "load": [load_start, load_end]}, indent=1))


if __name__ == "__main__":
    main()
