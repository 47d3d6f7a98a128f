"""Decode-speed benchmark: fxllm's compiled ONNX Runtime engines against transformers eager, in one run.

Measures milliseconds per decoded token at batch 1, greedy, a fixed number of new tokens (default 64) and a fixed
number of intra-op threads (default 2), on the same prompt token ids for every system. The systems run in
interleaved rounds (A B C, A B C, ...; each call warms up once before its timed run), --repeats rounds. Each
round of each fxllm row runs in a fresh process (benchmarks/fxllm_measure.py), as onnxruntime-genai and llama.cpp
always have: ONNX Runtime sessions loaded side by side slow each other (a paged engine beside a contiguous one
measured 1.10-1.12x it, ~1.0-1.06x in processes of their own); --in-process loads every fxllm row's engine here
once instead (faster to run, the protocol of tables before 2026-12-04). Per
context length, a table shows medians, tokens/s, each row's ms/token relative to the default fxllm row ("vs default": >1 is slower), each system's speedup over transformers measured in this same
run, and the KV-cache bytes per token of each fxllm artifact. It also says whether every fxllm row's greedy tokens
are identical to the default row's and to transformers' (they should be, unless a pass changes the model).

The systems are the default pipeline (`fxllm (default pipeline)`), one row `fxllm NAME` per --variant NAME=PASSES
compiled with that pass list, and transformers eager unless --skip-transformers. Every system decodes exactly
--new-tokens tokens: EOS does not stop them, and none suppresses it, so each emits the plain argmax sequence.

    .venv/bin/python benchmarks/decode.py                         # SmolLM2-135M, 64 tokens, 2 threads
    .venv/bin/python benchmarks/decode.py --contexts 64,1024      # one table per ~64- and ~1024-token prompt
    .venv/bin/python benchmarks/decode.py --variant "no-gqa=cleanup,fuse-projections,select-logits,kv-cache" \\
        --contexts 64,1024 --repeats 3 --skip-transformers        # the default pipeline against it without gqa
    .venv/bin/python benchmarks/decode.py --model DIR_OR_GGUF --artifact ARTIFACT --json results.json
    .venv/bin/python benchmarks/decode.py --skip-transformers --ortgenai int4 \
        --variant "int4-gptq=cleanup,gqa,fuse-projections,select-logits,quantize:method=int4-gptq,kv-cache"
                                                                  # quantized rows against onnxruntime-genai int4

Without --artifact, the default row's model is compiled with the default pipeline into
~/.cache/fxllm/bench/<model> on the first run; a variant's goes to ~/.cache/fxllm/bench/<model>--<NAME>--<hash of
its pass list>. Cached artifacts are reused while their recorded passes match; pass --recompile after changing the
compiler.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import re
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import fxllm
from fxllm.compiler.pipeline import build_pipeline, parse_pipeline, place_quantization
from fxllm.compiler.sources import ModelSource, load_model, resolve_source
from fxllm.runtime.contract import ModelSpec
from fxllm.errors import ArtifactError, FxllmError
from fxllm.runtime.manifest import load_manifest
from bandwidth import read_bandwidth
from fxllm_measure import engine_for, measure_in_subprocess, timed_run

DEFAULT_PROMPT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg, "
                  "a goldsmith from Mainz,")
CACHE_DIR = Path.home() / ".cache" / "fxllm" / "bench"
DEFAULT_SYSTEM = "fxllm (default pipeline)"
BASELINE = "transformers eager (sdpa)"
ORTGENAI = "onnxruntime-genai"
VARIANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


@dataclass(frozen=True)
class Variant:
    """One fxllm row: a compiled artifact and its manifest."""
    system: str
    artifact: Path
    manifest: dict[str, Any]

    @property
    def quantized(self) -> bool:
        """Quantized matmul weights: --int8-activations applies (fxllm.load refuses it on a float artifact)."""
        return "quantized" in self.manifest["facts"]

    @property
    def kv_bytes_per_token(self) -> int:
        return ModelSpec.from_dict(self.manifest["spec"]).kv_bytes_per_token()


@dataclass(frozen=True)
class Workload:
    prompt_ids: list[int]
    new_tokens: int
    repeats: int


@dataclass(frozen=True)
class Run:
    prefill_ms: float
    ms_per_token: float
    token_ids: list[int]


@dataclass
class Measurement:
    system: str
    ms_per_token: float  # median over the repeats
    prefill_ms: float  # median over the repeats
    runs_ms_per_token: list[float]
    token_ids: list[int]
    kv_bytes_per_token: int | None = None  # fxllm rows: from the artifact's spec (float32 K and V, all layers)
    model_bytes: int | None = None  # the model files on disk (fxllm: the artifact's ONNX and weights)

    @property
    def tokens_per_s(self) -> float:
        return 1e3 / self.ms_per_token

    @property
    def model_bytes_per_s(self) -> float | None:
        """The model's bytes on disk per decode step's time: the weight-read rate if every step reads every weight
        once as stored (compare with the machine's read bandwidth). It overstates where an untied embedding table is
        part of the file (read one row a token) and understates for a quantized fxllm artifact run with float
        activations (dequantized at load, it reads more than its file)."""
        return self.model_bytes / self.ms_per_token * 1e3 if self.model_bytes else None


Runner = Callable[[Workload], Measurement]


# --- arguments ---------------------------------------------------------------------------------------------------

def parse_variant(text: str) -> tuple[str, str]:
    """'NAME=PASSES' → (NAME, PASSES); NAME becomes part of a directory name, so it is kept to [A-Za-z0-9._-]."""
    name, eq, passes = text.partition("=")
    name, passes = name.strip(), passes.strip()
    if not eq or not passes:
        raise argparse.ArgumentTypeError(f"expected NAME=PASSES, got '{text}'")
    if not VARIANT_NAME.fullmatch(name):
        raise argparse.ArgumentTypeError(f"variant name '{name}' may only use letters, digits, '.', '_' and '-'")
    return name, passes


def parse_contexts(text: str) -> list[int]:
    """'64,1024' → [64, 1024]."""
    try:
        contexts = [int(item) for item in text.split(",") if item.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of token counts, got '{text}'") from None
    if not contexts or min(contexts) < 1:
        raise argparse.ArgumentTypeError(f"expected positive token counts, got '{text}'")
    return contexts


def parse_context(text: str) -> list[int]:
    """'2048' → [2048]: --context is --contexts with one value."""
    contexts = parse_contexts(text)
    if len(contexts) != 1:
        raise argparse.ArgumentTypeError(f"--context takes one token count (--contexts takes several), got '{text}'")
    return contexts


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", help="HF directory, .gguf file or 'smollm2-135m'")
    parser.add_argument("--artifact", type=Path,
                        help="compiled artifact of MODEL for the default row (default: compile once and cache)")
    parser.add_argument("--variant", type=parse_variant, action="append", default=[], metavar="NAME=PASSES",
                        help="also measure MODEL compiled with this pass list, as row 'fxllm NAME' (repeatable)")
    parser.add_argument("--recompile", action="store_true", help="rebuild the cached artifacts")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2, help="intra-op threads for every system")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per system, after one warm-up")
    parser.add_argument("--prompt", default=DEFAULT_PROMPT)
    contexts = parser.add_mutually_exclusive_group()
    contexts.add_argument("--contexts", type=parse_contexts, default=[None], metavar="N[,N...]",
                          help="one table per N: the prompt repeated to about N tokens")
    contexts.add_argument("--context", type=parse_context, dest="contexts", metavar="N", help="same as --contexts N")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--ortgenai", action="append", default=[], metavar="VARIANT",
                        help="also measure onnxruntime-genai's model builder output VARIANT (int4, int4-float-head, "
                             "int4-int8-head, fp32; repeatable), built once with benchmarks/ortgenai_baseline.py in a "
                             "venv of its own (see that file); the first one is the 'vs ortgenai' reference")
    parser.add_argument("--ortgenai-python", help="python of the onnxruntime-genai venv (default ~/.cache/fxllm/ortgenai-venv)")
    parser.add_argument("--row", action="append", default=[], type=parse_variant, metavar="NAME=ARTIFACT",
                        help="also measure an already compiled artifact directory, as row 'fxllm NAME' (repeatable)")
    parser.add_argument("--llamacpp", action="append", default=[], metavar="GGUF",
                        help="also measure this GGUF file with llama.cpp (its C API, a prebuilt CPU library in the venv "
                             "that benchmarks/llamacpp_baseline.py setup makes; repeatable)")
    parser.add_argument("--int8-activations", action="store_true",
                        help="quantized fxllm rows: int8 matmul activations (MatMulNBits accuracy level 4, what "
                             "onnxruntime-genai's int4 CPU models use: like for like with --ortgenai); default: what "
                             "each artifact recommends (float activations unless compiled with --int8-activations)")
    parser.add_argument("--in-process", action="store_true",
                        help="measure the fxllm rows in this process, every row's engine loaded side by side (the "
                             "protocol before fxllm_measure.py; co-resident sessions slow each other); default: each "
                             "round of each fxllm row in a fresh process, as the baselines run")
    parser.add_argument("--json", type=Path, help="also write the results here")
    return parser


def quiet_libraries() -> None:
    import warnings

    warnings.filterwarnings("ignore")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


# --- artifacts ---------------------------------------------------------------------------------------------------

def pipeline_record(passes: str | None, gguf: bool = False) -> list[dict[str, Any]]:
    """The passes and typed options a compile with `passes` records in its manifest; checks the pass list. A GGUF
    source's default pipeline keeps its quantized blocks (pipeline.place_quantization)."""
    passes, options = place_quantization(passes, None, gguf=gguf)
    return [{"name": step.name, "options": step.options} for step in build_pipeline(parse_pipeline(passes), options)]


def variant_directory(source: ModelSource, name: str, passes: str) -> Path:
    canonical = ",".join(item.strip() for item in passes.split(",") if item.strip())
    digest = hashlib.sha256(canonical.encode()).hexdigest()[:8]
    return CACHE_DIR / f"{source.name}--{name}--{digest}"


def cached_manifest(directory: Path, passes: str | None, gguf: bool = False) -> dict[str, Any] | None:
    """The manifest of the artifact in `directory` when it was compiled with `passes`, else None."""
    try:
        manifest = load_manifest(directory, verify=False).data  # fxllm.load checksums the files
    except ArtifactError:
        return None
    recorded = [{"name": p["name"], "options": p["options"]} for p in manifest["passes"]]
    if recorded != pipeline_record(passes, gguf):
        print(f"cached artifact {directory} was compiled with passes "
              f"{','.join(p['name'] for p in recorded)}; recompiling")
        return None
    print(f"using cached artifact {directory} (--recompile to rebuild it)")
    return manifest


def ensure_artifact(model: str, directory: Path, passes: str | None, recompile: bool) -> dict[str, Any]:
    """The manifest of the artifact in `directory`, compiled with `passes` (None: the default pipeline) if needed."""
    manifest = None if recompile else cached_manifest(directory, passes, bool(resolve_source(model).gguf_file))
    if manifest is None:
        start = time.perf_counter()
        fxllm.compile(model, directory, passes=passes)
        print(f"compiled {model} ({passes or 'default pipeline'}) → {directory} in "
              f"{time.perf_counter() - start:.1f} s", flush=True)
        manifest = load_manifest(directory, verify=False).data
    return manifest


def prepare_variants(args: argparse.Namespace, parser: argparse.ArgumentParser, source: ModelSource) -> list[Variant]:
    """The default row first, then one per --variant; every pass list is checked before anything compiles."""
    names = [name for name, _ in args.variant]
    if len(set(names)) < len(names):
        parser.error("--variant names must be distinct")
    for _, passes in args.variant:
        pipeline_record(passes)
    if args.artifact:
        default = Variant(DEFAULT_SYSTEM, args.artifact, load_manifest(args.artifact, verify=False).data)
    else:
        directory = CACHE_DIR / source.name
        default = Variant(DEFAULT_SYSTEM, directory, ensure_artifact(args.model, directory, None, args.recompile))
    variants = [default]
    for name, passes in args.variant:
        directory = variant_directory(source, name, passes)
        variants.append(Variant(f"fxllm {name}", directory,
                                ensure_artifact(args.model, directory, passes, args.recompile)))
    for name, path in args.row:
        variants.append(Variant(f"fxllm {name}", Path(path), load_manifest(Path(path), verify=False).data))
    for variant in variants:
        if variant.manifest["source"]["name"] != source.name:
            print(f"warning: {variant.artifact} was compiled from '{variant.manifest['source']['name']}', "
                  f"not '{source.name}'", file=sys.stderr)
    return variants


# --- prompts -----------------------------------------------------------------------------------------------------

def load_tokenizer(variant: Variant) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(variant.artifact / variant.manifest["tokenizer_dir"])


def encode_prompt(tokenizer: Any, prompt: str, context: int | None) -> list[int]:
    """Token ids of the prompt, repeated until it is at least `context` tokens long when `context` is given."""
    ids = tokenizer(prompt)["input_ids"]
    if context and len(ids) < context:
        ids = tokenizer(" ".join([prompt] * -(-context // len(ids))))["input_ids"]
    return list(ids)


def check_fits(work: Workload, variants: list[Variant], parser: argparse.ArgumentParser) -> None:
    for variant in variants:
        max_positions = variant.manifest["spec"]["max_positions"]
        if len(work.prompt_ids) + work.new_tokens > max_positions:
            parser.error(f"{len(work.prompt_ids)} prompt + {work.new_tokens} new tokens exceed the context of "
                         f"{max_positions} of {variant.artifact}")


# --- systems -----------------------------------------------------------------------------------------------------

def repeated(system: str, run_once: Callable[[], Run], repeats: int, warm_up: bool = True) -> Measurement:
    """One warm-up run (unless the runs were warmed up where they ran), then `repeats` timed runs summarized by
    their medians."""
    if warm_up:
        run_once()
    runs = [run_once() for _ in range(repeats)]
    return Measurement(
        system=system,
        ms_per_token=statistics.median(r.ms_per_token for r in runs),
        prefill_ms=statistics.median(r.prefill_ms for r in runs),
        runs_ms_per_token=[round(r.ms_per_token, 3) for r in runs],
        token_ids=runs[-1].token_ids,
    )


def fxllm_runner(variant: Variant, threads: int, int8_activations: bool | None, in_process: bool = False) -> Runner:
    """Measure the variant's engine: each round in a fresh process, as the baselines are (fxllm_measure.py), or,
    with `in_process`, one engine loaded here once and measured beside the other rows' engines."""
    engine = engine_for(variant.artifact, threads, int8_activations) if in_process else None

    def measure(work: Workload) -> Measurement:
        if engine is None:
            runs = iter(measure_in_subprocess(variant.artifact, work.prompt_ids, work.new_tokens, work.repeats,
                                              threads, int8_activations))
        else:
            runs = (timed_run(engine, work.prompt_ids, work.new_tokens) for _ in range(work.repeats + 1))

        def run_once() -> Run:
            result = next(runs)
            return Run(result["prefill_ms"], result["ms_per_token"], result["token_ids"])

        measurement = repeated(variant.system, run_once, work.repeats, warm_up=engine is not None)
        measurement.kv_bytes_per_token = variant.kv_bytes_per_token
        measurement.model_bytes = sum(f["bytes"] for name, f in variant.manifest["files"].items()
                                      if not name.startswith("tokenizer"))
        return measurement

    return measure


def transformers_runner(source: ModelSource, threads: int) -> Runner:
    """Load the transformers model once (float32, its default "sdpa" attention); the runner measures it."""
    import torch

    torch.set_num_threads(threads)
    model = load_model(source)

    def measure(work: Workload) -> Measurement:
        ids = torch.tensor([work.prompt_ids])

        def generate(new_tokens: int) -> tuple[float, list[int]]:
            # eos_token_id=None decodes through EOS like the fxllm side; min_new_tokens would instead replace an
            # EOS argmax with the runner-up token and make the greedy sequences differ.
            start = time.perf_counter()
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=new_tokens, eos_token_id=None)
            return (time.perf_counter() - start) * 1e3, out[0, ids.shape[1]:].tolist()

        def run_once() -> Run:
            # generate() reports no timings, so the decode rate is the difference between N tokens and 1 (≈ prefill).
            first_ms, _ = generate(1)
            total_ms, tokens = generate(work.new_tokens)
            return Run(first_ms, (total_ms - first_ms) / (work.new_tokens - 1), tokens)

        return repeated(BASELINE, run_once, work.repeats)

    return measure


def ortgenai_runner(variant: str, python: str | None, threads: int) -> Runner:
    """onnxruntime-genai (its own venv, through subprocess): the same prompt ids, greedy, no early stop."""
    import ortgenai_baseline

    model_dir = ortgenai_baseline.ensure_model(variant, python, threads=threads)

    def measure(work: Workload) -> Measurement:
        result = ortgenai_baseline.measure(model_dir, python, prompt_ids=work.prompt_ids, new_tokens=work.new_tokens,
                                           repeats=work.repeats, threads=threads)
        return Measurement(f"{ORTGENAI} {variant}", result["ms_per_token"], result["prefill_ms"],
                           result["runs_ms_per_token"], result["tokens"], model_bytes=result["model_bytes"])

    return measure


def llamacpp_runner(gguf: Path, threads: int) -> Runner:
    """llama.cpp's C API (a prebuilt library in its own venv, through subprocess): the same prompt ids, greedy."""
    import llamacpp_baseline

    def measure(work: Workload) -> Measurement:
        result = llamacpp_baseline.measure(gguf, work.prompt_ids, work.new_tokens, work.repeats, threads)
        return Measurement(f"llama.cpp {gguf.name}", result["ms_per_token"], result["prefill_ms"],
                           result["runs_ms_per_token"], result["tokens"], model_bytes=result["model_bytes"])

    return measure


def environment() -> dict[str, Any]:
    import onnxruntime
    import torch
    import transformers

    return {
        "cpus": os.cpu_count(),
        "machine": f"{platform.system()} {platform.machine()}",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "onnxruntime": onnxruntime.__version__,
        "transformers": transformers.__version__,
        "fxllm": fxllm.__version__,
    }


# --- comparisons -------------------------------------------------------------------------------------------------

def find(measurements: list[Measurement], system: str) -> Measurement | None:
    return next((m for m in measurements if m.system == system), None)


def ms_ratio(numerator: Measurement | None, denominator: Measurement | None) -> float | None:
    """numerator's ms/token over denominator's, or None when either was not measured."""
    return numerator.ms_per_token / denominator.ms_per_token if numerator and denominator else None


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first token where two sequences differ, or None when they are identical."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def greedy_verdicts(measurements: list[Measurement]) -> dict[str, dict[str, str]]:
    """For every fxllm row: whether its greedy tokens equal the default row's (other rows) and transformers'."""
    default, baseline = find(measurements, DEFAULT_SYSTEM), find(measurements, BASELINE)
    verdicts: dict[str, dict[str, str]] = {}
    for m in measurements:
        if m is baseline:
            continue
        for reference in (r for r in (default, baseline) if r and r is not m):
            index = first_difference(m.token_ids, reference.token_ids)
            verdicts.setdefault(m.system, {})[reference.system] = (
                "identical" if index is None else f"DIFFERENT from token {index} on")
    return verdicts


def ortgenai_reference(measurements: list[Measurement]) -> Measurement | None:
    """The first onnxruntime-genai row: fxllm rows report their ms/token relative to it."""
    return next((m for m in measurements if m.system.startswith(ORTGENAI)), None)


def format_ratio(value: float | None) -> str:
    return f"{value:.2f}x" if value else "n/a"


def format_table(measurements: list[Measurement]) -> str:
    header = ["system", "ms/token", "prefill ms", "tokens/s", "vs default", "speedup vs transformers",
              "KV cache bytes/token", "model MB", "model GB/s"]
    default, baseline = find(measurements, DEFAULT_SYSTEM), find(measurements, BASELINE)
    genai = ortgenai_reference(measurements)
    if genai:
        header.insert(5, f"vs {genai.system}")
    rows = []
    for m in measurements:
        row = [m.system, f"{m.ms_per_token:.1f}", f"{m.prefill_ms:.1f}", f"{m.tokens_per_s:.1f}",
               format_ratio(ms_ratio(m, default)), format_ratio(ms_ratio(baseline, m)),
               f"{m.kv_bytes_per_token:,}" if m.kv_bytes_per_token else "n/a",
               f"{m.model_bytes / 1e6:.0f}" if m.model_bytes else "n/a",
               f"{m.model_bytes_per_s / 1e9:.1f}" if m.model_bytes_per_s else "n/a"]
        if genai:
            row.insert(5, format_ratio(ms_ratio(m, genai)))
        rows.append(row)
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        padded = [cells[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(cells[1:], widths[1:])]
        return "| " + " | ".join(padded) + " |"

    rule = "|" + "|".join(["-" * (widths[0] + 2)] + ["-" * (w + 1) + ":" for w in widths[1:]]) + "|"
    return "\n".join([line(header), rule, *(line(row) for row in rows)])


def context_results(context: int | None, work: Workload, measurements: list[Measurement]) -> dict[str, Any]:
    """The JSON record of one context's measurements."""
    default, baseline = find(measurements, DEFAULT_SYSTEM), find(measurements, BASELINE)
    verdicts = greedy_verdicts(measurements)
    return {
        "context": context,
        "prompt_tokens": len(work.prompt_ids),
        "measurements": [
            {**asdict(m), "tokens_per_s": m.tokens_per_s, "model_bytes_per_s": m.model_bytes_per_s,
             "vs_default": ms_ratio(m, default), "vs_ortgenai": ms_ratio(m, ortgenai_reference(measurements)),
             "speedup_vs_transformers": ms_ratio(baseline, m), "greedy": verdicts.get(m.system, {})}
            for m in measurements
        ],
    }


# --- the run -----------------------------------------------------------------------------------------------------

def interleaved(work: Workload, runners: list[Runner]) -> list[Measurement]:
    """Every system once per round (A B C, A B C, ...: a busy machine's slow spells hit all of them alike), for
    work.repeats rounds; each system's medians over its rounds."""
    rounds = [[runner(Workload(work.prompt_ids, work.new_tokens, 1)) for runner in runners]
              for _ in range(work.repeats)]
    merged = []
    for per_system in zip(*rounds):
        last = per_system[-1]
        runs = [m.ms_per_token for m in per_system]
        merged.append(Measurement(last.system, statistics.median(runs),
                                  statistics.median(m.prefill_ms for m in per_system), [round(r, 3) for r in runs],
                                  last.token_ids, last.kv_bytes_per_token, last.model_bytes))
    return merged


def measure_context(context: int | None, work: Workload, runners: list[Runner]) -> dict[str, Any]:
    """Measure every system on one context's workload; print its table and greedy verdicts."""
    label = f"context ~{context} tokens" if context else "context: the prompt alone"
    print(f"\n{label} (prompt {len(work.prompt_ids)} tokens, {work.new_tokens} new tokens)", flush=True)
    measurements = interleaved(work, runners)
    print(format_table(measurements))
    for system, references in greedy_verdicts(measurements).items():
        for reference, verdict in references.items():
            print(f"greedy tokens, {system} vs {reference}: {verdict} ({work.new_tokens} tokens)")
    return context_results(context, work, measurements)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    if args.new_tokens < 2:
        parser.error("--new-tokens must be at least 2: the decode rate is measured over tokens after the first")
    if args.repeats < 1 or args.threads < 1:
        parser.error("--repeats and --threads must be at least 1")
    source = resolve_source(args.model)
    variants = prepare_variants(args, parser, source)
    tokenizer = load_tokenizer(variants[0])
    workloads = [Workload(encode_prompt(tokenizer, args.prompt, context), args.new_tokens, args.repeats)
                 for context in args.contexts]
    for work in workloads:
        check_fits(work, variants, parser)
    runners = [fxllm_runner(variant, args.threads, True if args.int8_activations and variant.quantized else None,
                            args.in_process) for variant in variants]
    runners += [ortgenai_runner(variant, args.ortgenai_python, args.threads) for variant in args.ortgenai]
    runners += [llamacpp_runner(Path(path), args.threads) for path in args.llamacpp]
    if not args.skip_transformers:
        runners.append(transformers_runner(source, args.threads))
    env = environment()
    print(f"model {source.name} | {args.new_tokens} new tokens | {args.threads} threads | batch 1, greedy | "
          f"median of {args.repeats} | {env['cpus']} CPUs ({env['machine']}) | torch {env['torch']} | "
          f"onnxruntime {env['onnxruntime']} | transformers {env['transformers']}", flush=True)
    bandwidth = [read_bandwidth(args.threads)]
    print(f"memory read bandwidth ({args.threads} threads, benchmarks/bandwidth.py): {bandwidth[0]:.1f} GB/s",
          flush=True)
    results = [measure_context(context, work, runners) for context, work in zip(args.contexts, workloads)]
    bandwidth.append(read_bandwidth(args.threads))
    print(f"\nmemory read bandwidth at the end: {bandwidth[1]:.1f} GB/s (start {bandwidth[0]:.1f}); 'model GB/s' is "
          "model MB ÷ ms/token")
    env["read_bandwidth_gb_s"] = {"start": round(bandwidth[0], 2), "end": round(bandwidth[1], 2)}
    if args.json:
        config = {"model": args.model, "artifacts": {v.system: str(v.artifact) for v in variants},
                  "passes": {v.system: [p["name"] for p in v.manifest["passes"]] for v in variants},
                  "contexts": args.contexts, "new_tokens": args.new_tokens, "threads": args.threads,
                  "repeats": args.repeats}
        args.json.write_text(json.dumps({"config": config, "environment": env, "results": results}, indent=2) + "\n")
        print(f"wrote {args.json}")


def script_main(run_script: Callable[[argparse.Namespace, argparse.ArgumentParser], None],
                build: Callable[[], argparse.ArgumentParser], name: str) -> None:
    """A benchmark's entry point: quiet libraries, parse arguments, run; an FxllmError becomes one line."""
    quiet_libraries()
    parser = build()
    try:
        run_script(parser.parse_args(), parser)
    except FxllmError as exc:
        sys.exit(f"{name}: error: {exc}")


def main() -> None:
    script_main(run, build_parser, "decode.py")


if __name__ == "__main__":
    main()
