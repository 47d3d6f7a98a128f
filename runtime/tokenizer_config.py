"""What transformers (5.x) reads from a tokenizer directory besides `tokenizer.json`, and what it does with it at
load, mirrored for runtime/tokenizer.py:
- the special tokens the config names (`bos_token` ... `mask_token`, any other `*_token` key, `extra_special_tokens`)
  that are not added tokens yet are added, as special ones, in transformers' order (it decides their ids);
- an older config's `added_tokens_decoder` is re-added first (re-adding replaces a token's flags);
- `split_special_tokens` makes special-token text tokenize as plain text;
- decoding cleans up spaces before punctuation only when the config asks and the model is not BPE;
- chat templates: `chat_template.jinja` (the default) and `additional_chat_templates/NAME.jinja` take priority over
  the config's `chat_template` (a string, or a list of {name, template}).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken

from fxllm.errors import ArtifactError
from fxllm.runtime.checks import short

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "additional_chat_templates"
NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
TOKEN_FLAGS = ("single_word", "lstrip", "rstrip", "normalized", "special")  # an AddedToken's bool options


def read_config(directory: Path) -> dict[str, Any]:
    """tokenizer_config.json as a dict ({} when the directory has none)."""
    path = directory / CONFIG_FILE
    if not path.is_file():
        return {}
    config = read_json(path)
    if not isinstance(config, dict):
        raise ArtifactError(f"{path} is not a JSON object")
    return config


def clean_up_spaces_enabled(config: dict[str, Any], backend: tokenizers.Tokenizer) -> bool:
    """transformers cleans up decoded spaces only when asked to, and never for BPE unless forced."""
    return bool(config.get("clean_up_tokenization_spaces", False)) and (
        type(backend.model).__name__ != "BPE"
        or bool(config.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False)))


def special_tokens(config: dict[str, Any]) -> tuple[dict[str, AddedToken], list[AddedToken]]:
    """Named special tokens (the standard ones and model-specific `*_token` keys) and the extra, unnamed ones."""
    # transformers' order (it decides the ids of tokens added at load): the standard names, then the others
    keys = [*NAMED_SPECIAL_TOKENS, *(key for key in config if key.endswith("_token") and key not in NAMED_SPECIAL_TOKENS)]
    named = {key: added_token(config[key], special=True) for key in keys if isinstance(config.get(key), (str, dict))}
    key = "extra_special_tokens" if config.get("extra_special_tokens") else "additional_special_tokens"
    extra_value = config.get(key) or []
    if isinstance(extra_value, dict):  # a dict of named model-specific tokens
        named.update({name: added_token(value, special=True) for name, value in extra_value.items()})
        extra_value = []
    if not isinstance(extra_value, list):
        raise ArtifactError(f"{CONFIG_FILE}: {key} must be a list of tokens or an object of named tokens, got "
                            f"{type(extra_value).__name__}")
    extra = [added_token(value, special=None) for value in extra_value if isinstance(value, (str, dict))]
    return named, extra


def added_token(value: str | dict[str, Any], special: bool | None) -> AddedToken:
    """A config entry (plain text, or a serialized AddedToken) as an AddedToken; `special=True` forces the flag.
    Anything else is an ArtifactError."""
    if isinstance(value, str):
        return AddedToken(value, special=True)
    if not isinstance(value, dict):
        raise ArtifactError(f"a special token in {CONFIG_FILE} is neither its text nor a token object: "
                            f"{str(value)[:60]!r}")
    fields = {key: value[key] for key in TOKEN_FLAGS if key in value}
    if not isinstance(value.get("content"), str):
        raise ArtifactError(f"a special token in {CONFIG_FILE} has no text: {value!r}")
    for key, flag in fields.items():  # AddedToken raises a TypeError on anything but a bool
        if not isinstance(flag, bool):
            raise ArtifactError(f"a special token in {CONFIG_FILE} ({value['content'][:60]!r}) has {key} = "
                                f"{short(flag)}; it must be true or false")
    if special:
        fields["special"] = True
    return AddedToken(value["content"], **fields)


def register_added_tokens(backend: tokenizers.Tokenizer, declared: Any, named: dict[str, AddedToken],
                          extra: list[AddedToken]) -> None:
    """Add what transformers adds at load: the config's own added-token list (older configs; re-adding replaces a
    token's flags), then every special token that is not an added token yet. One call, in transformers' order."""
    tokens: list[AddedToken] = []
    if isinstance(declared, dict):
        if not all(str(key).isdigit() for key in declared):
            raise ArtifactError(f"{CONFIG_FILE}: added_tokens_decoder keys must be token ids")
        tokens += [added_token(value, special=None) for _, value in sorted(declared.items(), key=lambda i: int(i[0]))]
    present = {token.content for token in backend.get_added_tokens_decoder().values()} | {t.content for t in tokens}
    for token in [*named.values(), *extra]:
        if token.content not in present:
            tokens.append(token)
            present.add(token.content)
    if tokens:
        backend.add_tokens(tokens)


def chat_templates(directory: Path, config: dict[str, Any]) -> str | dict[str, str] | None:
    """Template files take priority over the config's entry; one default template is a plain string."""
    templates: dict[str, str] = {}
    if (directory / CHAT_TEMPLATE_FILE).is_file():
        templates["default"] = read_text(directory / CHAT_TEMPLATE_FILE)
    if (directory / CHAT_TEMPLATE_DIR).is_dir():
        for path in sorted((directory / CHAT_TEMPLATE_DIR).glob("*.jinja")):
            templates[path.name.removesuffix(".jinja")] = read_text(path)
    if templates:
        return templates["default"] if list(templates) == ["default"] else templates
    entry = config.get("chat_template")
    if isinstance(entry, list):  # [{"name": ..., "template": ...}, ...]
        if not all(isinstance(item, dict) and isinstance(item.get("name"), str)
                   and isinstance(item.get("template"), str) for item in entry):
            raise ArtifactError(f"{CONFIG_FILE}: chat_template must be a template or a list of {{\"name\", "
                                "\"template\"}} objects")
        return {item["name"]: item["template"] for item in entry}
    return entry if isinstance(entry, str) else None


def read_text(path: Path) -> str:
    if path.exists() and not path.is_file():  # a FIFO or device would block the read
        raise ArtifactError(f"cannot read {path}: not a regular file")
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ArtifactError(f"cannot read {path}: {exc}") from exc


def read_json(path: Path) -> Any:
    try:
        return json.loads(read_text(path))
    except json.JSONDecodeError as exc:
        raise ArtifactError(f"{path} is corrupt: {exc}") from exc
