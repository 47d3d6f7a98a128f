"""What an artifact names (its manifest's strings, its file names) reaches the terminal as text: `fxllm inspect` and
the CLI's error line write control characters as escapes, so an artifact from elsewhere cannot send the terminal
escape sequences (retitle the window, rewrite the screen, set the clipboard with OSC 52)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from fxllm import cli
from fxllm.cli import main
from fxllm.runtime.contract import MANIFEST_FILE

ESCAPES = "\x1b]0;owned\x07\x1b[2J\x9b31m"  # set the window title, clear the screen, a C1 CSI


@pytest.fixture
def artifact_naming_escapes(make_tiny_artifact, tmp_path) -> Path:
    """A copy of the tiny artifact whose manifest's display strings hold terminal escape sequences (inspect reads
    them without checksumming the files, as it does for any artifact)."""
    copy = tmp_path / "artifact"
    shutil.copytree(make_tiny_artifact("llama"), copy)
    manifest = json.loads((copy / MANIFEST_FILE).read_text())
    manifest["source"]["name"] = "model" + ESCAPES
    manifest["fxllm_version"] += ESCAPES
    manifest["compile_seconds"] = {"load" + ESCAPES: 1.0}
    (copy / MANIFEST_FILE).write_text(json.dumps(manifest))
    return copy


def test_inspect_writes_a_manifests_control_characters_as_escapes(capsys, artifact_naming_escapes):
    """`fxllm inspect` printed the manifest's strings raw: ESC ] 0 ; ... BEL retitled the terminal."""
    capsys.readouterr()
    assert main(["inspect", str(artifact_naming_escapes)]) == 0
    out = capsys.readouterr().out
    assert not any(c in out for c in "\x1b\x07\x9b")
    assert "model\\x1b]0;owned\\x07\\x1b[2J\\x9b31m" in out


def test_an_error_naming_a_path_writes_its_control_characters_as_escapes(capsys, tmp_path):
    directory = tmp_path / ("not-an-artifact" + ESCAPES.replace("/", ""))
    directory.mkdir()
    capsys.readouterr()
    assert main(["generate", str(directory), "--prompt", "hi"]) == 1
    err = capsys.readouterr().err
    assert not any(c in err for c in "\x1b\x07\x9b") and "not-an-artifact\\x1b]0;owned\\x07" in err


def test_printable_keeps_text_newlines_tabs_and_non_ascii():
    assert cli.printable("line 1\n\tcafé → 東京") == "line 1\n\tcafé → 東京"
    assert cli.printable("a\x00b\x7fc") == "a\\x00b\\x7fc"
