"""Pipeline validation happens before any work and names the problem."""

from __future__ import annotations

import pytest

from fxllm.compiler.pass_registry import _REGISTRY, register_pass
from fxllm.compiler.pipeline import DEFAULT_PIPELINE, build_pipeline, parse_pipeline
from fxllm.errors import PipelineError


def test_default_pipeline_is_valid():
    steps = build_pipeline(parse_pipeline(None))
    assert [s.name for s in steps] == list(DEFAULT_PIPELINE)


def test_unknown_pass_is_named():
    with pytest.raises(PipelineError, match="unknown pass 'fuse-everything'.*available passes: .*kv-cache"):
        build_pipeline(parse_pipeline("cleanup,fuse-everything"))


def test_pass_applied_twice_is_rejected():
    """Named as listed twice (it was "'quantize' must run before anything that provides quantized")."""
    for passes, name in (("kv-cache,kv-cache", "kv-cache"), ("cleanup,quantize,quantize,kv-cache", "quantize")):
        with pytest.raises(PipelineError, match=f"pass '{name}' is listed twice"):
            build_pipeline(parse_pipeline(passes))


@pytest.fixture
def cache_reader_pass():
    @register_pass("test-needs-cache", requires=("kv-cache",))
    def needs_cache(program, *, factor: int = 2):
        """Test-only pass that needs a KV cache."""
        return program

    yield "test-needs-cache"
    del _REGISTRY["test-needs-cache"]


def test_missing_requirement_names_the_provider(cache_reader_pass):
    with pytest.raises(PipelineError, match=r"requires kv-cache.*cleanup → test-needs-cache.*put kv-cache before it"):
        build_pipeline(parse_pipeline(f"cleanup,{cache_reader_pass},kv-cache"))
    steps = build_pipeline(parse_pipeline(f"kv-cache,{cache_reader_pass}:factor=3"))
    assert steps[1].options == {"factor": 3}


def test_bad_options_are_rejected(cache_reader_pass):
    with pytest.raises(PipelineError, match="has no option 'speed'"):
        build_pipeline(parse_pipeline(f"kv-cache,{cache_reader_pass}:speed=9"))
    with pytest.raises(PipelineError, match="expected int, got 'two'"):
        build_pipeline(parse_pipeline(f"kv-cache,{cache_reader_pass}:factor=two"))
    with pytest.raises(PipelineError, match="not in the pipeline"):
        build_pipeline(parse_pipeline("kv-cache"), {"cleanup": {"x": "1"}})
    with pytest.raises(PipelineError, match="option 'factor' of '.*' is given twice"):
        parse_pipeline(f"kv-cache,{cache_reader_pass}:factor=3;factor=4")


@pytest.mark.parametrize("options, message", [  # the Python API's values, which no command-line text converts
    ({"paged": {"block_size": True}}, "expected int, got bool True"),
    ({"paged": {"block_size": 4.0}}, "expected int, got float 4.0"),
    ({"gqa": {"kv_heads": 1.0}}, "expected int, got float 1.0"),
    ({"quantize": {"method": "int4-rtn", "group_size": 32.0}}, "expected int, got float 32.0"),
    ({"quantize": {"method": 4}}, "expected str, got int 4"),
])
def test_python_option_values_of_the_wrong_type_are_refused(options, message):
    passes = ",".join(["cleanup", *options, "kv-cache"] if "paged" not in options else ["cleanup", "kv-cache", "paged"])
    with pytest.raises(PipelineError, match=message):
        build_pipeline(parse_pipeline(passes), options)


def test_pass_names_must_be_strings():
    with pytest.raises(PipelineError, match="passes must be pass names"):
        parse_pipeline(["cleanup", 3, "kv-cache"])


def test_empty_pipeline_is_rejected():
    with pytest.raises(PipelineError, match="empty"):
        parse_pipeline(" , ")


@pytest.mark.parametrize("text, position", [("cleanup,,kv-cache", 2), ("cleanup,kv-cache,", 3), (" ,cleanup", 1)])
def test_an_empty_entry_in_the_pass_list_is_refused_not_skipped(text, position):
    with pytest.raises(PipelineError, match=f"has an empty entry at position {position}$"):
        parse_pipeline(text)


def test_an_exact_pass_that_changes_tokens_fails_the_compile(make_tiny_model):
    import torch

    from fxllm.compiler.capture import capture
    from fxllm.compiler.pass_manager import PassFailure, run_pipeline
    from fxllm.compiler.sources import load_model, resolve_source

    @register_pass("test-breaks-logits")
    def breaks_logits(program):
        """Test-only pass claiming exactness while reversing the logits."""
        output = program.output_node()
        logits = output.args[0][0]
        with program.graph.inserting_before(output):
            flipped = program.graph.call_function(torch.ops.aten.neg.default, (logits,))
        output.args = ((flipped, *output.args[0][1:]),)
        return program

    try:
        program = capture(load_model(resolve_source(make_tiny_model("llama")))).program
        with pytest.raises(PassFailure, match="'test-breaks-logits' should be exact but changed"):
            run_pipeline(program, build_pipeline(parse_pipeline("test-breaks-logits")))
    finally:
        del _REGISTRY["test-breaks-logits"]


def test_an_exact_pass_that_moves_logits_past_float_rounding_fails_the_compile(make_tiny_model):
    """Greedy tokens alone let through a rewrite that changed the math slightly (a kv-cache pass that kept a
    sequence-length value of the uncached graph moved a tiny model's logits by 3.6e-3 and its greedy tokens only
    after the drift sample's 16): a shift of 1% of the logits' scale, every greedy token kept, fails too."""
    import torch

    from fxllm.compiler.capture import capture
    from fxllm.compiler.pass_manager import PassFailure, run_pipeline
    from fxllm.compiler.sources import load_model, resolve_source

    @register_pass("test-shifts-logits")
    def shifts_logits(program):
        """Test-only pass claiming exactness while scaling the logits by 1.01 (the argmax unchanged)."""
        output = program.output_node()
        logits = output.args[0][0]
        with program.graph.inserting_before(output):
            scaled = program.graph.call_function(torch.ops.aten.mul.Tensor, (logits, 1.01))
        output.args = ((scaled, *output.args[0][1:]),)
        return program

    try:
        program = capture(load_model(resolve_source(make_tiny_model("llama")))).program
        with pytest.raises(PassFailure, match=r"'test-shifts-logits' should be exact but moved the logits by more "
                                              r"than float rounding \(0.001 of their scale"):
            run_pipeline(program, build_pipeline(parse_pipeline("test-shifts-logits")))
    finally:
        del _REGISTRY["test-shifts-logits"]


@pytest.mark.parametrize("pipeline, options, message", [
    ("cleanup,quantize,kv-cache", {"quantize": {"method": "int4-gptq", "calib": "no-such-text.txt"}},
     "calibration text 'no-such-text.txt' does not exist"),
    ("cleanup,quantize,kv-cache", {"quantize": {"method": "int4-awq", "calib": "."}}, "'.' is a directory"),
    ("cleanup,quantize,kv-cache", {"quantize": {"method": "int5"}}, "unknown quantize method 'int5'"),
    ("cleanup,quantize,kv-cache", {"quantize": {"method": "int4-rtn", "group_size": "48"}}, "power of two >= 16"),
    ("cleanup,kv-cache,paged", {"paged": {"block_size": "12"}}, "block_size must be a power of two"),
])
def test_pass_options_are_checked_when_the_pipeline_is_built(pipeline, options, message):
    """Options a pass would refuse fail when the pipeline is built (compile_model does it before loading the
    model), not after minutes of loading, capture and earlier passes."""
    with pytest.raises(PipelineError, match=message):
        build_pipeline(parse_pipeline(pipeline), options)


@pytest.mark.parametrize("quant, quant_options, pass_options, flag", [
    ("int8", {}, {"method": "int4-rtn"}, "--quant int8 and --pass-option quantize.method=int4-rtn"),
    ("int4-rtn", {"group_size": 64}, {"group_size": "32"}, "--group-size 64 and --pass-option quantize.group_size=32"),
    ("int8", {"lm_head": "int4"}, {"lm_head": "int8"}, "--quant-lm-head int4 and --pass-option quantize.lm_head"),
])
def test_a_quantize_option_given_twice_is_refused(quant, quant_options, pass_options, flag):
    """--quant and its flags set the quantize pass's options; --pass-option setting one of them too was silently
    overridden. Options they do not set still pass through."""
    from fxllm.compiler.pipeline import place_quantization

    with pytest.raises(PipelineError, match=f"given twice \\({flag}.*give it once"):
        place_quantization(None, {"quantize": pass_options}, quant, quant_options)
    _, options = place_quantization(None, {"quantize": {"samples": "2"}}, quant, quant_options)
    assert options["quantize"] == {"samples": "2", **quant_options, "method": quant}
