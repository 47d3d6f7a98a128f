"""GGUF-exact compiles: a GGUF's own Q4_0 / Q4_1 / Q8_0 blocks become the artifact's int4/int8 blocks as stored.

Tiny random-weight Llama GGUF files are written with the `gguf` package (2 layers, hidden 64, SmolLM2's tokenizer
cut to 2,048 tokens: transformers parses a GGUF's vocabulary token by token). transformers' GGUF loading (dequantized to float32) is the reference: the artifact, run with float
activations, must give its greedy tokens and nearly its logits, while storing no more than the GGUF's bytes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import fxllm
from fxllm.compiler.pipeline import place_quantization
from fxllm.compiler.sources import load_model, load_tokenizer, resolve_source
from fxllm.compiler.targets.ort.group_query_attention import ROW_LENGTHS
from fxllm.errors import PipelineError
from tests.gguf_files import tiny_hf_model, write_gguf

LAYERS = 2
PROMPTS = ["The quick brown fox", "Paris is", "def fibonacci(n):"]


def write_tiny_gguf(path: Path, body: str, embedding: str = "Q8_0", exceptions: dict[str, str] | None = None,
                    seed: int = 0) -> Path:
    """A 2-layer Llama GGUF (tests/gguf_files.tiny_hf_model: hidden 64, a 2,048-token cut of SmolLM2's tokenizer):
    projections stored as `body`, token_embd (tied lm_head) as `embedding`, norms float32; `exceptions` maps
    tensor names to other types."""
    model_dir = tiny_hf_model("llama", path.parent / f"{path.stem}-hf", seed=seed,
                              overrides={"tie_word_embeddings": True})
    return write_gguf(model_dir, path, body, tensor_types={"token_embd.weight": embedding, **(exceptions or {})})


def gguf_tensor_bytes(path: Path) -> int:
    from gguf import GGUFReader

    return sum(int(t.n_bytes) for t in GGUFReader(path).tensors)


def greedy(engine, prompts: list[str], tokens: int = 24) -> list[list[int]]:
    engine.eos_token_ids = set()
    return [r.token_ids for r in engine.generate(prompts, max_new_tokens=tokens)]


def transformers_greedy(model, tokenizer, prompts: list[str], tokens: int = 24) -> list[list[int]]:
    out = []
    for prompt in prompts:
        ids = torch.tensor([tokenizer(prompt)["input_ids"]])
        with torch.no_grad():
            generated = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                       max_new_tokens=tokens, eos_token_id=None)
        out.append(generated[0, ids.shape[1]:].tolist())
    return out


@pytest.fixture(scope="module")
def q4_1_file(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.Q4_1.gguf", "Q4_1")


@pytest.fixture(scope="module")
def q4_1_artifact(q4_1_file, tmp_path_factory) -> Path:
    output = tmp_path_factory.mktemp("gguf-artifact") / "artifact"
    fxllm.compile(str(q4_1_file), output)
    return output


@pytest.mark.parametrize("body", ["Q4_1", "Q4_0", "Q8_0"])
def test_gguf_blocks_are_kept_exactly(body, q4_1_file, q4_1_artifact, tmp_path):
    """Default compile of a GGUF: greedy tokens equal transformers' float model's (dequantized from the same file),
    logits within float rounding, and the artifact's weights no larger than 1.1x the GGUF's tensors."""
    import onnx

    path = q4_1_file if body == "Q4_1" else write_tiny_gguf(tmp_path / f"tiny.{body}.gguf", body)
    artifact = q4_1_artifact if body == "Q4_1" else tmp_path / "artifact"
    if body != "Q4_1":
        fxllm.compile(str(path), artifact)
    source = resolve_source(str(path))
    model = load_model(source)
    engine = fxllm.load(artifact, int8_activations=False)
    assert greedy(engine, PROMPTS) == transformers_greedy(model, load_tokenizer(source), PROMPTS)
    ids = engine.tokenizer.encode(PROMPTS[1])
    with torch.no_grad():
        expected = model(torch.tensor([ids])).logits[0].numpy()
    assert abs(engine.score(ids) - expected).max() < 1e-3
    manifest = engine.manifest.data
    assert "quantized" in manifest["facts"] and any("keep" in note for note in manifest["spec"]["notes"])
    # the weights (external data) at the GGUF's size; the graph file holds no float copy of a matrix either (the
    # smallest, a float32 [2048, 64] embedding, would be 512 KiB). At this size the graph's own bytes are a large
    # share, so the two are bounded apart; on SmolLM2 the whole artifact is within 10% (benchmarks/gguf_exact.py).
    files = manifest["files"]
    assert files["model.onnx.data"]["bytes"] <= 1.1 * gguf_tensor_bytes(path)
    assert files["model.onnx"]["bytes"] < 256 * 1024
    graph = onnx.load(str(artifact / "model.onnx"), load_external_data=False).graph
    types = {i.name: i.data_type for i in graph.initializer}
    codes = [types[n.input[0]] for n in graph.node if n.op_type == "DequantizeLinear" and n.input[0] in types]
    bits = onnx.TensorProto.INT8 if body == "Q8_0" else onnx.TensorProto.INT4
    # per layer qkv, o, gate, up, down (split-projections; Q4_1's gate/up keep one MatMul, its offset term reads
    # their sum) + the Q8_0 lm_head
    projections = 4 if body == "Q4_1" else 5
    assert codes.count(bits) == LAYERS * projections + (body == "Q8_0") and onnx.TensorProto.INT8 in codes
    # the embedding reads the lm_head's codes (on the ort target through a Reshape, see untie-quantized-head)
    reshaped = {n.output[0]: n.input[0] for n in graph.node if n.op_type == "Reshape" and n.input[0] in types}
    gathered = [reshaped.get(n.input[0], n.input[0]) for n in graph.node if n.op_type == "Gather"]
    assert {types[name] for name in gathered if name in types} == {onnx.TensorProto.INT8}
    offset_sums = [n for n in graph.node if n.op_type == "ReduceSum" and n.name != ROW_LENGTHS]
    assert len(offset_sums) == (LAYERS * 4 if body == "Q4_1" else 0)


def test_unmapped_gguf_types_fall_back_to_float_with_a_warning(tmp_path, capfd):
    path = write_tiny_gguf(tmp_path / "tiny.mixed.gguf", "Q4_0", exceptions={"blk.1.ffn_down.weight": "Q5_0"})
    report = fxllm.compile(str(path), tmp_path / "artifact")
    assert "1 GGUF tensors of type Q5_0 have no exact form" in capfd.readouterr().err
    record = next(r for r in report.records if r.name == "quantize")
    (name, kind), = record.diagnostics["fallbacks"].items()
    assert name.endswith("model.layers.1.mlp.down_proj.weight") and kind == "Q5_0"
    engine = fxllm.load(tmp_path / "artifact", int8_activations=False)
    source = resolve_source(str(path))
    assert greedy(engine, PROMPTS[:1]) == transformers_greedy(load_model(source), load_tokenizer(source), PROMPTS[:1])


def test_tensorrt_form_of_gguf_blocks_audits_and_matches_ort(q4_1_file, q4_1_artifact, tmp_path):
    from fxllm.compiler.targets.tensorrt_audit import audit_file

    report = fxllm.compile(str(q4_1_file), tmp_path / "trt", target="tensorrt")
    assert audit_file(tmp_path / "trt") == []
    # the Q8_0 token_embd (tied lm_head) is a blocked INT8 dequantize: passed, but said to be unverified
    assert any(note.startswith("unverified for TensorRT") and "blocked INT8" in note for note in report.notes)
    trt_form = fxllm.load(tmp_path / "trt", int8_activations=False)
    ort_form = fxllm.load(q4_1_artifact, int8_activations=False)
    assert greedy(trt_form, PROMPTS) == greedy(ort_form, PROMPTS)


def test_requantize_and_quant_flags_on_gguf(q4_1_file, make_tiny_model, tmp_path):
    with pytest.raises(PipelineError, match="--requantize applies to GGUF sources only"):
        fxllm.compile(make_tiny_model("llama"), tmp_path / "a", requantize=True)
    with pytest.raises(PipelineError, match="kept exactly; add --requantize"):
        fxllm.compile(str(q4_1_file), tmp_path / "b", quant="int4-rtn")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    # what the library places (the same function the CLI's --quant / --requantize go through)
    assert place_quantization(None, None, gguf=True) == (
        "cleanup,gqa,fuse-projections,select-logits,quantize,kv-cache", {"quantize": {"method": "gguf"}})
    assert place_quantization(None, None, gguf=True, requantize=True) == (None, {})
    passes, options = place_quantization(None, None, "int4-gptq", {"group_size": 64, "zero_point": True}, gguf=True,
                                         requantize=True)
    assert "quantize,kv-cache" in passes and options["quantize"] == {"group_size": 64, "zero_point": True,
                                                                      "method": "int4-gptq"}
    with pytest.raises(PipelineError, match="needs a method"):
        place_quantization(None, None, None, {"group_size": 64})
    # an explicit pass list that quantizes a GGUF again (a bare quantize made a Q4_0 file int8) is refused
    for passes, options in (("cleanup,quantize,kv-cache", None), ("cleanup,quantize:method=int4-rtn,kv-cache", None),
                            ("cleanup,quantize,kv-cache", {"quantize": {"method": "int8"}})):
        with pytest.raises(PipelineError, match="but --passes quantizes them again"):
            place_quantization(passes, options, gguf=True)
    assert place_quantization("cleanup,quantize:method=gguf,kv-cache", None, gguf=True)[0].startswith("cleanup")
    assert place_quantization("cleanup,quantize,kv-cache", None, gguf=True, requantize=True)[0].startswith("cleanup")


def test_a_pass_list_without_quantize_says_the_gguf_becomes_float(q4_1_file, tmp_path, capfd):
    """A GGUF compiled with --passes but no quantize pass is dequantized to float32 (several times the file's size):
    said in a note, printed and in the report, naming how to keep the blocks; not with --requantize, which says
    float is meant, nor with quantize:method=gguf in the list."""
    capfd.readouterr()
    report = fxllm.compile(str(q4_1_file), tmp_path / "float", passes="cleanup,gqa,kv-cache")
    err = capfd.readouterr().err
    assert "fxllm: note: this pass list has no quantize pass" in err and "quantize:method=gguf" in err
    assert any("dequantized to float32" in note for note in report.notes)
    for kwargs in ({"passes": "cleanup,gqa,kv-cache", "requantize": True},
                   {"passes": "cleanup,gqa,quantize:method=gguf,kv-cache"}):
        report = fxllm.compile(str(q4_1_file), tmp_path / str(len(kwargs)), **kwargs)
        assert "no quantize pass" not in capfd.readouterr().err
        assert not any("dequantized to float32" in note for note in report.notes)
    float_file = write_tiny_gguf(tmp_path / "tiny.F16.gguf", "F16", embedding="F16")  # nothing would be kept
    report = fxllm.compile(str(float_file), tmp_path / "f16", passes="cleanup,gqa,kv-cache")
    assert "no quantize pass" not in capfd.readouterr().err and not report.notes


def test_a_quiet_load_draws_no_gguf_dequantization_bar(q4_1_file, capsys):
    """transformers draws its GGUF dequantization bar with tqdm directly; with fxllm's bars off (stderr is not a
    terminal here) the load prints nothing, and the bar is transformers' own again afterwards."""
    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    original = gguf_utils.tqdm
    capsys.readouterr()
    load_model(resolve_source(str(q4_1_file)))
    assert "de-quantizing" not in capsys.readouterr().err
    assert gguf_utils.tqdm is original


def test_cli_flags_are_one_line_errors(q4_1_file, make_tiny_model, tmp_path, capsys):
    from fxllm.cli import main

    tiny = str(make_tiny_model("llama"))
    capsys.readouterr()  # the fixtures' progress bars
    for argv, message in [([tiny, "--requantize"], "--requantize applies to GGUF sources only"),
                          ([str(q4_1_file), "--quant", "int4-rtn"], "kept exactly; add --requantize"),
                          ([str(q4_1_file), "--group-size", "64"], "needs a method"),
                          ([tiny, "--quant", ""], "--quant needs a method"),  # it compiled unquantized
                          ([tiny, "--quant", "int8", "--group-size", "32"], "--group-size applies to the int4 methods"),
                          ([tiny, "--spec-k", "3"], "--spec-k sets how many tokens a draft proposes; it needs --draft"),
                          ([str(q4_1_file), "--pass-option", "quantize.lm_head=int8"], "does not apply"),
                          ([tiny, "--quant", "int8", "--pass-option", "quantize.method=int4-rtn"], "given twice")]:
        assert main(["compile", *argv, "-o", str(tmp_path / "out")]) == 1
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1
        assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("key, value", [("method", "int8"), ("lm_head", "int8"), ("embedding", "int4"),
                                        ("group_size", "64")])
def test_quantize_options_on_a_kept_gguf_are_refused(key, value, q4_1_file, tmp_path):
    """The default pipeline keeps a GGUF's blocks with method gguf, which would override or ignore the caller's
    quantize options: refused before any work (the library's policy, so fxllm.compile and the CLI alike), nothing
    written; method=gguf itself, and any option with --requantize, are accepted."""
    with pytest.raises(PipelineError, match=f"quantize.{key}={value} does not apply.*add --requantize --quant"):
        fxllm.compile(str(q4_1_file), tmp_path / "out", pass_options={"quantize": {key: value}})
    assert not (tmp_path / "out").exists()
    passes, options = place_quantization(None, {"quantize": {"method": "gguf"}}, gguf=True)
    assert "quantize,kv-cache" in passes and options == {"quantize": {"method": "gguf"}}
    if key != "method":
        _, options = place_quantization(None, {"quantize": {key: value}}, "int8" if key != "group_size" else
                                        "int4-rtn", gguf=True, requantize=True)
        assert options["quantize"][key] == value


def test_stacked_expert_blocks_dequantize_to_the_experts_weights():
    """GGUF expert tensors (each [E·out, in], gate then up) stacked as dequantize_experts stores them: a [Σout, E·in]
    weight whose expert e occupies inputs e·in..(e+1)·in; Q4_0 and Q4_1 parts share the Q4_1 form exactly."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    from fxllm.compiler.quant.gguf_exact import decode_blocks, shared_form, stack_experts

    experts, width, hidden = 3, 8, 64
    generator = torch.Generator().manual_seed(0)
    gate, up = (torch.randn(experts, width, hidden, generator=generator) for _ in range(2))
    parts, values = [], []
    for weight, kind in ((gate, "Q4_0"), (up, "Q4_1")):
        raw = quantize(weight.reshape(-1, hidden).numpy(), GGMLQuantizationType[kind])
        parts.append(decode_blocks(kind, np.asarray(raw), experts * width, hidden))
        values.append(parts[-1].dequantize().reshape(experts, width, hidden))
    stacked = stack_experts(parts, experts)
    assert stacked.type_name == "Q4_1" and stacked.codes.shape == (2 * width, experts * hidden)
    expected = torch.cat(values, 1)  # [E, 2·width, hidden]: transformers' gate_up_proj
    assert torch.equal(stacked.dequantize().reshape(2 * width, experts, hidden).transpose(0, 1), expected)
    assert [shared_form(t) for t in (["Q8_0"], ["Q4_0", "Q4_1"], ["Q8_0", "Q4_0"], ["Q4_0", "Q5_0"])] == [
        "Q8_0", "Q4_1", None, None]


@pytest.fixture(scope="module")
def moe_gguf(tmp_path_factory) -> Path:
    """A 2-layer Qwen3-MoE GGUF (4 experts): Q4_0 weights, layer 0's up experts Q4_1 (fused by transformers with
    its Q4_0 gate experts), layer 1's down experts Q5_0 (no exact form)."""
    directory = tmp_path_factory.mktemp("moe")
    return write_gguf(tiny_hf_model("qwen3moe", directory / "hf"), directory / "moe.gguf", "Q4_0",
                      tensor_types={"blk.0.ffn_up_exps.weight": "Q4_1", "blk.1.ffn_down_exps.weight": "Q5_0"})


def test_gguf_moe_experts_keep_their_blocks(moe_gguf, tmp_path, capfd):
    """Stacked expert tensors are kept as blocks like linears (one dequantize_experts per weight), not expanded to
    float32 silently; the one of a type with no exact form stays float with the warning other tensors get."""
    report = fxllm.compile(str(moe_gguf), tmp_path / "artifact")
    err = capfd.readouterr().err
    assert "1 GGUF tensors of type Q5_0 have no exact form" in err and "moe_experts_1 down_proj" in err
    assert "exact values, stored as float32" in err
    quantize = next(r for r in report.records if r.name == "quantize")
    assert list(quantize.diagnostics["fallbacks"].values()) == ["Q5_0"]
    notes = {row["weight"]: row["note"] for row in quantize.diagnostics["layers"] if "experts" in row["weight"]}
    assert notes == {"moe_experts.up (4 experts)": "gguf Q4_1 kept", "moe_experts.down (4 experts)": "gguf Q4_0 kept",
                     "moe_experts_1.up (4 experts)": "gguf Q4_0 kept"}
    assert all(row["weight_error"] < 1e-6 for row in quantize.diagnostics["layers"])
    source = resolve_source(str(moe_gguf))
    model = load_model(source)
    engine = fxllm.load(tmp_path / "artifact", int8_activations=False)
    assert greedy(engine, PROMPTS) == transformers_greedy(model, load_tokenizer(source), PROMPTS)
    # no float32 copy of an expert weight but the Q5_0 one; the kept ones are stored as INT4 blocks
    import onnx

    graph = onnx.load(str(tmp_path / "artifact" / "model.onnx"), load_external_data=False).graph
    floats = [i.name for i in graph.initializer if i.data_type == onnx.TensorProto.FLOAT and len(i.dims) > 1
              and torch.Size(i.dims).numel() >= 64 * 768]
    assert floats == ["gguf_experts_1_down_float"]
    codes = {i.name: i.data_type for i in graph.initializer if i.name.startswith("gguf_experts")
             and "codes" in i.name}
    assert len(codes) == 3 and set(codes.values()) == {onnx.TensorProto.INT4}


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory):
    """A Q4_0 Llama GGUF whose Q4_1 token_embd is the tied lm_head, with layer 0's attn_k Q5_0 (a fused q/k/v part
    with no exact form), layer 1's attn_k Q4_1 and ffn_up Q8_0 (fused with Q4_0 siblings), compiled once:
    (file, artifact, its quantize record, the warnings printed)."""
    directory = tmp_path_factory.mktemp("mixed")
    path = write_tiny_gguf(directory / "mixed.gguf", "Q4_0", embedding="Q4_1",
                           exceptions={"blk.0.attn_k.weight": "Q5_0", "blk.1.attn_k.weight": "Q4_1",
                                       "blk.1.ffn_up.weight": "Q8_0"})
    report = fxllm.compile(str(path), directory / "artifact")
    record = next(r for r in report.records if r.name == "quantize")
    return path, directory / "artifact", record, record.diagnostics["warnings"]


def _warning(warnings: list[str], text: str) -> str:
    return next(w for w in warnings if text in w)


def test_fused_projections_of_mixed_gguf_types(mixed_gguf):
    """A fused projection is one block form: Q4_0 and Q4_1 parts share the Q4_1 form (kept, exact); a part with no
    exact form, or Q8_0 beside Q4_0, leaves the whole projection float, and the warning names the fused weight,
    its parts' types and why, apart from the tensors that have no exact form at all."""
    path, artifact, record, warnings = mixed_gguf
    layers = {row["weight"]: row["note"] for row in record.diagnostics["layers"]}
    assert layers["model.model.layers.1.self_attn.q_proj+k_proj+v_proj"] == "gguf Q4_0+Q4_1 kept"
    assert all(row["weight_error"] < 1e-6 for row in record.diagnostics["layers"])
    fused = _warning(warnings, "are parts of fused projections whose parts share no block form")
    assert fused.startswith("4 GGUF tensors of type Q4_0, Q8_0 ")  # layer 0's q and v, layer 1's gate and up
    assert "model.model.layers.0.self_attn.q_proj+k_proj+v_proj (Q4_0/Q5_0/Q4_0)" in fused
    assert "without fuse-projections" in fused and "exact values, stored as float32" in fused
    assert _warning(warnings, "have no exact form").startswith("1 GGUF tensors of type Q5_0 ")
    source = resolve_source(str(path))
    engine = fxllm.load(artifact, int8_activations=False)
    assert greedy(engine, PROMPTS) == transformers_greedy(load_model(source), load_tokenizer(source), PROMPTS)


def test_a_q4_1_embedding_is_said_to_be_dequantized_exactly(mixed_gguf):
    """A Q4_1 token_embd has an exact form (the tied lm_head keeps its Q4_1 blocks); only the embedding lookup
    cannot read per-block offsets, and the warning says that rather than that Q4_1 has no exact form."""
    _, _, record, warnings = mixed_gguf
    embedding = _warning(warnings, "token_embd.weight")
    assert embedding.startswith("1 GGUF tensors of type Q4_1 are token embeddings") and "no exact form" not in embedding
    assert "Q8_0 and Q4_0 only" in embedding and "exact values, stored as float32" in embedding
    head = next(row for row in record.diagnostics["layers"] if row["weight"].endswith("lm_head"))
    assert head["note"] == "gguf Q4_1 kept"


def test_a_self_int4_draft_of_a_gguf(q4_1_file, q4_1_artifact, tmp_path):
    """`--draft self-int4` (docs/speculative.md's first command, on the built-in GGUF) compiled the whole target,
    then failed in the draft's compile with a message about --passes the user never gave: the draft's compile
    did not read the file as the target did. On a target keeping its own blocks it is refused before any work (the
    draft would decode about as fast as the target); with --requantize the draft is int4 of the float weights and
    decodes speculatively, the target's greedy tokens unchanged."""
    with pytest.raises(PipelineError, match=r"^--draft self-int4 quantizes the target's float weights .* add "
                                            r"--requantize for a float target"):
        fxllm.compile(str(q4_1_file), tmp_path / "refused", draft="self-int4")
    assert not (tmp_path / "refused").exists()
    fxllm.compile(str(q4_1_file), tmp_path / "float", requantize=True)
    fxllm.compile(str(q4_1_file), tmp_path / "spec", requantize=True, draft="self-int4", spec_k=3)
    speculative = fxllm.load(tmp_path / "spec")
    assert greedy(speculative, PROMPTS) == greedy(fxllm.load(tmp_path / "float"), PROMPTS)
    metrics = speculative.stats().speculative
    assert metrics.mode == "self-int4" and metrics.target_calls > 0
