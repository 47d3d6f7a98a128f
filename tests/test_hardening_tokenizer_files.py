"""An artifact's tokenizer files edited by hand (or by someone who re-wrote the manifest's checksums to match): each
bad entry is a one-line ArtifactError naming the file, never an internal error."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from fxllm.errors import ArtifactError
from fxllm.runtime.tokenizer import load_tokenizer


def _tokenizer_with_config(tokenizer_dir: Path, tmp_path: Path, **entries) -> Path:
    """A copy of the tokenizer directory whose tokenizer_config.json has `entries` set."""
    copy = tmp_path / "tokenizer"
    shutil.copytree(tokenizer_dir, copy)
    config = json.loads((copy / "tokenizer_config.json").read_text())
    (copy / "tokenizer_config.json").write_text(json.dumps({**config, **entries}))
    return copy


@pytest.mark.parametrize("flag, value", [("lstrip", "yes"), ("single_word", 1), ("normalized", None),
                                         ("special", "x"), ("rstrip", [True])])
@pytest.mark.parametrize("entry", ["bos_token", "added_tokens_decoder", "extra_special_tokens"])
def test_a_special_tokens_flag_that_is_not_a_bool_is_an_artifact_error(tokenizer_dir, tmp_path, entry, flag, value):
    """A token object's flags (lstrip, single_word, ...) are passed to tokenizers' AddedToken, which raised a
    TypeError on anything but a bool: `fxllm generate` exited 2 ("internal error: TypeError: 'str' object is not an
    instance of 'bool'"). Now the token and the flag are named."""
    token = {"content": "<|im_start|>", flag: value}
    config = {"bos_token": token, "added_tokens_decoder": {"1": token},
              "extra_special_tokens": {"image_token": token}}[entry]
    copy = _tokenizer_with_config(tokenizer_dir, tmp_path, **{entry: config})
    with pytest.raises(ArtifactError, match=f"tokenizer_config.json .*'<\\|im_start\\|>'.* has {flag} = "
                                            "[^;]+; it must be true or false"):
        load_tokenizer(copy)


def test_bool_flags_still_load(tokenizer_dir, tmp_path):
    """The check refuses only non-bools: a token object with every flag a bool loads as before."""
    token = {"content": "<|im_start|>", "lstrip": False, "rstrip": False, "single_word": False, "normalized": False,
             "special": True}
    copy = _tokenizer_with_config(tokenizer_dir, tmp_path, bos_token=token, added_tokens_decoder={"1": token})
    assert load_tokenizer(copy).encode("<|im_start|>hi", add_special_tokens=False)[0] == 1
