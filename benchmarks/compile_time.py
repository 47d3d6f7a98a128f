"""Compile-time benchmark of the lowering: the same program lowered with and without skipping torch.onnx's
redundant decomposition re-trace (onnx_export._no_redundant_decomposition), alternated in one process.

Load, capture and the passes run once; then lowering runs --rounds times per variant, alternating (skip, full,
skip, full, ...), each printing its steps (re-export, onnx export, finish, save, check). Medians at the end.

    .venv/bin/python benchmarks/compile_time.py                       # SmolLM2 float (its GGUF loaded as float32)
    .venv/bin/python benchmarks/compile_time.py --tiny-layers 6       # a random 6-layer model of SmolLM2's shape
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
from pathlib import Path

import torch


def program_for(args: argparse.Namespace):
    from fxllm.compiler.capture import capture
    from fxllm.compiler.pass_manager import run_pipeline
    from fxllm.compiler.pipeline import build_pipeline, parse_pipeline
    from fxllm.compiler.sources import load_model, resolve_source

    start = time.perf_counter()
    if args.tiny_layers:
        from transformers import AutoModelForCausalLM, LlamaConfig

        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                             num_key_value_heads=2, num_hidden_layers=args.tiny_layers, max_position_embeddings=256)
        model = AutoModelForCausalLM.from_config(config).eval()
    else:
        model = load_model(resolve_source(args.model))
    program = capture(model).program
    program, _ = run_pipeline(program, build_pipeline(parse_pipeline(None)))
    print(f"load + capture + passes: {time.perf_counter() - start:.1f} s", flush=True)
    return program


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tiny-layers", type=int)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    import fxllm.compiler.targets.onnx_export as onnx_export

    program = program_for(args)
    skip = onnx_export._no_redundant_decomposition
    totals: dict[str, list[float]] = {"skip": [], "full": []}
    with tempfile.TemporaryDirectory() as scratch:
        for round_index in range(args.rounds):
            for variant in ("skip", "full"):
                onnx_export._no_redundant_decomposition = skip if variant == "skip" else contextlib.nullcontext
                steps: dict[str, float] = {}
                start = time.perf_counter()
                onnx_export.lower_to_onnx(program, Path(scratch) / f"{variant}{round_index}.onnx", "ort", steps)
                totals[variant].append(time.perf_counter() - start)
                print(f"{variant}: lowering {totals[variant][-1]:.1f} s "
                      + " ".join(f"{k} {v:.1f}s" for k, v in steps.items()), flush=True)
    onnx_export._no_redundant_decomposition = skip
    full, fast = statistics.median(totals["full"]), statistics.median(totals["skip"])
    print(f"median lowering: full {full:.1f} s, skip {fast:.1f} s ({fast / full:.2f}x)")


if __name__ == "__main__":
    main()
