"""Decode-speed benchmark: fxllm's compiled ONNX Runtime engine against transformers eager, in one run.

Measures milliseconds per decoded token at batch 1, greedy, a fixed number of new tokens (default 64) and a fixed
number of intra-op threads (default 2), on the same prompt token ids for every system. Each system runs once to warm
up and then --repeats times; the table shows medians, tokens/s, and each system's speedup over transformers measured
in this same run. It also says whether the systems' greedy tokens are identical (they should be).

Both systems decode exactly --new-tokens tokens: EOS does not stop them, and neither suppresses it, so each emits
the plain argmax sequence.

    .venv/bin/python benchmarks/decode.py                         # SmolLM2-135M, 64 tokens, 2 threads
    .venv/bin/python benchmarks/decode.py --context 2048          # decode after a ~2048-token prompt
    .venv/bin/python benchmarks/decode.py --model DIR_OR_GGUF --artifact ARTIFACT --json results.json

Without --artifact, the model is compiled with the default pipeline into ~/.cache/fxllm/bench/<name> on the first run
and reused afterwards; pass --recompile after changing the compiler.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import fxllm
from fxllm.compiler.sources import ModelSource, load_model, resolve_source
from fxllm.errors import ArtifactError, FxllmError
from fxllm.runtime.artifact import read_manifest

DEFAULT_PROMPT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg, "
                  "a goldsmith from Mainz,")
CACHE_DIR = Path.home() / ".cache" / "fxllm" / "bench"
BASELINE = "transformers eager (sdpa)"


@dataclass(frozen=True)
class Workload:
    prompt_ids: list[int]
    new_tokens: int
    threads: int
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

    @property
    def tokens_per_s(self) -> float:
        return 1e3 / self.ms_per_token


System = Callable[[Workload], Measurement]


def repeated(system: str, run_once: Callable[[], Run], repeats: int) -> Measurement:
    """One warm-up run, then `repeats` timed runs summarized by their medians."""
    run_once()
    runs = [run_once() for _ in range(repeats)]
    return Measurement(
        system=system,
        ms_per_token=statistics.median(r.ms_per_token for r in runs),
        prefill_ms=statistics.median(r.prefill_ms for r in runs),
        runs_ms_per_token=[round(r.ms_per_token, 3) for r in runs],
        token_ids=runs[-1].token_ids,
    )


def measure_fxllm(artifact: Path, work: Workload) -> Measurement:
    engine = fxllm.load(artifact, threads=work.threads)
    # With no EOS ids the engine never stops early, so every run decodes exactly new_tokens tokens.
    engine.eos_token_ids = set()

    def run_once() -> Run:
        result = engine.generate_ids([work.prompt_ids], max_new_tokens=work.new_tokens)[0]
        return Run(result.timings["prefill_ms"], result.timings["decode_ms_per_token"], result.token_ids)

    return repeated("fxllm (onnxruntime)", run_once, work.repeats)


def measure_transformers(source: ModelSource, work: Workload) -> Measurement:
    import torch

    torch.set_num_threads(work.threads)
    model = load_model(source)  # float32, transformers' default "sdpa" attention
    ids = torch.tensor([work.prompt_ids])

    def generate(new_tokens: int) -> tuple[float, list[int]]:
        # eos_token_id=None decodes through EOS like the fxllm side; min_new_tokens would instead replace an EOS
        # argmax with the runner-up token and make the greedy sequences differ.
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new_tokens,
                             eos_token_id=None)
        return (time.perf_counter() - start) * 1e3, out[0, ids.shape[1]:].tolist()

    def run_once() -> Run:
        # generate() reports no timings, so the decode rate is the difference between N tokens and 1 (≈ prefill).
        first_ms, _ = generate(1)
        total_ms, tokens = generate(work.new_tokens)
        return Run(first_ms, (total_ms - first_ms) / (work.new_tokens - 1), tokens)

    return repeated(BASELINE, run_once, work.repeats)


def ensure_artifact(model: str, source: ModelSource, recompile: bool) -> Path:
    """The cached artifact for `source`, compiled with the default pipeline when missing or when asked to."""
    directory = CACHE_DIR / source.name
    if not recompile:
        try:
            read_manifest(directory, verify=False)  # fxllm.load checksums the files
            print(f"using cached artifact {directory} (--recompile to rebuild it)")
            return directory
        except ArtifactError:
            pass
    start = time.perf_counter()
    fxllm.compile(model, directory)
    print(f"compiled {model} → {directory} in {time.perf_counter() - start:.1f} s")
    return directory


def encode_prompt(artifact: Path, manifest: dict[str, Any], prompt: str, context: int | None) -> list[int]:
    """Token ids of the prompt, repeated until it is at least `context` tokens long when `context` is given."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(artifact / manifest["tokenizer_dir"])
    ids = tokenizer(prompt)["input_ids"]
    if context and len(ids) < context:
        ids = tokenizer(" ".join([prompt] * -(-context // len(ids))))["input_ids"]
    return list(ids)


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


def find_baseline(measurements: list[Measurement]) -> Measurement | None:
    return next((m for m in measurements if m.system == BASELINE), None)


def speedups(measurements: list[Measurement]) -> dict[str, float | None]:
    baseline = find_baseline(measurements)
    return {m.system: baseline.ms_per_token / m.ms_per_token if baseline else None for m in measurements}


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first token where two sequences differ, or None when they are identical."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def format_table(measurements: list[Measurement]) -> str:
    header = ["system", "ms/token", "prefill ms", "tokens/s", "speedup vs transformers"]
    speedup = speedups(measurements)
    rows = [
        [m.system, f"{m.ms_per_token:.1f}", f"{m.prefill_ms:.1f}", f"{m.tokens_per_s:.1f}",
         f"{speedup[m.system]:.2f}x" if speedup[m.system] else "n/a"]
        for m in measurements
    ]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        padded = [cells[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(cells[1:], widths[1:])]
        return "| " + " | ".join(padded) + " |"

    rule = "|" + "|".join(["-" * (widths[0] + 2)] + ["-" * (w + 1) + ":" for w in widths[1:]]) + "|"
    return "\n".join([line(header), rule, *(line(row) for row in rows)])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", help="HF directory, .gguf file or 'smollm2-135m'")
    parser.add_argument("--artifact", type=Path, help="compiled artifact of MODEL (default: compile once and cache)")
    parser.add_argument("--recompile", action="store_true", help="rebuild the cached artifact")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2, help="intra-op threads for every system")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per system, after one warm-up")
    parser.add_argument("--prompt", default=DEFAULT_PROMPT)
    parser.add_argument("--context", type=int, help="repeat the prompt to about this many tokens")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--json", type=Path, help="also write the results here")
    return parser


def quiet_libraries() -> None:
    import warnings

    warnings.filterwarnings("ignore")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def prepare(args: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple[ModelSource, Path, Workload]:
    """Check the arguments, find or compile the artifact, and tokenize the prompt."""
    if args.new_tokens < 2:
        parser.error("--new-tokens must be at least 2: the decode rate is measured over tokens after the first")
    if args.repeats < 1 or args.threads < 1:
        parser.error("--repeats and --threads must be at least 1")
    source = resolve_source(args.model)
    artifact = args.artifact or ensure_artifact(args.model, source, args.recompile)
    manifest = read_manifest(artifact, verify=False)
    if manifest["source"]["name"] != source.name:
        print(f"warning: {artifact} was compiled from '{manifest['source']['name']}', not '{source.name}'",
              file=sys.stderr)
    work = Workload(encode_prompt(artifact, manifest, args.prompt, args.context), args.new_tokens, args.threads,
                    args.repeats)
    max_positions = manifest["spec"]["max_positions"]
    if len(work.prompt_ids) + work.new_tokens > max_positions:
        parser.error(f"{len(work.prompt_ids)} prompt + {work.new_tokens} new tokens exceed the model's context "
                     f"of {max_positions}")
    return source, artifact, work


def greedy_verdicts(measurements: list[Measurement]) -> dict[str, str]:
    """For every system but the baseline: whether its greedy tokens equal the baseline's."""
    baseline = find_baseline(measurements)
    verdicts = {}
    for m in measurements:
        if baseline and m is not baseline:
            index = first_difference(m.token_ids, baseline.token_ids)
            verdicts[m.system] = "identical" if index is None else f"DIFFERENT from token {index} on"
    return verdicts


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    source, artifact, work = prepare(args, parser)
    systems: list[System] = [partial(measure_fxllm, artifact)]
    if not args.skip_transformers:
        systems.append(partial(measure_transformers, source))
    env = environment()
    print(f"model {source.name} | prompt {len(work.prompt_ids)} tokens | {work.new_tokens} new tokens | "
          f"{work.threads} threads | batch 1, greedy | median of {work.repeats} | {env['cpus']} CPUs "
          f"({env['machine']}) | torch {env['torch']} | onnxruntime {env['onnxruntime']} | "
          f"transformers {env['transformers']}", flush=True)
    measurements = [system(work) for system in systems]

    print()
    print(format_table(measurements))
    verdicts = greedy_verdicts(measurements)
    for system, verdict in verdicts.items():
        print(f"greedy tokens, {system} vs transformers: {verdict} ({work.new_tokens} tokens)")
    if args.json:
        speedup = speedups(measurements)
        results = [{**asdict(m), "tokens_per_s": m.tokens_per_s, "speedup_vs_transformers": speedup[m.system],
                    "greedy_vs_transformers": verdicts.get(m.system)} for m in measurements]
        config = {"model": args.model, "artifact": str(artifact), "prompt_tokens": len(work.prompt_ids),
                  "new_tokens": work.new_tokens, "threads": work.threads, "repeats": work.repeats}
        args.json.write_text(json.dumps({"config": config, "environment": env, "results": results}, indent=2) + "\n")
        print(f"wrote {args.json}")


def main() -> None:
    quiet_libraries()
    parser = build_parser()
    try:
        run(parser.parse_args(), parser)
    except FxllmError as exc:
        sys.exit(f"decode.py: error: {exc}")


if __name__ == "__main__":
    main()
