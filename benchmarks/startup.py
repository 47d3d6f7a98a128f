"""Startup benchmark: the cold wall time of `fxllm generate ARTIFACT --max-new-tokens 1`, the runtime's own
tokenizer (after) against the previous way of loading it through transformers (before), in one run.

Every run is a fresh process (so imports, the manifest check, the ONNX Runtime session and the tokenizer all count);
the OS page cache is warm (one unmeasured run of each variant first). The variants alternate (A B A B ...) and the
table shows medians and each variant's ratio to the first row. Variants:

- `before (transformers tokenizer)`: the same command, with the engine's tokenizer loaded by transformers'
  `AutoTokenizer.from_pretrained` as fxllm did before runtime/tokenizer.py (and importing transformers for it);
  everything else is today's code.
- `before (REF)`, with --before-ref REF: the fxllm of git commit REF, extracted into a temporary directory (nothing in
  the repository changes) and run from there.
- `after (runtime tokenizer)`: today's `fxllm generate`.

It also runs `python -X importtime -c "import fxllm; fxllm.load(ARTIFACT)"` and reports whether torch, transformers,
fxllm.compiler or fxllm.passes appear in the import set (they must not), and the largest imports.

    .venv/bin/python benchmarks/startup.py                       # SmolLM2 (compiled once into the bench cache)
    .venv/bin/python benchmarks/startup.py ARTIFACT --repeats 9
    .venv/bin/python benchmarks/startup.py --tiny                # a tiny random-weight Llama: imports dominate
    .venv/bin/python benchmarks/startup.py --before-ref main~1   # also the previous commit itself
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

CACHE_DIR = Path.home() / ".cache" / "fxllm" / "bench"
REPO = Path(__file__).resolve().parents[1]
PROMPT = "The history of the printing press"
FORBIDDEN = ("torch", "transformers", "fxllm.compiler", "fxllm.passes")

# The previous Engine.load: `from transformers import AutoTokenizer; AutoTokenizer.from_pretrained(tokenizer_dir)`.
BEFORE_PRELUDE = """
import sys
import fxllm.runtime.engine as engine

def load_with_transformers(directory):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(directory)

engine.load_tokenizer = load_with_transformers
from fxllm.cli import main
sys.exit(main(sys.argv[1:]))
"""
CLI = "import sys\nfrom fxllm.cli import main\nsys.exit(main(sys.argv[1:]))"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", nargs="?", help="artifact directory (default: SmolLM2, compiled once into "
                                                    f"{CACHE_DIR}/startup-smollm2-135m)")
    parser.add_argument("--tiny", action="store_true", help="use a tiny random-weight Llama artifact (2 layers, "
                                                            "hidden 64, SmolLM2's tokenizer), compiled once")
    parser.add_argument("--repeats", type=int, default=7, help="measured runs per variant (default 7)")
    parser.add_argument("--before-ref", help="also run the fxllm of this git commit (e.g. main~1) as a variant")
    return parser


def default_artifact(tiny: bool) -> Path:
    """The cached benchmark artifact, compiled on first use (needs the compile extra)."""
    directory = CACHE_DIR / ("startup-tiny-llama" if tiny else "startup-smollm2-135m")
    if (directory / "manifest.json").is_file():
        return directory
    print(f"compiling {directory} (once)...", file=sys.stderr)
    if tiny:
        code = f"""
import torch, fxllm
from transformers import AutoModelForCausalLM, LlamaConfig
from fxllm.compiler.sources import load_tokenizer, resolve_source
import tempfile
torch.manual_seed(0)
config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1,
                     eos_token_id=2, pad_token_id=2)
with tempfile.TemporaryDirectory() as source:
    AutoModelForCausalLM.from_config(config).save_pretrained(source)
    load_tokenizer(resolve_source("smollm2-135m")).save_pretrained(source)
    fxllm.compile(source, {str(directory)!r})
"""
        subprocess.run([sys.executable, "-c", code], check=True)
    else:
        subprocess.run([sys.executable, "-m", "fxllm", "compile", "smollm2-135m", "-o", str(directory)], check=True)
    return directory


def checkout(ref: str, into: Path) -> Path:
    """`git archive REF` extracted under `into`, laid out as an importable `fxllm` package; returns the PYTHONPATH."""
    archive = into / "source.tar"
    with open(archive, "wb") as handle:
        subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar", ref], stdout=handle, check=True)
    source = into / "source"
    with tarfile.open(archive) as tar:
        tar.extractall(source, filter="data")
    for package in ("compiler", "passes", "runtime"):  # pyproject maps these folders to fxllm.<package>
        (source / "fxllm" / package).symlink_to(source / package, target_is_directory=True)
    return source


def variants(artifact: Path, before_ref_path: Path | None, ref: str | None) -> dict[str, tuple[list[str], dict]]:
    argv = ["generate", str(artifact), "--prompt", PROMPT, "--max-new-tokens", "1"]
    env = {**os.environ, "FXLLM_QUIET": "1"}
    table = {"before (transformers tokenizer)": ([sys.executable, "-c", BEFORE_PRELUDE, *argv], env)}
    if before_ref_path is not None:
        path_env = {**env, "PYTHONPATH": os.pathsep.join([str(before_ref_path), env.get("PYTHONPATH", "")])}
        table[f"before ({ref})"] = ([sys.executable, "-c", CLI, *argv], path_env)
    table["after (runtime tokenizer)"] = ([sys.executable, "-c", CLI, *argv], env)
    return table


def timed(command: list[str], env: dict, cwd: str) -> float:
    """Wall seconds of one run. `cwd` is neutral: `python -c` puts the working directory first on sys.path, and the
    repository's own fxllm/ folder there would shadow a --before-ref checkout."""
    start = time.perf_counter()
    proc = subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"startup.py: {' '.join(command[:3])}... failed:\n{proc.stderr}")
    return seconds


def import_report(artifact: Path, env: dict | None = None, prelude: str = "") -> tuple[int, list[str], list[str]]:
    """(modules imported, forbidden ones among them, the five largest top-level imports with their seconds)."""
    code = f"{prelude}\nimport fxllm\nfxllm.load({str(artifact)!r})"
    proc = subprocess.run([sys.executable, "-X", "importtime", "-c", code], env=env or os.environ,
                          cwd=tempfile.gettempdir(), capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"startup.py: importing and loading failed:\n{proc.stderr}")
    rows = []
    for line in proc.stderr.splitlines():
        if line.startswith("import time:") and "|" in line and "cumulative" not in line:
            _, cumulative, name = line[len("import time:"):].split("|")
            rows.append((int(cumulative), name.rstrip()))
    names = [name.strip() for _, name in rows]
    forbidden = sorted({n for n in names if any(n == f or n.startswith(f + ".") for f in FORBIDDEN)})
    top = sorted(((us, name.strip()) for us, name in rows if not name.startswith("  ")), reverse=True)[:5]
    return len(names), forbidden, [f"{name} {us / 1e6:.2f}s" for us, name in top]


def main() -> None:
    args = build_parser().parse_args()
    artifact = Path(args.artifact) if args.artifact else default_artifact(args.tiny)
    with tempfile.TemporaryDirectory(prefix="fxllm-startup-") as scratch:
        before_ref_path = checkout(args.before_ref, Path(scratch)) if args.before_ref else None
        runs = variants(artifact, before_ref_path, args.before_ref)
        for command, env in runs.values():  # warm the page cache; not measured
            timed(command, env, scratch)
        seconds: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(args.repeats):
            for name, (command, env) in runs.items():
                seconds[name].append(timed(command, env, scratch))
        before_imports = import_report(artifact, prelude="from transformers import AutoTokenizer\n"
                                       f"AutoTokenizer.from_pretrained({str(artifact / 'tokenizer')!r})")
        after_imports = import_report(artifact)

    print(f"startup: `fxllm generate {artifact} --prompt ... --max-new-tokens 1`, a fresh process per run, "
          f"{args.repeats} interleaved runs per variant, page cache warm")
    print(f"  {'variant':<34} {'median s':>9} {'min s':>7} {'max s':>7} {'ratio':>7}")
    baseline = statistics.median(next(iter(seconds.values())))
    for name, values in seconds.items():
        median = statistics.median(values)
        print(f"  {name:<34} {median:>9.3f} {min(values):>7.3f} {max(values):>7.3f} {median / baseline:>6.2f}x")
    for label, (count, forbidden, top) in (("before", before_imports), ("after", after_imports)):
        verdict = ", ".join(forbidden[:6]) + (" ..." if len(forbidden) > 6 else "") if forbidden else "none"
        print(f"import set ({label}): {count} modules; torch/transformers/fxllm.compiler/fxllm.passes among them: "
              f"{verdict}")
        print(f"  largest imports: {'; '.join(top)}")
    if after_imports[1]:
        raise SystemExit("startup.py: the runtime imported " + ", ".join(after_imports[1]))


if __name__ == "__main__":
    main()
