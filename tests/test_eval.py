"""`fxllm eval`: perplexity of an artifact equals its source model's on the same text, with KL ~ 0."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pydoc_data.topics
import pytest

from fxllm.errors import FxllmError
from fxllm.evaluation import EvalReport, Scorer, evaluate

# An offline English text that ships with Python itself.
TEXT = Path(pydoc_data.topics.__file__)


def test_artifact_matches_source_model(make_tiny_model, make_tiny_artifact):
    report = evaluate(str(make_tiny_artifact("llama")), TEXT, ctx=128, max_tokens=1024,
                      reference=str(make_tiny_model("llama")))
    assert report.tokens == 1024 - 8 and report.windows == 8
    assert math.isclose(report.perplexity, report.reference_perplexity, rel_tol=1e-5)
    assert report.mean_kl < 1e-8 and report.top1_agreement == 1.0
    assert "perplexity" in report.text()


def test_a_torch_target_artifact_is_scored_through_its_own_backend(make_torch_artifact, make_tiny_artifact):
    """`fxllm eval` on a `--target torch` artifact ended in "load it with backend='torch'", which eval has no way to
    say; it now loads such an artifact on the torch backend (CPU), as itself or as the reference."""
    torch_artifact, onnx_artifact = str(make_torch_artifact("llama")), str(make_tiny_artifact("llama"))
    report = evaluate(torch_artifact, TEXT, ctx=128, max_tokens=512, reference=onnx_artifact)
    assert report.tokens == 512 - 4 and math.isclose(report.perplexity, report.reference_perplexity, rel_tol=1e-4)
    assert report.mean_kl < 1e-6 and report.top1_agreement == 1.0


def test_a_ready_scorer_is_evaluated_with_the_windows_of_a_path(make_tiny_artifact):
    """evaluate() takes a Scorer (benchmarks/quant_quality.py scores onnxruntime-genai's model through a subclass)."""
    artifact = str(make_tiny_artifact("llama"))

    class Sharpened(Scorer):  # another model's logits: here the artifact's, doubled
        def logits(self, token_ids):
            return 2 * super().logits(token_ids)

    by_path = evaluate(artifact, TEXT, ctx=128, max_tokens=512)
    scored = evaluate(Sharpened(artifact), TEXT, ctx=128, max_tokens=512, reference=artifact)
    assert scored.model == artifact and (scored.tokens, scored.windows) == (by_path.tokens, by_path.windows)
    assert math.isclose(scored.reference_perplexity, by_path.perplexity, rel_tol=1e-9)
    assert not math.isclose(scored.perplexity, by_path.perplexity, rel_tol=1e-3) and scored.mean_kl > 1e-4


def test_bad_eval_arguments(make_tiny_artifact, tmp_path):
    artifact = str(make_tiny_artifact("llama"))
    with pytest.raises(FxllmError, match="does not exist"):
        evaluate(artifact, tmp_path / "missing.txt")
    with pytest.raises(FxllmError, match="exceeds the model's context of 256"):
        evaluate(artifact, TEXT, ctx=1024)
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(FxllmError, match="fewer than 2 tokens"):
        evaluate(artifact, tmp_path / "empty.txt", ctx=128)


def test_a_bad_reference_is_named_before_the_model_loads(make_tiny_artifact, tmp_path, monkeypatch):
    """A reference path that names nothing was refused as 'model path ... does not exist' (read as the model's
    fault), and only after the model had loaded (15-20 s for a source model)."""
    import fxllm.evaluation as evaluation_module

    def loads(*args, **kwargs):
        raise AssertionError("the model loaded before the reference was checked")

    monkeypatch.setattr(evaluation_module, "Scorer", loads)
    for reference, message in ((tmp_path / "missing", r"^--reference: model path '.*missing' does not exist"),
                               ("", "^--reference: the model path is empty"),
                               (tmp_path, r"^--reference: '.*' holds no model")):
        with pytest.raises(FxllmError, match=message):
            evaluate(str(make_tiny_artifact("llama")), TEXT, reference=str(reference))


def test_a_long_text_with_max_tokens_is_tokenized_by_its_head(tokenizer, monkeypatch):
    """An 8.7 MB text scored for 1,000 tokens was tokenized whole (1.4 GB; a 1 GB text would need ~140 GB): past
    WHOLE_TEXT_CHARS only growing heads are, and the kept ids are the whole text's."""
    import fxllm.evaluation as evaluation_module
    from fxllm.evaluation import leading_ids

    monkeypatch.setattr(evaluation_module, "WHOLE_TEXT_CHARS", 10_000)
    text = "\n\n".join(pydoc_data.topics.topics.values())
    seen: list[int] = []

    def encode(piece: str) -> list[int]:
        seen.append(len(piece))
        return tokenizer.encode(piece)

    whole = tokenizer.encode(text)
    for count in (1, 300, 1_000):
        seen.clear()
        assert leading_ids(encode, text, count) == whole[:count]
        assert max(seen) < len(text) / 4, seen
    assert leading_ids(encode, text, None) == whole


def test_the_window_fits_the_model_and_the_reference(make_tiny_artifact, tokenizer, tmp_path):
    """The default window (512) is shortened to a shorter context: `fxllm eval` of a 256-position model without
    --ctx was refused for a flag it was not given. A window longer than the reference's context is refused up front
    (a transformers reference scored past the positions it was built for; an artifact's failed mid-run)."""
    import torch
    from transformers import AutoModelForCausalLM

    from tests.conftest import tiny_config

    artifact = str(make_tiny_artifact("llama"))
    report = evaluate(artifact, TEXT, max_tokens=600)
    assert (report.ctx, report.windows, report.tokens) == (256, 3, 597)
    config = tiny_config("llama")
    config.max_position_embeddings = 64
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "short")
    tokenizer.save_pretrained(tmp_path / "short")
    with pytest.raises(FxllmError, match="--ctx 128 exceeds the reference's context of 64 tokens"):
        evaluate(artifact, TEXT, ctx=128, max_tokens=300, reference=str(tmp_path / "short"))
    assert evaluate(artifact, TEXT, max_tokens=300, reference=str(tmp_path / "short")).ctx == 64


def test_a_reference_of_another_vocabulary_and_an_overflowing_perplexity(make_tiny_model, tokenizer, tmp_path):
    """A reference whose logits are wider (a vocabulary padded on one side) is refused in one line, and a model whose
    mean NLL is past float range gets an infinite perplexity: both were a numpy/OverflowError crash."""
    import torch
    from transformers import AutoModelForCausalLM

    from tests.conftest import tiny_config

    config = tiny_config("llama")
    config.vocab_size += 64
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).eval().save_pretrained(tmp_path / "padded")
    tokenizer.save_pretrained(tmp_path / "padded")
    with pytest.raises(FxllmError, match=r"the reference scores 49216 token ids and the model 49152"):
        evaluate(str(make_tiny_model("llama")), TEXT, ctx=32, max_tokens=64, reference=str(tmp_path / "padded"))
    model = AutoModelForCausalLM.from_pretrained(make_tiny_model("llama")).eval()
    with torch.no_grad():
        model.lm_head.weight *= 1e6
    model.save_pretrained(tmp_path / "sharp")
    tokenizer.save_pretrained(tmp_path / "sharp")
    report = evaluate(str(tmp_path / "sharp"), TEXT, ctx=32, max_tokens=64)
    assert report.perplexity == math.inf


def test_the_report_as_json_is_strict_for_non_finite_values():
    """`fxllm eval --json` printed an infinite perplexity as `Infinity`, which strict JSON parsers refuse: it is
    null, and "non_finite" says which value it was."""
    def refuse(name):
        raise ValueError(f"non-standard JSON constant {name}")

    report = EvalReport("m", 62, 2, 32, math.inf, reference="r", reference_perplexity=3.5, mean_kl=math.nan,
                        top1_agreement=0.5)
    data = json.loads(json.dumps(report.to_dict()), parse_constant=refuse)
    assert data["perplexity"] is None and data["mean_kl"] is None and data["reference_perplexity"] == 3.5
    assert data["non_finite"] == {"perplexity": "inf", "mean_kl": "nan"}
    finite = EvalReport("m", 62, 2, 32, 12.5).to_dict()
    assert "non_finite" not in finite and finite["perplexity"] == 12.5


@pytest.mark.slow
def test_smollm2_artifact_perplexity_equals_transformers(smollm2_artifact):
    report = evaluate(str(smollm2_artifact), TEXT, ctx=512, max_tokens=2048, reference="smollm2-135m")
    assert math.isclose(report.perplexity, report.reference_perplexity, rel_tol=1e-4)
    assert report.top1_agreement > 0.995 and report.mean_kl < 1e-6
