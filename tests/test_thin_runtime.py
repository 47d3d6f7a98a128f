"""The runtime runs without the compiler: `fxllm.load(...).generate(...)`, `fxllm generate`, `fxllm inspect` and
`fxllm eval ARTIFACT` in a subprocess where importing torch, transformers, fxllm.compiler (or any other package of the
`compile` extra) fails as if it were not installed, with the same results as the full install. Without the extra,
the compiler's commands say in one line what to install. And `pip install fxllm` itself asks for no compiler package.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pydoc_data.topics
import pytest

import fxllm
from fxllm.extras import COMPILE_MODULES
from tests.conftest import PROMPTS, TINY_COMMON

REPO = Path(fxllm.__file__).resolve().parents[1]
FXLLM_SOURCES = [REPO / folder for folder in ("fxllm", "runtime", "compiler", "passes")]
COMPILER = ("fxllm.compiler", "fxllm.passes")
TEXT = Path(pydoc_data.topics.__file__)

# Installed through PYTHONPATH as `sitecustomize`, so it runs before anything else in the child, console scripts
# included: a blocked module is "not installed", and every attempt is logged with the file that tried.
SITECUSTOMIZE = textwrap.dedent('''
    import os, sys

    _BLOCKED = tuple(os.environ["FXLLM_TEST_BLOCK"].split(","))

    class _NotInstalled:
        def find_spec(self, name, path=None, target=None):
            if not any(name == b or name.startswith(b + ".") for b in _BLOCKED):
                return None
            frame = sys._getframe(1)
            while frame is not None and frame.f_code.co_filename.startswith("<frozen"):
                frame = frame.f_back
            with open(os.environ["FXLLM_TEST_BLOCK_LOG"], "a") as log:
                log.write(f"{name}\\t{frame.f_code.co_filename if frame else '?'}\\n")
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)", name=name)

    sys.meta_path.insert(0, _NotInstalled())
''')


class Blocked:
    """Runs commands in child processes where `modules` cannot be imported."""

    def __init__(self, directory: Path, modules: tuple[str, ...]):
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "sitecustomize.py").write_text(SITECUSTOMIZE)
        self.log = directory / "attempts.log"
        self.env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(directory), os.environ.get("PYTHONPATH", "")]),
                    "FXLLM_TEST_BLOCK": ",".join(modules), "FXLLM_TEST_BLOCK_LOG": str(self.log),
                    "FXLLM_QUIET": "1"}

    def run(self, *argv: str) -> subprocess.CompletedProcess:
        return subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=300)

    def cli(self, *argv: str) -> subprocess.CompletedProcess:
        return self.run(str(Path(sys.executable).with_name("fxllm")), *argv)

    def python(self, code: str) -> subprocess.CompletedProcess:
        return self.run(sys.executable, "-c", code)

    def attempts_by_fxllm(self) -> list[str]:
        """Blocked imports that fxllm's own code tried (a library probing for torch is its own business)."""
        lines = self.log.read_text().splitlines() if self.log.exists() else []
        return [line for line in lines
                if any(Path(line.split("\t")[1]).resolve().is_relative_to(src) for src in FXLLM_SOURCES)]


def ok(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.fixture(scope="module")
def no_compiler(tmp_path_factory) -> Blocked:
    return Blocked(tmp_path_factory.mktemp("no-compiler"), COMPILE_MODULES + ("tqdm",) + COMPILER)


@pytest.fixture(scope="module")
def other_family_artifact(tmp_path_factory):
    """A tiny Llama with a byte-level BPE tokenizer that adds a BOS (not SmolLM2's), compiled."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    from tests.tokenizer_families import build_family

    _, tokenizer_dir = build_family("gpt2-bpe", tmp_path_factory.mktemp("gpt2-bpe"))
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(0)
    config = LlamaConfig(**{**TINY_COMMON, "vocab_size": len(tokenizer), "bos_token_id": tokenizer.bos_token_id,
                            "eos_token_id": tokenizer.eos_token_id, "pad_token_id": None})
    model_dir = tmp_path_factory.mktemp("tiny-gpt2-bpe")
    AutoModelForCausalLM.from_config(config).eval().save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    output = tmp_path_factory.mktemp("artifact-gpt2-bpe") / "artifact"
    fxllm.compile(model_dir, output)
    return output


@functools.lru_cache(maxsize=4)
def reference_engine(artifact: Path):
    """The in-process engine (full install) and transformers' tokenizer of the artifact: the previous way."""
    from transformers import AutoTokenizer

    return fxllm.load(artifact), AutoTokenizer.from_pretrained(artifact / "tokenizer")


def expected_tokens(artifact: Path, prompts: list[str], max_new_tokens: int, chat: bool = False) -> list[list[int]]:
    """Greedy tokens of the prompts tokenized by transformers, generated by the in-process engine."""
    engine, reference = reference_engine(artifact)
    if chat:
        ids = [reference.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)["input_ids"]
               for p in prompts]
    else:
        ids = [reference(p)["input_ids"] for p in prompts]
    return [r.token_ids for r in engine.generate_ids(ids, max_new_tokens=max_new_tokens)]


API_SCRIPT = """
import json, sys
import fxllm
engine = fxllm.load(sys.argv[1])
plain = engine.generate(sys.argv[2:], max_new_tokens=8)
chat = engine.generate(sys.argv[2], max_new_tokens=8, chat=True)
streamed = "".join(engine.stream(sys.argv[2], max_new_tokens=8))
print(json.dumps({"plain": [r.token_ids for r in plain], "chat": chat.token_ids, "text": plain[0].text,
                  "streamed": streamed, "loaded": sorted(m for m in sys.modules if m.split(".")[0] in
                  ("torch", "transformers", "onnx", "accelerate") or m.startswith(("fxllm.compiler", "fxllm.passes")))}))
"""


def check_runtime_api(blocked: Blocked, artifact: Path, prompts: list[str]) -> None:
    out = json.loads(ok(blocked.run(sys.executable, "-c", API_SCRIPT, str(artifact), *prompts)))
    assert out["plain"] == expected_tokens(artifact, prompts, 8)
    assert [out["chat"]] == expected_tokens(artifact, prompts[:1], 8, chat=True)
    assert out["streamed"] == out["text"]
    assert out["loaded"] == []


def check_runtime_cli(blocked: Blocked, artifact: Path, prompts: list[str]) -> None:
    generate = ["generate", str(artifact), "--max-new-tokens", "6", "--json"]
    batch = [json.loads(line) for line in ok(blocked.cli(*generate, *(a for p in prompts for a in ("--prompt", p))))
             .splitlines()]
    assert [r["token_ids"] for r in batch] == expected_tokens(artifact, prompts, 6)
    streamed = ok(blocked.cli("generate", str(artifact), "--prompt", prompts[0], "--max-new-tokens", "6", "--chat"))
    chat_tokens = expected_tokens(artifact, prompts[:1], 6, chat=True)[0]
    assert streamed == reference_engine(artifact)[1].decode(chat_tokens, skip_special_tokens=True) + "\n"

    from fxllm.runtime.inspect import describe_artifact

    assert ok(blocked.cli("inspect", str(artifact))).rstrip("\n") == describe_artifact(artifact)["text"]
    report = json.loads(ok(blocked.cli("eval", str(artifact), "--text", str(TEXT), "--ctx", "32", "--max-tokens",
                                       "160", "--json")))
    from fxllm.evaluation import evaluate

    expected = evaluate(str(artifact), TEXT, ctx=32, max_tokens=160)
    assert report["tokens"] == expected.tokens
    assert math.isclose(report["perplexity"], expected.perplexity, rel_tol=1e-6)


def test_tiny_artifact_runs_without_the_compiler(no_compiler, make_tiny_artifact):
    artifact = make_tiny_artifact("llama")
    check_runtime_api(no_compiler, artifact, PROMPTS[:2])
    check_runtime_cli(no_compiler, artifact, PROMPTS[:2])
    assert no_compiler.attempts_by_fxllm() == []


def test_other_tokenizer_family_runs_without_the_compiler(no_compiler, other_family_artifact):
    check_runtime_api(no_compiler, other_family_artifact, PROMPTS[1:3])
    assert no_compiler.attempts_by_fxllm() == []


@pytest.mark.slow
def test_smollm2_runs_without_the_compiler(no_compiler, smollm2_artifact):
    check_runtime_api(no_compiler, smollm2_artifact, PROMPTS[:2])
    check_runtime_cli(no_compiler, smollm2_artifact, PROMPTS[:2])
    assert no_compiler.attempts_by_fxllm() == []


def test_compiler_commands_name_the_missing_extra(tmp_path, make_tiny_model, make_tiny_artifact):
    """torch and transformers are missing (fxllm.compiler itself is importable): one line, exit 1, nothing written."""
    blocked = Blocked(tmp_path / "shim", ("torch", "transformers"))
    source, artifact, output = make_tiny_model("llama"), make_tiny_artifact("llama"), tmp_path / "out"
    for argv in (["compile", str(source), "-o", str(output)], ["eval", str(source), "--text", str(TEXT)],
                 ["inspect", str(artifact), "--check", "tensorrt"], ["passes"]):
        proc = blocked.cli(*argv)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 1 and len(lines) == 1, (argv, proc.stderr)
        assert "missing torch, transformers" in lines[0] and "pip install 'fxllm[compile]'" in lines[0], lines[0]
    proc = blocked.python(f"import fxllm\ntry:\n    fxllm.compile({str(source)!r}, {str(output)!r})\n"
                          "except fxllm.FxllmError as exc:\n    print(type(exc).__name__)")
    assert ok(proc).strip() == "MissingDependencyError"
    assert not output.exists()


def test_the_runtime_install_asks_for_no_compiler_package():
    """`pip install fxllm` (no extra) requires only runtime packages; the `compile` extra holds the rest."""
    from packaging.requirements import Requirement

    requirements = [Requirement(r) for r in importlib.metadata.requires("fxllm")]
    base = {r.name.lower() for r in requirements if r.marker is None}
    compile_extra = {r.name.lower() for r in requirements if r.marker and r.marker.evaluate({"extra": "compile"})}
    assert base == {"numpy", "onnxruntime", "tokenizers", "jinja2"}
    assert {"torch", "transformers", "accelerate", "onnx", "onnxscript", "gguf", "tqdm"} <= compile_extra
