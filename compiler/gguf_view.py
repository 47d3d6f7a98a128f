"""A GGUF file read apart from its folder: the directory transformers' from_pretrained is given for a source."""

from __future__ import annotations

import contextlib
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from fxllm.compiler.source_checks import gguf_path
from fxllm.errors import ModelSourceError

if TYPE_CHECKING:
    from fxllm.compiler.sources import ModelSource


GGUF_VIEW_PREFIX = "fxllm-gguf-"
# What transformers reads from a model's folder besides the weights: a GGUF's folder holding none of these can be
# given to it as it is.
FOLDER_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json", "added_tokens.json", "tokenizer.model", "vocab.json", "merges.txt",
                "chat_template.jinja", "chat_template.json")


@contextlib.contextmanager
def transformers_directory(source: ModelSource) -> Iterator[Path]:
    """The directory transformers' from_pretrained is given for `source`. A GGUF file is the whole model, as
    llama.cpp reads it, but its folder may hold another model's files (llama.cpp's converter writes the .gguf into
    the Hugging Face folder it came from), and transformers takes that folder's tokenizer.json over the GGUF's
    vocabulary (dropping the GGUF's special tokens and chat template; a foreign one silently paired other ids with
    the weights) and its generation_config.json's end ids: so it is given a private temporary folder holding only
    a link to the file, or the folder itself where that holds none of FOLDER_FILES."""
    if not source.gguf_file or not any((source.directory / name).exists() for name in FOLDER_FILES):
        yield source.directory
        return
    alone = _linked_alone(source)
    try:
        yield alone
    finally:
        shutil.rmtree(alone, ignore_errors=True)


def _linked_alone(source: ModelSource) -> Path:
    """A new temporary directory holding only a link to the source's GGUF file, or a one-line ModelSourceError."""
    alone = None
    try:
        alone = Path(tempfile.mkdtemp(prefix=GGUF_VIEW_PREFIX))
        (alone / source.gguf_file).symlink_to(gguf_path(source).resolve())
        return alone
    except OSError as exc:
        if alone is not None:
            shutil.rmtree(alone, ignore_errors=True)
        raise ModelSourceError(f"'{gguf_path(source)}' shares its folder with other model files ("
                               f"{', '.join(name for name in FOLDER_FILES if (source.directory / name).exists())}), "
                               "which transformers would read instead of the GGUF's own, and no temporary folder to "
                               f"read it apart could be made ({exc.strerror or exc}): set TMPDIR to a writable "
                               "directory, or move the .gguf into a folder of its own") from exc


def users_paths(text: str, source: ModelSource) -> str:
    """`text` (an error of transformers) with the temporary folder a GGUF was read through named as its folder."""
    if not source.gguf_file:
        return text
    return re.sub(r"[^\s'\"]*" + re.escape(GGUF_VIEW_PREFIX) + r"\w+", str(source.directory), text)
