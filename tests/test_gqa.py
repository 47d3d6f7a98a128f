"""gqa: native grouped-query attention (no K/V repeat reaches attention) and MHA/GQA → fewer KV heads."""

from __future__ import annotations

from collections import Counter

import onnx
import pytest
import torch
from transformers import AutoModelForCausalLM

import fxllm
from fxllm.compiler.capture import capture
from fxllm.compiler.interface import run_sequence
from fxllm.compiler.pass_manager import run_pipeline
from fxllm.compiler.pipeline import build_pipeline, parse_pipeline
from fxllm.compiler.sources import load_model, resolve_source
from fxllm.errors import PipelineError
from tests.conftest import PROMPTS


def onnx_ops(artifact) -> Counter:
    model = onnx.load(str(artifact / "model.onnx"), load_external_data=False)
    return Counter(node.op_type for node in model.graph.node)


def kv_path_ops(artifact) -> set[str]:
    """Op types on the data paths from the past_key/past_value inputs to the Attention nodes."""
    model = onnx.load(str(artifact / "model.onnx"), load_external_data=False)
    consumers: dict[str, list] = {}
    for node in model.graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    visited: set[str] = set()
    op_types: set[str] = set()
    frontier = [i.name for i in model.graph.input if i.name.startswith("past_")]
    while frontier:
        for node in consumers.get(frontier.pop(), []):
            if node.op_type in ("Attention", "GroupQueryAttention", "Shape") or node.name in visited:
                continue  # Shape only reads dims: it is not on the K/V data path
            visited.add(node.name)
            op_types.add(node.op_type)
            frontier.extend(node.output)
    return op_types


def test_native_gqa_onnx_has_no_repeat_on_the_kv_path(make_tiny_artifact, make_tiny_model, tmp_path):
    native = make_tiny_artifact("llama")  # default pipeline includes gqa
    # the ort target reads the past straight into GroupQueryAttention; the standard form concatenates it first
    assert kv_path_ops(native) <= {"Concat"} and onnx_ops(native)["GroupQueryAttention"] == 2
    repeated = tmp_path / "no-gqa"
    fxllm.compile(make_tiny_model("llama"), repeated, passes="cleanup,fuse-projections,kv-cache")
    assert {"Expand", "Reshape"} <= kv_path_ops(repeated), "without gqa the cache is repeated every step"


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_native_gqa_generates_the_same_tokens(arch, make_tiny_model, make_tiny_artifact, tmp_path):
    without = tmp_path / "no-gqa"
    fxllm.compile(make_tiny_model(arch), without, passes="cleanup,fuse-projections,kv-cache")
    native, repeated = fxllm.load(make_tiny_artifact(arch)), fxllm.load(without)
    batch = [r.token_ids for r in native.generate(PROMPTS, max_new_tokens=32)]
    assert batch == [r.token_ids for r in repeated.generate(PROMPTS, max_new_tokens=32)]
    for prompt, tokens in zip(PROMPTS, batch):
        assert native.generate(prompt, max_new_tokens=32).token_ids == tokens
        assert repeated.generate(prompt, max_new_tokens=32).token_ids == tokens


def test_regrouping_equals_mean_pooled_transformers_model(make_tiny_model):
    """The pass's conversion is exactly Ainslie et al.'s mean-pooling applied to the checkpoint."""
    directory = make_tiny_model("llama")
    program = capture(load_model(resolve_source(directory))).program
    program, _ = run_pipeline(program, build_pipeline(parse_pipeline("cleanup,gqa:kv_heads=1")))
    assert program.spec.num_kv_heads == 1 and program.spec.source_num_kv_heads == 2

    model = AutoModelForCausalLM.from_pretrained(directory).eval()
    pooled = AutoModelForCausalLM.from_config(
        type(model.config)(**{**model.config.to_dict(), "num_key_value_heads": 1})
    ).eval()
    state = model.state_dict()
    head_dim = model.config.head_dim
    for key, value in state.items():
        if key.endswith(("k_proj.weight", "v_proj.weight")):
            state[key] = value.reshape(2, head_dim, -1).mean(0)
    pooled.load_state_dict(state)
    ids = torch.randint(0, 49152, (2, 10), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(run_sequence(program, ids), pooled(ids).logits, atol=1e-5, rtol=1e-5)


def test_gpt2_mha_regroups_4_to_2_to_1(make_tiny_model, tokenizer, tmp_path):
    directory = make_tiny_model("gpt2")
    model = AutoModelForCausalLM.from_pretrained(directory).eval()
    engine = fxllm.load(_compile(directory, tmp_path / "mha", None))
    ids = tokenizer(PROMPTS[0], return_tensors="pt").input_ids
    want = model.generate(ids, max_new_tokens=16, do_sample=False)[0, ids.shape[1]:].tolist()
    assert engine.generate(PROMPTS[0], max_new_tokens=16).token_ids == want
    bytes_per_token = {}
    for heads in (4, 2, 1):
        artifact = _compile(directory, tmp_path / f"kv{heads}", heads)
        engine = fxllm.load(artifact)
        assert engine.spec.num_kv_heads == heads
        assert len(engine.generate(PROMPTS, max_new_tokens=8)) == len(PROMPTS)
        from fxllm.runtime.inspect import describe_artifact

        bytes_per_token[heads] = describe_artifact(artifact)["kv_cache_bytes_per_token"]
    assert bytes_per_token[4] == 2 * bytes_per_token[2] == 4 * bytes_per_token[1]


def _compile(directory, output, kv_heads):
    fxllm.compile(directory, output, pass_options={"gqa": {"kv_heads": kv_heads}} if kv_heads else None)
    return output


@pytest.mark.parametrize("heads,message", [(3, "must divide the 4 query heads"), (4, "more than the model's 2 KV")])
def test_bad_kv_heads(make_tiny_model, heads, message):
    program = capture(load_model(resolve_source(make_tiny_model("llama")))).program
    with pytest.raises(PipelineError, match=message):
        run_pipeline(program, build_pipeline(parse_pipeline(f"cleanup,gqa:kv_heads={heads}")))
