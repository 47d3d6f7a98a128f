"""A model directory that ships its own Python classes (`auto_map` in config.json or tokenizer_config.json) is
refused by `fxllm compile` at once: its code never runs, and nothing asks whether it may."""

from __future__ import annotations

import builtins
import json
import shutil
from pathlib import Path

import pytest

import fxllm
from fxllm.errors import ModelSourceError

CUSTOM_CODE = '''from pathlib import Path
Path({marker!r}).write_text("the model's own code ran")
from transformers import PreTrainedTokenizerFast, LlamaConfig, LlamaForCausalLM
class CustomTokenizer(PreTrainedTokenizerFast): pass
class CustomConfig(LlamaConfig): model_type = "custom-llama"
class CustomModel(LlamaForCausalLM): config_class = CustomConfig
'''


def _with_custom_code(model: Path, directory: Path, file: str, entries: dict) -> Path:
    """A copy of `model` with custom_code.py beside it and `entries` set in `file` (a JSON config)."""
    shutil.copytree(model, directory)
    # transformers imports a copy from its modules cache: the marker's path is absolute
    (directory / "custom_code.py").write_text(CUSTOM_CODE.format(marker=str(directory / "CODE_RAN")))
    config = json.loads((directory / file).read_text())
    (directory / file).write_text(json.dumps({**config, **entries}))
    return directory


@pytest.mark.parametrize("file, entries", [
    ("tokenizer_config.json", {"auto_map": {"AutoTokenizer": [None, "custom_code.CustomTokenizer"]},
                               "tokenizer_class": "CustomTokenizer"}),
    ("config.json", {"auto_map": {"AutoConfig": "custom_code.CustomConfig",
                                  "AutoModelForCausalLM": "custom_code.CustomModel"},
                     "model_type": "custom-llama"}),
])
def test_a_model_with_its_own_code_is_refused_without_asking(make_tiny_model, tmp_path, monkeypatch, file, entries):
    """transformers, not told trust_remote_code, asked "Do you wish to run the custom code? [y/N]" on the terminal
    (`fxllm compile` sat waiting 15 s) and, answered "y", imported the directory's Python file and compiled its
    classes (the tokenizer case; a config naming an unknown model type was refused by the architecture check
    already). Here every question is answered "y": the compile must still be refused and the code never run."""
    questions: list[str] = []
    monkeypatch.setattr(builtins, "input", lambda prompt="": questions.append(prompt) or "y")
    model = _with_custom_code(make_tiny_model("llama"), tmp_path / "model", file, entries)
    with pytest.raises(ModelSourceError, match="contains custom code"):
        fxllm.compile(model, tmp_path / "out")
    assert questions == []
    assert not (model / "CODE_RAN").exists()
    assert not (tmp_path / "out").exists()


def test_an_auto_map_beside_a_known_model_type_is_built_as_transformers_class_and_said(make_tiny_model, tmp_path,
                                                                                       capsys):
    """Many Hub models keep an auto_map from before transformers supported them (model_type llama here):
    transformers builds its own class and the directory's code never runs. That was silent, though code that
    changes the model would make the artifact another model; the compile now says so, on stderr and in its notes."""
    model = _with_custom_code(make_tiny_model("llama"), tmp_path / "model", "config.json",
                              {"auto_map": {"AutoModelForCausalLM": "custom_code.CustomModel"}})
    capsys.readouterr()
    report = fxllm.compile(model, tmp_path / "out")
    said = ("config.json names the model's own code (AutoModelForCausalLM in auto_map); fxllm never runs it and "
            "built transformers' LlamaForCausalLM instead: if that code changes the model, this artifact is not the "
            "model it describes")
    assert f"fxllm: warning: {said}" in capsys.readouterr().err.splitlines()
    assert said in report.notes and not (model / "CODE_RAN").exists()
