"""Compile with a paged KV cache, then serve many prompts at once with continuous batching and prefix caching.

usage: python examples/serve_many.py [MODEL] [OUTPUT]
  MODEL   Hugging Face model directory, .gguf file, or smollm2-135m (the default)
  OUTPUT  artifact directory to write (default: artifacts/<model name>-paged)
"""

from __future__ import annotations

import sys
from pathlib import Path

import fxllm
from fxllm.compiler.sources import resolve_source

SYSTEM = "You are a concise assistant. Answer in one sentence, with no preamble. "
QUESTIONS = ["What is the capital of France?", "Name a prime number above 50.", "What colour is the sky?",
             "Who wrote Hamlet?", "What is 12 times 12?", "Which planet is largest?", "What is H2O?",
             "Name a primary colour."]


def main(argv: list[str]) -> None:
    model = argv[1] if len(argv) > 1 else "smollm2-135m"
    output = argv[2] if len(argv) > 2 else f"artifacts/{Path(model).stem}-paged"
    # An explicit pass list is taken as written: a GGUF (smollm2-135m is one) keeps its own int4 blocks only with
    # quantize:method=gguf in it, as the default pipeline has.
    kept_blocks = "quantize:method=gguf," if resolve_source(model).gguf_file else ""
    fxllm.compile(model, output, passes=f"cleanup,gqa,fuse-projections,select-logits,{kept_blocks}kv-cache,"
                                        "paged:block_size=16")

    engine = fxllm.load(output, kv_cache_memory="128MB", max_batch=32)
    print(f"KV pool: {engine.capacity_tokens():,} tokens")
    # chat=True: the model's chat template (an instruct model given raw text may end at once)
    results = engine.generate([SYSTEM + q for q in QUESTIONS], max_new_tokens=32, chat=True)
    for question, result in zip(QUESTIONS, results):
        print(f"--- {question}\n{result.text.strip()}")
    stats = engine.stats()  # the shared system prompt's full blocks are computed once
    print(f"decode steps {stats.decode_steps}, mean batch {stats.mean_decode_batch:.2f}, "
          f"prefix hit rate {stats.prefix_cache_hit_rate:.0%}, peak blocks {stats.peak_kv_blocks_used}, "
          f"preemptions {stats.preemptions}")


if __name__ == "__main__":
    main(sys.argv)
