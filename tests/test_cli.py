"""The CLI: every bad input is one clear line on stderr and a non-zero exit; good input produces useful output."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from fxllm.cli import main
from fxllm.runtime.contract import FORMAT_VERSION


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()  # drop whatever fixtures printed
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_one_line_error(code: int, err: str, pattern: str) -> None:
    assert code != 0
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fxllm: error: "), err
    assert pattern in lines[0], lines[0]


@pytest.fixture(scope="module")
def tiny_unsupported(tmp_path_factory):
    from transformers import BertConfig, BertForMaskedLM, T5Config, T5ForConditionalGeneration

    directories = {}
    for name, model in {
        "bert": BertForMaskedLM(BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1,
                                           num_attention_heads=2, intermediate_size=64)),
        "t5": T5ForConditionalGeneration(T5Config(vocab_size=100, d_model=32, d_ff=64, num_layers=1, num_heads=2,
                                                  d_kv=16)),
    }.items():
        directories[name] = tmp_path_factory.mktemp(name)
        model.save_pretrained(directories[name])
    return directories


def test_missing_path(capsys, tmp_path):
    code, _, err = run_cli(capsys, "compile", str(tmp_path / "missing"), "-o", str(tmp_path / "out"))
    assert_one_line_error(code, err, "does not exist")


def test_directory_without_a_model(capsys, tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    code, _, err = run_cli(capsys, "compile", str(tmp_path), "-o", str(tmp_path / "out"))
    assert_one_line_error(code, err, "holds no model: expected config.json")


@pytest.mark.parametrize("name,message", [("bert", "BertForMaskedLM is not a causal language model"),
                                          ("t5", "T5ForConditionalGeneration is an encoder-decoder model")])
def test_unsupported_architecture(capsys, tmp_path, tiny_unsupported, name, message):
    code, _, err = run_cli(capsys, "compile", str(tiny_unsupported[name]), "-o", str(tmp_path / "out"))
    assert_one_line_error(code, err, message)


def test_unknown_pass_and_impossible_order(capsys, tmp_path, make_tiny_model):
    model = str(make_tiny_model("llama"))
    code, _, err = run_cli(capsys, "compile", model, "-o", str(tmp_path / "o"), "--passes", "cleanup,nonsense")
    assert_one_line_error(code, err, "unknown pass 'nonsense'")
    code, _, err = run_cli(capsys, "compile", model, "-o", str(tmp_path / "o"), "--passes", "kv-cache,kv-cache")
    assert_one_line_error(code, err, "pass 'kv-cache' is listed twice (order: kv-cache → kv-cache)")
    code, _, err = run_cli(capsys, "compile", model, "-o", str(tmp_path / "o"), "--passes", "cleanup,kv-cache,quantize")
    assert_one_line_error(code, err, "pass 'quantize' must run before anything that provides kv-cache")
    code, _, err = run_cli(capsys, "compile", model, "-o", str(tmp_path / "o"), "--passes", "cleanup")
    assert_one_line_error(code, err, "must include 'kv-cache'")
    assert not (tmp_path / "o").exists()


def test_corrupt_and_too_new_artifacts(capsys, tmp_path, make_tiny_artifact):
    corrupt = tmp_path / "corrupt"
    shutil.copytree(make_tiny_artifact("llama"), corrupt)
    weights = corrupt / "model.onnx.data"
    data = bytearray(weights.read_bytes())
    data[100] ^= 0x01
    weights.write_bytes(bytes(data))
    code, _, err = run_cli(capsys, "generate", str(corrupt), "--prompt", "hi")
    assert_one_line_error(code, err, "'model.onnx.data' is corrupt")

    newer = tmp_path / "newer"
    shutil.copytree(make_tiny_artifact("llama"), newer)
    manifest = json.loads((newer / "manifest.json").read_text())
    manifest["format_version"] = FORMAT_VERSION + 1
    (newer / "manifest.json").write_text(json.dumps(manifest))
    code, _, err = run_cli(capsys, "inspect", str(newer))
    assert_one_line_error(code, err, "is newer than this fxllm supports")


def test_prompt_longer_than_context(capsys, make_tiny_artifact):
    code, _, err = run_cli(capsys, "generate", str(make_tiny_artifact("llama")), "--prompt", "word " * 400)
    assert_one_line_error(code, err, "the model's context is 256 tokens")


def test_generate_json_and_inspect(capsys, make_tiny_artifact):
    artifact = str(make_tiny_artifact("llama"))
    code, out, _ = run_cli(capsys, "generate", artifact, "--prompt", "Paris is", "--max-new-tokens", "4", "--json")
    assert code == 0
    result = json.loads(out)
    assert result["prompt"] == "Paris is" and len(result["token_ids"]) == 4
    assert set(result["timings"]) >= {"prefill_ms", "decode_ms_per_token"}
    code, out, _ = run_cli(capsys, "inspect", artifact)
    assert code == 0 and "KV cache     512 bytes/token" in out and "kv-cache" in out
    code, out, _ = run_cli(capsys, "passes")
    assert code == 0 and "kv-cache (default)" in out


def test_generate_sampling_options(capsys, make_tiny_artifact, monkeypatch, tmp_path):
    """The sampling adjustments, bad words and a structure (a JSON schema from a file) reach the engine (the CLI's
    tokens equal the Python API's with the same settings); a malformed --logit-bias, an out-of-range value, an
    unreadable @FILE or two structures are one line, before the artifact is loaded."""
    import fxllm

    artifact = str(make_tiny_artifact("llama"))
    settings = dict(repetition_penalty=1.4, presence_penalty=0.5, frequency_penalty=0.3, logit_bias={5: 2.0},
                    min_tokens=3, bad_words=["the", "of it"], skip_special_tokens=False)
    expected = fxllm.load(artifact).generate("Paris is", max_new_tokens=6, **settings)
    code, out, _ = run_cli(capsys, "generate", artifact, "--prompt", "Paris is", "--max-new-tokens", "6", "--json",
                           "--repetition-penalty", "1.4", "--presence-penalty", "0.5", "--frequency-penalty", "0.3",
                           "--logit-bias", "5=2", "--min-tokens", "3", "--bad-word", "the", "--bad-word", "of it",
                           "--keep-special-tokens")
    assert code == 0 and json.loads(out)["token_ids"] == expected.token_ids
    assert json.loads(out)["text"] == expected.text
    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "array", "items": {"enum": ["yes", "no"]}, "minItems": 3, "maxItems": 3}')
    structured = fxllm.load(artifact).generate("Paris is", max_new_tokens=20,
                                               structured_outputs={"json": schema.read_text()})
    code, out, _ = run_cli(capsys, "generate", artifact, "--prompt", "Paris is", "--max-new-tokens", "20", "--json",
                           "--json-schema", f"@{schema}")
    assert code == 0 and json.loads(out)["text"] == structured.text and len(json.loads(structured.text)) == 3
    monkeypatch.setattr(fxllm, "load", lambda *a, **k: pytest.fail("loaded before the options were checked"))
    for flags, says in ((["--logit-bias", "5:2"], "--logit-bias '5:2': expected TOKEN_ID=BIAS"),
                        (["--logit-bias", "x=1"], "--logit-bias 'x=1': expected TOKEN_ID=BIAS"),
                        (["--logit-bias", "\u0663=100"], "expected TOKEN_ID=BIAS"),  # int() reads Arabic-Indic 3
                        (["--logit-bias", "7_042=-1"], "expected TOKEN_ID=BIAS"),
                        (["--logit-bias", " 5=1"], "expected TOKEN_ID=BIAS"),
                        (["--logit-bias", "9" * 5000 + "=1"], "--logit-bias '99999"),
                        (["--logit-bias", "5=300"], "logit_bias[5]: logit_bias must be <= 100"),
                        (["--min-p", "2"], "min_p must be <= 1"),
                        (["--min-tokens", "70", "--max-new-tokens", "64"], "min_tokens (70) must be <= max_tokens"),
                        (["--repetition-penalty", "0"], "repetition_penalty must be >= 0.01"),
                        (["--bad-word", "ok", "--bad-word", " "], "bad_words[1] is empty or only whitespace"),
                        (["--json-schema", "@/nonexistent/schema.json"], "--json-schema @/nonexistent/schema.json: "
                                                                         "cannot read the file"),
                        (["--regex", "a", "--choice", "b"], "give exactly one of json, regex, choice, grammar")):
        code, _, err = run_cli(capsys, "generate", artifact, "--prompt", "x", *flags)
        assert_one_line_error(code, err, says)


def test_generate_prefills_in_calls_of_max_tokens_per_step(capsys, make_tiny_artifact, monkeypatch):
    """--max-tokens-per-step reaches the engine: a 40-odd-token prompt in calls of at most 7 tokens gives the tokens
    of one call."""
    from fxllm.runtime.backend_ort import OrtBackend

    widths = []  # tokens fed by each model call
    run = OrtBackend.run

    def recording_run(self, feeds):
        widths.append(feeds["input_ids"].shape[1])
        return run(self, feeds)

    monkeypatch.setattr(OrtBackend, "run", recording_run)
    argv = ["generate", str(make_tiny_artifact("llama")), "--prompt", " ".join(["one two three four"] * 10),
            "--max-new-tokens", "5", "--json"]
    whole = json.loads(run_cli(capsys, *argv)[1])
    prompt_length, decode_calls = widths[0], widths[1:]
    assert prompt_length > 21 and decode_calls == [1] * 4  # the first token comes from the prefill
    widths.clear()
    chunked = json.loads(run_cli(capsys, *argv, "--max-tokens-per-step", "7")[1])
    spans = -(-prompt_length // 7)
    assert widths[:spans] == [-(-prompt_length // spans)] * (spans - 1) + [widths[spans - 1]]
    assert max(widths[:spans]) <= 7 and sum(widths[:spans]) == prompt_length and widths[spans:] == decode_calls
    assert chunked["token_ids"] == whole["token_ids"]


def test_console_script_exit_code_and_single_line(tmp_path):
    fxllm_bin = shutil.which("fxllm") or str(__import__("pathlib").Path(sys.executable).parent / "fxllm")
    proc = subprocess.run([fxllm_bin, "generate", str(tmp_path / "none"), "--prompt", "x"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.strip() == f"fxllm: error: artifact '{tmp_path / 'none'}' does not exist"


def test_host_out_of_memory_from_torch_is_a_user_error(capsys, monkeypatch):
    """torch's CPU allocator raises a RuntimeError, not MemoryError, when an allocation fails: exit 1, one line."""
    import torch

    from fxllm import cli

    def too_big(args):
        torch.empty(2 ** 50, dtype=torch.uint8)  # 1 PiB: refused by the allocator

    monkeypatch.setitem(cli.COMMANDS, "inspect", too_big)
    code, _, err = run_cli(capsys, "inspect", "somewhere")
    assert_one_line_error(code, err, "out of memory (an allocation failed)")
    assert code == 1


def test_device_out_of_memory_is_a_user_error(capsys, monkeypatch):
    """torch's CUDA out-of-memory error is a resource limit the user can act on (exit 1, one line), as MemoryError
    is; any other exception from a command stays an internal error (exit 2)."""
    import torch

    from fxllm import cli

    def out_of_memory(args):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore detail")

    monkeypatch.setitem(cli.COMMANDS, "inspect", out_of_memory)
    code, _, err = run_cli(capsys, "inspect", "somewhere")
    assert code == 1
    assert_one_line_error(code, err, "out of GPU memory (CUDA out of memory. Tried to allocate 2.00 GiB)")

    def bug(args):
        raise RuntimeError("a bug")

    monkeypatch.setitem(cli.COMMANDS, "inspect", bug)
    code, _, err = run_cli(capsys, "inspect", "somewhere")
    assert code == 2 and err.startswith("fxllm: internal error: RuntimeError: a bug")


def test_generate_speculates_as_asked(capsys, make_tiny_artifact):
    """--speculative ngram (prompt lookup, no draft) on any artifact, with --spec-k: the same greedy tokens, and the
    speculation's line on stderr; --spec-k on an artifact that does not speculate is one line, not ignored."""
    artifact = str(make_tiny_artifact("llama"))
    argv = ["generate", artifact, "--prompt", "one two three one two three one two", "--max-new-tokens", "12"]
    code, plain, err = run_cli(capsys, *argv)
    assert code == 0 and "[speculative" not in err
    code, speculated, err = run_cli(capsys, *argv, "--speculative", "ngram", "--spec-k", "3")
    assert code == 0 and speculated == plain and "[speculative ngram k=3:" in err
    code, off, err = run_cli(capsys, *argv, "--speculative", "off")
    assert code == 0 and off == plain and "[speculative" not in err
    code, _, err = run_cli(capsys, *argv, "--spec-k", "3")
    assert_one_line_error(code, err, "decodes without it")
