"""Compile a model with the default passes, then generate: a batch of two prompts, and one streamed chat answer.

usage: python examples/compile_and_generate.py [MODEL] [OUTPUT]
  MODEL   Hugging Face model directory, .gguf file, or smollm2-135m (the default)
  OUTPUT  artifact directory to write (default: artifacts/<model name>)
"""

from __future__ import annotations

import sys
from pathlib import Path

import fxllm


def main(argv: list[str]) -> None:
    model = argv[1] if len(argv) > 1 else "smollm2-135m"
    output = argv[2] if len(argv) > 2 else f"artifacts/{Path(model).stem}"

    # the default passes (cleanup,gqa,fuse-projections,select-logits,kv-cache), target "ort"
    report = fxllm.compile(model, output)
    print(f"compiled {model} -> {report.output} in {report.total_seconds:.1f} s "
          f"({', '.join(f'{phase} {s:.1f} s' for phase, s in report.seconds.items())})")
    for record in report.records:
        print(f"  pass {record.name:<10} {record.seconds:.2f} s  max|Δlogit| {record.drift.max_abs_logit:.2e}  "
              f"greedy agreement {record.drift.greedy_agreement:.0%}")

    engine = fxllm.load(output)

    # A list of prompts of different lengths runs as one left-padded batch; greedy unless temperature > 0.
    results = engine.generate(["The capital of France is", "def fibonacci(n):"], max_new_tokens=24)
    for result in results:
        print(f"--- {result.prompt!r}: {len(result.token_ids)} tokens, finish_reason={result.finish_reason}")
        print(result.text)
    print(f"timings (first of the batch of 2): {results[0].timings}")

    # One prompt, wrapped in the model's chat template, streamed as text deltas.
    print("--- chat (streamed)")
    for piece in engine.stream("What is the capital of France?", chat=True, max_new_tokens=48):
        print(piece, end="", flush=True)
    print()
    print(f"engine stats: {engine.stats()}")


if __name__ == "__main__":
    main(sys.argv)
