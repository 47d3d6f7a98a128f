"""The artifact's tokenizer, without transformers: the `tokenizers` library on `tokenizer.json`, plus what
transformers takes from `tokenizer_config.json` and the chat template files (runtime/tokenizer_config.py), giving the
token ids transformers gives. Chat templates render in runtime/chat_template.py.

The compiler writes the tokenizer directory with transformers' `save_pretrained`, so `tokenizer.json` already holds the
whole pipeline (normalizer, pre-tokenizer, model, post-processor with any BOS/EOS, added tokens). Only files of the
directory are read, and the manifest's check (runtime/artifact_files.py `check_tokenizer_dir`) has already refused
any file in it that the artifact does not list.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping
from functools import cached_property
from pathlib import Path
from typing import Any

import tokenizers

from fxllm.errors import ArtifactError, GenerationError
from fxllm.runtime.chat_template import render_chat
from fxllm.runtime.tokenizer_config import (TOKENIZER_FILE, chat_templates, clean_up_spaces_enabled, read_config,
                                            read_text, register_added_tokens, special_tokens)

_BYTE_FALLBACK_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


class Tokenizer:
    """Text ↔ token ids for one model. `vocab_size` counts added tokens too (transformers' `len(tokenizer)`)."""

    def __init__(self, backend: tokenizers.Tokenizer, special_tokens: Mapping[str, str],
                 extra_special_tokens: Iterable[str] = (), chat_template: str | dict[str, str] | None = None,
                 clean_up_spaces: bool = False):
        self.backend = backend
        self.special_tokens = dict(special_tokens)  # name → text, e.g. {"eos_token": "<|im_end|>"}; templates see it
        self.extra_special_tokens = list(extra_special_tokens)
        self.chat_template = chat_template
        self.clean_up_spaces = clean_up_spaces

    # -- text ↔ ids ---------------------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `add_special_tokens` applies the post-processor (e.g. a BOS) as transformers does."""
        if not isinstance(text, str):
            raise GenerationError(f"can only tokenize text, got {type(text).__name__}")
        # encode_batch, unlike encode, releases the GIL while it works: a server tokenizing a long prompt on a
        # worker thread keeps its event loop running
        return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """The text of `ids`; ids outside the vocabulary decode to nothing."""
        ids = [i for i in map(int, ids) if 0 <= i < 2 ** 32]  # past u32 the tokenizers binding raised OverflowError
        text = self.backend.decode(ids, skip_special_tokens=skip_special_tokens)
        return _clean_up_spaces(text) if self.clean_up_spaces else text

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry of an id (e.g. 'Ġhello' for byte-level BPE), None outside the vocabulary."""
        return self.backend.id_to_token(int(token_id))

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes this token adds to the text (OpenAI logprobs' `bytes`; a token may hold part of a UTF-8
        character). Exact for byte-level BPE, byte-fallback (`<0xNN>`) and SentencePiece-style (`▁` = space)
        vocabulary tokens; added tokens and other kinds are the token decoded on its own."""
        token = self.id_to_token(token_id)
        if token is None:
            return b""
        if int(token_id) not in self._added_ids:
            if self._byte_level and all(char in _UNICODE_TO_BYTE for char in token):
                return bytes(_UNICODE_TO_BYTE[char] for char in token)
            byte = self._fallback_byte(token_id)
            if byte is not None:
                return bytes([byte])
            if self._space_marker:
                return token.replace(self._space_marker, " ").encode("utf-8")
        return self.decode([token_id], skip_special_tokens=False).encode("utf-8")

    def is_fallback_byte(self, token_id: int) -> bool:
        """Whether the id is a byte-fallback token (`<0xNN>` under a ByteFallback decoder): the decoder reads a run of
        them as one byte string, so a later byte of the run can change the text of the earlier ones."""
        return self._fallback_byte(token_id) is not None

    def _fallback_byte(self, token_id: int) -> int | None:
        """The byte a byte-fallback token stands for; None for any other id."""
        if "ByteFallback" not in self._decoder_types or int(token_id) in self._added_ids:
            return None
        token = self.id_to_token(token_id)
        match = _BYTE_FALLBACK_TOKEN.match(token) if token is not None else None
        return int(match.group(1), 16) if match else None

    # -- special tokens -----------------------------------------------------------------------------------------

    def special_token_id(self, name: str) -> int | None:
        """The id of a named special token ("eos_token", ...); the unknown token's id when it is not in the
        vocabulary (as transformers does), None when the tokenizer names no such token."""
        token = self.special_tokens.get(name)
        if token is None:
            return None
        token_id = self.backend.token_to_id(token)
        return token_id if token_id is not None or name == "unk_token" else self.unk_token_id

    @property
    def bos_token_id(self) -> int | None:
        return self.special_token_id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self.special_token_id("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self.special_token_id("pad_token")

    @property
    def unk_token_id(self) -> int | None:
        return self.special_token_id("unk_token")

    @cached_property
    def all_special_ids(self) -> frozenset[int]:
        """Ids of the added tokens marked special: the ones `decode(skip_special_tokens=True)` drops."""
        return frozenset(i for i, token in self.backend.get_added_tokens_decoder().items() if token.special)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    # -- chat ---------------------------------------------------------------------------------------------------

    def apply_chat_template(self, messages: Any, /, add_generation_prompt: bool = True, *, tools: list | None = None,
                            documents: list | None = None, chat_template: str | None = None, **kwargs: Any) -> str:
        """The conversation as prompt text, rendered as transformers renders it (tokenize it with
        `encode(text, add_special_tokens=False)`: the template writes its own special tokens). `chat_template`: a
        template, or the name of one of the model's templates; extra keyword arguments reach the template."""
        template = self._select_template(chat_template, tools)
        return render_chat(template, messages, add_generation_prompt=add_generation_prompt, tools=tools,
                           documents=documents, special_tokens=self.special_tokens, variables=kwargs)

    def _select_template(self, requested: str | None, tools: list | None) -> str:
        templates = self.chat_template
        if isinstance(templates, dict):
            if requested is not None:
                return templates.get(requested, requested)
            if tools is not None and "tool_use" in templates:
                return templates["tool_use"]
            if "default" in templates:
                return templates["default"]
            raise GenerationError(f"this model has several chat templates and none is the default; name one of "
                                  f"{sorted(templates)}")
        if requested is not None:
            return requested
        if templates is None:
            raise GenerationError("this model's tokenizer has no chat template; send a plain prompt instead")
        return templates

    # -- decoder facts (for token_bytes) -------------------------------------------------------------------------

    @cached_property
    def _decoders(self) -> list[dict[str, Any]]:
        decoder = self.backend.decoder
        if decoder is None:
            return []
        state = json.loads(decoder.__getstate__())
        return state.get("decoders", [state])

    @cached_property
    def _decoder_types(self) -> set[str]:
        return {d.get("type") for d in self._decoders}

    @cached_property
    def _byte_level(self) -> bool:
        return "ByteLevel" in self._decoder_types

    @cached_property
    def _space_marker(self) -> str | None:
        """The character a SentencePiece-style vocabulary writes for a space ('▁'), if the decoder restores it."""
        for d in self._decoders:
            if d.get("type") == "Metaspace":
                return d.get("replacement")
            if d.get("type") == "Replace" and d.get("content") == " ":
                return d.get("pattern", {}).get("String")
        return None

    @cached_property
    def _added_ids(self) -> frozenset[int]:
        return frozenset(self.backend.get_added_tokens_decoder())


def load_tokenizer(directory: str | os.PathLike) -> Tokenizer:
    """The tokenizer saved in DIRECTORY (an artifact's tokenizer/ folder, or any transformers tokenizer directory
    with a tokenizer.json). Unreadable or missing files are an ArtifactError."""
    directory = Path(directory)
    config = read_config(directory)
    path = directory / TOKENIZER_FILE
    if not path.is_file():
        raise ArtifactError(f"the tokenizer in '{directory}' has no {TOKENIZER_FILE} (fxllm's runtime reads the "
                            "`tokenizers` format; recompile the artifact with a fast tokenizer)")
    try:
        backend = tokenizers.Tokenizer.from_str(read_text(path))
    except ArtifactError:
        raise
    except Exception as exc:  # tokenizers raises a bare Exception on a malformed file
        raise ArtifactError(f"cannot read {path}: {' '.join(str(exc).split())}") from exc
    named, extra = special_tokens(config)
    register_added_tokens(backend, config.get("added_tokens_decoder"), named, extra)
    backend.encode_special_tokens = bool(config.get("split_special_tokens", False))
    return Tokenizer(backend, {name: token.content for name, token in named.items()},
                     [token.content for token in extra], chat_templates(directory, config),
                     clean_up_spaces_enabled(config, backend))


def _clean_up_spaces(text: str) -> str:
    """transformers' `clean_up_tokenization`: drop the space WordPiece-style decoders leave before punctuation and
    English contractions."""
    for spaced, joined in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                           (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(spaced, joined)
    return text


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-in for each byte (GPT-2's table), inverted: character → byte. Printable
    Latin-1 bytes stand for themselves; the other 68 bytes map, in order, to the characters from U+0100 on."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + n): b for n, b in enumerate(others)}}


_UNICODE_TO_BYTE = _byte_level_alphabet()
