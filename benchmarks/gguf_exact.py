"""GGUF-exact check on SmolLM2: the artifact compiled from a GGUF (its own blocks kept) against transformers' float
model loaded from the same file (its dequantization is the reference).

For each GGUF (default: the shipped Q4_1; --kind Q4_0 / Q8_0 re-writes it with the `gguf` package first, like
tests/test_gguf_types.py): compile with the default pipeline into ~/.cache/fxllm/bench/gguf-exact/<kind> (cached),
then report
- greedy tokens on 8 prompts x 64 tokens, artifact (float activations) vs transformers: identical or not;
- perplexity on britannica (ctx 512, 8192 tokens), artifact vs transformers, and the mean KL between them
  (fxllm eval's protocol), with float and with int8 activations;
- the artifact's model bytes against the GGUF's tensor bytes.

    .venv/bin/python benchmarks/gguf_exact.py                     # Q4_1 (about 10 minutes on a quiet machine)
    .venv/bin/python benchmarks/gguf_exact.py --kind Q4_0 --kind Q8_0
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

import fxllm
from fxllm.compiler.sources import default_model_path, load_model, resolve_source
from fxllm.evaluation import evaluate
from fxllm.runtime.manifest import load_manifest

ROOT = Path.home() / ".cache" / "fxllm" / "bench" / "gguf-exact"
PROMPTS = ["The capital of France is", "The history of the printing press begins", "def fibonacci(n):",
           "In 1911 the Encyclopaedia Britannica described", "The quick brown fox", "Water boils at",
           "Once upon a time, in a small village,", "The three primary colors are"]


def gguf_file(kind: str) -> Path:
    shipped = default_model_path()
    if kind == "Q4_1":
        return shipped
    path = ROOT / f"SmolLM2-135M-Instruct.{kind}.gguf"
    if not path.exists():
        from gguf import GGMLQuantizationType

        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from tests.test_gguf_types import requantize_gguf

        ROOT.mkdir(parents=True, exist_ok=True)
        requantize_gguf(shipped, path, GGMLQuantizationType[kind])
    return path


def tensor_bytes(path: Path) -> int:
    from gguf import GGUFReader

    return sum(int(t.n_bytes) for t in GGUFReader(path).tensors)


def check(kind: str, new_tokens: int) -> dict:
    path = gguf_file(kind)
    artifact = ROOT / kind
    start = time.perf_counter()
    try:
        load_manifest(artifact, verify=False).data
        compile_s = None
    except fxllm.FxllmError:
        fxllm.compile(str(path), artifact)
        compile_s = time.perf_counter() - start
    engine = fxllm.load(artifact, int8_activations=False, threads=2)
    engine.eos_token_ids = set()
    model = load_model(resolve_source(str(path)))
    torch.set_num_threads(2)
    identical = 0
    for prompt in PROMPTS:
        ids = engine.tokenizer.encode(prompt)
        ours = engine.generate_ids([ids], max_new_tokens=new_tokens)[0].token_ids
        with torch.no_grad():
            theirs = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                    do_sample=False, max_new_tokens=new_tokens, eos_token_id=None)[0, len(ids):]
        identical += ours == theirs.tolist()
    del model
    evals = {}
    for label, int8 in (("float", False), ("int8", True)):
        report = evaluate(str(artifact), "britannica", ctx=512, max_tokens=8192, reference=str(path),
                          int8_activations=int8)
        evals[label] = {"perplexity": report.perplexity, "reference_perplexity": report.reference_perplexity,
                        "mean_kl": report.mean_kl, "top1": report.top1_agreement}
    manifest = load_manifest(artifact, verify=False).data
    size = sum(f["bytes"] for name, f in manifest["files"].items() if not name.startswith("tokenizer"))
    return {"kind": kind, "gguf": str(path.name), "compile_s": compile_s, "prompts": len(PROMPTS),
            "new_tokens": new_tokens, "identical_prompts": identical, "eval": evals, "model_bytes": size,
            "gguf_tensor_bytes": tensor_bytes(path), "size_ratio": size / tensor_bytes(path)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", action="append", choices=["Q4_1", "Q4_0", "Q8_0"])
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    for kind in args.kind or ["Q4_1"]:
        result = check(kind, args.new_tokens)
        print(json.dumps(result, indent=1), flush=True)
        with (ROOT / "results.jsonl").open("a") as out:
            out.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
