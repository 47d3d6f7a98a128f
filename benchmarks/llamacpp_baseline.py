"""llama.cpp baseline for the decode benchmark: a GGUF file run by llama.cpp's C API, CPU, batch 1, greedy.

No compiler is needed: `setup` installs a prebuilt llama.cpp library from PyPI into a venv of its own (never the
project's .venv) and the benchmark calls its C API through cffi::

    python3 benchmarks/llamacpp_baseline.py setup                 # ~/.cache/fxllm/llamacpp-venv (idempotent)

The library is the CPU build inside the `llama-cpp-cffi` 0.3.1 wheel (manylinux_2_28; llama.cpp of late 2024,
built for AVX2 + FMA + F16C, `llama_print_system_info` is printed with the results). Why that one:
- llama-cpp-python builds llama.cpp from source (~25 minutes on 2 cores); on the development machine its native
  build imported but died with SIGILL at the first evaluation (the CPU reports AMX and AVX-512 features,
  presumably not all usable inside its VM).
- Newer llama-cpp-cffi wheels (0.4.x) need GCC 14's libstdc++ (`__cxa_call_terminate`), which needs glibc 2.38;
  Debian 12 has 2.36.
So this baseline is an AVX2 llama.cpp, not a current native build with AVX-512 kernels: on a machine with AVX-512
a fresh native llama.cpp may well be faster. Say so next to any number it produces.

Measuring (the same prompt ids as the other systems; prints one JSON object)::

    ~/.cache/fxllm/llamacpp-venv/bin/python benchmarks/llamacpp_baseline.py bench --model FILE.gguf \\
        --prompt-ids 1,2,3 --new-tokens 64 --repeats 3 --threads 2

A run evaluates the prompt in one `llama_decode` (prefill_ms: that call plus the argmax of its last logits), then
each of the remaining new_tokens - 1 tokens is one `llama_decode` of one token plus an argmax over its logits
(ms_per_token: their mean). Greedy, no early stop at EOS, so the output is the plain argmax sequence like every
other row. One warm-up run, then --repeats timed runs; medians are reported. Everything imported at the top is the
standard library, so benchmarks/decode.py imports this file for `measure()` (which shells out to the venv's python).
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

DEFAULT_VENV = Path.home() / ".cache" / "fxllm" / "llamacpp-venv"
WHEEL = "llama-cpp-cffi==0.3.1"  # see the module docstring for why this version
LIBRARY_GLOB = "lib/python3*/site-packages/llama/_llama_cpp_cpu*.so"


def venv_python(venv: Path = DEFAULT_VENV) -> Path:
    return venv / "bin" / "python"


def setup_venv(venv: Path = DEFAULT_VENV, base_python: str = "python3") -> Path:
    """A venv with the prebuilt library (its wheel's Python package and dependencies are not needed) and cffi."""
    python = venv_python(venv)
    if not python.exists():
        subprocess.run([base_python, "-m", "venv", str(venv)], check=True)
    if not glob.glob(str(venv / LIBRARY_GLOB)):
        subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--no-deps", "--only-binary=:all:", WHEEL],
                       check=True)
    if subprocess.run([str(python), "-c", "import cffi, numpy"], capture_output=True).returncode != 0:
        subprocess.run([str(python), "-m", "pip", "install", "--quiet", "cffi", "numpy"], check=True)
    return python


def load_library():
    """(lib, ffi) of the CPU library in this venv, imported by path: the wheel's package __init__ would import
    transformers and pick a GPU build when it finds one."""
    found = glob.glob(os.path.join(sys.prefix, LIBRARY_GLOB))
    if not found:
        raise SystemExit(f"no llama.cpp library in {sys.prefix}: run `python3 {__file__} setup` first")
    spec = importlib.util.spec_from_file_location("_llama_cpp_cpu", found[0])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.lib, module.ffi


def benchmark(model: Path, prompt_ids: list[int], new_tokens: int, repeats: int, threads: int) -> dict[str, Any]:
    """Runs inside the llama.cpp venv."""
    import numpy as np

    lib, ffi = load_library()
    lib.llama_backend_init()
    handle = lib.llama_load_model_from_file(str(model).encode(), lib.llama_model_default_params())
    if handle == ffi.NULL:
        raise SystemExit(f"llama.cpp cannot load {model}")
    params = lib.llama_context_default_params()
    params.n_ctx = len(prompt_ids) + new_tokens + 8
    params.n_batch = params.n_ubatch = max(len(prompt_ids), 8)
    params.n_threads = params.n_threads_batch = threads
    context = lib.llama_new_context_with_model(handle, params)
    vocab = lib.llama_n_vocab(handle)
    prompt = ffi.new("int32_t[]", prompt_ids)
    one = ffi.new("int32_t[1]")

    def decode(tokens, count: int) -> int:
        """Evaluate `count` tokens; the argmax of the last one's logits."""
        if lib.llama_decode(context, lib.llama_batch_get_one(tokens, count)) != 0:
            raise SystemExit("llama_decode failed")
        logits = np.frombuffer(ffi.buffer(lib.llama_get_logits_ith(context, -1), vocab * 4), dtype=np.float32)
        return int(np.argmax(logits))

    def run_once() -> tuple[float, float, list[int]]:
        lib.llama_kv_cache_clear(context)
        start = time.perf_counter()
        token = decode(prompt, len(prompt_ids))
        prefill = time.perf_counter() - start
        tokens = [token]
        start = time.perf_counter()
        for _ in range(new_tokens - 1):
            one[0] = token
            token = decode(one, 1)
            tokens.append(token)
        return prefill * 1e3, (time.perf_counter() - start) * 1e3 / (new_tokens - 1), tokens

    run_once()
    runs = [run_once() for _ in range(repeats)]
    system = ffi.string(lib.llama_print_system_info()).decode().strip()
    lib.llama_free(context)
    lib.llama_free_model(handle)
    return {"ms_per_token": statistics.median(r[1] for r in runs), "prefill_ms": statistics.median(r[0] for r in runs),
            "runs_ms_per_token": [round(r[1], 3) for r in runs], "tokens": runs[-1][2],
            "model_bytes": model.stat().st_size, "llama_cpp": f"{WHEEL} CPU library ({system})"}


def measure(model: Path, prompt_ids: list[int], new_tokens: int, repeats: int, threads: int,
            python: str | None = None) -> dict[str, Any]:
    """benchmark() through the llama.cpp venv's python (for callers in the project's .venv)."""
    python = str(python or venv_python())
    if not Path(python).exists():
        raise SystemExit(f"no llama.cpp venv at {python}: run `python3 {__file__} setup` first")
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
