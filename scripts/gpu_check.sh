#!/usr/bin/env bash
# The prepared GPU check (issue #15; docs/gpu.md): builds random-weight SmolLM2-135M- and Llama-3.2-1B-shaped models,
# compiles them for the torch target and prints/writes: environment, fp32 greedy parity against transformers, bf16
# decode speed against transformers (eager, and torch.compile with a static cache), and the HBM-bandwidth floor.
# Needs only the working tree and a Python with torch + transformers (a lent GPU machine has them; no network).
# Without a CUDA device it runs CI-sized on CPU and the GPU rows say "no CUDA device".
#   scripts/gpu_check.sh [--out FILE] [--cpu-decode] [--budget-s SECONDS]     (results: $OUT/gpu_check.md if $OUT is set)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PYTHON="${PYTHON:-}"
if [ -z "$PYTHON" ]; then
    if [ -x "$ROOT/.venv/bin/python" ]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
# Not installed (a bare GPU machine): lay out the fxllm package from the tree (pyproject's package-dir mapping)
# as symlinks in a temporary directory on PYTHONPATH.
if ! "$PYTHON" -c "import fxllm.compiler, fxllm.runtime" 2>/dev/null; then
    TREE="$(mktemp -d)"
    trap 'rm -rf "$TREE"' EXIT
    mkdir "$TREE/fxllm"
    for f in "$ROOT"/fxllm/*.py; do ln -s "$f" "$TREE/fxllm/"; done
    for sub in compiler passes runtime; do ln -s "$ROOT/$sub" "$TREE/fxllm/$sub"; done
    export PYTHONPATH="$TREE${PYTHONPATH:+:$PYTHONPATH}"
fi
ARGS=("$@")
if [ -n "${OUT:-}" ] && [[ " $* " != *" --out "* ]]; then ARGS+=(--out "$OUT/gpu_check.md"); fi
"$PYTHON" "$ROOT/benchmarks/gpu_check.py" "${ARGS[@]}"
