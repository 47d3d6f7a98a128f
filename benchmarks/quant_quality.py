"""Quantization quality table: perplexity, mean KL and top-1 agreement of quantized SmolLM2 artifacts against fp32.

Each configuration is compiled once into ~/.cache/fxllm/bench/quality/<name> (reused while its recorded passes
match; --recompile rebuilds) and scored with fxllm's own evaluation, exactly as

    fxllm eval ARTIFACT --text britannica --ctx 512 --max-tokens 8192 --reference <fp32 artifact>

Every result is appended to ~/.cache/fxllm/bench/quality/results.jsonl as it comes in (a long run survives an
interruption), then the table is printed with bits per quantized weight (scales and offsets counted).

    .venv/bin/python benchmarks/quant_quality.py                          # every configuration (hours on 2 cores)
    .venv/bin/python benchmarks/quant_quality.py --only gptq-asym-g64,rtn-asym-g64
    .venv/bin/python benchmarks/quant_quality.py --table                  # print the table of recorded results
    .venv/bin/python benchmarks/quant_quality.py --only awq-asym-g128-head4 --ortgenai int4 --int8-activations

`--ortgenai VARIANT` also scores onnxruntime-genai's build of the same model (benchmarks/ortgenai_baseline.py) on
the same windows and token ids, run by plain ONNX Runtime, so fxllm's speed rows can be compared at their quality.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import fxllm
from fxllm.runtime.manifest import load_manifest

ROOT = Path.home() / ".cache" / "fxllm" / "bench" / "quality"
RESULTS = ROOT / "results.jsonl"
MODEL = "smollm2-135m"
REFERENCE = "fp32"

# name → compile options (the GGUF source is loaded as float and re-quantized: requantize=True), eval options
CONFIGS: dict[str, dict[str, Any]] = {
    "fp32": {"requantize": True},
    "gguf-q4_1": {},  # the GGUF's own Q4_1 blocks (Q8_0 tied embedding/lm_head), kept exactly
    "int8": {"requantize": True, "quant": "int8"},
}
for group in (32, 64, 128):
    for method in ("rtn", "gptq", "awq"):
        for zero_point in (False, True):
            CONFIGS[f"{method}-{'asym' if zero_point else 'sym'}-g{group}"] = {
                "requantize": True, "quant": f"int4-{method}",
                "quant_options": {"group_size": group, "zero_point": zero_point}}
        # the speed configurations of benchmarks/decode.py: the lm_head quantized too (int4, same group size)
        CONFIGS[f"{method}-asym-g{group}-head4"] = {
            "requantize": True, "quant": f"int4-{method}",
            "quant_options": {"group_size": group, "zero_point": True, "lm_head": "int4"}}


def compile_config(name: str, recompile: bool) -> tuple[Path, float | None]:
    directory = ROOT / name
    if not recompile:
        try:
            load_manifest(directory, verify=False).data
            return directory, None
        except fxllm.FxllmError:
            pass
    start = time.perf_counter()
    fxllm.compile(MODEL, directory, **CONFIGS[name])
    return directory, time.perf_counter() - start


# SmolLM2's quantized projections per layer as (out, in): fused q/k/v, o, fused gate/up, down
SMOLLM2_LINEARS = ((960, 576), (576, 576), (3072, 576), (576, 1536))


def bits_per_weight(name: str) -> float | None:
    """Bits per quantized weight over SmolLM2's projections: the code, plus each block's float16 scale (and offset,
    counted as wide as the scale, when asymmetric; the ort target stores it as a 4-bit zero point, the tensorrt
    target as a float32 offset); int8 has float32 per-channel scales; the GGUF row stores float16 scales and float32
    offsets (5.5 bits)."""
    from fxllm.compiler.quant.numerics import QuantFormat
    from fxllm.passes.quantize import int4_format

    options = CONFIGS[name]
    if name.startswith("gguf"):
        return 4 + 16 / 32 + 32 / 32
    if "quant" not in options:
        return None
    group = options.get("quant_options", {}).get("group_size", 128)
    fmt = QuantFormat(8, 0) if options["quant"] == "int8" else \
        int4_format(group, options["quant_options"].get("zero_point", False))
    total = sum(out * inp for out, inp in SMOLLM2_LINEARS)
    return sum(fmt.bits_per_weight(inp, out) * out * inp for out, inp in SMOLLM2_LINEARS) / total


def measure(name: str, recompile: bool, float_activations: bool) -> dict[str, Any]:
    from fxllm.evaluation import evaluate

    directory, compile_s = compile_config(name, recompile)
    reference, _ = compile_config(REFERENCE, False)
    start = time.perf_counter()
    report = evaluate(str(directory), "britannica", ctx=512, max_tokens=8192, reference=str(reference),
                      int8_activations=not float_activations)
    manifest = load_manifest(directory, verify=False).data
    size = sum(f["bytes"] for file, f in manifest["files"].items() if not file.startswith("tokenizer"))
    return {"name": name, "options": {k: v for k, v in CONFIGS[name].items()}, "float_activations": float_activations,
            "perplexity": report.perplexity, "reference_perplexity": report.reference_perplexity,
            "mean_kl": report.mean_kl, "top1": report.top1_agreement, "tokens": report.tokens,
            "bits_per_weight": bits_per_weight(name), "model_bytes": size,
            "compile_s": None if compile_s is None else round(compile_s, 1),
            "eval_s": round(time.perf_counter() - start, 1)}


def ortgenai_scorer(variant: str, reference: Path, threads: int = 2):
    """A Scorer over onnxruntime-genai's build of SmolLM2 (built on demand), run by plain ONNX Runtime: its contrib
    ops (GroupQueryAttention, MatMulNBits at the accuracy level the builder wrote) need no onnxruntime-genai. One call
    per window with an empty cache; the tokenizer of the fp32 `reference` artifact (the same SmolLM2 tokenizer), so
    both score identical token ids."""
    import numpy as np
    import onnxruntime as ort
    from fxllm.evaluation import Scorer
    from fxllm.runtime.tokenizer import load_tokenizer

    import ortgenai_baseline

    model_dir = ortgenai_baseline.ensure_model(variant, threads=threads)

    class OrtGenaiScorer(Scorer):
        def __init__(self) -> None:
            options = ort.SessionOptions()
            options.intra_op_num_threads = threads
            options.log_severity_level = 3
            self.session = ort.InferenceSession(str(model_dir / "model.onnx"), options,
                                                providers=["CPUExecutionProvider"])
            self.name, self.kind = f"onnxruntime-genai {variant}", "onnxruntime-genai"
            self.tokenizer = load_tokenizer(load_manifest(reference, verify=False).tokenizer_dir)
            config = json.loads((model_dir / "genai_config.json").read_text())["model"]
            self.max_context, self.head_size = config["context_length"], config["decoder"]["head_size"]

        def logits(self, token_ids: list[int]) -> np.ndarray:
            feeds = {"input_ids": np.asarray([token_ids], np.int64),
                     "attention_mask": np.ones((1, len(token_ids)), np.int64)}
            for i in self.session.get_inputs():
                if i.name.startswith("past_key_values."):  # [batch, kv heads, past, head size], empty
                    feeds[i.name] = np.zeros((1, i.shape[1], 0, self.head_size), np.float32)
            return self.session.run(["logits"], feeds)[0][0]

    return OrtGenaiScorer(), model_dir


def measure_ortgenai(variant: str) -> dict[str, Any]:
    from fxllm.evaluation import evaluate

    reference, _ = compile_config(REFERENCE, False)
    scorer, model_dir = ortgenai_scorer(variant, reference)
    start = time.perf_counter()
    report = evaluate(scorer, "britannica", ctx=512, max_tokens=8192, reference=str(reference))
    build = json.loads((model_dir / "fxllm-build.json").read_text())
    return {"name": scorer.name, "options": {"builder_args": build["builder_args"]},
            "float_activations": variant != "int4",  # its int4 MatMulNBits run at accuracy level 4 (int8)
            "perplexity": report.perplexity, "reference_perplexity": report.reference_perplexity,
            "mean_kl": report.mean_kl, "top1": report.top1_agreement, "tokens": report.tokens,
            "bits_per_weight": None, "model_bytes": sum(p.stat().st_size for p in model_dir.glob("model.onnx*")),
            "compile_s": None, "eval_s": round(time.perf_counter() - start, 1)}


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| configuration | activations | bits/weight | perplexity | vs fp32 | mean KL | top-1 | model MB |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        delta = r["perplexity"] / r["reference_perplexity"] - 1
        bits = f"{r['bits_per_weight']:.2f}" if r.get("bits_per_weight") else "–"
        lines.append(f"| {r['name']} | {'float' if r['float_activations'] else 'int8'} | {bits} | "
                     f"{r['perplexity']:.3f} | {delta:+.2%} | {r['mean_kl']:.2e} | {r['top1']:.1%} | "
                     f"{r['model_bytes'] / 1e6:.1f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma list of configuration names (default: all)")
    parser.add_argument("--recompile", action="store_true")
    parser.add_argument("--int8-activations", action="store_true",
                        help="score with int8 matmul activations (default: float activations, the runtime's default "
                             "and the exact weights-only math)")
    parser.add_argument("--table", action="store_true", help="only print the table of recorded results")
    parser.add_argument("--ortgenai", choices=["int4", "fp32"], action="append", default=[],
                        help="also score onnxruntime-genai's build of this variant (repeatable; without --only, "
                             "nothing else)")
    args = parser.parse_args()
    ROOT.mkdir(parents=True, exist_ok=True)
    if not args.table:
        everything = [] if args.ortgenai else [n for n in CONFIGS if n != REFERENCE]
        names = args.only.split(",") if args.only else everything
        unknown = [n for n in names if n not in CONFIGS]
        if unknown:
            sys.exit(f"unknown configuration(s) {', '.join(unknown)}; known: {', '.join(CONFIGS)}")
        jobs = [(measure_ortgenai, variant) for variant in args.ortgenai]
        jobs += [(lambda n: measure(n, args.recompile, not args.int8_activations), name) for name in names]
        for measure_row, name in jobs:
            row = measure_row(name)
            with RESULTS.open("a") as out:
                out.write(json.dumps(row) + "\n")
            print(json.dumps(row), flush=True)
    rows = [json.loads(line) for line in RESULTS.read_text().splitlines()] if RESULTS.exists() else []
    print(table(rows))


if __name__ == "__main__":
    main()
