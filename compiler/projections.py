"""Finding and rewriting the linear projection (or the slice of a fused one) that produces a tensor.

Used by passes that change weights per output feature, e.g. `gqa` regrouping K/V heads. Handles plain linears
(W [out, in]), Conv1D-style addmm (W [in, out], GPT-2) and fused projections followed by a split on the last dim.
"""

from __future__ import annotations

import operator
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import torch

aten = torch.ops.aten
Node = torch.fx.Node
SPLITS = {aten.split.Tensor, aten.split_with_sizes.default}
LAYOUT_OPS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.clone.default,
              aten.contiguous.default, aten.alias.default}


@dataclass(frozen=True)
class ProjectionSlice:
    projection: Node  # aten.linear (weight [out, in]) or aten.addmm (weight [in, out])
    start: int  # output features [start, stop) of the projection that reach the traced tensor
    stop: int
    split: Node | None  # the split that cuts the slice out of a fused projection, if any
    reshapes: tuple[Node, ...] = ()  # reshapes between the projection and the split (their last dim follows it)


def constant(program, node) -> torch.Tensor | None:
    if not isinstance(node, Node) or node.op != "get_attr":
        return None
    value = program.graph_module
    for part in node.target.split("."):
        value = getattr(value, part)
    return value if isinstance(value, torch.Tensor) else None


def _weight_and_bias(node: Node) -> tuple[Node, Node | None, bool]:
    """(weight get_attr, bias get_attr or None, output-features-are-rows)."""
    if node.target is aten.linear.default:
        bias = node.args[2] if len(node.args) > 2 else None
        return node.args[1], bias, True
    return node.args[2], node.args[0], False  # addmm(bias, x, W)


def split_sizes(split: Node) -> list[int]:
    if split.target is aten.split_with_sizes.default:
        return list(split.args[1])
    total = split.args[0].meta["val"].shape[split.args[2] if len(split.args) > 2 else 0]
    size = split.args[1]
    return [size] * (total // size) + ([total % size] if total % size else [])


def _on_data_path(program) -> set[Node]:
    """Nodes computed from the token ids (not from positions or constants alone)."""
    reached = {program.placeholder("input_ids")}
    for node in program.graph.nodes:
        if any(isinstance(a, Node) and a in reached for a in node.all_input_nodes):
            reached.add(node)
    return reached


def trace_projection(program, node: Node, max_steps: int = 64) -> ProjectionSlice | None:
    """Walk back from `node` through layout, rotary and split ops to the projection that computes it."""
    data = _on_data_path(program)
    found_split: tuple[Node, int, int] | None = None
    reshapes: list[Node] = []
    current = node
    for _ in range(max_steps):
        if not isinstance(current, Node) or current.op != "call_function":
            return None
        if current.target in (aten.linear.default, aten.addmm.default):
            weight, _, rows = _weight_and_bias(current)
            if constant(program, weight) is None:
                return None
            features = constant(program, weight).shape[0 if rows else 1]
            start, stop = (found_split[1], found_split[2]) if found_split else (0, features)
            return ProjectionSlice(current, start, stop, found_split[0] if found_split else None, tuple(reshapes))
        if current.target is operator.getitem and getattr(current.args[0], "target", None) in SPLITS:
            split = current.args[0]
            rank = split.args[0].meta["val"].dim()
            dim = split.args[2] if len(split.args) > 2 else 0
            if found_split or dim not in (-1, rank - 1):
                return None
            sizes = split_sizes(split)
            start = sum(sizes[: current.args[1]])
            found_split = (split, start, start + sizes[current.args[1]])
            current = split.args[0]
            continue
        if found_split and current.target not in LAYOUT_OPS:
            return None  # between a split and its projection only reshapes that keep the last dim are allowed
        if found_split and current.args[0].meta["val"].shape[-1] != current.meta["val"].shape[-1]:
            return None
        if found_split:
            reshapes.append(current)
        inputs = [a for a in current.args if isinstance(a, Node) and a in data]
        if not inputs and current.args and isinstance(current.args[0], (list, tuple)):
            inputs = [a for a in current.args[0] if isinstance(a, Node) and a in data]
        if not inputs:
            return None
        current = inputs[0]
    return None


def rewrite_projection_slices(program, slices: list[ProjectionSlice],
                              transform: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Replace each slice's output-feature rows of weight (and bias) by transform(rows); other slices of a fused
    projection are kept; a split after a fused projection gets the new sizes."""
    graph = program.graph
    by_projection: dict[Node, list[ProjectionSlice]] = defaultdict(list)
    for item in slices:
        if item not in by_projection[item.projection]:
            by_projection[item.projection].append(item)
    for index, (projection, items) in enumerate(by_projection.items()):
        weight_node, bias_node, rows = _weight_and_bias(projection)
        split = items[0].split
        if split is not None:
            sizes = split_sizes(split)
            bounds = [(sum(sizes[:i]), sum(sizes[: i + 1])) for i in range(len(sizes))]
        else:
            bounds = [(items[0].start, items[0].stop)]
        changed = {(item.start, item.stop) for item in items}

        def rebuild(tensor: torch.Tensor, output_rows: bool) -> tuple[torch.Tensor, list[int]]:
            matrix = tensor if output_rows else tensor.transpose(0, 1)
            pieces = [transform(matrix[a:b]) if (a, b) in changed else matrix[a:b] for a, b in bounds]
            merged = torch.cat(pieces, 0)
            return (merged if output_rows else merged.transpose(0, 1)).contiguous(), [p.shape[0] for p in pieces]

        new_weight, new_sizes = rebuild(constant(program, weight_node), rows)
        replacements = {weight_node: new_weight}
        if bias_node is not None:
            replacements[bias_node] = rebuild(constant(program, bias_node), True)[0]
        for old, tensor in replacements.items():
            name = f"regrouped_{index}_{'weight' if old is weight_node else 'bias'}"
            program.graph_module.register_buffer(name, tensor.detach())
            with graph.inserting_before(projection):
                projection.replace_input_with(old, graph.get_attr(name))
        old_total, new_total = sum(b - a for a, b in bounds), sum(new_sizes)
        for reshape in items[0].reshapes:
            if len(reshape.args) > 1 and isinstance(reshape.args[1], (list, tuple)) and reshape.args[1][-1] == old_total:
                reshape.args = (reshape.args[0], [*reshape.args[1][:-1], new_total], *reshape.args[2:])
        if split is not None:
            with graph.inserting_before(split):
                new_split = graph.call_function(aten.split_with_sizes.default, (split.args[0], new_sizes, -1))
            split.replace_all_uses_with(new_split)
            graph.erase_node(split)
    drop_unused_attributes(program)


def drop_unused_attributes(program) -> None:
    """Erase get_attr nodes nobody uses and delete the tensors no get_attr refers to any more."""
    graph = program.graph
    for node in [n for n in graph.nodes if n.op == "get_attr" and not n.users]:
        target = node.target
        graph.erase_node(node)
        if not any(n.op == "get_attr" and n.target == target for n in graph.nodes):
            owner_path, _, name = target.rpartition(".")
            owner = program.graph_module.get_submodule(owner_path) if owner_path else program.graph_module
            delattr(owner, name)
