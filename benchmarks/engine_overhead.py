"""Wall-clock cost of the runtime around the model: greedy generation through the public API, timed from the
caller's side (tokenization excluded), so the engine's own per-step work — scheduling, feeds, sampling, stop checks,
detokenization — is inside the measurement, unlike the engine's internal timings.

Rows, per artifact: one request alone (ms per generated token, prefill included), and a batch of --batch requests
in one call (generated tokens per second of wall time). EOS is disabled so every request emits exactly
--new-tokens tokens. Medians of --repeats runs after one warm-up; several artifacts (say a contiguous and a paged
compile of one model) are measured in turns, and each is compared with the first. Uses only Engine.generate_ids,
encode and eos_token_ids, so the same script measures older revisions too (benchmarks/revisions.py runs it under
two revisions, interleaved).

    .venv/bin/python benchmarks/engine_overhead.py ARTIFACT [ARTIFACT ...] [--new-tokens 32] [--batch 8]
        [--repeats 5] [--json F]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import fxllm

PROMPT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg, a goldsmith "
          "from Mainz,")


def timed(engine, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
    start = time.perf_counter()
    results = engine.generate_ids(prompts, max_new_tokens=new_tokens)
    return time.perf_counter() - start, [r.token_ids for r in results]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifacts", type=Path, nargs="+")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    engines = [fxllm.load(artifact, threads=args.threads) for artifact in args.artifacts]
    workloads = []
    for engine in engines:
        engine.eos_token_ids = set()
        ids = engine.encode(PROMPT)
        batch = [ids[: len(ids) - i] for i in range(args.batch)]  # distinct lengths
        timed(engine, [ids], args.new_tokens)  # warm-up
        timed(engine, batch, args.new_tokens)
        workloads.append((ids, batch))
    single: list[list[float]] = [[] for _ in engines]
    batched: list[list[float]] = [[] for _ in engines]
    for _ in range(args.repeats):  # every artifact and workload in turn, so drifts in machine load hit all
        for n, (engine, (ids, batch)) in enumerate(zip(engines, workloads)):
            wall, _ = timed(engine, [ids], args.new_tokens)
            single[n].append(wall * 1e3 / args.new_tokens)
            wall, out = timed(engine, batch, args.new_tokens)
            batched[n].append(sum(map(len, out)) / wall)
    results = {}
    for n, (artifact, engine) in enumerate(zip(args.artifacts, engines)):
        one, many = statistics.median(single[n]), statistics.median(batched[n])
        results[str(artifact)] = {"paged": bool(engine.paged), "single_ms_per_token": one,
                                  "batch_tokens_per_s": many, "single_runs": single[n], "batch_runs": batched[n]}
        first = results[str(args.artifacts[0])]
        print(f"{artifact} ({'paged' if engine.paged else 'contiguous'}): one request {one:.2f} ms/token "
              f"({one / first['single_ms_per_token']:.3f}x the first); batch of {args.batch} {many:.1f} tokens/s "
              f"({many / first['batch_tokens_per_s']:.3f}x)")
    if args.json:
        config = {"new_tokens": args.new_tokens, "batch": args.batch, "repeats": args.repeats, "threads": args.threads}
        args.json.write_text(json.dumps({"config": config, "artifacts": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
