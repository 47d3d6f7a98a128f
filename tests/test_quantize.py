"""quantize: RTN / GPTQ / AWQ math against direct computations, and the DQ → MatMul form in ONNX."""

from __future__ import annotations

import json

import onnx
import pytest
import torch
from onnx import TensorProto

import fxllm
from fxllm.compiler.quant.awq import search_clipping, search_scales
from fxllm.compiler.capture import capture
from fxllm.compiler.quant.gptq import HessianAccumulator, gptq_quantize
from fxllm.compiler.pass_manager import run_pipeline
from fxllm.compiler.pipeline import build_pipeline, parse_pipeline
from fxllm.compiler.quant.numerics import QuantFormat, dequantize_codes, expand_scales, round_to_nearest
from fxllm.compiler.sources import load_model, load_tokenizer, resolve_source
from fxllm.compiler.targets.ort.group_query_attention import ROW_LENGTHS
from fxllm.compiler.targets.tensorrt_audit import audit_file
from fxllm.errors import PipelineError

INT4_G32 = QuantFormat(4, 32)


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_int8_per_channel_round_trip():
    weight = torch.randn(48, 64, generator=_generator(0))
    codes, scales, _ = round_to_nearest(weight, QuantFormat(8, 0))
    assert codes.dtype == torch.int8 and scales.shape == (48,)
    assert (codes.abs().amax(1) == 127).all()  # every output channel uses the full range
    error = (dequantize_codes(codes, scales, QuantFormat(8, 0)) - weight).abs()
    assert (error <= scales[:, None] / 2 + 1e-7).all()  # round-to-nearest: at most half a step


def test_int4_blockwise_round_trip_with_a_ragged_last_block():
    weight = torch.randn(8, 80, generator=_generator(1))  # 80 = 2 blocks of 32 + one of 16
    weight[3, 5] = 40.0  # an outlier only widens its own block's step
    codes, scales, _ = round_to_nearest(weight, INT4_G32)
    assert scales.shape == (3, 8) and codes.min() >= -8 and codes.max() <= 7
    steps = scales.repeat_interleave(32, 0)[:80].t()
    assert ((dequantize_codes(codes, scales, INT4_G32) - weight).abs() <= steps / 2 + 1e-6).all()
    assert scales[0, 3] == pytest.approx(40.0 / 7) and scales[1, 3] < 1.0


@pytest.mark.parametrize("in_features", [64, 80])
def test_asymmetric_int4_is_exact_as_signed_codes_plus_block_offsets(in_features):
    """A zero point per block, stored as signed codes c = u − 8 and offsets s·(8 − z): s·c + offset equals the
    asymmetric grid's value s·(u − z) for every weight, and the grid spans each block's own [min, max]."""
    weight = torch.rand(8, in_features, generator=_generator(20)) * 3 - 0.5  # lopsided: symmetric wastes most codes
    fmt = QuantFormat(4, 32, symmetric=False)
    codes, scales, offsets = round_to_nearest(weight, fmt)
    assert codes.min() >= -8 and codes.max() <= 7 and offsets.shape == scales.shape
    zeros = 8 - offsets / scales
    torch.testing.assert_close(zeros, zeros.round(), atol=1e-4, rtol=0)  # integer zero points
    steps = scales.repeat_interleave(32, 0)[:in_features].t()
    asymmetric = dequantize_codes(codes, scales, fmt, offsets)
    assert ((asymmetric - weight).abs() <= steps / 2 + 1e-5).all()
    symmetric = dequantize_codes(*round_to_nearest(weight, INT4_G32)[:2], INT4_G32)
    assert (asymmetric - weight).norm() < 0.6 * (symmetric - weight).norm()


def test_bits_per_weight_count_scales_and_offsets():
    assert QuantFormat(4, 64).bits_per_weight(576, 1536) == pytest.approx(4.5)
    assert QuantFormat(4, 64, symmetric=False).bits_per_weight(576, 1536) == pytest.approx(5.0)
    assert QuantFormat(4, 128, symmetric=False).bits_per_weight(1536, 576) == pytest.approx(4.5)
    assert QuantFormat(8, 0).bits_per_weight(576, 1536) == pytest.approx(8 + 32 / 576)
    assert QuantFormat(4, 32, symmetric=False, half_scales=True).bits_per_weight(576, 1536) == pytest.approx(5.0)


@pytest.mark.parametrize("symmetric", [True, False])
def test_half_scale_formats_choose_codes_against_float16_scales(symmetric):
    """The scales a half-scale format stores are float16 values, and the codes are rounded against those (not
    against the float32 scales they came from): dequantizing with the stored scales is what the graph computes."""
    weight = torch.randn(48, 96, generator=_generator(7)) * 0.05
    fmt = QuantFormat(4, 32, symmetric=symmetric, half_scales=True)
    codes, scales, offsets = round_to_nearest(weight, fmt)
    assert torch.equal(scales, scales.half().float())
    float32 = round_to_nearest(weight, QuantFormat(4, 32, symmetric=symmetric))
    assert not torch.equal(scales, float32.scales)
    error = (dequantize_codes(codes, scales, fmt, offsets) - weight).abs()
    step = expand_scales(scales, fmt, 96)  # [out, in]: each element's block scale
    assert bool((error <= step * (0.5 if symmetric else 1.0) + 1e-7).all())


def _correlated_inputs(tokens: int, features: int, seed: int) -> torch.Tensor:
    gen = _generator(seed)
    mixing = torch.randn(features, features, generator=gen) * 0.5 + torch.eye(features)
    return torch.randn(tokens, features, generator=gen) @ mixing


def test_hessian_accumulator_matches_direct_formula():
    x = _correlated_inputs(300, 16, 2)
    accumulator = HessianAccumulator(16)
    for chunk in x.split(70):
        accumulator.add(chunk)
    torch.testing.assert_close(accumulator.hessian, 2 * x.double().t() @ x.double() / 300, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_with_a_diagonal_hessian_is_round_to_nearest(act_order):
    """With uncorrelated inputs there is nothing to compensate: GPTQ must reduce to plain rounding."""
    weight = torch.randn(24, 64, generator=_generator(3))
    hessian = torch.diag(torch.rand(64, generator=_generator(4)) + 0.5)
    codes, scales, _ = gptq_quantize(weight, hessian, INT4_G32, damp=0.0, act_order=act_order)
    rtn_codes, rtn_scales, _ = round_to_nearest(weight, INT4_G32)
    torch.testing.assert_close(scales, rtn_scales)
    assert torch.equal(codes, rtn_codes)


def test_gptq_lazy_block_updates_equal_column_by_column_updates():
    """Lazy batching only reorders the same updates: block size 1 (each column's error applied at once to every
    later column, the textbook OBQ step) and block size 64 must give the same codes."""
    weight = torch.randn(32, 128, generator=_generator(5))
    hessian = HessianAccumulator(128)
    hessian.add(_correlated_inputs(512, 128, 6))
    fmt = QuantFormat(4, 64)
    lazy = gptq_quantize(weight, hessian.hessian, fmt, block_size=64).codes
    eager = gptq_quantize(weight, hessian.hessian, fmt, block_size=1).codes
    assert (lazy == eager).float().mean() > 0.999


@pytest.mark.parametrize("act_order,symmetric", [(False, True), (True, True), (True, False)])
def test_gptq_lowers_the_output_error_on_a_known_hessian(act_order, symmetric):
    """The GPTQ objective tr((W−Ŵ) H (W−Ŵ)ᵀ) for correlated inputs: clearly below round-to-nearest."""
    weight = torch.randn(64, 128, generator=_generator(7)) * 0.02
    x = _correlated_inputs(2048, 128, 8)
    hessian = HessianAccumulator(128)
    hessian.add(x)
    fmt = QuantFormat(4, 32, symmetric)

    def objective(codes, scales, offsets):
        delta = (weight - dequantize_codes(codes, scales, fmt, offsets)).double()
        return float(torch.trace(delta @ hessian.hessian @ delta.t()))

    gptq = objective(*gptq_quantize(weight, hessian.hessian, fmt, act_order=act_order))
    rtn = objective(*round_to_nearest(weight, fmt))
    assert gptq < 0.75 * rtn


def test_gptq_act_order_keeps_contiguous_group_scales():
    """Static groups: with act-order the scales are the float weight's per-group ranges (blocked-DQ compatible)."""
    weight = torch.randn(16, 96, generator=_generator(9))
    hessian = HessianAccumulator(96)
    hessian.add(_correlated_inputs(256, 96, 10))
    scales = gptq_quantize(weight, hessian.hessian, INT4_G32, act_order=True).scales
    torch.testing.assert_close(scales, round_to_nearest(weight, INT4_G32)[1])


def test_awq_scales_protect_a_planted_outlier_channel():
    weight = torch.randn(64, 128, generator=_generator(11)) * 0.02
    x = torch.randn(1024, 128, generator=_generator(12))
    x[:, 37] *= 40.0  # one input channel carries huge activations
    search = search_scales(x, weight, INT4_G32)
    assert int(search.scales.argmax()) == 37 and search.ratio > 0
    assert search.scales[37] > 3 * search.scales.median()
    reference = x @ weight.t()
    rtn = dequantize_codes(*round_to_nearest(weight, INT4_G32)[:2], INT4_G32)
    awq = dequantize_codes(*round_to_nearest(weight * search.scales, INT4_G32)[:2], INT4_G32) / search.scales
    rtn_error = ((x @ rtn.t() - reference) ** 2).mean()
    assert ((x @ awq.t() - reference) ** 2).mean() < 0.5 * rtn_error
    assert min(search.errors) == pytest.approx(float(((x @ awq.t() - reference) ** 2).mean()), rel=1e-4)
    rtn_error_on_sample = float(((x @ rtn.t() - reference) ** 2).mean())
    assert search.errors[0] == pytest.approx(rtn_error_on_sample, rel=1e-4)  # s = 1 is a candidate: RTN itself


def test_awq_clipping_never_widens_and_never_hurts():
    weight = torch.randn(32, 64, generator=_generator(13))
    x = torch.randn(256, 64, generator=_generator(14))
    absmax = search_clipping(x, weight, INT4_G32).scales * 7
    original = round_to_nearest(weight, INT4_G32)[1] * 7
    assert (absmax <= original + 1e-6).all() and (absmax >= 0.5 * original - 1e-6).all()
    assert (absmax < original - 1e-6).any()  # some group does better clipped


def _compile(model, tmp_path, name, options, dump=False):
    artifact = tmp_path / name
    passes = f"cleanup,gqa,fuse-projections,select-logits,quantize:{options},kv-cache"
    report = fxllm.compile(model, artifact, passes=passes, dump_dir=tmp_path / f"{name}-dump" if dump else None)
    return artifact, report


@pytest.mark.parametrize("method,bits", [("int8", TensorProto.INT8), ("int4-rtn", TensorProto.INT4)])
def test_quantized_artifact_form_and_generation(method, bits, make_tiny_model, calibration_file, tmp_path):
    artifact, report = _compile(make_tiny_model("llama"), tmp_path, method,
                                f"method={method};group_size=32;calib={calibration_file}")
    record = next(r for r in report.records if r.name == "quantize")
    assert 0 < record.drift.max_abs_logit < 1.0 and record.drift.mean_kl < 1e-2  # lossy, but close on the tiny model
    # data-free methods still report each layer's output error (on a few samples of the calibration text)
    assert all(0 < layer["output_error"] < 0.5 for layer in record.diagnostics["layers"])
    model = onnx.load(str(artifact / "model.onnx"), load_external_data=False)
    initializers = {i.name: i for i in model.graph.initializer}
    dq = [n for n in model.graph.node if n.op_type == "DequantizeLinear"]
    assert len(dq) == 2 * 5  # qkv, o, gate, up (split-projections), down per layer; lm_head stays float
    for node in dq:
        assert len(node.input) == 2, "no zero point"
        assert initializers[node.input[0]].data_type == bits
    consumers = {name: n.op_type for n in model.graph.node for name in n.input}
    assert {consumers[n.output[0]] for n in dq} == {"MatMul"}
    # TensorRT-legal but for the attention and norm contrib ops the ort target's legalization adds
    assert {f.op for f in audit_file(artifact)} <= {"com.microsoft.GroupQueryAttention",
                                                    "com.microsoft.SkipSimplifiedLayerNormalization"}
    # float activations unless compiled with int8_activations=True: the default runs the drift report's math
    assert json.loads((artifact / "manifest.json").read_text())["runtime"] == {"int8_activations": False}
    results = fxllm.load(artifact).generate(["The quick brown fox", "Paris is"], max_new_tokens=8)
    assert all(len(r.token_ids) == 8 for r in results)


def test_conv1d_projections_are_quantized(make_tiny_model, tmp_path):
    """GPT-2's Conv1D projections (addmm with an [in, out] weight) become linears in cleanup, at float rounding
    distance, so int8 quantizes all four per layer instead of failing to find any."""
    report = fxllm.compile(make_tiny_model("gpt2"), tmp_path / "int8", quant="int8")
    cleanup, quantize = (next(r for r in report.records if r.name == name) for name in ("cleanup", "quantize"))
    assert cleanup.drift.max_abs_logit < 1e-4 and cleanup.drift.greedy_agreement == 1.0
    assert len(quantize.diagnostics["layers"]) == 4 * 2
    model = onnx.load(str(tmp_path / "int8" / "model.onnx"), load_external_data=False)
    assert sum(n.op_type in ("MatMulNBits", "DequantizeLinear") for n in model.graph.node) == 4 * 2
    assert len(fxllm.load(tmp_path / "int8").generate("The quick brown fox", max_new_tokens=8).token_ids) == 8


@pytest.mark.parametrize("method,lm_head,embedding", [("int4-gptq", "int8", "int4"), ("int4-awq", "float", "int8")])
def test_calibrated_methods_compile_with_per_layer_errors(method, lm_head, embedding, make_tiny_model,
                                                          calibration_file, tmp_path):
    artifact, report = _compile(
        make_tiny_model("llama"), tmp_path, method, f"method={method};group_size=32;calib={calibration_file};"
        f"samples=4;seq_len=64;lm_head={lm_head};embedding={embedding}", dump=True)
    record = next(r for r in report.records if r.name == "quantize")
    assert 0 < record.drift.max_abs_logit < 1.0
    layers = record.diagnostics["layers"]
    assert len(layers) == 2 * 4 + (lm_head != "float")  # every projection (plus the lm_head when quantized)
    assert all(0 < layer["output_error"] < 0.5 and 0 < layer["weight_error"] < 0.5 for layer in layers)
    # on the inputs each layer really receives, the calibrated method beats round-to-nearest's output error
    int4 = [layer for layer in layers if layer["bits"] == 4]
    assert sum(layer["output_error"] < layer["rtn_output_error"] for layer in int4) >= len(int4) - 1
    mean = sum(layer["output_error"] for layer in int4) / sum(layer["rtn_output_error"] for layer in int4)
    assert mean < (0.9 if method == "int4-gptq" else 1.0)
    assert any("self_attn.q_proj+k_proj+v_proj" in layer["weight"] for layer in layers)
    if method == "int4-awq":
        notes = {layer["note"].split("=")[0] for layer in layers}
        assert "awq α" in notes  # at least the norm-fed projections got folded input scales
    table = (tmp_path / f"{method}-dump" / "05_quantize.layers.txt").read_text()
    assert "output err" in table and ("lm_head" in table) == (lm_head != "float")
    saved = json.loads((tmp_path / f"{method}-dump" / "05_quantize.report.json").read_text())
    assert saved["diagnostics"]["layers"][0]["layer"]
    model = onnx.load(str(artifact / "model.onnx"), load_external_data=False)
    assert sum(n.op_type == "Gather" for n in model.graph.node) >= 2  # quantized embedding: codes and scales rows
    result = fxllm.load(artifact).generate(["The quick brown fox"], max_new_tokens=6)[0]
    assert len(result.token_ids) == 6


@pytest.mark.parametrize("method", ["int4-gptq", "int4-awq"])
def test_calibrated_methods_default_to_asymmetric_group_32(method, make_tiny_model, calibration_file, tmp_path):
    """Without group_size / zero_point the calibrated methods use METHOD_DEFAULTS (asymmetric, group 32): the
    lowered blocks are 32 wide and carry zero points (the ort form: UINT4 zero points on the DequantizeLinear), and
    the scales are stored as float16 (a Cast the session folds at load)."""
    from fxllm.passes.quantize import METHOD_DEFAULTS

    assert METHOD_DEFAULTS[method] == (32, True)
    artifact, report = _compile(make_tiny_model("llama"), tmp_path, method,
                                f"method={method};calib={calibration_file};samples=2;seq_len=64")
    model = onnx.load(str(artifact / "model.onnx"), load_external_data=False)
    dq = [n for n in model.graph.node if n.op_type == "DequantizeLinear"]
    assert dq and all(len(n.input) == 3 for n in dq)
    assert {a.i for n in dq for a in n.attribute if a.name == "block_size"} == {32}
    initializers = {i.name: i.data_type for i in model.graph.initializer}
    casts = {n.output[0]: n.input[0] for n in model.graph.node if n.op_type == "Cast"}
    assert all(initializers[casts[n.input[1]]] == TensorProto.FLOAT16 for n in dq)
    assert "group size 32, asymmetric" in " ".join(json.loads((artifact / "manifest.json").read_text())["spec"]["notes"])


def test_quantize_bad_options(make_tiny_model, tmp_path):
    """Each is refused before the graph is touched, so one captured program serves every case."""
    source = resolve_source(make_tiny_model("llama"))
    program = capture(load_model(source)).program
    program.tokenizer = load_tokenizer(source)
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    marked = tmp_path / "marked.txt"  # a byte-order mark alone: empty too (it counted as 3 tokens)
    marked.write_bytes(b"\xef\xbb\xbf\n")
    short = tmp_path / "short.txt"
    short.write_text("Only a few words of calibration text.")
    binary = tmp_path / "random.bin"
    binary.write_bytes(bytes([0xFF, 0xFE]) + bytes(range(256)) * 100)
    for text, message in [("method=int3", "unknown quantize method 'int3'"),
                          ("method=int4-rtn;group_size=24", "power of two"),
                          ("method=int4-rtn;group_size=24;zero_point=true", "power of two"),
                          ("method=int4-rtn;lm_head=int2", "lm_head must be one of"),
                          ("method=int8;zero_point=true", "zero_point applies to the int4 methods"),
                          ("method=int4-gptq;damp=nan", "damp .* must be a finite number >= 0, got nan"),
                          ("method=int4-gptq;damp=-0.5", "damp .* must be a finite number >= 0, got -0.5"),
                          (f"method=int4-gptq;calib={empty}", "is empty"),
                          (f"method=int4-gptq;calib={marked}", "is empty"),
                          (f"method=int4-awq;calib={short}",  # windows cut to the tiny model's 256 positions
                           "has 8 tokens; 16 samples of 256 tokens need 4096"),
                          (f"method=int4-gptq;calib={tmp_path / 'missing.txt'}",
                           "the calibration text '.*missing.txt' does not exist"),
                          (f"method=int4-awq;calib={binary}", r"'.*random.bin' is not UTF-8 text \(byte 0x")]:
        with pytest.raises(PipelineError, match=message):
            run_pipeline(program, build_pipeline(parse_pipeline(f"quantize:{text},kv-cache")))


def _onnx_logits(path, feeds: dict, optimize: bool):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = (ort.GraphOptimizationLevel.ORT_ENABLE_ALL if optimize
                                        else ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    options.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "0")  # float activations: exact
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return session.run(["logits"], feeds)[0]


@pytest.mark.parametrize("target,group", [("ort", 32), ("tensorrt", 128)])
def test_asymmetric_int4_lowers_exactly(target, group, make_tiny_model, tmp_path):
    """int4 with zero points (group 32; and 128, one ragged block on the tiny model's 64-wide inputs), lowered to
    ONNX: the artifact's logits equal the rewritten torch program's, with ONNX Runtime's fusions off and on. The
    TensorRT form carries them as an exact offset term (no zero point; the audit passes); the ort form as UINT4
    zero points (compiler/targets/ort/int4_zero_points.py)."""
    from fxllm.compiler.interface import step_inputs
    from fxllm.compiler.targets.onnx_export import lower_to_onnx

    source = resolve_source(make_tiny_model("llama"))
    steps = build_pipeline(parse_pipeline(
        f"cleanup,gqa,fuse-projections,quantize:method=int4-rtn;zero_point=true;group_size={group},kv-cache"))
    quantized, _ = run_pipeline(capture(load_model(source)).program, steps)
    path = tmp_path / "model.onnx"
    lower_to_onnx(quantized, path, target)
    ids = torch.randint(0, 49152, (2, 7), generator=_generator(30))
    inputs = step_inputs(quantized, ids, {})
    expected = quantized.graph_module(*inputs)[0].detach().numpy()
    feeds = {sig.name: value.numpy() for sig, value in zip(quantized.inputs, inputs)}
    for optimize in (False, True):
        assert abs(_onnx_logits(path, feeds, optimize) - expected).max() < 2e-4
    model = onnx.load(str(path), load_external_data=False)
    inputs = 2 if target == "tensorrt" else 3
    assert all(len(n.input) == inputs for n in model.graph.node if n.op_type == "DequantizeLinear")
    offsets = sum(n.op_type == "ReduceSum" and n.name != ROW_LENGTHS for n in model.graph.node)
    assert offsets == (2 * 4 if target == "tensorrt" else 0)  # one offset term per projection
    if target == "tensorrt":
        assert audit_file(path) == []
        # the block sums' padding and reshape take constants, not the input's runtime shape (Shape → Concat)
        producers = {out: node for node in model.graph.node for out in node.output}
        constants = {init.name for init in model.graph.initializer}
        constants |= {out for node in model.graph.node if node.op_type == "Constant" for out in node.output}
        for node in model.graph.node:
            if node.op_type == "ReduceSum" and node.name != ROW_LENGTHS:
                reshape = producers[node.input[0]]
                assert reshape.op_type == "Reshape" and reshape.input[1] in constants
        assert any(node.op_type == "Pad" for node in model.graph.node)  # group 128 over 64-wide inputs: ragged


def test_tensorrt_form_of_asymmetric_int4_matches_the_ort_form(make_tiny_model, calibration_file, tmp_path):
    """The default int4-awq format (asymmetric, group 32, float16 scales) compiled for both targets from one
    model: the TensorRT form (offset term, float32 scales and offsets, no contrib ops) passes the audit, and on
    ONNX Runtime it gives the ort form's (zero points, float16 scales, contrib ops) greedy tokens."""
    model = make_tiny_model("llama")
    options = {"quantize": {"calib": str(calibration_file), "samples": 2, "seq_len": 64}}
    fxllm.compile(model, tmp_path / "ort", quant="int4-awq", pass_options=options)
    fxllm.compile(model, tmp_path / "trt", quant="int4-awq", pass_options=options, target="tensorrt")
    assert audit_file(tmp_path / "trt") == []
    prompts = ["The quick brown fox", "Paris is the capital of", "1, 2, 3,"]
    tokens = {name: [r.token_ids for r in fxllm.load(tmp_path / name).generate(prompts, max_new_tokens=16)]
              for name in ("ort", "trt")}
    assert tokens["trt"] == tokens["ort"]


def test_a_calibration_text_too_short_is_refused_before_the_passes(make_tiny_model, tmp_path, monkeypatch):
    """GPTQ / AWQ refused a text too short for their samples only inside the quantize pass (44 s into a SmolLM2
    compile); now right after the capture."""
    import fxllm
    import fxllm.compiler.compile as compile_module
    from fxllm.errors import PipelineError

    def passes_ran(*args, **kwargs):
        raise AssertionError("the passes ran before the calibration text was checked")

    monkeypatch.setattr(compile_module, "run_pipeline", passes_ran)
    short = tmp_path / "short.txt"
    short.write_text("Far too short.")
    with pytest.raises(PipelineError, match=r"the calibration text '.*short\.txt' has \d+ tokens; 16 samples"):
        fxllm.compile(make_tiny_model("llama"), tmp_path / "out", quant="int4-gptq", quant_options={"calib": str(short)})
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("quant, options, message", [
    ("int4-gptq", {"samples": 0}, "need samples >= 1 and seq_len >= 2, got 0 and 512"),
    ("int4-awq", {"seq_len": 1}, "need samples >= 1 and seq_len >= 2, got 16 and 1"),
    ("int8", {"zero_point": True}, "zero_point applies to the int4 methods"),
    ("int4-gptq", {"calib": "blank"}, r"the calibration text '.*blank\.txt' is empty"),
])
def test_quantize_options_are_refused_before_the_model_loads(quant, options, message, make_tiny_model, tmp_path,
                                                             monkeypatch):
    """These were refused only inside the quantize pass or its calibration, after the load and the capture (15-19 s
    on a tiny model, minutes on a real one); the pipeline's option check now refuses them first."""
    import fxllm.compiler.compile as compile_module

    def loads(*args, **kwargs):
        raise AssertionError("the model loaded before the options were checked")

    monkeypatch.setattr(compile_module, "load_model", loads)
    blank = tmp_path / "blank.txt"
    blank.write_text(" \n\n ")
    if options.get("calib") == "blank":
        options = {"calib": str(blank)}
    with pytest.raises(PipelineError, match=message):
        fxllm.compile(make_tiny_model("llama"), tmp_path / "out", quant=quant, pass_options={"quantize": options})
    assert not (tmp_path / "out").exists()


def test_a_long_calibration_text_is_tokenized_in_slices(make_tiny_model, calibration_file):
    """A 56 MB calibration text was tokenized whole for 2 windows of 64 tokens: 112 s and 7.9 GB. A text over
    WHOLE_TEXT_CHARS is tokenized only in one slice a window, at evenly spread places; each window is real text's
    tokens (it decodes to a piece of the text) and the windows differ."""
    from fxllm.compiler.quant import calibration
    from fxllm.compiler.quant.calibration import calibration_tokens

    tokenizer = load_tokenizer(resolve_source(make_tiny_model("llama")))
    base = calibration_file.read_text()
    text = base * (calibration.WHOLE_TEXT_CHARS // len(base) + 2)
    seen: list[int] = []

    def counting(piece, **kwargs):
        seen.append(len(piece))
        return tokenizer(piece, **kwargs)

    windows = calibration_tokens(counting, text, 4, 64, "long.txt")
    assert windows.shape == (4, 64)
    assert sum(seen) <= 4 * 64 * calibration.SLICE_CHARS_PER_TOKEN * 2 ** (calibration.SLICE_TRIES - 1)
    assert len({tuple(row.tolist()) for row in windows}) == 4
    for row in windows:
        assert tokenizer.decode(row.tolist()).strip() in text


def test_mixture_of_experts_routers_stay_float(tmp_path):
    """A router (linear → softmax → top-k) rounded to int4 moves tokens to other experts, a discrete error the
    experts' own rounding does not make; it is [experts × hidden], nothing to save. AutoAWQ and llama.cpp keep it
    float, and so does the quantize pass, saying so in the artifact's notes, with the experts' rounding."""
    from tests.gguf_files import tiny_hf_model

    source = resolve_source(tiny_hf_model("qwen3moe", tmp_path / "moe"))
    program = capture(load_model(source)).program
    program.tokenizer = load_tokenizer(source)
    pipeline = build_pipeline(parse_pipeline("quantize:method=int4-rtn;group_size=32,kv-cache"))
    program, _ = run_pipeline(program, pipeline)
    left = [n for n in program.graph.nodes if n.target is torch.ops.aten.linear.default]
    routers = [n for n in left if any(u.target is torch.ops.aten.topk.default for u in _within(n, 8))]
    assert len(routers) == program.spec.num_layers == len(left) - 1  # a router a layer, and the float lm_head
    assert f"quantize: {len(routers)} mixture-of-experts routers kept float" in program.spec.notes
    assert any(n.target is torch.ops.fxllm.dequant_linear.default for n in program.graph.nodes)


def _within(node, depth):
    frontier, seen = [node], []
    for _ in range(depth):
        frontier = [user for n in frontier for user in n.users]
        seen += frontier
    return seen
