"""--kv-cache-dtype int8: GroupQueryAttention's quantized cache, calibrated at compile, its drift measured and
recorded; the runtime's buffers follow the signature; every other combination is refused before any work."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

import fxllm
from fxllm.errors import PipelineError
from fxllm.runtime.contract import ModelSpec
from fxllm.runtime.manifest import load_manifest

pytestmark = pytest.mark.xdist_group("kv-cache-int8")


@pytest.fixture(scope="module")
def int8_artifact(tmp_path_factory, make_tiny_model, calibration_file):
    output = tmp_path_factory.mktemp("kv8") / "artifact"
    report = fxllm.compile(make_tiny_model("llama"), output, kv_cache_dtype="int8",
                           kv_cache_calib=str(calibration_file))
    return output, report


def test_the_cache_is_int8_and_its_drift_is_recorded(int8_artifact):
    output, report = int8_artifact
    manifest = load_manifest(output)
    caches = [sig for sig in (*manifest.io.inputs, *manifest.io.outputs) if sig.name.startswith(("past_", "present_"))]
    assert caches and {sig.dtype for sig in caches} == {"int8"}
    assert manifest.spec.kv_cache_dtype == "int8"
    assert manifest.spec.kv_bytes_per_token() == ModelSpec.from_dict(
        manifest.data["spec"] | {"kv_cache_dtype": ""}).kv_bytes_per_token() // 4
    recorded = manifest.data["lowering"]["kv_cache"]
    assert recorded == report.kv_cache and recorded["dtype"] == "int8" and "calib.txt" in recorded["calibration"]
    drift = recorded["drift"]
    assert all(math.isfinite(v) for v in drift.values())
    from fxllm.runtime.inspect import describe_artifact  # inspect showed only the passes' (float cache) drift

    assert f"int8 KV cache ({recorded['calibration']}), on the written artifact: max|Δlogit| " \
           f"{drift['max_abs_logit']:.2e}" in describe_artifact(output)["text"]
    # a real, measured drift: not zero (int8 codes are not the float cache), and small (the random tiny model's
    # logits are nearly flat, so a few of its 32 argmaxes flip: 84% agree)
    assert 0 < drift["max_abs_logit"] < 0.5 and 0 < drift["mean_kl"] < 1e-3 and drift["greedy_agreement"] >= 0.75


def test_the_runtime_keeps_int8_buffers_and_generates_like_the_float_cache(int8_artifact, make_tiny_artifact):
    output, _ = int8_artifact
    engine = fxllm.load(output)
    prompt = [list(range(100, 140))]
    result = engine.generate_ids(prompt, max_new_tokens=12)[0]
    assert len(result.token_ids) == 12
    cache = engine.runner.new_cache()
    assert {buffer.dtype for buffer in cache.keys + cache.values} == {np.dtype(np.int8)}
    scores = engine.runner.step_one(cache, prompt[0], 0, all_logits=True)
    float_engine = fxllm.load(make_tiny_artifact("llama"))
    reference = float_engine.runner.step_one(float_engine.runner.new_cache(), prompt[0], 0, all_logits=True)
    assert 0 < np.abs(scores - reference).max() < 0.5 and (scores.argmax(-1) == reference.argmax(-1)).mean() >= 0.75


@pytest.mark.parametrize("options, message", [
    ({"kv_cache_dtype": "int4"}, "kv_cache_dtype must be one of auto, int8, got str 'int4'"),
    ({"kv_cache_dtype": "int8", "target": "tensorrt"}, "target 'ort' only"),
    ({"kv_cache_dtype": "int8", "passes": "cleanup,gqa,kv-cache,paged"}, "the paged pool stays float32"),
    ({"kv_cache_dtype": "int8", "ort_steps": ["group-query-attention"]}, "needs the ort steps"),
    ({"kv_cache_dtype": "int8", "kv_cache_calib": "no-such-file.txt"}, "kv-cache int8: the calibration text "
                                                                       "'no-such-file.txt' does not exist"),
    ({"kv_cache_dtype": "int8", "kv_cache_calib": ""}, "the calibration text path is empty"),  # "'' is a directory"
    # a calibration text without the int8 cache was ignored without a word
    ({"kv_cache_calib": "shakespeare"}, "--kv-cache-calib applies to --kv-cache-dtype int8"),
])
def test_what_cannot_be_an_int8_cache_is_refused_before_any_work(tmp_path, make_tiny_model, options, message):
    output = tmp_path / "out"
    with pytest.raises(PipelineError, match=message.replace("(", r"\(").replace(")", r"\)")):
        fxllm.compile(make_tiny_model("llama"), output, **options)
    assert not output.exists() and not any(tmp_path.iterdir())  # nothing half-written


def test_a_manifest_mixing_int8_and_float_caches_is_refused(int8_artifact, tmp_path):
    import shutil

    from fxllm.errors import ArtifactError
    from fxllm.runtime.artifact import write_manifest

    output, _ = int8_artifact
    copy = tmp_path / "copy"
    shutil.copytree(output, copy)
    data = json.loads((copy / "manifest.json").read_text())
    data["spec"]["kv_cache_dtype"] = ""
    write_manifest(copy, {k: v for k, v in data.items() if k not in ("kind", "format_version", "files")})
    with pytest.raises(ArtifactError, match="int8 caches in some layers or against spec.kv_cache_dtype unset"):
        fxllm.load(copy)


def test_a_model_whose_attention_does_not_lower_to_the_kernel_is_refused_after_the_capture(tmp_path, tokenizer):
    """Gemma 2's soft-capped attention lowers to standard ops, not GroupQueryAttention: refused from the captured
    spec, before the passes, the calibration and the lowering (which refused it last, after all three)."""
    import torch
    from transformers import AutoModelForCausalLM, Gemma2Config

    from fxllm.errors import UnsupportedModelError
    from tests.conftest import TINY_COMMON

    torch.manual_seed(0)
    config = Gemma2Config(**{**TINY_COMMON, "head_dim": 16, "sliding_window": 8})
    source, output = tmp_path / "gemma2", tmp_path / "out"
    AutoModelForCausalLM.from_config(config).save_pretrained(source)
    tokenizer.save_pretrained(source)
    with pytest.raises(UnsupportedModelError, match=r"does not lower to \(soft-capping\)"):
        fxllm.compile(source, output, kv_cache_dtype="int8")
    assert not output.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["gemma2"]


def test_a_calibration_text_too_short_is_refused_before_the_passes(tmp_path_factory, make_tiny_model, monkeypatch):
    """It was refused after the passes (a GPTQ's minutes on SmolLM2), where the cache's calibration ran."""
    import fxllm.compiler.compile as compile_module

    def passes_ran(*args, **kwargs):
        raise AssertionError("the passes ran before the calibration text was checked")

    monkeypatch.setattr(compile_module, "run_pipeline", passes_ran)
    short = tmp_path_factory.mktemp("short") / "short.txt"
    short.write_text("Too short to calibrate anything.")
    output = tmp_path_factory.mktemp("out") / "out"
    with pytest.raises(PipelineError, match=r"kv-cache int8: the calibration text '.*short\.txt' has \d+ tokens; "
                                            r"calibrating the cache needs at least 256"):
        fxllm.compile(make_tiny_model("llama"), output, kv_cache_dtype="int8", kv_cache_calib=str(short))
    assert not output.exists()
