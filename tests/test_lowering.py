"""ONNX lowering: a checked model of standard ops whose ONNX Runtime outputs match the torch program."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import onnx
import onnxruntime as ort

from tests.conftest import PROMPTS


def test_onnx_is_valid_standard_and_native(make_tiny_model, tmp_path):
    """The standard form (target tensorrt; target ort legalizes it further: tests/test_ort_legalization.py)."""
    import fxllm

    artifact = tmp_path / "trt"
    fxllm.compile(make_tiny_model("llama"), artifact, target="tensorrt")
    model_path = artifact / "model.onnx"
    onnx.checker.check_model(str(model_path), full_check=True)
    model = onnx.load(str(model_path), load_external_data=False)
    assert {op.domain for op in model.opset_import} <= {"", "ai.onnx"}
    assert all(node.domain in ("", "ai.onnx") for node in model.graph.node), "no contrib ops in the TensorRT form"
    ops = Counter(node.op_type for node in model.graph.node)
    assert ops["Attention"] == 2  # one per layer, fed by the cache concatenation
    assert ops["RMSNormalization"] == 5 and ops["RotaryEmbedding"] == 4
    assert ops["Cos"] == ops["Sin"] == 1, "one rotary table shared by every layer"
    assert not {"Expand", "Tile"} & set(ops), "K/V must not be repeated to the query heads"
    attention = [n for n in model.graph.node if n.op_type == "Attention"]
    outputs = {name: node for node in model.graph.node for name in node.output}
    for node in attention:  # 4D q, k, v, mask: no past inputs, one output (the form TensorRT's parser accepts)
        assert len(node.input) == 4 and [o for o in node.output if o] == node.output[:1]
        assert {outputs[name].op_type for name in node.input[1:3]} == {"Concat"}
    assert (artifact / "model.onnx.data").stat().st_size > 1_000_000, "weights live in external data"


def test_onnx_runtime_matches_torch_reference(make_tiny_artifact, make_tiny_model, tokenizer):
    import torch
    from transformers import AutoModelForCausalLM

    artifact = make_tiny_artifact("qwen2")
    model = AutoModelForCausalLM.from_pretrained(make_tiny_model("qwen2")).eval()
    session = ort.InferenceSession(str(artifact / "model.onnx"), providers=["CPUExecutionProvider"])
    ids = np.asarray([tokenizer(PROMPTS[1])["input_ids"]], dtype=np.int64)
    manifest = json.loads((artifact / "manifest.json").read_text())
    feeds = {"input_ids": ids, "position_ids": np.arange(ids.shape[1])[None], "attention_mask": np.ones_like(ids),
             "logits_index": np.arange(ids.shape[1])}
    for sig in manifest["io"]["inputs"]:
        if sig["name"].startswith("past_"):
            feeds[sig["name"]] = np.zeros((1, sig["dims"][1], 0, sig["dims"][3]), np.float32)
    logits = session.run(["logits"], feeds)[0]
    with torch.no_grad():
        expected = model(torch.from_numpy(ids)).logits.numpy()
    np.testing.assert_allclose(logits, expected, atol=1e-4, rtol=1e-4)


def test_type_promotion_is_skipped_only_where_the_exporter_would_insert_nothing(make_tiny_model):
    """Lowering skips torch.onnx's type-promotion pass when `needs_type_promotion` says it would change nothing;
    that answer is checked against the pass itself: the tiny llama through the default pipeline (nothing to cast)
    and a graph that adds an int64 tensor to a float one (a cast)."""
    import torch
    from torch.onnx._internal.exporter import _fx_passes

    from fxllm.compiler.capture import capture
    from fxllm.compiler.pass_manager import run_pipeline
    from fxllm.compiler.pipeline import build_pipeline, parse_pipeline
    from fxllm.compiler.sources import load_model, resolve_source
    from fxllm.compiler.targets.onnx_export import export_program
    from fxllm.compiler.targets.torch_onnx import needs_type_promotion, prepare_for_onnx

    class Mixed(torch.nn.Module):
        def forward(self, x, counts):
            return x * 2 + counts

    program = capture(load_model(resolve_source(make_tiny_model("llama")))).program
    program, _ = run_pipeline(program, build_pipeline(parse_pipeline(
        "cleanup,gqa,fuse-projections,quantize:method=int4-rtn,select-logits,kv-cache,paged:block_size=4")))
    mixed = torch.export.export(Mixed(), (torch.ones(2, 3), torch.arange(3)))
    for exported, expected in ((export_program(program), False), (mixed, True)):
        module = exported.graph_module
        prepare_for_onnx(module)
        before = [(n.op, n.target, n.args) for n in module.graph.nodes]
        assert needs_type_promotion(module) is expected
        _fx_passes.insert_type_promotion_nodes(module)
        assert (before != [(n.op, n.target, n.args) for n in module.graph.nodes]) is expected


def test_no_op_elimination_keeps_constants_that_are_only_close_to_0_or_1():
    """The optimizer drops x + 0, x * 1, x - 0, x / 1 only for exact constants: onnxscript's own rules took
    |c| <= 1e-8 for 0 and 1 ± 1e-5 for 1, and removed an RMSNorm's `+ 1e-8` epsilon (see the test below)."""
    import onnx_ir as ir
    from onnx import TensorProto, helper

    from fxllm.compiler.targets.onnx_export import optimize_graph

    def scalar(name: str, value: float):
        return helper.make_node("Constant", [], [name], value=helper.make_tensor(name, TensorProto.FLOAT, [], [value]))

    constants = {"eps": 1e-8, "near_one": 1.000001, "zero": 0.0, "one": 1.0}
    nodes = [scalar(name, value) for name, value in constants.items()]
    nodes += [helper.make_node("Add", ["x", "eps"], ["a"]), helper.make_node("Mul", ["near_one", "a"], ["b"]),
              helper.make_node("Sub", ["b", "zero"], ["c"]), helper.make_node("Div", ["c", "one"], ["d"]),
              helper.make_node("Add", ["zero", "d"], ["e"]), helper.make_node("Mul", ["e", "one"], ["y"])]
    value = helper.make_tensor_value_info
    graph = helper.make_graph(nodes, "g", [value("x", TensorProto.FLOAT, [2])], [value("y", TensorProto.FLOAT, [2])])
    model = ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)]))
    optimize_graph(model)
    kept = [(node.op_type, [float(v.const_value.numpy()) for v in node.inputs if v.const_value is not None])
            for node in model.graph]
    assert kept == [("Add", [np.float32(1e-8)]), ("Mul", [np.float32(1.000001)])], kept


def test_an_rms_norm_epsilon_of_1e_8_survives_lowering(tokenizer, tmp_path):
    """Helium-like RMSNorm epsilon 1e-8: the padding token's embedding row is all zeros, so a batched (left-padded)
    call normalized 0 / sqrt(0) once the epsilon was optimized away, and every batched generation failed with
    non-finite logits. Batched now equals one prompt at a time and transformers."""
    import torch
    import transformers

    import fxllm

    config = transformers.LlamaConfig(vocab_size=49152, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                      num_hidden_layers=1, intermediate_size=96, max_position_embeddings=128,
                                      rms_norm_eps=1e-8, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(config).eval().save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    fxllm.compile(tmp_path / "model", tmp_path / "artifact")
    engine = fxllm.load(tmp_path / "artifact")
    engine.eos_token_ids = set()
    single = [engine.generate(prompt, max_new_tokens=4).token_ids for prompt in PROMPTS[:2]]
    assert [result.token_ids for result in engine.generate(PROMPTS[:2], max_new_tokens=4)] == single
