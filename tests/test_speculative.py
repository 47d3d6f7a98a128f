"""Speculative decoding end to end: every draft mode reproduces the target's greedy tokens; bad drafts and k fail
clearly. (The sampling rule itself is proven lossless by the chi-square test in test_speculative_sampling.py.)"""

from __future__ import annotations

import pytest
import torch

import fxllm
from fxllm.errors import FxllmError, ModelSourceError, PipelineError
from tests.conftest import PROMPTS, tiny_config

EIGHT_PROMPTS = PROMPTS + [f"{p} {p}" for p in PROMPTS]  # the second half repeats itself: n-gram drafts get hits


@pytest.fixture(scope="module")
def greedy_reference(make_tiny_artifact):
    engine = fxllm.load(make_tiny_artifact("llama"))
    return [engine.generate(p, max_new_tokens=64).token_ids for p in EIGHT_PROMPTS]


@pytest.mark.parametrize("draft", ["ngram", "self-layers:1", "self-int4"])
def test_greedy_output_is_the_targets(draft, make_tiny_model, greedy_reference, tmp_path):
    artifact = tmp_path / draft.replace(":", "-")
    fxllm.compile(make_tiny_model("llama"), artifact, draft=draft, spec_k=4)
    engine = fxllm.load(artifact)
    results = engine.generate(EIGHT_PROMPTS, max_new_tokens=64)
    assert [r.token_ids for r in results] == greedy_reference
    metrics = engine.stats().speculative
    assert metrics.mode == draft.split(":")[0] and metrics.target_calls > 0
    if draft == "self-int4":  # a close draft: most proposals accepted, several tokens per target call
        assert metrics.acceptance_rate > 0.3 and metrics.tokens_per_target_call > 1.5
    if draft != "ngram":  # a model draft's k proposals in one call of its unrolled graph: the same tokens
        unrolled = fxllm.load(artifact, unrolled_draft=True)
        assert [r.token_ids for r in unrolled.generate(EIGHT_PROMPTS, max_new_tokens=64)] == greedy_reference
    plain = fxllm.load(artifact, speculative=False)
    assert plain.generate(EIGHT_PROMPTS[0], max_new_tokens=16).token_ids == greedy_reference[0][:16]
    from fxllm.runtime.inspect import describe_artifact  # inspect said nothing of the draft

    described = describe_artifact(artifact)["text"]
    assert f"speculative  {draft}" in described and "k 4" in described


def test_sampling_is_seeded_and_uses_the_draft(make_tiny_model, tmp_path):
    artifact = tmp_path / "sampled"
    fxllm.compile(make_tiny_model("llama"), artifact, draft="self-int4", spec_k=3)
    engine = fxllm.load(artifact)
    first = engine.generate(PROMPTS[0], max_new_tokens=24, temperature=0.8, top_p=0.9, seed=7).token_ids
    assert engine.generate(PROMPTS[0], max_new_tokens=24, temperature=0.8, top_p=0.9, seed=7).token_ids == first
    assert len(first) == 24 and engine.stats().speculative.proposed > 0


def test_bad_drafts_and_k(make_tiny_model, tokenizer, tmp_path_factory, tmp_path):
    from transformers import AutoModelForCausalLM

    target = make_tiny_model("llama")
    for k in (0, 100):
        with pytest.raises(PipelineError, match="--spec-k must be between 1 and 16"):
            fxllm.compile(target, tmp_path / f"k{k}", draft="ngram", spec_k=k)
    with pytest.raises(PipelineError, match="self-layers:2 must keep fewer layers than the target's 2"):
        fxllm.compile(target, tmp_path / "layers", draft="self-layers:2")
    with pytest.raises(PipelineError, match="self-layers:N needs a layer count"):
        fxllm.compile(target, tmp_path / "layers-x", draft="self-layers:x")

    other_tokenizer = tmp_path_factory.mktemp("other-tokenizer")
    torch.manual_seed(1)
    AutoModelForCausalLM.from_config(tiny_config("llama")).save_pretrained(other_tokenizer)
    tokenizer.save_pretrained(other_tokenizer)
    from transformers import AutoTokenizer

    changed = AutoTokenizer.from_pretrained(other_tokenizer)
    changed.add_tokens(["<extra_token_0>", "<extra_token_1>"])
    changed.save_pretrained(other_tokenizer)
    with pytest.raises(ModelSourceError, match="tokenizes differently from the target"):
        fxllm.compile(target, tmp_path / "other", draft=str(other_tokenizer))

    bigger_vocab = tmp_path_factory.mktemp("bigger-vocab")
    config = tiny_config("llama")
    config.vocab_size += 64
    AutoModelForCausalLM.from_config(config).save_pretrained(bigger_vocab)
    tokenizer.save_pretrained(bigger_vocab)
    with pytest.raises(ModelSourceError, match="output logits"):
        fxllm.compile(target, tmp_path / "vocab", draft=str(bigger_vocab))
    assert not (tmp_path / "vocab").exists()  # nothing half-written


def test_a_draft_model_is_checked_before_any_weight_loads(make_tiny_model, tmp_path, monkeypatch):
    """A draft whose config states another vocabulary was refused only after the target and the whole draft had
    compiled (23 s for a tiny pair, minutes for real ones); a draft fxllm cannot compile was refused in words that
    read as the target's. Both now before any weight loads, the second naming --draft."""
    from transformers import AutoModelForCausalLM, BloomConfig

    import fxllm.compiler.compile as compile_module
    from fxllm.errors import UnsupportedModelError

    target = make_tiny_model("llama")
    bigger_vocab = tmp_path / "bigger-vocab"
    config = tiny_config("llama")
    config.vocab_size += 64
    AutoModelForCausalLM.from_config(config).save_pretrained(bigger_vocab)
    alibi = tmp_path / "alibi"
    BloomConfig(n_layer=1, hidden_size=32, n_head=2).save_pretrained(alibi)

    def loads(*args, **kwargs):
        raise AssertionError("a weight loaded before the draft was checked")

    monkeypatch.setattr(compile_module, "load_model", loads)
    with pytest.raises(ModelSourceError, match=f"{config.vocab_size} output logits, the target {config.vocab_size-64}"):
        fxllm.compile(target, tmp_path / "vocab", draft=str(bigger_vocab))
    with pytest.raises(UnsupportedModelError, match=rf"^--draft '{alibi}': .*ALiBi attention"):
        fxllm.compile(target, tmp_path / "alibi-out", draft=str(alibi))
    assert not (tmp_path / "vocab").exists() and not (tmp_path / "alibi-out").exists()


def test_spec_k_override_is_checked(make_tiny_model, tmp_path):
    artifact = tmp_path / "ngram"
    fxllm.compile(make_tiny_model("llama"), artifact, draft="ngram", spec_k=2)
    assert fxllm.load(artifact, spec_k=6).speculator.k == 6
    with pytest.raises(FxllmError, match="spec_k must be between 1 and 16"):
        fxllm.load(artifact, spec_k=17)


def test_a_draft_the_speculator_cannot_run_is_refused_at_load(make_tiny_model, tokenizer, tiny_paged_artifact,
                                                              tmp_path):
    """A draft directory swapped for another artifact (checksums rewritten) loaded, then failed every generation
    inside ONNX Runtime: one of another vocabulary, or a paged one. Both are refused when the artifact loads."""
    import json
    import shutil

    from transformers import AutoModelForCausalLM

    from fxllm.errors import ArtifactError
    from fxllm.runtime.artifact import write_manifest
    from fxllm.runtime.contract import MANIFEST_FILE

    artifact = tmp_path / "artifact"
    fxllm.compile(make_tiny_model("llama"), artifact, draft="self-layers:1", spec_k=2)
    bigger_vocab, config = tmp_path / "bigger-vocab", tiny_config("llama")
    config.vocab_size += 64
    AutoModelForCausalLM.from_config(config).save_pretrained(bigger_vocab)
    tokenizer.save_pretrained(bigger_vocab)
    other_vocab = tmp_path / "other-vocab"
    fxllm.compile(bigger_vocab, other_vocab)

    def swap_draft(draft) -> None:
        shutil.rmtree(artifact / "draft")
        shutil.copytree(draft, artifact / "draft")
        manifest = json.loads((artifact / MANIFEST_FILE).read_text())
        write_manifest(artifact, {k: v for k, v in manifest.items() if k not in ("files", "format_version")})

    swap_draft(other_vocab)
    with pytest.raises(ArtifactError, match="has 49216 token ids and the target 49152"):
        fxllm.load(artifact)
    swap_draft(tiny_paged_artifact)
    with pytest.raises(ArtifactError, match="has a paged KV cache"):
        fxllm.load(artifact)
