"""Shared fixtures: real tokenizer (SmolLM2's, from the installed GGUF), tiny random-weight models of each supported
architecture saved as Hugging Face directories, and their compiled artifacts — each built once per session."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

# pytest-xdist workers share the machine's cores: each worker's libraries — torch, ONNX Runtime through fxllm's
# default thread count (runtime/backend_ort.default_threads), and the CLI, server and Ray processes a test starts,
# which inherit it — get an equal share instead of all cores each, so idle threads do not spin against the other
# worker's (set before torch is imported: torch reads it once).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _WORKERS)))

import torch  # noqa: E402

os.environ.setdefault("FXLLM_QUIET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

PROMPTS = [
    "The quick brown fox",
    "In 1911 the Encyclopaedia Britannica described the life of William Shakespeare, who was born in",
    "def fibonacci(n):",
    "Paris is",
]

TINY_COMMON = dict(
    vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=2,
)


def tiny_config(arch: str):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    if arch == "llama":
        return LlamaConfig(**TINY_COMMON)
    if arch == "qwen2":
        return Qwen2Config(**TINY_COMMON, use_sliding_window=False)
    if arch == "mistral":
        return MistralConfig(**TINY_COMMON, sliding_window=None)
    if arch == "gpt2":
        return tiny_gpt2_config()
    raise ValueError(arch)


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    from fxllm.compiler.sources import load_tokenizer, resolve_source

    directory = tmp_path_factory.mktemp("tokenizer")
    load_tokenizer(resolve_source("smollm2-135m")).save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


@pytest.fixture(scope="session")
def calibration_file(tmp_path_factory):
    """Real English text that ships with Python, for the calibrated quantizers and the int8 KV cache (the tests only
    need text, not a public-domain one)."""
    from pydoc_data.topics import topics

    path = tmp_path_factory.mktemp("calib") / "calib.txt"
    path.write_text("\n\n".join(topics.values()))
    return path


@pytest.fixture(scope="session")
def make_tiny_model(tmp_path_factory, tokenizer):
    """arch → HF directory with random weights (seeded) and the real SmolLM2 tokenizer."""
    from transformers import AutoModelForCausalLM

    cache: dict[str, Path] = {}

    def make(arch: str) -> Path:
        if arch not in cache:
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(tiny_config(arch)).eval()
            directory = tmp_path_factory.mktemp(f"tiny-{arch}")
            model.save_pretrained(directory)
            tokenizer.save_pretrained(directory)
            cache[arch] = directory
        return cache[arch]

    return make


@pytest.fixture(scope="session")
def make_tiny_artifact(tmp_path_factory, make_tiny_model):
    """arch → compiled artifact directory (default pipeline)."""
    import fxllm

    cache: dict[str, Path] = {}

    def make(arch: str) -> Path:
        if arch not in cache:
            output = tmp_path_factory.mktemp(f"artifact-{arch}") / "artifact"
            fxllm.compile(make_tiny_model(arch), output)
            cache[arch] = output
        return cache[arch]

    return make


def snapshot(directory: Path) -> dict[str, bytes]:
    """Every file under `directory` by relative path, with its bytes."""
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def hidden_entries(parent: Path) -> list[str]:
    """The names starting with '.' in `parent` (where staging and retired directories live), sorted."""
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


@pytest.fixture
def artifact_copy(make_tiny_artifact, tmp_path) -> Path:
    """A private copy of the tiny llama artifact (compiled by this fxllm: it carries the marker)."""
    copy = tmp_path / "artifact"
    shutil.copytree(make_tiny_artifact("llama"), copy)
    return copy


@pytest.fixture(scope="module")
def broken_model(make_tiny_model, tmp_path_factory) -> Path:
    """The tiny llama's directory with its weights replaced by garbage: resolving it and reading its config work,
    loading it fails. A compile that reports an output problem with this model found it before loading."""
    directory = tmp_path_factory.mktemp("broken-model")
    shutil.copytree(make_tiny_model("llama"), directory, dirs_exist_ok=True)
    for weights in directory.glob("*.safetensors"):
        weights.write_bytes(b"not a safetensors file")
    return directory


TINY_PAGED_PASSES = "cleanup,gqa,fuse-projections,select-logits,kv-cache,paged:block_size=4"


@pytest.fixture(scope="session")
def tiny_paged_artifact(tmp_path_factory, make_tiny_model) -> Path:
    """The tiny llama compiled for the paged KV cache (blocks of 4 tokens); shared, so tests only read it."""
    import fxllm

    output = tmp_path_factory.mktemp("artifact-llama-paged") / "artifact"
    fxllm.compile(make_tiny_model("llama"), output, passes=TINY_PAGED_PASSES)
    return output


@pytest.fixture(scope="session")
def smollm2_artifact(tmp_path_factory) -> Path:
    import fxllm

    output = tmp_path_factory.mktemp("smollm2") / "artifact"
    # requantize: the float32 model transformers loads (the GGUF's own blocks are kept by default)
    fxllm.compile("smollm2-135m", output, dump_dir=tmp_path_factory.mktemp("smollm2-dumps"), requantize=True)
    return output


@pytest.fixture(scope="session")
def smollm2_model():
    from fxllm.compiler.sources import load_model, resolve_source

    return load_model(resolve_source("smollm2-135m"))


def tiny_gpt2_config():
    from transformers import GPT2Config

    return GPT2Config(vocab_size=49152, n_embd=64, n_layer=2, n_head=4, n_positions=256, bos_token_id=1,
                      eos_token_id=2)


@pytest.fixture(scope="session")
def make_torch_artifact(tmp_path_factory, make_tiny_model):
    """(arch, paged, dtype) → a `--target torch` artifact of the tiny model (default pipeline, + paged)."""
    import fxllm
    from fxllm.compiler.pipeline import DEFAULT_PIPELINE

    cache: dict[tuple, Path] = {}

    def make(arch: str = "llama", paged: bool = False, dtype: str = "float32") -> Path:
        key = (arch, paged, dtype)
        if key not in cache:
            output = tmp_path_factory.mktemp(f"torch-{arch}-{dtype}{'-paged' if paged else ''}") / "artifact"
            passes = ",".join(DEFAULT_PIPELINE) + (",paged" if paged else "")
            fxllm.compile(make_tiny_model(arch), output, passes=passes, target="torch", dtype=dtype)
            cache[key] = output
        return cache[key]

    return make


# With `pytest -n 2` (pytest-xdist, `--dist loadgroup`: the README's test command), each group runs on one worker.
# A test module is its own group, so its module-scoped fixtures are built once; every test that uses the real
# SmolLM2 joins one group, so its session fixtures (a 60-100 s compile) are built once, not once per worker; the
# Ray Serve modules share one group, so only one local Ray cluster runs at a time.
SMOLLM2_FIXTURES = {"smollm2_artifact", "smollm2_model"}


# tryfirst: pytest-xdist's worker reads the xdist_group marks in its own pytest_collection_modifyitems, which (a
# plugin registered after this conftest) would otherwise run first and see none of the marks added here.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("xdist_group"):
            continue
        module = item.nodeid.split("::")[0]
        if SMOLLM2_FIXTURES & set(getattr(item, "fixturenames", ())):
            group = "smollm2"
        elif Path(module).name.startswith("test_ray"):
            group = "ray"
        else:
            group = module
        item.add_marker(pytest.mark.xdist_group(group))
