"""TensorRT target: the audit (runs anywhere), the TensorRT form's numerics on ONNX Runtime, and the build/run
paths, which skip with a reason where TensorRT or a GPU is missing."""

from __future__ import annotations

import importlib.util

import onnx
import pytest
from onnx import TensorProto, helper

import fxllm
from fxllm.compiler.targets.tensorrt_audit import audit_file, audit_model
from fxllm.errors import ArtifactError
from fxllm.runtime.backend_trt import check_plan_compatibility
from tests.conftest import PROMPTS

HAS_TENSORRT = importlib.util.find_spec("tensorrt") is not None


def has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.fixture(scope="module")
def trt_artifact(make_tiny_model, tmp_path_factory):
    output = tmp_path_factory.mktemp("trt") / "artifact"
    report = fxllm.compile(make_tiny_model("llama"), output, target="tensorrt")
    return output, report


def test_tensorrt_target_passes_the_audit_and_matches_ort(trt_artifact, make_tiny_artifact):
    artifact, _ = trt_artifact
    assert audit_file(artifact) == []
    trt_form, ort_form = fxllm.load(artifact), fxllm.load(make_tiny_artifact("llama"))
    assert [r.token_ids for r in trt_form.generate(PROMPTS, max_new_tokens=16)] == \
           [r.token_ids for r in ort_form.generate(PROMPTS, max_new_tokens=16)]


def test_every_onnx_node_knows_its_origin(trt_artifact):
    artifact, _ = trt_artifact
    model = onnx.load(str(artifact / "model.onnx"), load_external_data=False)
    origins = {p.value for n in model.graph.node for p in n.metadata_props if p.key == "fxllm.origin"}
    assert {"capture", "kv-cache", "fuse-projections"} <= origins
    fused = {p.value for n in model.graph.node if n.op_type in ("RMSNormalization", "RotaryEmbedding")
             for p in n.metadata_props if p.key == "fxllm.origin"}
    assert fused == {"lowering"}  # the exporter's fusions, not the fx node whose metadata they copied
    assert all(any(p.key == "fxllm.origin" for p in n.metadata_props) for n in model.graph.node)


@pytest.mark.skipif(HAS_TENSORRT, reason="checks the message for machines without TensorRT")
def test_without_tensorrt_the_onnx_and_audit_still_come_out(trt_artifact):
    artifact, report = trt_artifact
    assert (artifact / "model.onnx").is_file() and not (artifact / "engine.plan").exists()
    assert any("pip install 'fxllm[tensorrt]'" in note and "passed the TensorRT audit" in note
               for note in report.notes)
    with pytest.raises(ArtifactError, match="needs TensorRT"):
        fxllm.load(artifact, backend="tensorrt")


def planted_model() -> onnx.ModelProto:
    """One node per rule: each must be reported with its name."""
    f, i64 = TensorProto.FLOAT, TensorProto.INT64
    inputs = [helper.make_tensor_value_info(n, f, [1, 2, 4, 8]) for n in ("q", "k", "v", "pk", "pv")]
    inputs += [helper.make_tensor_value_info("axes", i64, [1]), helper.make_tensor_value_info("x", f, [4, 4]),
               helper.make_tensor_value_info("zp", TensorProto.INT8, [4]),
               helper.make_tensor_value_info("w8", TensorProto.INT8, [4, 4]),
               helper.make_tensor_value_info("idx", i64, [2, 1])]
    nodes = [
        helper.make_node("Attention", ["q", "k", "v", "", "pk", "pv"], ["y", "present_k", "present_v"],
                         name="attention_with_past"),
        helper.make_node("DynamicQuantizeLinear", ["x"], ["xq", "xs", "xz"], name="dynamic_quant"),
        helper.make_node("GroupQueryAttention", ["q", "k", "v"], ["g"], domain="com.microsoft", name="contrib_gqa"),
        helper.make_node("ReduceMean", ["x", "axes"], ["m"], name="reduce_axes_input"),
        helper.make_node("ScatterND", ["x", "idx", "x"], ["s"], reduction="add", name="scatter_add"),
        helper.make_node("DequantizeLinear", ["w8", "s8", "zp"], ["dq"], name="dq_zero_point"),
        helper.make_node("MatMul", ["x", "x"], ["fine"], name="plain_matmul"),
    ]
    nodes[0].metadata_props.add(key="fxllm.origin", value="kv-cache")
    graph = helper.make_graph(nodes, "planted", inputs, [helper.make_tensor_value_info("fine", f, [4, 4])],
                              initializer=[helper.make_tensor("s8", f, [], [0.1])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23), helper.make_opsetid("com.microsoft", 1)])


def test_audit_names_every_planted_violation():
    findings = audit_model(planted_model())
    by_node = {}
    for finding in findings:
        by_node.setdefault(finding.node, []).append(finding.rule)
    assert set(by_node) == {"attention_with_past", "dynamic_quant", "contrib_gqa", "reduce_axes_input",
                            "scatter_add", "dq_zero_point"}
    assert any("past_key/past_value" in r for r in by_node["attention_with_past"])
    assert any("first output" in r for r in by_node["attention_with_past"])
    assert "com.microsoft.GroupQueryAttention" in {f.op for f in findings}
    assert next(f for f in findings if f.node == "attention_with_past").origin == "kv-cache"
    assert any("reduction 'add'" in r for r in by_node["scatter_add"])


def test_audit_knows_versions(trt_artifact):
    artifact, _ = trt_artifact
    old = audit_file(artifact, (10, 14))
    assert {f.op for f in old} == {"RMSNormalization", "RotaryEmbedding"}
    assert all("10.15" in f.rule for f in old)


def test_inspect_check_exit_codes(trt_artifact, tmp_path, capsys):
    from fxllm.cli import main

    artifact, _ = trt_artifact
    assert main(["inspect", str(artifact), "--check", "tensorrt"]) == 0
    assert "no findings" in capsys.readouterr().out
    assert main(["inspect", str(artifact), "--check", "tensorrt", "--trt-version", "10.13"]) == 1
    assert "Attention is parsed from TensorRT 10.14" in capsys.readouterr().out
    # refused, not ignored: without --check the version had no effect
    assert main(["inspect", str(artifact), "--trt-version", "10.13"]) == 1
    assert capsys.readouterr().err.strip() == "fxllm: error: --trt-version sets the TensorRT version of an audit; " \
                                              "it needs --check tensorrt"


@pytest.mark.parametrize("embedding", ["int8", "int4"])
def test_a_quantized_embedding_is_said_to_be_unverified(make_tiny_model, tmp_path, capsys, embedding):
    """A quantized embedding is a blocked DequantizeLinear of rows a Gather took from the codes (INT8: an int4
    embedding keeps a code a byte, ONNX's Gather has no INT4): the compile said nothing of it (only dequantizes of a
    stored weight were looked at) and `inspect --check tensorrt` said "no findings", where docs/quantization.md
    calls it unverified on TensorRT. Both say so now."""
    from fxllm.cli import main

    output = tmp_path / "artifact"
    report = fxllm.compile(make_tiny_model("llama"), output, target="tensorrt", quant="int8",
                           quant_options={"embedding": embedding})
    notes = [note for note in report.notes if note.startswith("unverified for TensorRT")]
    assert all(any(kind in note for note in notes) for kind in ("blocked INT8", "a Gather took")), notes
    capsys.readouterr()
    assert main(["inspect", str(output), "--check", "tensorrt"]) == 0
    printed = capsys.readouterr().out
    assert "no findings" in printed
    assert [line for line in printed.splitlines() if line.startswith("  unverified: ")] == \
           [f"  unverified: {note.removeprefix('unverified for TensorRT: ')}" for note in notes]


def test_plan_from_another_tensorrt_or_gpu_is_refused():
    recorded = {"version": "10.15.1", "compute_capability": "9.0", "gpu": "NVIDIA H200"}
    check_plan_compatibility(recorded, "10.15.1", "9.0")
    with pytest.raises(ArtifactError, match="built with TensorRT 10.15.1, this machine has 11.0.0"):
        check_plan_compatibility(recorded, "11.0.0", "9.0")
    with pytest.raises(ArtifactError, match=r"compute capability 9.0 \(NVIDIA H200\), this GPU is 8.9"):
        check_plan_compatibility(recorded, "10.15.1", "8.9")
    with pytest.raises(ArtifactError, match="no TensorRT engine"):
        check_plan_compatibility(None, "10.15.1", "9.0")


@pytest.mark.skipif(not HAS_TENSORRT or not has_gpu(), reason="needs TensorRT 10.15+ and a CUDA GPU")
def test_engine_build_and_run_match_onnx_runtime(trt_artifact):  # pragma: no cover - GPU machines only
    from fxllm.compiler.targets.tensorrt_build import build_engine

    artifact, _ = trt_artifact
    build_engine(artifact, optimization_level=1, max_batch=4, max_tokens=64)
    on_trt = fxllm.load(artifact, backend="tensorrt").generate(PROMPTS, max_new_tokens=16)
    on_ort = fxllm.load(artifact).generate(PROMPTS, max_new_tokens=16)
    assert [r.token_ids for r in on_trt] == [r.token_ids for r in on_ort]


@pytest.mark.slow
def test_smollm2_tensorrt_form_audits_clean_and_matches_ort(smollm2_artifact, tmp_path):
    artifact = tmp_path / "smollm2-trt"
    fxllm.compile("smollm2-135m", artifact, target="tensorrt", requantize=True)
    assert audit_file(artifact) == []
    trt_form, ort_form = fxllm.load(artifact), fxllm.load(smollm2_artifact)
    assert [r.token_ids for r in trt_form.generate(PROMPTS, max_new_tokens=32)] == \
           [r.token_ids for r in ort_form.generate(PROMPTS, max_new_tokens=32)]
