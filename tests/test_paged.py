"""paged: block-table KV cache + continuous batching give the contiguous pipeline's greedy tokens, also under
preemption; prefix caching shares blocks; bad budgets and sizes fail clearly."""

from __future__ import annotations

import onnx
import pytest

import fxllm
from fxllm.compiler.targets.tensorrt_audit import audit_file
from fxllm.errors import GenerationError, PipelineError
from tests.conftest import PROMPTS

MIXED = [(prompt + " ") * (1 + i % 3) + str(i) for i, prompt in enumerate(PROMPTS * 4)]  # 16 prompts, 6-60 tokens


@pytest.fixture(scope="module")
def paged_artifact(tiny_paged_artifact):
    return tiny_paged_artifact


@pytest.fixture(scope="module")
def contiguous_tokens(make_tiny_artifact):
    engine = fxllm.load(make_tiny_artifact("llama"))
    return [engine.generate(prompt, max_new_tokens=24).token_ids for prompt in MIXED]


def test_paged_graph_form(paged_artifact):
    model = onnx.load(str(paged_artifact / "model.onnx"), load_external_data=False)
    inputs = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input}
    assert inputs["key_cache_0"] == [1, 2, "pool_slots_b4", 16]  # head-major views (ort paged-run)
    assert inputs["block_tables"] == ["batch", "table"] and inputs["context_lens"] == ["batch"]
    assert "attention_mask" not in inputs and not any(name.startswith("past_") for name in inputs)
    outputs = {o.name: [d.dim_param or d.dim_value for d in o.type.tensor_type.shape.dim] for o in model.graph.output}
    assert outputs["new_key_1"] == ["batch", 2, "tokens", 16]
    # standard ops, but for the norms and the attention the ort target's legalization makes (compiler/targets/ort):
    # each layer's attention is an If of GroupQueryAttention in the pool and the gathered forms
    nodes = list(_all_nodes(model.graph))
    contrib = {n.op_type for n in nodes if n.domain not in ("", "ai.onnx")}
    assert contrib == {"SkipSimplifiedLayerNormalization", "GroupQueryAttention"}
    ifs = [n for n in model.graph.node if n.op_type == "If" and n.name.startswith("paged_run_attention_")]
    assert len(ifs) == 2  # one per layer
    assert not any(n.op_type in ("ScatterND", "ScatterElements") for n in nodes)  # the pool is written in place
    assert not any(n.op_type == "Transpose" and n.input[0].startswith("key_cache") for n in nodes)
    assert {f.op for f in audit_file(paged_artifact)} == {f"com.microsoft.{op}" for op in contrib}


def _all_nodes(graph):
    for node in graph.node:
        yield node
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                yield from _all_nodes(attribute.g)


def test_sixteen_prompts_together_match_the_contiguous_pipeline(paged_artifact, contiguous_tokens):
    engine = fxllm.load(paged_artifact)
    results = engine.generate(MIXED, max_new_tokens=24)
    assert [r.token_ids for r in results] == contiguous_tokens
    stats = engine.stats()
    assert stats.max_decode_batch == 16 and stats.preemptions == 0
    assert stats.kv_blocks_used == 0  # everything freed at the end
    assert 0 <= stats.kv_waste_at_peak < 0.25


def test_a_small_kv_budget_preempts_without_changing_outputs(paged_artifact, contiguous_tokens):
    engine = fxllm.load(paged_artifact, kv_blocks=48)  # room for a few of the 16 requests at a time
    results = engine.generate(MIXED, max_new_tokens=24)
    assert engine.stats().preemptions > 0
    assert [r.token_ids for r in results] == contiguous_tokens


@pytest.mark.parametrize("arch", ["qwen2", "gpt2"])  # gpt2: LayerNorm, so contrib ops only inside the Ifs
def test_without_gqa(arch, make_tiny_model, make_tiny_artifact, tmp_path):
    output = tmp_path / "paged-no-gqa"
    fxllm.compile(make_tiny_model(arch), output, passes="cleanup,kv-cache,paged:block_size=8")
    reference = fxllm.load(make_tiny_artifact(arch))
    expected = [reference.generate(p, max_new_tokens=12).token_ids for p in PROMPTS]
    assert [r.token_ids for r in fxllm.load(output).generate(PROMPTS, max_new_tokens=12)] == expected


def test_prefix_cache_shares_a_system_prompt(paged_artifact, contiguous_tokens):
    system = "You are a helpful assistant who answers briefly and precisely. " * 3
    prompts = [system + question for question in PROMPTS]
    engine = fxllm.load(paged_artifact)
    first = [r.token_ids for r in engine.generate(prompts, max_new_tokens=8)]
    assert engine.stats().prefix_cache_hit_rate > 0.5
    assert engine.stats().prefill_cached_tokens > 0
    alone = fxllm.load(paged_artifact)
    assert [alone.generate(p, max_new_tokens=8).token_ids for p in prompts] == first


def test_a_stopped_stream_frees_its_blocks(paged_artifact):
    engine = fxllm.load(paged_artifact)
    stream = engine.stream(PROMPTS[1], max_new_tokens=20)
    next(stream)
    stream.close()  # the caller stops reading: the request's blocks must not stay allocated
    assert engine.batcher().manager.num_used_blocks == 0
    assert len(engine.generate(PROMPTS[1], max_new_tokens=4).token_ids) == 4


def test_scores_match_the_contiguous_artifact(paged_artifact, make_tiny_artifact):
    ids = fxllm.load(paged_artifact).encode(PROMPTS[1])
    paged_logits = fxllm.load(paged_artifact).score(ids)
    contiguous = fxllm.load(make_tiny_artifact("llama")).score(ids)
    assert abs(paged_logits - contiguous).max() < 1e-4


def test_bad_budgets_and_sizes(paged_artifact, make_tiny_model, tmp_path):
    with pytest.raises(GenerationError, match="holds no KV block"):
        fxllm.load(paged_artifact, kv_cache_memory="1KB")
    with pytest.raises(GenerationError, match="cannot read 'lots'"):
        fxllm.load(paged_artifact, kv_cache_memory="lots")
    engine = fxllm.load(paged_artifact, kv_blocks=4)  # 16 tokens
    with pytest.raises(GenerationError, match="needs .* KV blocks, but the pool has 4"):
        engine.generate(PROMPTS[1], max_new_tokens=8)
    with pytest.raises(PipelineError, match="power of two"):
        fxllm.compile(make_tiny_model("llama"), tmp_path / "bad", passes="cleanup,kv-cache,paged:block_size=12")
    with pytest.raises(PipelineError, match=r"block_size 1073741824 is larger than the model's context \(256"):
        fxllm.compile(make_tiny_model("llama"), tmp_path / "huge", passes=f"cleanup,kv-cache,paged:block_size={2 ** 30}")
    assert not (tmp_path / "huge").exists()
    with pytest.raises(PipelineError, match="requires kv-cache"):
        fxllm.compile(make_tiny_model("llama"), tmp_path / "bad2", passes="cleanup,paged,kv-cache")
