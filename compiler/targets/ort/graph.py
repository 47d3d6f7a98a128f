"""Small onnx_ir helpers the `ort` legalization steps share: find a value's producer and constant, add nodes and
initializers stamped with the step that made them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import onnx_ir as ir

from fxllm.compiler.targets.tensorrt_audit import ORIGIN_KEY

MS_DOMAIN = "com.microsoft"  # ONNX Runtime's contrib ops


def producer(value: ir.Value | None, op_type: str | None = None) -> ir.Node | None:
    """The node computing `value` (of `op_type`, when given; default-domain ops only), or None."""
    if value is None:
        return None
    node = value.producer()
    if node is None or (op_type is not None and (node.op_type != op_type or node.domain not in ("", "ai.onnx"))):
        return None
    return node


def constant(value: ir.Value | None) -> np.ndarray | None:
    """The numpy value of an initializer or a Constant node's output, else None."""
    if value is None:
        return None
    if value.const_value is not None:
        return value.const_value.numpy()
    node = producer(value, "Constant")
    if node is not None and "value" in node.attributes:
        return node.attributes["value"].as_tensor().numpy()
    return None


def static_dims(value: ir.Value) -> tuple[Any, ...] | None:
    """The value's dims (ints for static ones, symbol names or None otherwise), or None without a shape."""
    if value.shape is None:
        return None
    return tuple(d if isinstance(d, int) else getattr(d, "value", None) for d in value.shape.dims)


class Builder:
    """Adds nodes in front of an anchor node (keeping the graph's order valid for the anchor's inputs), each stamped
    with `origin` so `fxllm inspect` and the TensorRT audit can tell which lowering step made it."""

    def __init__(self, graph: ir.Graph, origin: str):
        self.graph = graph
        self.origin = origin

    def node(self, op_type: str, inputs: Sequence[ir.Value | None], attributes: Mapping[str, Any] | None = None,
             *, before: ir.Node, domain: str = "", outputs: int = 1, name: str | None = None) -> ir.Node:
        node = ir.node(op_type, list(inputs), dict(attributes or {}), domain=domain, num_outputs=outputs,
                       name=name or None)
        node.metadata_props[ORIGIN_KEY] = self.origin
        self.graph.insert_before(before, node)
        return node

    def initializer(self, name: str, array: np.ndarray | ir.TensorProtocol) -> ir.Value:
        tensor = array if isinstance(array, ir.TensorProtocol) else ir.tensor(array, name=name)
        value = ir.Value(name=name, shape=ir.Shape(tensor.shape), type=ir.TensorType(tensor.dtype),
                         const_value=tensor)
        self.graph.register_initializer(value)
        return value


def int64_constant(build: Builder, prefix: str, values: int | list[int]) -> ir.Value:
    """An int64 initializer holding `values` (a scalar for an int), made once per prefix and value:
    `{prefix}_scalar_3`, `{prefix}_const_0_m1`."""
    flat = [values] if isinstance(values, int) else values
    kind = "scalar" if isinstance(values, int) else "const"
    name = f"{prefix}_{kind}_" + "_".join(str(v).replace("-", "m") for v in flat)
    if name not in build.graph.initializers:
        return build.initializer(name, np.asarray(values, dtype=np.int64))
    return build.graph.initializers[name]


def packed_4bit(values: np.ndarray, dtype: ir.DataType, name: str) -> ir.PackedTensor:
    """4-bit values (0..15 for UINT4, -8..7 for INT4) → an ONNX tensor of `dtype`, two per byte, the first element
    in the low nibble."""
    flat = (np.asarray(values).astype(np.int8).ravel() & 0x0F).astype(np.uint8)
    if flat.size % 2:
        flat = np.append(flat, np.uint8(0))
    return ir.PackedTensor((flat[0::2] | (flat[1::2] << 4)).astype(np.uint8), dtype, shape=np.shape(values), name=name)


def unique_name(graph: ir.Graph, stem: str) -> str:
    """`stem`, or `stem_N` for the first N that no initializer or value of the graph uses yet."""
    taken = set(graph.initializers)
    taken.update(v.name for v in graph.inputs)
    taken.update(v.name for node in graph for v in node.outputs)
    if stem not in taken:
        return stem
    index = 1
    while f"{stem}_{index}" in taken:
        index += 1
    return f"{stem}_{index}"


def remove_unused(model: ir.Model) -> None:
    """Drop nodes and initializers no output depends on any more (the pieces a rewrite bypassed)."""
    from onnx_ir.passes.common import RemoveUnusedNodesPass

    RemoveUnusedNodesPass()(model)


def take_place(old: ir.Value, new: ir.Value, aside: str) -> None:
    """`new` replaces `old` everywhere (graph outputs included) under old's name, dtype and shape; old is renamed
    `<name>_<aside>` so the two never share a name before the unused one is removed."""
    name = old.name
    new.dtype, new.shape = old.dtype, copy_shape(old)
    old.name = f"{name}_{aside}"
    old.replace_all_uses_with(new, replace_graph_outputs=True)
    new.name = name


def copy_shape(value: ir.Value) -> ir.Shape | None:
    """A new Shape equal to value's (shapes and types are objects: sharing one would let a later edit of the
    original, such as store_half_scales' dtype change, leak into the copy)."""
    return None if value.shape is None else ir.Shape(list(value.shape.dims))
