"""Step `attention-rotary`: the rotary embedding of q and k moves into GroupQueryAttention (`do_rotary`), and a
q/k/v Split of one fused projection goes with it (packed QKV), which is the form onnxruntime-genai exports.

before: q, k, v = Split(qkv); q' = RotaryEmbedding(q, cos, sin); k' = RotaryEmbedding(k, cos, sin)
        out = GroupQueryAttention(q', k', v, past_k, past_v, seqlens_k, total, -, -, -, bias)
after:  out = GroupQueryAttention(qkv, -, -, past_k, past_v, seqlens_k, total, cos_table, sin_table, -, bias,
                                  do_rotary=1)

Per layer that removes the Split and both RotaryEmbedding nodes (90 nodes for SmolLM2; on a 2-core CPU each
node costs dispatch time on top of its math). Without one Split feeding q, k and v, only the rotaries move.

Positions. The op rotates the token in cache row r by position r (it derives positions from seqlens_k). For an
unpadded row that is its position; a left-padded row's rows are all shifted by its padding, queries and keys
alike, and a rotary embedding depends only on the difference of the two positions, so the attention is the same
up to float rounding. The runtime therefore never drops leading cache columns of a shared buffer (that would
shift queries but not the keys already rotated), and the tables cover twice the model's context: a left-padded
row's rows can reach the longest prompt plus the longest generation.

Tables. cos_table[p] / sin_table[p] are what the graph computes for position p: the subgraph from `position_ids`
to the RotaryEmbeddings' cos and sin inputs, copied onto constant positions 0..n−1, which ONNX Runtime folds into
two tables when the session loads (the file gains a few nodes, not the tables). The step applies only when that
subgraph reads nothing but `position_ids` and constants and, evaluated at compile time, gives the same rows for
two different lengths (a table that depends on the sequence length, such as dynamic NTK scaling, is left
alone), the rotary spans the whole head and its half-width is a multiple of 8 (the op's rule). All or nothing:
when one attention does not match, the graph keeps its separate rotaries. `position_ids` stays a graph input
(unused after the step) so the calling convention does not change.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from fxllm.compiler.targets.ort.graph import MS_DOMAIN, Builder, constant, producer, static_dims, take_place
from fxllm.runtime.contract import POSITION_IDS

NAME = "attention-rotary"
# The cos and sin tables (2 x context rows) ONNX Runtime folds into memory when it loads the model: past this (a
# 512K-token context at head size 128) the rotaries keep computing per step instead.
MAX_TABLE_BYTES = 2**28


def apply(model: ir.Model, context) -> int:
    graph = model.graph
    positions = next((value for value in graph.inputs if value.name == POSITION_IDS), None)
    attentions = [n for n in graph if n.op_type == "GroupQueryAttention" and n.domain == MS_DOMAIN]
    if positions is None or not attentions:
        return 0
    sites = [_match(node) for node in attentions]
    if any(site is None for site in sites):
        return 0
    rows = 2 * int(context.spec.max_positions)
    if rows * max(site.head_dim for site in sites) * 4 > MAX_TABLE_BYTES:
        return 0  # ONNX Runtime would fold the tables into memory at load: keep the rotaries computing per step
    cones: dict[tuple[int, int], list[ir.Node] | None] = {}
    for site in sites:
        key = (id(site.cos), id(site.sin))
        if key not in cones:
            cones[key] = checked_cone(model, site.cos, site.sin, positions, rows, site.head_dim)
        if cones[key] is None:
            return 0
    build = Builder(graph, f"lowering:ort/{NAME}")
    tables: dict[tuple[int, int], tuple[ir.Value, ir.Value]] = {}
    for site in sites:
        key = (id(site.cos), id(site.sin))
        if key not in tables:
            tables[key] = table_subgraph(build, cones[key], (site.cos, site.sin), positions, rows, len(tables))
        _rewrite(build, site, *tables[key])
    return len(sites)


@dataclass
class _Site:
    attention: ir.Node
    q_rotary: ir.Node
    k_rotary: ir.Node
    packed: ir.Value | None  # the fused q/k/v projection, when one Split gives all three
    head_dim: int

    @property
    def cos(self) -> ir.Value:
        return self.q_rotary.inputs[1]

    @property
    def sin(self) -> ir.Value:
        return self.q_rotary.inputs[2]


def _match(attention: ir.Node) -> _Site | None:
    """q and k of this GroupQueryAttention are full-width RotaryEmbeddings (3 inputs) of one cos/sin pair that
    nothing else reads; `packed` is the fused projection when one Split gives q, k and v."""
    inputs = list(attention.inputs)
    if len(inputs) < 7 or any(v is not None for v in inputs[7:10]) or attention.attributes.get_int("do_rotary", 0):
        return None
    rotaries = [producer(inputs[i], "RotaryEmbedding") for i in (0, 1)]
    if any(r is None or len(r.inputs) != 3 or len(r.outputs[0].uses()) != 1 for r in rotaries):
        return None
    q_rotary, k_rotary = rotaries
    if q_rotary.inputs[1] is not k_rotary.inputs[1] or q_rotary.inputs[2] is not k_rotary.inputs[2]:
        return None
    interleaved = {r.attributes.get_int("interleaved", 0) for r in rotaries}
    if len(interleaved) != 1 or any(r.attributes.get_int("rotary_embedding_dim", 0) for r in rotaries):
        return None
    q_heads = attention.attributes.get_int("num_heads", 0)
    dims = static_dims(q_rotary.inputs[0])
    width = dims[-1] if dims else None
    if not q_heads or not isinstance(width, int) or width % q_heads:
        return None
    return _Site(attention, q_rotary, k_rotary, _packed_source(q_rotary, k_rotary, inputs[2]), width // q_heads)


def _packed_source(q_rotary: ir.Node, k_rotary: ir.Node, v: ir.Value | None) -> ir.Value | None:
    """x when q, k, v are the three outputs of Split(x, axis=-1) in that order and are read only here."""
    split = producer(q_rotary.inputs[0], "Split")
    if split is None or v is None or len(split.outputs) != 3:
        return None
    if list(split.outputs) != [q_rotary.inputs[0], k_rotary.inputs[0], v]:
        return None
    source = split.inputs[0]
    rank = len(source.shape) if source is not None and source.shape is not None else -1
    if rank != 3 or split.attributes.get_int("axis", 0) not in (-1, 2):
        return None
    if any(len(out.uses()) != 1 for out in split.outputs):
        return None
    return source


def checked_cone(model: ir.Model, cos: ir.Value, sin: ir.Value, positions: ir.Value, rows: int,
                  head_dim: int) -> list[ir.Node] | None:
    """The nodes computing cos and sin from position_ids, when ONNX Runtime gives [rows, head_dim/2] tables from
    them on positions 0..rows−1, equal in their first rows/2 rows to a run on rows/2 positions (else None: they read
    anything but position_ids and constants, depend on the length, or have the wrong width)."""
    if head_dim % 2 or (head_dim // 2) % 8:
        return None
    nodes = _cone(model.graph, (cos, sin), positions)
    if nodes is None:
        return None
    results = _evaluate(model, nodes, (cos, sin), (rows // 2, rows))
    if results is None:
        return None
    short, full = results
    for half, whole in zip(short, full):
        if whole.ndim == 3 and whole.shape[0] == 1:
            half, whole = half[0], whole[0]
        if whole.shape != (rows, head_dim // 2) or whole.dtype != np.float32:
            return None
        if not np.array_equal(half, whole[: rows // 2]):
            return None
    return nodes


def table_subgraph(build: Builder, nodes: list[ir.Node], outputs: tuple[ir.Value, ir.Value], positions: ir.Value,
                    rows: int, index: int) -> tuple[ir.Value, ir.Value]:
    """A copy of the cos/sin subgraph on the constant positions [[0, ..., rows−1]], reshaped to [rows, width]. Every
    input of the copy is constant, so ONNX Runtime folds it into the two tables when the session loads: the file
    holds a few nodes, not the tables (2 × context rows each)."""
    first = next(iter(build.graph))
    bounds = [build.initializer(f"rotary_table_{index}_{name}", np.asarray(value, dtype=np.int64))
              for name, value in (("start", 0), ("limit", rows), ("delta", 1), ("axes", [0]))]
    arange = build.node("Range", bounds[:3], before=first).outputs[0]
    table_positions = build.node("Unsqueeze", [arange, bounds[3]], before=first).outputs[0]
    mapped: dict[int, ir.Value] = {id(positions): table_positions}
    for node in nodes:
        copy = build.node(node.op_type, [None if v is None else mapped.get(id(v), v) for v in node.inputs],
                          dict(node.attributes), before=first, domain=node.domain,
                          outputs=len(node.outputs), name=f"{node.name}_rotary_table_{index}")
        for old, new in zip(node.outputs, copy.outputs):
            mapped[id(old)] = new
            if old.dtype is not None:
                new.dtype = old.dtype
    shape = build.initializer(f"rotary_table_{index}_shape", np.asarray([rows, -1], dtype=np.int64))
    tables = []
    for kind, value in zip(("cos", "sin"), outputs):
        table = build.node("Reshape", [mapped[id(value)], shape], before=first).outputs[0]
        table.name, table.dtype = f"rotary_{kind}_table_{index}", ir.DataType.FLOAT
        tables.append(table)
    return tables[0], tables[1]


def _cone(graph: ir.Graph, outputs: tuple[ir.Value, ...], positions: ir.Value) -> list[ir.Node] | None:
    """The nodes computing `outputs`, in graph order, when their only non-constant leaf is `positions`."""
    needed: set[int] = set()
    stack = list(outputs)
    seen: set[int] = set()
    while stack:
        value = stack.pop()
        if value is None or id(value) in seen:
            continue
        seen.add(id(value))
        if value is positions or value.const_value is not None:
            continue
        node = value.producer()
        if node is None:
            return None  # another graph input
        if id(node) not in needed:
            needed.add(id(node))
            stack.extend(node.inputs)
    if not needed or constant(outputs[0]) is not None:
        return None
    return [node for node in graph if id(node) in needed]


def _evaluate(model: ir.Model, nodes: list[ir.Node], outputs: tuple[ir.Value, ...],
              lengths: tuple[int, ...]) -> list[list[np.ndarray]] | None:
    """`outputs` from running `nodes` in one ONNX Runtime session on position_ids = [[0, ..., n−1]], per length n."""
    import onnx
    import onnxruntime as ort

    initializers, names = [], set()
    for node in nodes:
        for value in node.inputs:
            if value is not None and value.const_value is not None and value.name not in names:
                names.add(value.name)
                initializers.append(ir.serde.serialize_tensor(value.const_value))
                initializers[-1].name = value.name
    graph = onnx.helper.make_graph(
        [ir.serde.serialize_node(node) for node in nodes], "rotary_tables",
        [onnx.helper.make_tensor_value_info(POSITION_IDS, onnx.TensorProto.INT64, [1, None])],
        [onnx.helper.make_tensor_value_info(value.name, onnx.TensorProto.FLOAT, None) for value in outputs],
        initializers)
    opsets = [onnx.helper.make_opsetid(domain, version) for domain, version in model.opset_imports.items()]
    proto = onnx.helper.make_model(graph, opset_imports=opsets, ir_version=10)
    try:
        options = ort.SessionOptions()
        options.log_severity_level = 4  # a failure here only means "keep the separate rotaries": not the user's
        session = ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
        return [session.run(None, {POSITION_IDS: np.arange(n, dtype=np.int64)[None]}) for n in lengths]
    except Exception:  # a subgraph ONNX Runtime cannot run alone: keep the separate rotaries
        return None


def _rewrite(build: Builder, site: _Site, cos: ir.Value, sin: ir.Value) -> None:
    attention = site.attention
    inputs = list(attention.inputs) + [None] * (11 - len(attention.inputs))
    if site.packed is not None:
        q, k, v = site.packed, None, None
    else:
        q, k, v = site.q_rotary.inputs[0], site.k_rotary.inputs[0], inputs[2]
    attributes = {name: attr.value for name, attr in attention.attributes.items()}
    attributes |= {"do_rotary": 1, "rotary_interleaved": site.q_rotary.attributes.get_int("interleaved", 0)}
    new = build.node("GroupQueryAttention", [q, k, v, *inputs[3:7], cos, sin, *inputs[9:]], attributes,
                     before=attention, domain=MS_DOMAIN, outputs=len(attention.outputs),
                     name=f"{attention.name}_rotary")
    for old, value in zip(attention.outputs, new.outputs):
        take_place(old, value, "separate_rotary")
