"""Lint's incremental meta refresh: after every pass its values equal a full propagation's, and a change a pass
makes in the middle of the graph reaches every node downstream of it."""

from __future__ import annotations

import pytest
import torch

from fxllm.compiler.capture import capture
from fxllm.compiler.lint import LintError, lint
from fxllm.compiler.pass_manager import run_pipeline
from fxllm.compiler.pipeline import build_pipeline, parse_pipeline
from fxllm.compiler.program import Program
from fxllm.compiler.sources import load_model, resolve_source


def _metadata(program: Program) -> dict[str, object]:
    def describe(value):
        if isinstance(value, torch.Tensor):
            return (tuple(value.shape), value.dtype, value.stride())
        if isinstance(value, (list, tuple)):
            return tuple(describe(v) for v in value)
        return value

    return {node.name: describe(node.meta.get("val")) for node in program.graph.nodes}


def _full_refresh(program: Program) -> dict[str, object]:
    """The same graph in a fresh module (no propagation state, no recorded keys): everything propagated anew."""
    from fxllm.compiler.lint import refresh_meta

    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(program.graph, {}))
    module = torch.fx.GraphModule(program.graph_module, graph)
    copy = Program(module, program.spec, program.inputs, program.outputs)
    for node in copy.graph.nodes:
        node.meta = {}
    refresh_meta(copy)
    return _metadata(copy)


@pytest.mark.parametrize("passes", [
    "cleanup,gqa,fuse-projections,select-logits,kv-cache",
    "cleanup,gqa,fuse-projections,quantize:method=int4-rtn;group_size=32;zero_point=true,kv-cache,paged",
])
def test_incremental_refresh_equals_a_full_propagation_after_every_pass(passes, make_tiny_model):
    program = capture(load_model(resolve_source(make_tiny_model("llama")))).program
    steps = build_pipeline(parse_pipeline(passes))
    for step in steps:  # one pass at a time, comparing after each
        program, _ = run_pipeline(program, [step])
        assert _metadata(program) == _full_refresh(program), step.name


def test_a_changed_shape_reaches_every_node_downstream(make_tiny_model):
    """A rewrite that changes one node's shape in the middle of the graph, after a lint has recorded every value:
    the next lint propagates the change (here into a shape error at the residual add), it is not hidden by the
    values kept from before."""
    program = capture(load_model(resolve_source(make_tiny_model("llama")))).program
    lint(program)
    norm_weight = next(n for n in program.graph.nodes if n.op == "get_attr" and "layers.1" in str(n.target)
                       and "norm" in str(n.target))
    user = next(iter(norm_weight.users))
    with program.graph.inserting_before(user):
        shorter = program.graph.call_function(torch.ops.aten.slice.Tensor, (norm_weight, 0, 0, 8))
    user.replace_input_with(norm_weight, shorter)
    program.graph_module.recompile()
    with pytest.raises(LintError, match="shape propagation failed"):
        lint(program)
