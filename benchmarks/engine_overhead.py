"""Wall-clock cost of the runtime around the model: greedy generation through the public API, timed from the
caller's side (tokenization excluded), so the engine's own per-step work — scheduling, feeds, sampling, stop checks,
detokenization — is inside the measurement, unlike the engine's internal timings.

Rows: one request alone (ms per generated token, prefill included), and a batch of --batch requests in one call
(generated tokens per second of wall time). EOS is disabled so every request emits exactly --new-tokens tokens.
Medians of --repeats runs after one warm-up. Uses only Engine.generate_ids and eos_token_ids, so the same script
measures older revisions too (benchmarks/revisions.py runs it under two revisions, interleaved).

    .venv/bin/python benchmarks/engine_overhead.py ARTIFACT [--new-tokens 32] [--batch 8] [--repeats 5] [--json F]
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
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    engine = fxllm.load(args.artifact, threads=args.threads)
    engine.eos_token_ids = set()
    ids = engine.encode(PROMPT)
    batch = [ids[: len(ids) - i] for i in range(args.batch)]  # distinct lengths
    timed(engine, [ids], args.new_tokens)  # warm-up
    timed(engine, batch, args.new_tokens)
    single, batched = [], []
    for _ in range(args.repeats):  # alternate the two workloads so drifts in machine load hit both
        wall, _ = timed(engine, [ids], args.new_tokens)
        single.append(wall * 1e3 / args.new_tokens)
        wall, out = timed(engine, batch, args.new_tokens)
        batched.append(sum(map(len, out)) / wall)
    result = {"single_ms_per_token": statistics.median(single), "batch_tokens_per_s": statistics.median(batched),
              "runs": {"single_ms_per_token": single, "batch_tokens_per_s": batched},
              "config": {"artifact": str(args.artifact), "new_tokens": args.new_tokens, "batch": args.batch,
                         "repeats": args.repeats, "threads": args.threads, "paged": bool(engine.paged)}}
    print(f"one request: {result['single_ms_per_token']:.2f} ms/token (wall, prefill included); batch of "
          f"{args.batch}: {result['batch_tokens_per_s']:.1f} tokens/s")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
