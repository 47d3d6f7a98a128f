"""What the CLI prints for a hostile user's inputs: an `inspect` size line that names its files and a bits-per-weight
line for a quantized artifact, strict JSON from `eval --json` even for an infinite perplexity, and one stderr line
(no transformers LOAD REPORT) for a model directory whose config contradicts its weights."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pydoc_data.topics
import pytest

from fxllm.cli import main

TEXT = Path(pydoc_data.topics.__file__)
SIZE_LINE = re.compile(r"^size {9}[\d.]+ (B|KiB|MiB|GiB) in \d+ files?: (.+)$", re.M)
QUANT_LINE = re.compile(r"^quantized {4}([\d.]+)% of ([\d,]+) weights as int4 codes: ([\d.]+) bits per quantized "
                        r"weight as stored, scales and offsets counted$", re.M)


def strict_json(text: str):
    """json.loads that refuses the non-standard constants Python's json writes for inf and nan."""
    def refuse(name: str):
        raise ValueError(f"non-standard JSON constant {name}")

    return json.loads(text, parse_constant=refuse)


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory) -> Path:
    from tests.gguf_files import tiny_hf_model

    return tiny_hf_model("llama", tmp_path_factory.mktemp("messages") / "hf")


@pytest.fixture(scope="module")
def int4_artifact(hf_model, tmp_path_factory) -> Path:
    """The 2,048-token llama with int4-rtn projections (a 1 MiB artifact)."""
    import fxllm

    output = tmp_path_factory.mktemp("int4") / "artifact"
    fxllm.compile(hf_model, output, quant="int4-rtn")
    return output


def expected_projection_bits(model_dir: Path) -> float:
    """Bits per quantized weight of int4-rtn's default format over the decoder layers' linears, by the formula
    benchmarks/quant_quality.py reports (QuantFormat.bits_per_weight): code + float16 scale per block."""
    import torch
    from transformers import AutoModelForCausalLM

    from fxllm.passes.quantize import int4_format

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    linears = [m for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear)]
    fmt = int4_format(128, False)
    total = sum(m.weight.numel() for m in linears)
    return sum(fmt.bits_per_weight(m.in_features, m.out_features) * m.weight.numel() for m in linears) / total


def test_inspect_names_the_files_of_a_small_artifact_and_its_bits_per_weight(capsys, int4_artifact, hf_model):
    """The size line listed only files over 1 MiB (`size 0.9 MiB: ` for a small artifact) and no line gave the
    bits of a quantized weight."""
    capsys.readouterr()
    assert main(["inspect", str(int4_artifact)]) == 0
    text = capsys.readouterr().out
    size = SIZE_LINE.search(text)
    assert size, text
    named = dict(re.findall(r"(\S+) ([\d.]+ (?:B|KiB|MiB))", size.group(2)))
    assert {"model.onnx.data", "tokenizer/tokenizer.json"} <= set(named), size.group(0)  # both, under 1 MiB or not
    quant = QUANT_LINE.search(text)
    assert quant, text
    assert float(quant.group(3)) == pytest.approx(expected_projection_bits(hf_model), abs=0.005)
    assert 0 < float(quant.group(1)) < 100

    assert main(["inspect", str(int4_artifact), "--json"]) == 0
    info = strict_json(capsys.readouterr().out)
    quant = info["quantization"]
    assert quant["bits_per_weight"] == pytest.approx(expected_projection_bits(hf_model), abs=1e-4)
    assert quant["codes"] == [{"bits": 4, "stored_bits": 4, "weights": quant["weights"],
                               "bits_per_weight": quant["bits_per_weight"]}]
    assert 0 < quant["weights"] < quant["of_weights"]


def test_inspect_of_a_float_artifact_has_no_quantized_line(capsys, make_tiny_artifact):
    capsys.readouterr()
    assert main(["inspect", str(make_tiny_artifact("llama"))]) == 0
    text = capsys.readouterr().out
    assert SIZE_LINE.search(text) and not re.search(r"^quantized", text, re.M)


def test_eval_json_is_strict_for_an_infinite_perplexity(capsys, hf_model, tmp_path):
    """`eval --json` printed `"perplexity": Infinity`, which no strict JSON parser reads."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_model).eval()
    with torch.no_grad():
        model.lm_head.weight *= 1e6
    model.save_pretrained(tmp_path / "sharp")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(hf_model / name, tmp_path / "sharp" / name)
    capsys.readouterr()
    main(["eval", str(tmp_path / "sharp"), "--text", str(TEXT), "--ctx", "32", "--max-tokens", "64", "--json"])
    report = strict_json(capsys.readouterr().out)
    assert report["perplexity"] is None and report["non_finite"] == {"perplexity": "inf"}
    assert report["tokens"] == 62


def test_a_config_contradicting_its_weights_is_one_line(capfd, monkeypatch, hf_model, tmp_path):
    """transformers logged a multi-line LOAD REPORT, then fxllm quoted its "look at the above report!"."""
    monkeypatch.setenv("FXLLM_QUIET", "1")  # no "loading ..." status line
    shutil.copytree(hf_model, tmp_path / "model")
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    config["hidden_size"] = 32
    (tmp_path / "model" / "config.json").write_text(json.dumps(config))
    capfd.readouterr()
    code = main(["compile", str(tmp_path / "model"), "-o", str(tmp_path / "artifact")])
    err = capfd.readouterr().err
    lines = err.strip().splitlines()
    assert code == 1 and len(lines) == 1 and lines[0].startswith("fxllm: error: "), err
    assert re.search(r"model' does not match its config\.json: \d+ weights have another shape than the config gives "
                     r"them \(e\.g\. \S+ is \[\d+, 64\] in the file, \[\d+, 32\]", lines[0]), lines[0]
    assert "report" not in err


def test_inspect_counts_a_gguf_q4_1_block_as_5_5_bits(hf_model, tmp_path):
    """A GGUF's Q4_1 blocks kept exactly: a 4-bit code per weight plus, per block of 32, a float16 scale and a float32
    offset (its minimum): 4 + 16/32 + 32/32 = 5.5 bits, the figure benchmarks/quant_quality.py gives the GGUF row."""
    import fxllm
    from fxllm.runtime.inspect import describe_artifact
    from tests.gguf_files import write_gguf

    path = write_gguf(hf_model, tmp_path / "q4_1.gguf", "Q4_1", tensor_types={"token_embd.weight": "Q8_0"})
    fxllm.compile(path, tmp_path / "artifact")
    quant = describe_artifact(tmp_path / "artifact")["quantization"]
    assert [(c["bits"], c["bits_per_weight"]) for c in quant["codes"]] == [(4, 5.5), (8, 8.5)]
    assert re.search(r"as int4 and int8 codes: [\d.]+ bits per quantized weight as stored \(int4 5\.50 over [\d,]+, "
                     r"int8 8\.50 over [\d,]+\)", describe_artifact(tmp_path / "artifact")["text"])


def test_inspect_names_an_int4_embedding_int4(hf_model, tmp_path):
    """A GGUF's Q4_0 embedding keeps its blocks as int4 codes stored one per byte (ONNX's Gather has no INT4): inspect
    calls them int4 (in 8-bit storage), not int8."""
    import fxllm
    from fxllm.runtime.inspect import describe_artifact
    from tests.gguf_files import write_gguf

    path = write_gguf(hf_model, tmp_path / "q4_0.gguf", "Q4_0")
    fxllm.compile(path, tmp_path / "artifact")
    info = describe_artifact(tmp_path / "artifact")
    assert {c["bits"] for c in info["quantization"]["codes"]} == {4}, info["quantization"]
    assert {(c["stored_bits"], c["bits_per_weight"]) for c in info["quantization"]["codes"]} >= {(8, 8.5)}
    assert re.search(r"as int4 codes: [\d.]+ bits per quantized weight as stored \(int4 4\.50 over [\d,]+, "
                     r"int4 in 8-bit storage 8\.50 over [\d,]+\)", info["text"]), info["text"]
