"""Graph patterns shared by passes: recognising and building a repeat of K/V heads (transformers' repeat_kv)."""

from __future__ import annotations

import sys

import torch

aten = torch.ops.aten
Node = torch.fx.Node

RESHAPES = {aten.reshape.default, aten.view.default, aten._unsafe_view.default, aten.flatten.using_ints}
PASS_THROUGH = {aten.clone.default, aten.alias.default, aten.contiguous.default}


def is_identity_slice(node: Node) -> bool:
    """x[:, :, ...] as export writes it: slice(x, dim, 0, INT64_MAX) (or end None), step 1."""
    if node.op != "call_function" or node.target is not aten.slice.Tensor:
        return False
    start = node.args[2] if len(node.args) > 2 else node.kwargs.get("start", None)
    end = node.args[3] if len(node.args) > 3 else node.kwargs.get("end", None)
    step = node.args[4] if len(node.args) > 4 else node.kwargs.get("step", 1)
    return start in (0, None) and (end is None or (isinstance(end, int) and end >= sys.maxsize)) and step == 1


def skip_no_ops(node) -> Node:
    while isinstance(node, Node) and (is_identity_slice(node) or node.target in PASS_THROUGH):
        node = node.args[0]
    return node


def match_repeat_kv(node) -> tuple[Node, int] | None:
    """If `node` repeats the heads (dim 1) of a [B,H,S,D] tensor — reshape(expand(unsqueeze(x, 2))) or
    repeat_interleave(x, n, 1) — return (x, n); else None. The order (head h ← source head h // n) is the one
    attention's GQA grouping uses, so dropping the repeat is exact."""
    node = skip_no_ops(node)
    if not isinstance(node, Node) or node.op != "call_function":
        return None
    if node.target is aten.repeat_interleave.self_int and (node.args[2] if len(node.args) > 2 else None) == 1:
        return node.args[0], int(node.args[1])
    if node.target not in RESHAPES:
        return None
    expand = skip_no_ops(node.args[0])
    if not isinstance(expand, Node) or expand.target is not aten.expand.default:
        return None
    unsqueeze = skip_no_ops(expand.args[0])
    if not isinstance(unsqueeze, Node) or unsqueeze.target is not aten.unsqueeze.default or unsqueeze.args[1] != 2:
        return None
    groups = expand.args[1][2]
    if not isinstance(groups, int):
        return None
    return skip_no_ops(unsqueeze.args[0]), groups


def build_repeat_kv(graph: torch.fx.Graph, source: Node, groups: int) -> Node:
    """Insert flatten(expand(unsqueeze(source, 2), [-1, -1, groups, -1, -1]), 1, 2): shape-agnostic repeat_kv."""
    unsqueeze = graph.call_function(aten.unsqueeze.default, (source, 2))
    expand = graph.call_function(aten.expand.default, (unsqueeze, [-1, -1, groups, -1, -1]))
    return graph.call_function(aten.flatten.using_ints, (expand, 1, 2))


def call_arguments(node: Node) -> dict:
    """The arguments of a call to an OpOverload by schema name, defaults filled in (positional and keyword alike)."""
    schema = node.target._schema
    values = {}
    for index, argument in enumerate(schema.arguments):
        if index < len(node.args):
            values[argument.name] = node.args[index]
        elif argument.name in node.kwargs:
            values[argument.name] = node.kwargs[argument.name]
        elif argument.has_default_value():
            values[argument.name] = argument.default_value
    return values


# Elementwise ops a model may apply to its logits after the lm_head with scalar operands: scaling (Granite divides,
# Cohere multiplies), final soft-capping (Gemma 2/3: tanh(x / cap) * cap), dtype casts.
LOGIT_TRANSFORMS = {aten.div.Tensor, aten.div.Scalar, aten.mul.Tensor, aten.mul.Scalar, aten.tanh.default,
                    aten._to_copy.default, aten.to.dtype}


def logits_projection(output_value, projections) -> Node | None:
    """The lm_head behind the logits: `output_value` itself when it is a call to one of `projections`, or the
    projection reached through LOGIT_TRANSFORMS whose other operands are scalars; None otherwise."""
    node = skip_no_ops(output_value)
    while isinstance(node, Node) and node.op == "call_function":
        if node.target in projections:
            return node
        operands = [arg for arg in node.args if isinstance(arg, Node) and _rank(arg) != 0]
        if node.target not in LOGIT_TRANSFORMS or len(operands) != 1:
            return None
        node = skip_no_ops(operands[0])
    return None


def _rank(node: Node) -> int | None:
    """A node's tensor rank (0 for a scalar tensor), None for a non-tensor value (a SymInt) or unknown."""
    value = node.meta.get("val")
    return value.dim() if isinstance(value, torch.Tensor) else None
