"""Target `ort` legalization (compiler/targets/ort): every step is checked against the standard form it rewrites,
on the same inputs — identical greedy tokens, logits within float noise — and for the form it produces."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

import fxllm
from fxllm.compiler.capture import capture
from fxllm.compiler.pass_manager import run_pipeline
from fxllm.compiler.pipeline import build_pipeline, parse_pipeline, place_quantization
from fxllm.compiler.sources import load_model, resolve_source
from fxllm.compiler.targets.onnx_export import lower_to_onnx
from fxllm.compiler.targets.ort import STEP_NAMES
from fxllm.compiler.targets.tensorrt_audit import audit_file
from fxllm.errors import PipelineError
from fxllm.runtime.backend import StepFeeds
from fxllm.runtime.backend_ort import OrtBackend
from fxllm.runtime.contract import (ATTENTION_MASK, INPUT_IDS, KV_CAPACITY_PER_ROW, LOGITS_INDEX, POSITION_IDS,
                                    ModelIO)
from fxllm.runtime.kv_cache import SharedKVCache
from fxllm.runtime.model_runner import ModelRunner
from fxllm.runtime.request import SamplingParams
from tests.conftest import PROMPTS

QUANTIZED = "cleanup,gqa,fuse-projections,select-logits,quantize:{options},kv-cache"


def program_of(model: Path, passes: str | None = None):
    """The captured, rewritten program of a model directory or GGUF file (a GGUF keeps its blocks, as compile does)."""
    source = resolve_source(model)
    passes, options = place_quantization(passes, None, gguf=bool(source.gguf_file))
    program = capture(load_model(source)).program
    if source.gguf_file:
        program.source_file = source.directory / source.gguf_file
    program, _ = run_pipeline(program, build_pipeline(parse_pipeline(passes), options))
    return program


def ops(path: Path) -> Counter:
    return Counter(node.op_type for node in onnx.load(str(path), load_external_data=False).graph.node)


def greedy(path: Path, lowered, program, prompt: list[int], steps: int = 12) -> tuple[list[int], list[np.ndarray]]:
    """Prefill + `steps` greedy decode steps through the runtime's model runner (shared KV buffers bound by the
    ORT backend when the signature has them); → tokens and every step's logits."""
    io = ModelIO.from_signature(lowered.inputs, lowered.outputs)
    runner = ModelRunner(OrtBackend(path, threads=1, aliases=io.aliases), io, program.spec)
    cache = runner.new_cache()
    logits = [runner.step_one(cache, prompt, 0, all_logits=True)]
    tokens = [int(logits[-1][-1].argmax())]
    for _ in range(steps):
        logits.append(runner.step_one(cache, tokens[-1:], len(prompt) + len(tokens) - 1, all_logits=False))
        tokens.append(int(logits[-1][-1].argmax()))
    return tokens, logits


def assert_same_generation(standard, legalized, program, tokenizer, tolerance: float) -> None:
    for text in PROMPTS[:2]:
        ids = tokenizer(text)["input_ids"]
        want_tokens, want_logits = greedy(*standard, program, ids)
        got_tokens, got_logits = greedy(*legalized, program, ids)
        assert got_tokens == want_tokens
        assert max(float(np.abs(a - b).max()) for a, b in zip(got_logits, want_logits)) < tolerance


@pytest.fixture(scope="module")
def float_program(make_tiny_model):
    return program_of(make_tiny_model("llama"))


@pytest.fixture(scope="module")
def float_lowerings(float_program, tmp_path_factory):
    """The tiny llama's default pipeline lowered to the standard form and with every ort step."""
    directory = tmp_path_factory.mktemp("ort-legalization")
    result = {}
    for name, steps in (("standard", ()), ("legalized", None)):
        path = directory / f"{name}.onnx"
        result[name] = (path, lower_to_onnx(float_program, path, "ort", ort_steps=steps))
    return result


def test_group_query_attention_and_skip_norm_form(float_lowerings, float_program):
    path, lowered = float_lowerings["legalized"]
    counts = ops(path)
    layers = float_program.spec.num_layers
    assert lowered.legalized["group-query-attention"] == counts["GroupQueryAttention"] == layers
    assert lowered.legalized["skip-rms-norm"] == counts["SkipSimplifiedLayerNormalization"] == 2 * layers
    assert "Attention" not in counts and "Concat" not in counts and "Transpose" not in counts
    # attention-rotary: the rotary moved into the attention, which reads the fused q/k/v projection whole
    assert lowered.legalized["attention-rotary"] == layers and "RotaryEmbedding" not in counts
    assert "Split" not in counts  # the gate/up run as two MatMuls (split-projections)
    graph = onnx.load(str(path), load_external_data=False).graph
    attention = next(node for node in graph.node if node.op_type == "GroupQueryAttention")
    attributes = {a.name: onnx.helper.get_attribute_value(a) for a in attention.attribute}
    assert attributes["do_rotary"] == 1 and attention.input[1] == attention.input[2] == ""
    # the tables are a constant subgraph, folded by ONNX Runtime at load: its optimized model has no Cos/Sin left
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(path.with_suffix(".optimized.onnx"))
    ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    optimized = onnx.load(options.optimized_model_filepath, load_external_data=False).graph
    assert not {"Cos", "Sin"} & {node.op_type for node in optimized.node}
    tables = {i.name: i for i in optimized.initializer}
    table = next(node for node in optimized.node if node.op_type == "GroupQueryAttention").input[7]
    assert list(tables[table].dims) == [2 * float_program.spec.max_positions, float_program.spec.head_dim // 2]
    io = ModelIO.from_signature(lowered.inputs, lowered.outputs)
    assert io.shared_buffer and io.aliases["present_key_0"] == "past_key_0"
    # full attention everywhere: each row's tokens from buffer row 0, right-padded rows, no attention bias
    assert io.right_padded and all(len(node.input) < 11 or node.input[10] == ""
                                   for node in graph.node if node.op_type == "GroupQueryAttention")
    graph_inputs = {i.name: i for i in onnx.load(str(path), load_external_data=False).graph.input}
    assert graph_inputs["past_key_0"].type.tensor_type.shape.dim[2].dim_param == KV_CAPACITY_PER_ROW
    standard_path, standard = float_lowerings["standard"]
    assert not ModelIO.from_signature(standard.inputs, standard.outputs).shared_buffer
    assert all(node.domain in ("", "ai.onnx") for node in onnx.load(str(standard_path)).graph.node)


def test_legalized_form_generates_what_the_standard_form_does(float_lowerings, float_program, tokenizer):
    assert_same_generation(float_lowerings["standard"], float_lowerings["legalized"], float_program, tokenizer, 1e-4)


def test_rotary_tables_past_the_memory_bound_stay_per_step(float_program, tokenizer, tmp_path, monkeypatch):
    """Tables of 2 x context rows past MAX_TABLE_BYTES (a context of millions of tokens: ONNX Runtime would fold
    gigabytes at load) are not made: the rotaries keep computing per step, and generation is the same."""
    from fxllm.compiler.targets.ort import attention_rotary

    table_bytes = 2 * float_program.spec.max_positions * float_program.spec.head_dim * 4
    monkeypatch.setattr(attention_rotary, "MAX_TABLE_BYTES", table_bytes - 1)
    path = tmp_path / "per-step.onnx"
    lowered = lower_to_onnx(float_program, path, "ort")
    assert lowered.legalized["attention-rotary"] == 0 and lowered.legalized["group-query-attention"] > 0
    standard = tmp_path / "standard.onnx"
    assert_same_generation((standard, lower_to_onnx(float_program, standard, "ort", ort_steps=())), (path, lowered),
                           float_program, tokenizer, 1e-4)


def test_shared_buffer_grows_and_rolls_back(float_lowerings, float_program, tokenizer, monkeypatch):
    """A buffer smaller than the context is regrown with its rows kept; a truncated buffer (speculative rollback)
    is overwritten by the next step exactly like a cache that was cut."""
    monkeypatch.setattr(SharedKVCache, "MIN_CAPACITY", 4)
    ids = tokenizer(PROMPTS[1])["input_ids"]
    want, _ = greedy(*float_lowerings["standard"], float_program, ids, steps=20)
    got, _ = greedy(*float_lowerings["legalized"], float_program, ids, steps=20)
    assert got == want
    path, lowered = float_lowerings["legalized"]
    io = ModelIO.from_signature(lowered.inputs, lowered.outputs)
    runner = ModelRunner(OrtBackend(path, threads=1, aliases=io.aliases), io, float_program.spec)
    cache = runner.new_cache()
    runner.step_one(cache, ids + want[:5], 0, all_logits=False)
    cache.truncate(len(ids) + 2)  # reject three "draft" tokens
    logits = runner.step_one(cache, want[2:6], len(ids) + 2, all_logits=True)
    assert [int(row.argmax()) for row in logits] == want[3:7]


def test_decode_steps_copy_their_inputs_into_the_bound_arrays(float_lowerings, float_program, tokenizer):
    """A step input whose shape and dtype did not change is copied into the array the backend already bound: a
    decode step rebinds only its attention mask (which grows by one column), and it computes what the standard
    artifact computes; the caller's arrays stay the caller's (changing one after the call changes nothing bound)."""
    path, lowered = float_lowerings["legalized"]
    io = ModelIO.from_signature(lowered.inputs, lowered.outputs)
    backend = OrtBackend(path, threads=1, aliases=io.aliases)
    runner = ModelRunner(backend, io, float_program.spec)
    binds, bind = [], backend._binding.bind_input
    backend._binding.bind_input = lambda name, *rest: (binds.append(name), bind(name, *rest))[1]
    ids = tokenizer(PROMPTS[0])["input_ids"]
    want, want_logits = greedy(*float_lowerings["standard"], float_program, ids, steps=4)
    cache = runner.new_cache()
    runner.step_one(cache, ids, 0, all_logits=False)
    for step, token in enumerate(want[:4]):
        binds.clear()
        logits = runner.step_one(cache, [token], len(ids) + step, all_logits=False)
        np.testing.assert_allclose(logits[-1], want_logits[step + 1][-1], atol=1e-4)
        # the prefill's ids and positions were longer; its logits index ([last]) already had the decode's shape
        assert binds == ([ATTENTION_MASK] if step else [INPUT_IDS, POSITION_IDS, ATTENTION_MASK])
    fed = np.asarray([[want[4]]], dtype=np.int64)
    cache.reserve(len(ids) + 5)
    backend.run(StepFeeds({INPUT_IDS: fed, POSITION_IDS: np.asarray([[len(ids) + 4]], dtype=np.int64),
                           ATTENTION_MASK: np.ones((1, len(ids) + 5), dtype=np.int64),
                           LOGITS_INDEX: np.asarray([0], dtype=np.int64)}, cache.feeds()))
    fed[0, 0] = 7
    assert backend._bound[INPUT_IDS][0, 0] == want[4]


def test_bound_steps_write_fresh_logits_without_fetching_outputs(float_lowerings, float_program, tokenizer,
                                                                  monkeypatch):
    """On a shared-buffer artifact the logits' shape follows from the inputs' dims, so the backend writes them into
    an array of its own per call (nothing is fetched from ONNX Runtime afterwards) and a later step never
    overwrites logits an earlier one returned."""
    path, lowered = float_lowerings["legalized"]
    io = ModelIO.from_signature(lowered.inputs, lowered.outputs)
    backend = OrtBackend(path, threads=1, aliases=io.aliases)
    runner = ModelRunner(backend, io, float_program.spec)
    monkeypatch.setattr(backend._binding, "get_outputs", lambda: pytest.fail("outputs were fetched"))
    ids = tokenizer(PROMPTS[0])["input_ids"]
    want, want_logits = greedy(*float_lowerings["standard"], float_program, ids, steps=2)
    cache = runner.new_cache()
    first = runner.step_one(cache, ids, 0, all_logits=False)
    kept = first.copy()
    second = runner.step_one(cache, want[:1], len(ids), all_logits=False)
    assert not np.shares_memory(first, second)
    np.testing.assert_array_equal(first, kept)
    np.testing.assert_allclose(second[-1], want_logits[1][-1], atol=1e-4)


def test_unchanged_kv_buffers_are_not_rebound_and_two_caches_can_take_turns(float_lowerings, float_program,
                                                                             tokenizer, monkeypatch):
    """A step whose KV buffers (StepFeeds.state) are its previous call's binds only its own inputs; two caches
    stepped in turns on one backend (a scoring call beside the running batch) each keep their own tokens."""
    path, lowered = float_lowerings["legalized"]
    io = ModelIO.from_signature(lowered.inputs, lowered.outputs)
    backend = OrtBackend(path, threads=1, aliases=io.aliases)
    runner = ModelRunner(backend, io, float_program.spec)
    prompts = [tokenizer(text)["input_ids"] for text in PROMPTS[:2]]
    want = [greedy(path, lowered, float_program, ids, steps=6)[0] for ids in prompts]
    bound = []
    bind_input = backend._binding.bind_input
    monkeypatch.setattr(backend._binding, "bind_input", lambda name, *rest: (bound.append(name),
                                                                           bind_input(name, *rest)))

    def step(cache, ids, tokens):
        bound.clear()
        logits = runner.step_one(cache, tokens[-1:], len(ids) + len(tokens) - 1, all_logits=False)
        tokens.append(int(logits[-1].argmax()))

    caches = [runner.new_cache(), runner.new_cache()]
    got = [[int(runner.step_one(cache, ids, 0, all_logits=False)[-1].argmax())] for cache, ids in zip(caches, prompts)]
    for _ in range(5):
        for cache, ids, tokens in zip(caches, prompts, got):
            step(cache, ids, tokens)
            assert len(bound) > 2 * io.num_layers  # the other cache's call came between: its buffers are rebound
    step(caches[1], prompts[1], got[1])
    assert set(bound) <= {INPUT_IDS, POSITION_IDS, ATTENTION_MASK, LOGITS_INDEX}
    step(caches[0], prompts[0], got[0])
    assert got == want


def test_engine_batches_right_padded_rows_on_the_shared_buffer(make_tiny_model, tmp_path):
    """The whole runtime: batched prompts of different lengths (right padding on the legalized artifact, left on
    the standard one; rows leaving the batch) give the standard form's tokens, and prompt logprobs read each row's
    own positions."""
    model = make_tiny_model("llama")
    outputs, logprobs = {}, {}
    for name, steps in (("standard", ()), ("legalized", None)):
        fxllm.compile(model, tmp_path / name, ort_steps=steps)
        engine = fxllm.load(tmp_path / name)
        assert engine.io.right_padded == (name == "legalized")
        outputs[name] = [r.token_ids for r in engine.generate(PROMPTS, max_new_tokens=16)]
        core, tokens, logprobs[name] = engine.core, {}, {}
        for i, (prompt, most) in enumerate(zip(PROMPTS, [3, 16, 9, 12])):  # one batch, rows leaving it in turn
            core.add_request(str(i), engine.encode(prompt), SamplingParams(max_tokens=most, prompt_logprobs=1))
        while core.has_unfinished():
            for output in core.step():
                tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
                if output.prompt_logprobs:
                    logprobs[name][output.request_id] = [e.logprob for e in output.prompt_logprobs[1:]]
        outputs[name].append(tokens)
    assert len(logprobs["standard"]) == len(PROMPTS) and outputs["legalized"] == outputs["standard"]
    for i in logprobs["standard"]:
        assert np.allclose(logprobs["legalized"][i], logprobs["standard"][i], atol=1e-4)


def test_a_sliding_window_keeps_left_padding_and_the_bias(tokenizer, tmp_path):
    """A window lives in the attention mask, which GroupQueryAttention's per-row lengths cannot say: a sliding-window
    model keeps left-padded rows and the bias, and batches them right."""
    from transformers import AutoModelForCausalLM, MistralConfig

    from tests.conftest import TINY_COMMON

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(MistralConfig(**TINY_COMMON, sliding_window=6)).eval()
    model.save_pretrained(tmp_path / "hf")
    tokenizer.save_pretrained(tmp_path / "hf")
    outputs = {}
    for name, steps in (("standard", ()), ("legalized", None)):
        fxllm.compile(tmp_path / "hf", tmp_path / name, ort_steps=steps)
        engine = fxllm.load(tmp_path / name)
        outputs[name] = [r.token_ids for r in engine.generate(PROMPTS, max_new_tokens=12)]
    assert engine.io.shared_buffer and not engine.io.right_padded
    assert outputs["legalized"] == outputs["standard"]


def test_a_prefill_sizes_the_shared_buffer_for_its_generation(make_tiny_artifact, monkeypatch):
    """The prefill makes room for max_tokens more rows (up to doubling the prompt), so decode steps never move the
    buffers; a longer generation still grows them and generates the same tokens."""
    engine = fxllm.load(make_tiny_artifact("llama"))
    engine.eos_token_ids = set()
    prompt = engine.encode(PROMPTS[1])
    want = engine.generate_ids([prompt], max_new_tokens=2 * len(prompt))[0].token_ids
    monkeypatch.setattr(SharedKVCache, "MIN_CAPACITY", 4)
    moves = []
    move = SharedKVCache._move
    monkeypatch.setattr(SharedKVCache, "_move", lambda cache, *args: (moves.append(cache.length), move(cache, *args)))
    short = engine.generate_ids([prompt], max_new_tokens=len(prompt))[0].token_ids
    assert moves == [0] and short == want[: len(prompt)]  # sized once, before the prompt's rows were written
    moves.clear()
    assert engine.generate_ids([prompt], max_new_tokens=2 * len(prompt))[0].token_ids == want
    # the short generation's buffers are reused (room for one prompt's length of tokens), then one doubling
    assert len(moves) == 1 and moves[0] > len(prompt)


def test_a_finished_generation_leaves_its_shared_buffers_to_the_next(make_tiny_artifact, monkeypatch):
    """The next prefill of the same batch size writes into the previous generation's buffers (zeroed, still bound:
    no fresh allocation) and generates what a fresh engine does; another batch size gets buffers of its own, and a
    long generation's buffers are not kept for a short one."""
    artifact = make_tiny_artifact("llama")
    fresh, engine = fxllm.load(artifact), fxllm.load(artifact)
    for e in (fresh, engine):
        e.eos_token_ids = set()
    prompts = [engine.encode(text) for text in PROMPTS[:2]]
    runner = engine.runner

    def buffers() -> list[int]:
        return [a.ctypes.data for a in runner._cache.keys + runner._cache.values]

    engine.generate_ids([prompts[0]], max_new_tokens=8)
    first = buffers()
    assert engine.generate_ids([prompts[1]], max_new_tokens=8)[0].token_ids == \
        fresh.generate_ids([prompts[1]], max_new_tokens=8)[0].token_ids
    assert buffers() == first
    batched = engine.generate_ids(prompts, max_new_tokens=8)
    assert buffers() != first and [r.token_ids for r in batched] == \
        [r.token_ids for r in fresh.generate_ids(prompts, max_new_tokens=8)]
    monkeypatch.setattr(SharedKVCache, "MIN_CAPACITY", 4)  # the tiny model's 256 positions fit the default
    engine.generate_ids([prompts[0]], max_new_tokens=128)
    grown = buffers()
    engine.generate_ids([prompts[0]], max_new_tokens=4)
    assert buffers() != grown


def test_shared_cache_row_and_column_edits_match_the_growing_cache():
    """select_rows / drop_leading / truncate on the shared buffer keep exactly what the growing cache keeps."""
    from fxllm.runtime.kv_cache import ContiguousKVCache

    rng = np.random.default_rng(0)
    keys = [rng.standard_normal((3, 2, 7, 4)).astype(np.float32) for _ in range(2)]
    growing = ContiguousKVCache([k.copy() for k in keys], [k + 1 for k in keys])
    shared = SharedKVCache.empty(2, 3, 2, 4)
    shared.reserve(7)
    for buffer, k in zip(shared.keys + shared.values, keys + [k + 1 for k in keys]):
        buffer[:, :, :7] = k
    shared.update({})
    for edit in (lambda c: c.select_rows([2, 0]), lambda c: c.drop_leading(3), lambda c: c.truncate(2)):
        edit(growing), edit(shared)
        assert shared.length == growing.length
        for a, b in zip(shared.keys + shared.values, growing.keys + growing.values):
            np.testing.assert_array_equal(a[:, :, :shared.length], b)


@pytest.fixture(scope="module")
def asymmetric_program(make_tiny_model):
    return program_of(make_tiny_model("llama"),
                      QUANTIZED.format(options="method=int4-rtn;zero_point=true;group_size=32"))


def test_int4_zero_points_replace_the_offset_term(asymmetric_program, tmp_path, tokenizer):
    standard = (tmp_path / "std.onnx", None)
    standard = (standard[0], lower_to_onnx(asymmetric_program, standard[0], "ort", ort_steps=()))
    path = tmp_path / "zp.onnx"
    legalized = (path, lower_to_onnx(asymmetric_program, path, "ort", ort_steps=("int4-zero-points",)))
    assert legalized[1].legalized["int4-zero-points"] == 2 * 4  # qkv, o, gate+up, down per layer
    model = onnx.load(str(path), load_external_data=False)
    counts = ops(path)
    assert "ReduceSum" not in counts and ops(standard[0])["ReduceSum"] == 8
    initializers = {i.name: i for i in model.graph.initializer}
    for node in (n for n in model.graph.node if n.op_type == "DequantizeLinear"):
        assert len(node.input) == 3
        assert {initializers[node.input[i]].data_type for i in (0, 2)} == {onnx.TensorProto.UINT4}
    # float activations in both: (u - z)·s against c·s + s·(8 - z), the same numbers up to rounding
    assert_same_generation(standard, legalized, asymmetric_program, tokenizer, 1e-3)


def test_tied_quantized_head_fuses_into_matmulnbits(tmp_path):
    """A GGUF's tied Q8_0 token_embd is the lm_head's weight and the embedding's table in one initializer: only the
    untie step lets ONNX Runtime fuse the lm_head's DequantizeLinear → MatMul (checked in its optimized model)."""
    from tests.test_gguf_exact import write_tiny_gguf

    from fxllm.compiler.sources import load_tokenizer

    path = write_tiny_gguf(tmp_path / "tiny.gguf", "Q4_0", embedding="Q8_0")
    program, tokenizer = program_of(path), load_tokenizer(resolve_source(path))  # the file's own small vocabulary
    lowerings = {}
    for name, steps in (("standard", ()), ("untied", ("untie-quantized-head",))):
        path = tmp_path / f"{name}.onnx"
        lowerings[name] = (path, lower_to_onnx(program, path, "ort", ort_steps=steps))
    assert lowerings["untied"][1].legalized["untie-quantized-head"] == 2  # its codes and its scales

    def optimized_ops(path: Path) -> Counter:
        options = ort.SessionOptions()
        options.optimized_model_filepath = str(path.with_suffix(".optimized.onnx"))
        options.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "4")
        ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        return ops(path.with_suffix(".optimized.onnx"))

    assert optimized_ops(lowerings["standard"][0])["MatMul"] == 1  # the lm_head: dequantized every step
    assert optimized_ops(lowerings["untied"][0])["MatMul"] == 0
    assert_same_generation(lowerings["standard"], lowerings["untied"], program, tokenizer, 1e-4)


def test_tensorrt_target_keeps_the_standard_form(float_program, tmp_path):
    path = tmp_path / "trt.onnx"
    lowered = lower_to_onnx(float_program, path, "tensorrt")
    assert lowered.legalized == {}
    assert all(node.domain in ("", "ai.onnx") for node in onnx.load(str(path)).graph.node)
    assert audit_file(path) == []


def test_unknown_steps_are_refused(make_tiny_model, tmp_path):
    with pytest.raises(PipelineError, match="unknown ort legalization step"):
        fxllm.compile(make_tiny_model("llama"), tmp_path / "x", ort_steps=("no-such-step",))
    with pytest.raises(PipelineError, match="applies to target 'ort' only"):
        fxllm.compile(make_tiny_model("llama"), tmp_path / "x", ort_steps=STEP_NAMES, target="tensorrt")


@pytest.mark.parametrize("quantize", [None, "method=int4-rtn;zero_point=true;group_size=32",
                                      "method=int4-rtn;zero_point=false;group_size=32"])
def test_split_projections_run_the_gate_and_up_as_two_matmuls(make_tiny_model, tmp_path, tokenizer, quantize):
    """The MLP's fused gate/up + Split becomes one MatMul per part (the same columns); the fused q/k/v, which
    GroupQueryAttention reads whole, stays fused."""
    program = program_of(make_tiny_model("llama"), None if quantize is None else QUANTIZED.format(options=quantize))
    before = [step for step in STEP_NAMES if step != "split-projections"]
    standard = (tmp_path / "fused.onnx", None)
    standard = (standard[0], lower_to_onnx(program, standard[0], "ort", ort_steps=tuple(before)))
    path = tmp_path / "split.onnx"
    legalized = (path, lower_to_onnx(program, path, "ort"))
    layers = program.spec.num_layers
    assert legalized[1].legalized["split-projections"] == layers
    counts, fused = ops(path), ops(standard[0])
    assert fused["Split"] == layers and "Split" not in counts
    assert counts["MatMul"] == fused["MatMul"] + layers and counts["GroupQueryAttention"] == layers
    if quantize is not None:
        assert counts["DequantizeLinear"] == fused["DequantizeLinear"] + layers
        model = onnx.load(str(path), load_external_data=False)
        initializers = {i.name: i for i in model.graph.initializer}
        kinds = {initializers[node.input[0]].data_type
                 for node in model.graph.node if node.op_type == "DequantizeLinear"}
        assert kinds == {onnx.TensorProto.UINT4 if "zero_point=true" in quantize else onnx.TensorProto.INT4}
    assert_same_generation(standard, legalized, program, tokenizer, 1e-5)
