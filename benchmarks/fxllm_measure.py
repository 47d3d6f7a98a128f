"""One fxllm artifact's decode speed, measured in a process of its own (how benchmarks/decode.py runs fxllm rows).

The baselines (onnxruntime-genai, llama.cpp) each run in a fresh process per round; fxllm rows used to share
decode.py's process with every other row's engine and with transformers. Co-resident ONNX Runtime sessions are
not free: a paged engine measured 1.10-1.12x a contiguous one loaded beside it, and ~1.0-1.06x each in its own
process. So an fxllm row is measured the same way as the baselines: this file loads the artifact in a fresh
process, runs one warm-up and --repeats timed generations, and prints one JSON object.

    .venv/bin/python benchmarks/fxllm_measure.py ARTIFACT --prompt-ids 1,2,3 --new-tokens 64 --repeats 1
    → {"runs": [{"prefill_ms": ..., "ms_per_token": ..., "token_ids": [...]}, ...]}
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any


def engine_for(artifact: Path, threads: int, int8_activations: bool | None) -> Any:
    """The engine a benchmark measures: prefix caching off (a paged artifact's repeated prompt would otherwise come
    from the cache after the warm-up, its prefill not measured) and no EOS ids (every run decodes exactly the
    requested tokens)."""
    import fxllm

    engine = fxllm.load(artifact, threads=threads, int8_activations=int8_activations, prefix_caching=False)
    engine.eos_token_ids = set()
    return engine


def timed_run(engine: Any, prompt_ids: list[int], new_tokens: int) -> dict[str, Any]:
    """One greedy generation: its prefill ms, decode ms per token (tokens after the first) and token ids.

    Wall times, as the baselines time their own loops: prefill is the time to the first token (admission, the
    prompt's calls, sampling token 1), decode the inter-token latency (everything between two tokens: scheduling,
    the model call, sampling, detokenizing, handing the output over). Until 2026-12-06 these were the engine's
    model-call times (`prefill_ms`, `decode_ms_per_token`), which leave out ~0.1-0.3 ms of Python a token."""
    result = engine.generate_ids([prompt_ids], max_new_tokens=new_tokens)[0]
    return {"prefill_ms": result.timings["ttft_ms"], "ms_per_token": result.timings["inter_token_ms"],
            "token_ids": list(result.token_ids)}


def measure_in_subprocess(artifact: Path, prompt_ids: list[int], new_tokens: int, repeats: int, threads: int,
                          int8_activations: bool | None) -> list[dict[str, Any]]:
    """timed_run `repeats` times (after one warm-up) in a fresh python process; its runs, in order."""
    command = [sys.executable, str(Path(__file__).resolve()), str(artifact), "--prompt-ids",
               ",".join(str(i) for i in prompt_ids), "--new-tokens", str(new_tokens), "--repeats", str(repeats),
               "--threads", str(threads)]
    if int8_activations is not None:
        command.append("--int8-activations" if int8_activations else "--float-activations")
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        from fxllm.errors import FxllmError

        raise FxllmError(f"measuring {artifact} in a subprocess failed: {last}")
    return json.loads(done.stdout.strip().splitlines()[-1])["runs"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--prompt-ids", required=True, help="comma list of prompt token ids")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=1, help="timed runs after one warm-up")
    parser.add_argument("--threads", type=int, default=2)
    activations = parser.add_mutually_exclusive_group()
    activations.add_argument("--int8-activations", dest="int8", action="store_const", const=True, default=None)
    activations.add_argument("--float-activations", dest="int8", action="store_const", const=False)
    args = parser.parse_args()
    from decode import quiet_libraries
    from fxllm.errors import FxllmError

    quiet_libraries()
    prompt_ids = [int(i) for i in args.prompt_ids.split(",") if i.strip()]
    try:
        engine = engine_for(args.artifact, args.threads, args.int8)
        timed_run(engine, prompt_ids, args.new_tokens)
        runs = [timed_run(engine, prompt_ids, args.new_tokens) for _ in range(args.repeats)]
    except FxllmError as exc:
        sys.exit(f"fxllm_measure.py: error: {exc}")
    print(json.dumps({"runs": runs}))


if __name__ == "__main__":
    main()
