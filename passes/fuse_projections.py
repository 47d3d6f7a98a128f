"""Pass `fuse-projections`: one matmul for the projections that read the same activation.

before: linear(x, Wq), linear(x, Wk), linear(x, Wv)   (and linear(x, Wgate), linear(x, Wup))
→ after: split(linear(x, cat[Wq; Wk; Wv]), [dq, dk, dv])   — fewer, larger GEMVs per decode step.
"""

from __future__ import annotations

import operator
from collections import defaultdict

import torch

from fxllm.compiler.pass_registry import register_pass
from fxllm.compiler.program import Program
from fxllm.compiler.projections import constant, drop_unused_attributes

aten = torch.ops.aten
FUSED_FROM = "fxllm_fused_from"


def _bias(node: torch.fx.Node):
    return node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")


def _fusable_groups(program: Program) -> list[list[torch.fx.Node]]:
    """Linear nodes grouped by (input, bias or not), with constant weights of one dtype and input width."""
    groups: dict[tuple, list[torch.fx.Node]] = defaultdict(list)
    for node in program.graph.nodes:
        if node.op != "call_function" or node.target is not aten.linear.default:
            continue
        weight = constant(program, node.args[1])
        bias = _bias(node)
        if weight is None or (bias is not None and constant(program, bias) is None):
            continue
        groups[(node.args[0], bias is not None, weight.dtype, weight.shape[1])].append(node)
    return [nodes for nodes in groups.values() if len(nodes) > 1]


@register_pass("fuse-projections", requires=("captured",), provides=("fused-projections",),
               forbids=("fused-projections", "quantized"))
def fuse_projections(program: Program) -> Program:
    """Merge linear layers that share an input into one linear followed by a split."""
    graph = program.graph
    for index, nodes in enumerate(_fusable_groups(program)):
        weights = [constant(program, n.args[1]) for n in nodes]
        has_bias = _bias(nodes[0]) is not None
        name = f"fused_projection_{index}"
        program.graph_module.register_buffer(f"{name}_weight", torch.cat(weights, 0).detach())
        if has_bias:
            biases = [constant(program, _bias(n)) for n in nodes]
            program.graph_module.register_buffer(f"{name}_bias", torch.cat(biases, 0).detach())
        first = nodes[0]
        with graph.inserting_before(first):
            args = [first.args[0], graph.get_attr(f"{name}_weight")]
            if has_bias:
                args.append(graph.get_attr(f"{name}_bias"))
            fused = graph.call_function(aten.linear.default, tuple(args))
            fused.meta[FUSED_FROM] = [str(n.args[1].target) for n in nodes]  # names for reports (quantize's dump)
            sizes = [w.shape[0] for w in weights]
            split = graph.call_function(aten.split_with_sizes.default, (fused, sizes, -1))
            parts = [graph.call_function(operator.getitem, (split, i)) for i in range(len(nodes))]
        for node, part in zip(nodes, parts):
            node.replace_all_uses_with(part)
            graph.erase_node(node)
    drop_unused_attributes(program)
    return program
