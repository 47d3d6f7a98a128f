"""Before/after in one run: a benchmark script under a base revision's code and under this working tree, interleaved
(base, this, base, this, ...), with the medians of its headline numbers and their ratio.

The base revision is exported with `git archive` into a temporary directory and imported ahead of this checkout
(PYTHONPATH), so both sides use the same virtual environment. Each side runs its own copy of the script (this
tree's when the base has none) with `--json`; the numbers compared per script:
  decode.py           every fxllm row's ms/token and prefill ms, per context
  paged.py            tokens/s of every throughput run (c), the prefix-caching prefill speedup (d)
  engine_overhead.py  per artifact: ms/token of one request and tokens/s of a batch, wall clock

    .venv/bin/python benchmarks/revisions.py --base main --rounds 3 -- engine_overhead.py ARTIFACT PAGED_ARTIFACT
    .venv/bin/python benchmarks/revisions.py --base main -- paged.py --quick --artifact PAGED_ARTIFACT
    .venv/bin/python benchmarks/revisions.py --base main -- decode.py --artifact ARTIFACT --skip-transformers
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE_DIRS = {"compiler": "compiler", "passes": "passes", "runtime": "runtime"}  # pyproject's package-dir
Extract = Callable[[dict], dict[str, float]]


def decode_numbers(data: dict) -> dict[str, float]:
    numbers = {}
    for context in data["results"]:
        for m in context["measurements"]:
            if m["system"].startswith("fxllm"):
                where = f"{m['system']} @ {context['prompt_tokens']} prompt tokens"
                numbers[f"{where}: ms/token"] = m["ms_per_token"]
                numbers[f"{where}: prefill ms"] = m["prefill_ms"]
    return numbers


def paged_numbers(data: dict) -> dict[str, float]:
    numbers = {f"{run['label']}: tokens/s": run["tokens_per_s"] for run in data["throughput"]["runs"]}
    numbers["prefix caching: prefill speedup (x)"] = data["prefix"]["prefill_speedup"] or 0.0
    return numbers


def overhead_numbers(data: dict) -> dict[str, float]:
    numbers = {}
    for artifact, m in data["artifacts"].items():
        name = f"{Path(artifact).name} ({'paged' if m['paged'] else 'contiguous'})"
        numbers[f"{name}: one request, ms/token"] = m["single_ms_per_token"]
        numbers[f"{name}: batch, tokens/s"] = m["batch_tokens_per_s"]
    return numbers


EXTRACTORS: dict[str, Extract] = {"decode.py": decode_numbers, "paged.py": paged_numbers,
                                  "engine_overhead.py": overhead_numbers}


def export_revision(revision: str, directory: Path) -> Path:
    """`git archive revision` under directory/tree, and an import root directory/path whose `fxllm` package maps
    the subpackages as pyproject.toml does. Returns the import root."""
    tree = directory / "tree"
    tree.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", revision], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    package = directory / "path" / "fxllm"
    shutil.copytree(tree / "fxllm", package)
    for name, folder in PACKAGE_DIRS.items():
        (package / name).symlink_to(tree / folder, target_is_directory=True)
    return directory / "path"


def side_environment(script: Path, import_root: Path | None) -> dict[str, str]:
    """The environment a side runs in; checks that `fxllm.runtime` really comes from that side's code."""
    env = dict(os.environ)
    if import_root is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(import_root), str(script.parent), env.get("PYTHONPATH", "")])
    probe = "import fxllm.runtime.engine as e; print(e.__file__)"
    found = Path(subprocess.run([sys.executable, "-c", probe], check=True, env=env, capture_output=True, text=True,
                                cwd=script.parent).stdout.strip())
    expected = (import_root / "fxllm" if import_root is not None else ROOT) / "runtime" / "engine.py"
    if found != expected:
        raise SystemExit(f"revisions.py: the side meant to import {expected} imports {found}")
    return env


def run_side(script: Path, args: list[str], env: dict[str, str], output: Path) -> dict:
    command = [sys.executable, str(script), *args, "--json", str(output)]
    subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL)
    return json.loads(output.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="main", help="git revision to compare against (default main)")
    parser.add_argument("--rounds", type=int, default=3, help="runs per side, interleaved (default 3)")
    parser.add_argument("script", choices=sorted(EXTRACTORS))
    parser.add_argument("script_args", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    extract = EXTRACTORS[args.script]
    with tempfile.TemporaryDirectory(prefix="fxllm-revisions-") as temporary:
        temporary = Path(temporary)
        base_root = export_revision(args.base, temporary / "base")
        base_script = temporary / "base" / "tree" / "benchmarks" / args.script
        base_script = base_script if base_script.exists() else ROOT / "benchmarks" / args.script
        this_script = ROOT / "benchmarks" / args.script
        sides = {args.base: (base_script, side_environment(base_script, base_root)),
                 "this tree": (this_script, side_environment(this_script, None))}
        numbers: dict[str, list[dict[str, float]]] = {side: [] for side in sides}
        for round_ in range(args.rounds):
            for side, (script, env) in sides.items():
                print(f"round {round_ + 1}/{args.rounds}: {args.script} on {side}", flush=True)
                numbers[side].append(extract(run_side(script, args.script_args, env, temporary / "out.json")))
    base, this = numbers[args.base], numbers["this tree"]
    print(f"\n{args.script} {' '.join(args.script_args)}: medians of {args.rounds} interleaved runs per side")
    print(f"| number | {args.base} | this tree | this / {args.base} |\n|---|---:|---:|---:|")
    for key in base[0]:
        before = statistics.median(run[key] for run in base)
        after = statistics.median(run[key] for run in this if key in run)
        print(f"| {key} | {before:.2f} | {after:.2f} | {after / before if before else float('nan'):.3f} |")


if __name__ == "__main__":
    main()
