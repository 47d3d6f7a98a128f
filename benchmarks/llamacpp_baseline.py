"""llama.cpp baseline for the decode benchmark: a GGUF file run by llama-cpp-python, CPU, batch 1, greedy.

llama-cpp-python builds llama.cpp from its PyPI sdist (about 25 minutes on 2 busy cores) into a venv of its own,
never the project's .venv::

    python3 benchmarks/llamacpp_baseline.py setup                 # ~/.cache/fxllm/llamacpp-venv (idempotent)

On the development machine that build (llama-cpp-python 0.3.36, llama.cpp's default native CPU build) imports,
but the process dies with SIGILL at the first evaluation: the CPU reports AMX and AVX-512 features, presumably not
all usable inside its VM. Not yet tried: rebuilding with CMAKE_ARGS="-DGGML_NATIVE=OFF" (another ~25 minutes).

Measuring (the same prompt ids as the other systems; prints one JSON object)::

    ~/.cache/fxllm/llamacpp-venv/bin/python benchmarks/llamacpp_baseline.py bench --model FILE.gguf \\
        --prompt-ids 1,2,3 --new-tokens 64 --repeats 3 --threads 2

A run evaluates the prompt (prefill_ms: that forward pass plus picking token 1 from its logits), then each of the
remaining new_tokens - 1 tokens is one `eval([token])` plus an argmax over its logits (ms_per_token: their mean).
Greedy, no early stop at EOS, so the output is the plain argmax sequence like every other row. One warm-up run,
then --repeats timed runs; medians are reported. Everything imported at the top is the standard library, so
benchmarks/decode.py imports this file for `measure()` (which shells out to the venv's python).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

DEFAULT_VENV = Path.home() / ".cache" / "fxllm" / "llamacpp-venv"
REQUIREMENTS = ["llama-cpp-python", "numpy"]


def venv_python(venv: Path = DEFAULT_VENV) -> Path:
    return venv / "bin" / "python"


def setup_venv(venv: Path = DEFAULT_VENV, base_python: str = "python3") -> Path:
    python = venv_python(venv)
    if python.exists() and subprocess.run([str(python), "-c", "import llama_cpp"], capture_output=True).returncode == 0:
        return python
    if not python.exists():
        subprocess.run([base_python, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", *REQUIREMENTS], check=True,
                   env={"CMAKE_BUILD_PARALLEL_LEVEL": "2", **__import__("os").environ})
    return python


def benchmark(model: Path, prompt_ids: list[int], new_tokens: int, repeats: int, threads: int) -> dict[str, Any]:
    """Runs inside the llama-cpp-python venv."""
    import llama_cpp
    import numpy as np

    llm = llama_cpp.Llama(str(model), n_ctx=len(prompt_ids) + new_tokens + 8, n_threads=threads,
                          n_threads_batch=threads, n_batch=max(len(prompt_ids), 8), verbose=False)

    def run_once() -> tuple[float, float, list[int]]:
        llm.reset()
        start = time.perf_counter()
        llm.eval(prompt_ids)
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        prefill = time.perf_counter() - start
        tokens = [token]
        start = time.perf_counter()
        for _ in range(new_tokens - 1):
            llm.eval([token])
            token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
            tokens.append(token)
        return prefill * 1e3, (time.perf_counter() - start) * 1e3 / (new_tokens - 1), tokens

    run_once()
    runs = [run_once() for _ in range(repeats)]
    return {"ms_per_token": statistics.median(r[1] for r in runs), "prefill_ms": statistics.median(r[0] for r in runs),
            "runs_ms_per_token": [round(r[1], 3) for r in runs], "tokens": runs[-1][2],
            "model_bytes": model.stat().st_size, "llama_cpp_python": llama_cpp.__version__}


def measure(model: Path, prompt_ids: list[int], new_tokens: int, repeats: int, threads: int,
            python: str | None = None) -> dict[str, Any]:
    """benchmark() through the llama-cpp-python venv's python (for callers in the project's .venv)."""
    python = str(python or venv_python())
    if not Path(python).exists():
        raise SystemExit(f"no llama-cpp-python venv at {python}: run `python3 {__file__} setup` first")
    command = [python, __file__, "bench", "--model", str(model), "--prompt-ids", ",".join(map(str, prompt_ids)),
               "--new-tokens", str(new_tokens), "--repeats", str(repeats), "--threads", str(threads)]
    out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("bench")
    bench.add_argument("--model", type=Path, required=True)
    bench.add_argument("--prompt-ids", required=True, help="comma list of token ids")
    bench.add_argument("--new-tokens", type=int, default=64)
    bench.add_argument("--repeats", type=int, default=3)
    bench.add_argument("--threads", type=int, default=2)
    setup = sub.add_parser("setup")
    setup.add_argument("--venv", type=Path, default=DEFAULT_VENV)
    args = parser.parse_args()
    if args.command == "setup":
        print(setup_venv(args.venv))
        return
    ids = [int(i) for i in args.prompt_ids.split(",") if i]
    print(json.dumps(benchmark(args.model, ids, args.new_tokens, args.repeats, args.threads)))


if __name__ == "__main__":
    sys.exit(main())
