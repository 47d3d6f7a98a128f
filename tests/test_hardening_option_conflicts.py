"""A compile option given two values (in --passes and in --pass-option, --kv-heads or --quant; or one --pass-option
twice) is refused before any work: the last value used to win silently, so the artifact was not the one asked for.
Likewise an empty --served-model-name, which used to fall back to the default name without a word, and int8
activations asked of an artifact that has nothing quantized."""

from __future__ import annotations

import json

import pytest

import fxllm
from fxllm.cli import main
from fxllm.compiler.pipeline import build_pipeline, parse_pipeline
from fxllm.errors import InvalidArgumentError, PipelineError

PASSES_WITH_KV_HEADS_1 = "cleanup,gqa:kv_heads=1,fuse-projections,select-logits,kv-cache"


def _one_line_error(capsys, argv: list[str]) -> str:
    capsys.readouterr()
    code = main(argv)
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(lines) == 1 and lines[0].startswith("fxllm: error: "), lines
    return lines[0]


@pytest.mark.parametrize("flags, message", [
    (["--pass-option", "gqa.kv_heads=1", "--kv-heads", "2"],
     "--kv-heads 2 and --pass-option gqa.kv_heads=1 both set the KV heads; give one"),
    (["--pass-option", "gqa.kv_heads=2", "--pass-option", "gqa.kv-heads=1"],
     "--pass-option gqa.kv_heads is given twice (2 and 1); give it once"),
    (["--passes", PASSES_WITH_KV_HEADS_1, "--kv-heads", "2"],
     "pass 'gqa' option 'kv_heads' is given two values: gqa:kv_heads=1 in the pass list and 2 besides it"),
    (["--passes", "cleanup,gqa,fuse-projections,select-logits,quantize:method=int8,kv-cache", "--quant", "int4-rtn"],
     "pass 'quantize' option 'method' is given two values: quantize:method=int8 in the pass list and int4-rtn"),
])
def test_an_option_given_two_values_is_refused(capsys, make_tiny_model, tmp_path, flags, message):
    """Each of these compiled with the last value (2 KV heads; int4-rtn though the pass list said int8)."""
    output = tmp_path / "out"
    assert message in _one_line_error(capsys, ["compile", str(make_tiny_model("llama")), "-o", str(output), *flags])
    assert not output.exists()


def test_the_same_value_given_twice_is_not_a_conflict():
    """Nothing is dropped when both places say the same: gqa:kv_heads=2 and pass options {"gqa": {"kv_heads": 2}}."""
    steps = build_pipeline(parse_pipeline("cleanup,gqa:kv_heads=2,kv-cache"), {"gqa": {"kv_heads": 2}})
    assert steps[1].options["kv_heads"] == 2


def test_build_pipeline_refuses_two_values_for_one_option():
    with pytest.raises(PipelineError, match="pass 'gqa' option 'kv_heads' is given two values"):
        build_pipeline(parse_pipeline("cleanup,gqa:kv_heads=2,kv-cache"), {"gqa": {"kv_heads": 1}})


@pytest.mark.parametrize("name", ["", "  "])
def test_an_empty_served_model_name_is_refused(capsys, tmp_path, name):
    """`fxllm serve ART --served-model-name "$UNSET"` served under the artifact directory's name instead, so clients
    sending the name meant got 404 model not found; it is a usage error, before the artifact is loaded."""
    message = _one_line_error(capsys, ["serve", str(tmp_path / "no-artifact"), "--served-model-name", name])
    assert "--served-model-name is empty" in message


def test_int8_activations_without_quantization_is_refused(capsys, make_tiny_model, tmp_path):
    """A float32 compile took --int8-activations and wrote an artifact that ignores it (nothing to quantize)."""
    output = tmp_path / "out"
    message = _one_line_error(capsys, ["compile", str(make_tiny_model("llama")), "-o", str(output),
                                       "--int8-activations"])
    assert "--int8-activations applies to quantized artifacts" in message and not output.exists()


def test_int8_activations_on_a_float_artifact_is_refused_at_load(capsys, make_tiny_artifact):
    """`fxllm generate FLOAT_ARTIFACT --int8-activations` (and fxllm.load's int8_activations=True) ran float
    activations without a word: nothing in a float artifact is quantized. Float activations stay accepted (they are
    what it runs)."""
    artifact = make_tiny_artifact("llama")
    with pytest.raises(InvalidArgumentError, match="applies to quantized artifacts, and .* has float weights"):
        fxllm.load(artifact, int8_activations=True)
    assert fxllm.load(artifact, int8_activations=False).generate("Paris is", max_new_tokens=2).token_ids
    message = _one_line_error(capsys, ["generate", str(artifact), "--prompt", "hi", "--int8-activations"])
    assert "--int8-activations) applies to quantized artifacts" in message


@pytest.mark.parametrize("speculative", [True, False, "ngram"])
def test_unrolled_draft_without_a_draft_model_is_refused(make_tiny_artifact, speculative):
    """fxllm.load(..., unrolled_draft=True) on an artifact without a model draft loaded and ignored it, where
    kv_blocks, spec_k and int8_activations are refused when they have nothing to act on."""
    artifact = make_tiny_artifact("llama")
    with pytest.raises(InvalidArgumentError, match=r"^unrolled_draft applies to an artifact compiled with a model "
                                                   r"draft \(--draft MODEL or --draft self-int4\), and this load "
                                                   r"of '.*' runs no draft"):
        fxllm.load(artifact, unrolled_draft=True, speculative=speculative)
    assert fxllm.load(artifact, unrolled_draft=False, speculative=speculative).generate("Paris is",
                                                                                       max_new_tokens=2).token_ids


def test_int8_activations_on_a_transformers_model_is_refused(capsys, make_tiny_model, tmp_path):
    """`fxllm eval HF_MODEL --int8-activations` scored in float without a word."""
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 20)
    message = _one_line_error(capsys, ["eval", str(make_tiny_model("llama")), "--text", str(text),
                                       "--int8-activations"])
    assert "--int8-activations) applies to quantized artifacts" in message and "is not an artifact" in message


@pytest.mark.parametrize("flag", ["--max-new", "--max-tokens-per", "--temp"])
def test_a_flag_is_never_taken_for_a_longer_one_it_begins(capsys, tmp_path, flag):
    """argparse completes unambiguous prefixes: `--max-tokens 3` (the OpenAI name) ran as --max-tokens-per-step 3
    and generated the default 64 tokens. Prefixes are refused now, before the artifact is loaded."""
    message = _one_line_error(capsys, ["generate", str(tmp_path / "no-artifact"), "--prompt", "hi", flag, "3"])
    assert f"unrecognized arguments: {flag} 3" in message


def test_max_tokens_is_max_new_tokens(capsys, make_tiny_artifact):
    capsys.readouterr()
    code = main(["generate", str(make_tiny_artifact("llama")), "--prompt", "Paris is", "--max-tokens", "3", "--json"])
    assert code == 0 and len(json.loads(capsys.readouterr().out)["token_ids"]) == 3


@pytest.mark.parametrize("options, says", [
    ({"passes": ("cleanup", None)}, "passes must be pass names (strings), got NoneType None"),  # was AttributeError
    ({"ort_steps": [5]}, "ort_steps must be a list of step names (strings), got list [5]"),  # was a TypeError after checks
    ({"ort_steps": "group-query-attention"}, "ort_steps must be a list of step names"),  # was split into letters
])
def test_pipeline_arguments_of_the_wrong_type_are_pipeline_errors(make_tiny_model, tmp_path, options, says):
    import re

    import fxllm

    with pytest.raises(PipelineError, match=re.escape(says)):
        fxllm.compile(make_tiny_model("llama"), tmp_path / "out", **options)
    assert not (tmp_path / "out").exists()


def test_ids_no_tokenizer_holds_decode_to_nothing(tokenizer_dir):
    """decode([-1]) and decode([10**12]) raised the tokenizers binding's OverflowError."""
    from fxllm.runtime.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_dir)
    ids = tokenizer.encode("Hello world", add_special_tokens=False)
    assert tokenizer.decode([-1, *ids, 10 ** 12, 2 ** 32]) == tokenizer.decode(ids) == "Hello world"
