"""Half precision (--dtype): bf16 and fp16 artifacts of a tiny model compile with the dtype pass's drift reported
and run (torch target on the torch backend; the TensorRT-form fp16 ONNX, which passes the audit, on ONNX Runtime),
the TensorRT optimization profile covers every dynamic input, and a precision a target does not run is refused."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch

import fxllm
from fxllm.compiler.targets.tensorrt_build import network_flags, profile_shapes
from fxllm.errors import FxllmError, PipelineError
from fxllm.runtime.contract import LOGITS, ModelSpec, parse_cache_name
from fxllm.runtime.manifest import load_manifest
from tests.conftest import PROMPTS


@pytest.fixture(autouse=True)
def torch_threads():
    threads = torch.get_num_threads()  # the torch backend is loaded with threads=1 (see test_torch_target)
    yield
    torch.set_num_threads(threads)


def dtype_record(artifact) -> dict:
    record = load_manifest(artifact).data["passes"][-1]
    assert record["name"] == "dtype"
    return record["drift"]


@pytest.fixture(scope="module")
def bf16_paged(make_torch_artifact):
    return make_torch_artifact("llama", paged=True, dtype="bfloat16")


@pytest.fixture(scope="module")
def fp16_tensorrt(make_tiny_model, tmp_path_factory):
    output = tmp_path_factory.mktemp("trt-fp16") / "artifact"
    report = fxllm.compile(make_tiny_model("llama"), output, target="tensorrt", dtype="float16")
    assert any("passed the TensorRT audit" in note for note in report.notes)  # the compile fails on a finding
    return output


def test_bf16_torch_artifact_runs_with_its_drift_reported(bf16_paged, make_torch_artifact):
    manifest = load_manifest(bf16_paged)
    assert manifest.spec.dtype == "bfloat16"
    caches = [sig for sig in manifest.io.inputs + manifest.io.outputs if parse_cache_name(sig.name)]
    assert caches and {sig.dtype for sig in caches} == {"bfloat16"}
    assert manifest.io.outputs[0].dtype == "float32"  # logits leave in float32
    drift = dtype_record(bf16_paged)
    print(f"bf16 drift against float32: {drift}")
    assert 0 < drift["max_abs_logit"] < 0.05 and drift["mean_kl"] < 1e-4

    engine = fxllm.load(bf16_paged, backend="torch", threads=1)
    assert engine.runner.pool.keys[0].dtype == torch.bfloat16
    half = [r.token_ids for r in engine.generate(PROMPTS, max_new_tokens=8)]
    full = [r.token_ids for r in fxllm.load(make_torch_artifact("llama"), backend="torch", threads=1).generate(
        PROMPTS, max_new_tokens=8)]
    assert all(len(tokens) == 8 for tokens in half)
    agreement = np.mean([a == b for h, f in zip(half, full) for a, b in zip(h, f)])
    print(f"bf16 vs fp32 greedy tokens (random tiny model, near-tied logits): {agreement:.0%} agree")


def test_fp16_torch_artifact_runs_with_its_drift_reported(make_torch_artifact):
    """float16 on the torch target's contiguous cache (bf16 above covers the paged one): float16 caches, float32
    logits, the drift reported, greedy generation running on the torch backend."""
    artifact = make_torch_artifact("llama", dtype="float16")
    manifest = load_manifest(artifact)
    assert manifest.spec.dtype == "float16" and not manifest.io.paged
    caches = [sig for sig in manifest.io.inputs + manifest.io.outputs if parse_cache_name(sig.name)]
    assert caches and {sig.dtype for sig in caches} == {"float16"}
    assert manifest.io.outputs[0].dtype == "float32"
    drift = dtype_record(artifact)
    print(f"fp16 drift against float32: {drift}")
    assert 0 < drift["max_abs_logit"] < 0.01 and drift["mean_kl"] < 1e-5
    results = fxllm.load(artifact, backend="torch", threads=1).generate(PROMPTS, max_new_tokens=8)
    assert all(len(r.token_ids) == 8 for r in results)


def test_bf16_tensorrt_form_passes_the_audit(make_tiny_model, tmp_path):
    report = fxllm.compile(make_tiny_model("llama"), tmp_path / "artifact", target="tensorrt", dtype="bfloat16")
    assert any("passed the TensorRT audit" in note for note in report.notes)
    model = onnx.load(str(tmp_path / "artifact" / "model.onnx"), load_external_data=False)
    types = {v.name: v.type.tensor_type.elem_type for v in model.graph.input}
    assert types["past_key_0"] == onnx.TensorProto.BFLOAT16


def test_fp16_tensorrt_form_runs_on_onnx_runtime_within_its_drift(fp16_tensorrt, make_tiny_artifact):
    """The half-precision ONNX TensorRT would build from: float16 caches, float32 logits; on ONNX Runtime its
    logits stay within the drift the compile reported of the float32 artifact's."""
    model = onnx.load(str(fp16_tensorrt / "model.onnx"), load_external_data=False)
    types = {v.name: v.type.tensor_type.elem_type for v in list(model.graph.input) + list(model.graph.output)}
    assert types["past_key_0"] == types["present_key_0"] == onnx.TensorProto.FLOAT16
    assert types[LOGITS] == onnx.TensorProto.FLOAT
    drift = dtype_record(fp16_tensorrt)
    assert 0 < drift["max_abs_logit"] < 0.01

    half, full = prompt_logits(fp16_tensorrt), prompt_logits(make_tiny_artifact("llama"))
    print(f"fp16 TensorRT form on ONNX Runtime vs float32: max |Δlogit| {np.abs(half - full).max():.2e}")
    assert np.abs(half - full).max() < 10 * drift["max_abs_logit"] + 1e-3


@pytest.mark.parametrize("paged", [False, True])
def test_fp16_tensorrt_form_generates_through_fxllm_load(fp16_tensorrt, make_tiny_model, tmp_path, paged):
    """fxllm's own runtime runs the half-precision ONNX on ONNX Runtime (its caches and paged pool in float16, as
    the graph declares them; they were float32, which ONNX Runtime refused at the first step): greedy tokens of
    the float32 TensorRT form, contiguous and paged."""
    if paged:
        passes = "cleanup,gqa,fuse-projections,select-logits,kv-cache,paged"
        fxllm.compile(make_tiny_model("llama"), tmp_path / "half", target="tensorrt", dtype="float16", passes=passes)
        fxllm.compile(make_tiny_model("llama"), tmp_path / "full", target="tensorrt", passes=passes)
        half, full = tmp_path / "half", tmp_path / "full"
    else:
        half = fp16_tensorrt
        fxllm.compile(make_tiny_model("llama"), tmp_path / "full", target="tensorrt")
        full = tmp_path / "full"
    tokens = [[r.token_ids for r in fxllm.load(a).generate(PROMPTS, max_new_tokens=8)] for a in (half, full)]
    assert tokens[0] == tokens[1]


def test_bf16_tensorrt_form_is_refused_by_onnx_runtime_in_one_line(make_tiny_model, tmp_path):
    fxllm.compile(make_tiny_model("llama"), tmp_path / "artifact", target="tensorrt", dtype="bfloat16")
    with pytest.raises(FxllmError, match=r"is a bfloat16 artifact, which runs on TensorRT .*--dtype float16"):
        fxllm.load(tmp_path / "artifact")


def prompt_logits(artifact, ids=((1, 400, 500, 600, 700, 800),)) -> np.ndarray:
    """Logits of every position of `ids` from a contiguous artifact's model.onnx on a raw ONNX Runtime session (an
    empty cache of the type and shape its inputs declare)."""
    import onnxruntime as ort

    ids = np.array(ids, dtype=np.int64)
    session = ort.InferenceSession(str(artifact / "model.onnx"), providers=["CPUExecutionProvider"])
    feeds = {"input_ids": ids, "position_ids": np.arange(ids.shape[1])[None], "attention_mask": np.ones_like(ids),
             "logits_index": np.arange(ids.shape[1])}
    for value in session.get_inputs():
        if parse_cache_name(value.name):
            dtype = np.float16 if value.type == "tensor(float16)" else np.float32
            feeds[value.name] = np.zeros((1, value.shape[1], 0, value.shape[3]), dtype=dtype)
    return session.run([LOGITS], feeds)[0]


@pytest.mark.parametrize("arch", ["gemma3", "cohere"])
def test_half_tensorrt_form_of_a_norm_computed_in_float32(arch, tokenizer, tmp_path):
    """Gemma normalizes x.float() and Cohere scales by weight.float(), each casting back: the fused
    RMSNormalization took inputs of two types, which ONNX's checker refused (an internal error). Both inputs are
    float32 now and the output is cast back: the audit passes, and on ONNX Runtime the float16 form's logits stay
    within the reported drift of the float32 artifact's."""
    import transformers

    from tests.test_architectures import ARCHITECTURES, COMMON, build_model

    if arch in ARCHITECTURES:
        directory = build_model(arch, tmp_path / arch, tokenizer)
    else:
        config = transformers.CohereConfig(**COMMON, num_key_value_heads=2, intermediate_size=96, logit_scale=0.5)
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(config).eval().save_pretrained(tmp_path / arch)
        tokenizer.save_pretrained(tmp_path / arch)
        directory = tmp_path / arch
    report = fxllm.compile(directory, tmp_path / "half", target="tensorrt", dtype="float16")
    assert any("passed the TensorRT audit" in note for note in report.notes)
    model = onnx.load(str(tmp_path / "half" / "model.onnx"), load_external_data=False)
    types = {v.name: v.type.tensor_type.elem_type for v in model.graph.value_info}
    types.update({i.name: i.data_type for i in model.graph.initializer})
    norms = [n for n in model.graph.node if n.op_type == "RMSNormalization"]
    assert norms and all(types[n.input[0]] == types[n.input[1]] == onnx.TensorProto.FLOAT for n in norms)
    fxllm.compile(directory, tmp_path / "full", target="tensorrt")
    half, full = prompt_logits(tmp_path / "half"), prompt_logits(tmp_path / "full")
    drift = dtype_record(tmp_path / "half")["max_abs_logit"]
    print(f"{arch} fp16 TensorRT form vs float32: max |Δlogit| {np.abs(half - full).max():.2e}, reported {drift:.2e}")
    assert np.abs(half - full).max() < 10 * drift + 1e-3


def test_tensorrt_profile_covers_every_dynamic_input(fp16_tensorrt, bf16_paged):
    for artifact in (fp16_tensorrt, bf16_paged):  # contiguous + select-logits; paged + select-logits
        manifest = json.loads((artifact / "manifest.json").read_text())
        shapes = profile_shapes(manifest, max_batch=8, max_tokens=256)
        dynamic = {sig["name"] for sig in manifest["io"]["inputs"]}
        assert set(shapes) == dynamic
        context = manifest["spec"]["max_positions"]
        named: dict[str, set] = {}
        for sig in manifest["io"]["inputs"]:
            low, opt, high = shapes[sig["name"]]
            for i, dim in enumerate(sig["dims"]):
                assert low[i] <= opt[i] <= high[i] and low[i] >= 0
                if isinstance(dim, int):
                    assert low[i] == opt[i] == high[i] == dim
                else:
                    named.setdefault(dim, set()).add((low[i], opt[i], high[i]))
        assert all(len(ranges) == 1 for ranges in named.values())  # a shared dim has one range
        assert named["select"] == {(1, 1, 256)} and named["batch"] == {(1, 1, 8)}
        if "table" in named:  # paged: a table covers the whole context; the pool is the runtime's default
            block_size = manifest["io"]["inputs"][-1]["dims"][1]
            assert named["table"] == {(1, context // block_size // 2, context // block_size)}
            blocks = named["blocks"].pop()
            bytes_per_block = ModelSpec.from_dict(manifest["spec"]).kv_bytes_per_token() * block_size
            per_sequence = context // block_size  # 512 MiB or 64 full contexts, whichever is less
            assert blocks[0] == 1 and blocks[2] == min((512 << 20) // bytes_per_block, 64 * per_sequence)
    bad = {"spec": {"max_positions": 64}, "io": {"inputs": [{"name": "x", "dims": ["beams"], "dtype": "int64"}]}}
    with pytest.raises(FxllmError, match="beams"):
        profile_shapes(bad, 1, 1)
    manifest = json.loads((fp16_tensorrt / "manifest.json").read_text())
    for max_batch, max_tokens, name in ((0, 512, "--max-batch"), (8, -1, "--max-tokens"), (True, 512, "--max-batch")):
        with pytest.raises(FxllmError, match=f"{name} must be an integer >= 1"):  # max below min: TensorRT's failure
            profile_shapes(manifest, max_batch, max_tokens)


@pytest.mark.parametrize("level", [-1, 6, 2.5, True])
def test_engine_build_refuses_an_optimization_level_tensorrt_lacks(fp16_tensorrt, level):
    """Refused before TensorRT is even imported (it is not installed here): the build would fail on a GPU only."""
    from fxllm.compiler.targets.tensorrt_build import build_engine

    with pytest.raises(FxllmError, match="--optimization-level must be an integer from 0 to 5"):
        build_engine(fp16_tensorrt, optimization_level=level)


def test_half_networks_are_strongly_typed():
    class Flags:
        STRONGLY_TYPED = 1

    class TensorRT:
        NetworkDefinitionCreationFlag = Flags

    assert network_flags(TensorRT, "float16") == network_flags(TensorRT, "bfloat16") == 2
    assert network_flags(TensorRT, "float32") == 0


@pytest.mark.parametrize("options, words", [
    (dict(dtype="float16"), "target 'ort' does not run float16"),
    (dict(dtype="float64"), "unknown dtype 'float64'"),
    (dict(dtype="bfloat16", target="torch", quant="int8"), "quantized artifacts are float32 only"),
    (dict(target="torch", passes="cleanup,kv-cache,dtype,select-logits"), "must be the last pass"),
    (dict(dtype="float16", target="torch", passes="cleanup,kv-cache,dtype"), "give only one"),
])
def test_unsupported_precision_is_refused_before_any_work(make_tiny_model, tmp_path, options, words):
    with pytest.raises(PipelineError) as info:
        fxllm.compile(make_tiny_model("llama"), tmp_path / "out", **options)
    assert words in str(info.value) and "\n" not in str(info.value)
    assert not (tmp_path / "out").exists()


def test_half_precision_kv_bytes():
    spec = ModelSpec("LlamaForCausalLM", "llama", 2, 4, 2, 16, 64, 100, 64, dtype="bfloat16")
    assert spec.kv_bytes_per_token() == 2 * 2 * 2 * 16 * 2
    assert spec.kv_bytes_per_token(4) == 2 * 2 * 2 * 16 * 4
