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

aten = torch.ops.aten


def _constant(program: Program, node) -> torch.Tensor | None:
    if not isinstance(node, torch.fx.Node) or node.op != "get_attr":
        return None
    value = program.graph_module
    for part in node.target.split("."):
        value = getattr(value, part)
    return value if isinstance(value, torch.Tensor) else None


def _bias(node: torch.fx.Node):
    return node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")


def _fusable_groups(program: Program) -> list[list[torch.fx.Node]]:
    """Linear nodes grouped by (input, bias or not), with constant weights of one dtype and input width."""
    groups: dict[tuple, list[torch.fx.Node]] = defaultdict(list)
    for node in program.graph.nodes:
        if node.op != "call_function" or node.target is not aten.linear.default:
            continue
        weight = _constant(program, node.args[1])
        bias = _bias(node)
        if weight is None or (bias is not None and _constant(program, bias) is None):
            continue
        groups[(node.args[0], bias is not None, weight.dtype, weight.shape[1])].append(node)
    return [nodes for nodes in groups.values() if len(nodes) > 1]


def _remove_attribute(program: Program, target: str) -> None:
    owner_path, _, name = target.rpartition(".")
    owner = program.graph_module.get_submodule(owner_path) if owner_path else program.graph_module
    delattr(owner, name)


@register_pass("fuse-projections", requires=("captured",), provides=("fused-projections",),
               forbids=("fused-projections", "quantized"))
def fuse_projections(program: Program) -> Program:
    """Merge linear layers that share an input into one linear followed by a split."""
    graph = program.graph
    for index, nodes in enumerate(_fusable_groups(program)):
        weights = [_constant(program, n.args[1]) for n in nodes]
        has_bias = _bias(nodes[0]) is not None
        name = f"fused_projection_{index}"
        program.graph_module.register_buffer(f"{name}_weight", torch.cat(weights, 0).detach())
        if has_bias:
            biases = [_constant(program, _bias(n)) for n in nodes]
            program.graph_module.register_buffer(f"{name}_bias", torch.cat(biases, 0).detach())
        first = nodes[0]
        with graph.inserting_before(first):
            args = [first.args[0], graph.get_attr(f"{name}_weight")]
            if has_bias:
                args.append(graph.get_attr(f"{name}_bias"))
            fused = graph.call_function(aten.linear.default, tuple(args))
            sizes = [w.shape[0] for w in weights]
            split = graph.call_function(aten.split_with_sizes.default, (fused, sizes, -1))
            parts = [graph.call_function(operator.getitem, (split, i)) for i in range(len(nodes))]
        for node, part in zip(nodes, parts):
            node.replace_all_uses_with(part)
            constants = [a for a in (node.args[1], _bias(node)) if isinstance(a, torch.fx.Node)]
            graph.erase_node(node)
            for constant in constants:
                if not constant.users:
                    target = constant.target
                    graph.erase_node(constant)
                    if not any(n.op == "get_attr" and n.target == target for n in graph.nodes):
                        _remove_attribute(program, target)
    return program
