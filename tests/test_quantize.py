"""quantize: weight-only int8 / int4-RTN, checked against direct computation, in the DQ → MatMul ONNX form."""

from __future__ import annotations

import onnx
import pytest
import torch
from onnx import TensorProto

import fxllm
from fxllm.compiler.capture import capture
from fxllm.compiler.ops import dequantize
from fxllm.compiler.pass_manager import run_pipeline
from fxllm.compiler.pipeline import build_pipeline, parse_pipeline
from fxllm.compiler.sources import load_model, resolve_source
from fxllm.compiler.tensorrt_audit import audit_file
from fxllm.errors import PipelineError
from fxllm.passes.quantize import quantize_int4_rtn, quantize_int8


def test_int8_per_channel_round_trip():
    weight_t = torch.randn(64, 48, generator=torch.Generator().manual_seed(0))
    q, scales = quantize_int8(weight_t)
    assert q.dtype == torch.int8 and scales.shape == (48,)
    assert q.abs().max() == 127  # every column uses the full range
    error = (dequantize(q, scales, 0) - weight_t).abs()
    assert (error <= scales / 2 + 1e-7).all()  # round-to-nearest: at most half a step per column


def test_int4_blockwise_round_trip():
    weight_t = torch.randn(128, 8, generator=torch.Generator().manual_seed(1))
    weight_t[5, 3] = 40.0  # an outlier only widens its own block's step
    q, scales = quantize_int4_rtn(weight_t, 32)
    assert scales.shape == (4, 8) and q.min() >= -8 and q.max() <= 7
    error = (dequantize(q, scales, 32) - weight_t).abs().reshape(4, 32, 8)
    assert (error <= scales[:, None, :] / 2 + 1e-6).all()
    assert scales[0, 3] == pytest.approx(40.0 / 7) and scales[1, 3] < 1.0


@pytest.mark.parametrize("method,bits", [("int8", TensorProto.INT8), ("int4-rtn", TensorProto.INT4)])
def test_quantized_artifact_form_and_generation(method, bits, make_tiny_model, tmp_path):
    artifact = tmp_path / method
    report = fxllm.compile(make_tiny_model("llama"), artifact,
                           passes=f"cleanup,gqa,fuse-projections,quantize:method={method};group_size=32,kv-cache")
    drift = report.records[3].drift
    assert 0 < drift.max_abs_logit < 1.0 and drift.mean_kl < 1e-2  # lossy, but close on the tiny model
    model = onnx.load(str(artifact / "model.onnx"), load_external_data=False)
    initializers = {i.name: i for i in model.graph.initializer}
    dq = [n for n in model.graph.node if n.op_type == "DequantizeLinear"]
    assert len(dq) == 2 * 4  # qkv, o, gate+up, down per layer; lm_head stays float
    for node in dq:
        assert len(node.input) == 2, "no zero point"
        assert initializers[node.input[0]].data_type == bits
    consumers = {name: n.op_type for n in model.graph.node for name in n.input}
    assert {consumers[n.output[0]] for n in dq} == {"MatMul"}
    assert audit_file(artifact) == []
    results = fxllm.load(artifact).generate(["The quick brown fox", "Paris is"], max_new_tokens=8)
    assert all(len(r.token_ids) == 8 for r in results)


def test_quantize_bad_options(make_tiny_model):
    program = capture(load_model(resolve_source(make_tiny_model("llama")))).program
    for text, message in [("quantize:method=int3", "unknown quantize method 'int3'"),
                          ("quantize:method=int4-gptq", "not implemented yet"),
                          ("quantize:method=int4-rtn;group_size=24", "power of two"),
                          ("quantize:method=int4-rtn;group_size=128", "not a multiple of group_size 128")]:
        with pytest.raises(PipelineError, match=message):
            run_pipeline(program, build_pipeline(parse_pipeline(f"cleanup,{text},kv-cache")))
