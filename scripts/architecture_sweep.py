"""Sweep fxllm over transformers' causal-LM architectures, beyond the test matrix: for each, a tiny random-weight
model (2 layers, hidden 64, 4 heads, SmolLM2's tokenizer; norms, biases and weights randomized like the matrix's
perturbed rows), `fxllm compile` with the default pipeline, then fxllm's greedy tokens (one prompt at a time and
all in one call, EOS ignored) against transformers' `generate(do_sample=False)`, 3 prompts x 16 tokens.

    .venv/bin/python scripts/architecture_sweep.py qwen2 olmo2 cohere2@swa   # these (ARCH@VARIANT: see VARIANTS)
    .venv/bin/python scripts/architecture_sweep.py --all                     # every causal-LM model type
    .venv/bin/python scripts/architecture_sweep.py --table                   # the results so far

Each architecture runs in its own process under --timeout seconds and --memory-gb of address space (a few
multimodal types' tiny configs took all 24 GB of the development VM, and the kernel's OOM killer with it). Outcomes:
OK, WRONG TOKENS (a bug), refused (fxllm's one-line error: the feature it names), crashed (a traceback: a bug), over
the memory limit, and transformers failing on the tiny config itself (not fxllm's). Models, artifacts and
results/<arch>.json go under --work-dir (default ~/.cache/fxllm/architecture-sweep). Nothing here is a test: the
matrix in tests/test_architectures.py is.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PROMPTS = ["The quick brown fox",
           "In 1911 the Encyclopaedia Britannica described the life of William Shakespeare, who was born in",
           "def fibonacci(n):"]
NEW_TOKENS = 16
WINDOW = 8  # shorter than the prompts plus their new tokens: windows are exercised

# set where the config class has the field (or an alias of it)
COMMON = dict(vocab_size=49152, hidden_size=64, num_attention_heads=4, num_hidden_layers=2,
              max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=2,
              num_key_value_heads=2, intermediate_size=96, head_dim=16, ffn_dim=96,
              num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2,
              moe_intermediate_size=32, n_shared_experts=1, moe_num_experts=4, moe_k=2, moe_topk=2,
              top_k=2, n_group=1, topk_group=1, first_k_dense_replace=1)
# per family: fields its defaults get wrong for the tiny shape
EXTRA: dict[str, dict] = {
    "gpt2": dict(n_inner=96), "gpt_bigcode": dict(n_inner=96), "gptj": dict(rotary_dim=8, n_inner=96),
    "codegen": dict(rotary_dim=8, n_inner=96), "mpt": dict(expansion_ratio=2),
    "persimmon": dict(partial_rotary_factor=0.5), "ctrl": dict(dff=96),
    "deepseek_v2": dict(kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16),
}
ALTERNATING = dict(sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"])
# ARCH@VARIANT: the family's config with a feature its defaults leave unused switched on
VARIANTS: dict[str, dict] = {
    "cohere2@swa": ALTERNATING, "olmo3@swa": ALTERNATING, "cwm@swa": dict(sliding_window=WINDOW, layer_types=[
        "full_attention", "sliding_attention"]), "afmoe@swa": ALTERNATING, "mellum@swa": ALTERNATING,
    "exaone4@swa": dict(**ALTERNATING, sliding_window_pattern=2),
    "vaultgemma@swa": dict(**ALTERNATING, query_pre_attn_scalar=24),
    "vaultgemma@swa_untied": dict(**ALTERNATING, query_pre_attn_scalar=24, tie_word_embeddings=False,
                                  final_logit_softcapping=3.0),
    "qwen2@swa": dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
    "lfm2@conv": dict(layer_types=["conv", "full_attention"]),
    "stablelm@qknorm_parallel": dict(qk_layernorm=True, use_parallel_residual=True, use_qkv_bias=True),
    "cohere@qknorm": dict(use_qk_norm=True),
    "granitemoe@mult": dict(embedding_multiplier=12.0, logits_scaling=8.0, residual_multiplier=0.22,
                            attention_multiplier=0.05),
    "gpt2@scale": dict(scale_attn_by_inverse_layer_idx=True, reorder_and_upcast_attn=True),
}


def make_config(arch: str):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    family = arch.split("@")[0]
    config_class = CONFIG_MAPPING[family]
    default = config_class()
    extra = {**EXTRA.get(family, {}), **VARIANTS.get(arch, {})}
    fields = {name: value for name, value in {**COMMON, **extra}.items()
              if name in extra or hasattr(default, name) or name in getattr(config_class, "attribute_map", {})}
    return config_class(**fields), fields


def tokenizer(work: Path):
    from transformers import AutoTokenizer

    from fxllm.compiler.sources import load_tokenizer, resolve_source

    if not (work / "tokenizer" / "tokenizer.json").exists():
        load_tokenizer(resolve_source("smollm2-135m")).save_pretrained(work / "tokenizer")
    return AutoTokenizer.from_pretrained(work / "tokenizer")


def reference_tokens(directory: Path, tok) -> list[list[int]]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    out = []
    for prompt in PROMPTS:
        ids = torch.tensor([tok(prompt)["input_ids"]])
        with torch.no_grad():
            generated = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                       max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, eos_token_id=None,
                                       pad_token_id=tok.pad_token_id)
        out.append(generated[0, ids.shape[1]:].tolist())
    return out


def one(arch: str, work: Path) -> dict:
    """Build, compile and compare one architecture; the result as a dict."""
    import torch
    import transformers

    import fxllm

    sys.path.insert(0, str(ROOT))
    from tests.test_architectures import perturb  # the matrix's perturbed rows, the same way

    directory, artifact = work / arch, work / f"{arch}-artifact"
    result: dict = {"arch": arch}
    try:
        config, result["fields"] = make_config(arch)
        tok = tokenizer(work)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
            perturb(model)
        shutil.rmtree(directory, ignore_errors=True)
        model.save_pretrained(directory)
        tok.save_pretrained(directory)
        expected = reference_tokens(directory, tok)
    except Exception as exc:  # noqa: BLE001 - transformers' own failure on this tiny config
        return {**result, "outcome": "transformers failed", "error": f"{type(exc).__name__}: {exc}"[:300]}
    shutil.rmtree(artifact, ignore_errors=True)
    compiled = subprocess.run([sys.executable, "-m", "fxllm", "compile", str(directory), "-o", str(artifact)],
                              capture_output=True, text=True)
    errors = [line for line in compiled.stderr.splitlines() if line.strip()]
    if compiled.returncode != 0:
        outcome = "refused" if compiled.returncode == 1 and len(errors) == 1 else f"crashed ({compiled.returncode})"
        return {**result, "outcome": outcome, "error": errors[-1] if errors else ""}
    engine = fxllm.load(artifact)
    engine.eos_token_ids = set()
    single = [engine.generate(prompt, max_new_tokens=NEW_TOKENS).token_ids for prompt in PROMPTS]
    batched = [r.token_ids for r in engine.generate(PROMPTS, max_new_tokens=NEW_TOKENS)]
    if single == expected and batched == expected:
        return {**result, "outcome": "OK"}
    return {**result, "outcome": "WRONG TOKENS", "expected": expected, "single": single, "batched": batched}


def causal_lm_architectures() -> list[str]:
    """Every model type transformers maps to a causal LM (encoders with an LM head and multimodal ones included:
    they end as refusals or transformers failures)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _limit_memory(limit: int) -> None:
    """In the child, before it runs: its address space at most `limit` bytes (an allocation past it raises
    MemoryError there instead of waking the kernel's OOM killer)."""
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("archs", nargs="*", help="transformers model types, optionally ARCH@VARIANT")
    parser.add_argument("--all", action="store_true", help="every model type transformers maps to a causal LM")
    parser.add_argument("--table", action="store_true", help="print the results under --work-dir and stop")
    parser.add_argument("--work-dir", type=Path, default=Path.home() / ".cache/fxllm/architecture-sweep")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per architecture (default 300)")
    parser.add_argument("--memory-gb", type=float, default=8.0,
                        help="address space per architecture's process, GB (default 8)")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # the child process of one architecture
    args = parser.parse_args(argv)
    results = args.work_dir / "results"
    results.mkdir(parents=True, exist_ok=True)
    if args.one:
        (results / f"{args.one}.json").write_text(json.dumps(one(args.one, args.work_dir), indent=1))
        return 0
    if not args.table:
        for arch in (causal_lm_architectures() if args.all else []) + args.archs:
            started = time.perf_counter()
            child = None
            try:
                child = subprocess.run([sys.executable, __file__, "--one", arch, "--work-dir", str(args.work_dir)],
                                       capture_output=True, text=True, timeout=args.timeout,
                                       env={**os.environ, "FXLLM_QUIET": "1"},
                                       preexec_fn=partial(_limit_memory, int(args.memory_gb * 2**30)))
            except subprocess.TimeoutExpired:
                (results / f"{arch}.json").write_text(json.dumps({"arch": arch, "outcome": "timed out"}))
            found = results / f"{arch}.json"
            if not found.exists() and child is not None and "MemoryError" in child.stderr:
                found.write_text(json.dumps({"arch": arch, "outcome": "over the memory limit",
                                             "error": f"more than --memory-gb {args.memory_gb:g}"}))
            outcome = json.loads(found.read_text())["outcome"] if found.exists() else "no result (crashed)"
            print(f"{arch:28} {outcome:20} {time.perf_counter() - started:6.1f} s", flush=True)
    for found in sorted(results.glob("*.json")):
        result = json.loads(found.read_text())
        print(f"{result['arch']:28} {result['outcome']:20} {result.get('error', '')[:160]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
