"""Step `paged-attention`: a paged layer's attention reads the pool in place when the pool it is given is about
the size of what it reads, instead of gathering the context into a contiguous copy first.

before: past_k = Gather(Reshape(key_cache_i), rows); out = Attention(q, Concat(past_k, k), Concat(past_v, v), mask)
        → Transpose → Reshape [B, T, Hq·D]
after:  out = If(view_fits,
                 then: pool attention — q·key_cache_iᵀ over every slot of the pool input, ‖ q·kᵀ over the step's
                       own keys, under one additive bias, softmax, ·value_cache_i ‖ ·v (com.microsoft.FusedMatMul
                       reads the [slots, Hkv, D] pool through strides: nothing is copied),
                 else: the gathered form: past_k gathered as before, then com.microsoft.GroupQueryAttention
                       (q, k, v, past_k, past_v, seqlens_k = context_lens + T − 1, total = max + T): it places
                       the step's keys after each row's context in its own present copy and attends causally,
                       so the Concats, the mask and the Attention go — when one row or one token a row is fed
                       (the kernel's rule; a nested If), else and where a layer slides the Attention form above,
                       moved into the branch)
        Where the gathered form is GroupQueryAttention its If comes first — If(not view_fits and the kernel takes
        the step, GroupQueryAttention, If(view_fits, pool, Attention)) — so its path, the common one, runs one If
        (a subgraph execution, ~20 µs on 2 cores) instead of two.
        q, k and v enter in their [B, T, H·D] layout (their RotaryEmbedding runs there, as group-query-attention
        has it; new_key_i becomes that rotated k in its output layout) and the If returns [B, T, Hq·D]: no
        transpose of the step's rows that the pool form does not need (on 2 cores each small node costs
        microseconds).
packed: where q, k, v = RotaryEmbedding(Split(qkv)) of one fused projection and the rotary's cos/sin fold into
        tables (attention-rotary's rules), GroupQueryAttention takes qkv whole and rotates q and k itself
        (do_rotary), the If also returns new_key_i / new_value_i (out of the op's present, or the rotated k and v
        in their output layout), and the Split and rotaries run only in the branches that read them
        (_rewrite_packed).

The runtime passes the slice of the pool its batch's block tables span (runtime/paged_cache.py `feeds`), with the
tables relative to that slice. For one sequence whose blocks lie together that slice is exactly its context, so
a decode step reads each cached key and value once, as the contiguous artifact does; ONNX Runtime has no CPU
paged-attention kernel, and its ops cannot alias a gathered view, so this is the form that copies nothing. The
pool form scores every query against every slot of the slice (a batch of several sequences would score each
query against all of them), so it runs only when the slice holds at most twice the slots of the block table and
the step feeds at most 32 tokens (`view_fits`, computed once per step): larger batches keep the gather, and so
does a prefill, whose one copy of the context serves all its tokens (and whose new-token scores would be
quadratic here, where the Attention kernel is causal-aware). Where the gathered form is GroupQueryAttention (3
nodes a layer against the pool form's 16) the pool form also waits for 128 slots of context: below that the
copy costs less than the nodes (SmolLM2 at 64 tokens, measured).

The bias [B·T, slots + B·T] is built once per step (in an If of its own, skipped when the gather form runs): slot
s of the slice is visible to query (b, t) when block s // block_size appears in row b's table at a logical index
l with l·block_size + s % block_size < context_lens[b] (and, under a sliding window W, within W − 1 positions of
the query at context_lens[b] + t); a block listed twice (a released block's stand-in) is visible where any of its
entries is (an OR, computed as a product of the table's one-hot matrix with the per-entry visibility; a block
listed twice with both entries visible would be read once, a table the runtime never makes). The new
keys: query (b, t) sees (b, t') for t' ≤ t (and t − t' < W). Padding entries of a table are never visible.
All or nothing: when one attention does not match, the graph keeps the gathered form everywhere.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from fxllm.compiler.targets.ort.attention_rotary import checked_cone, table_subgraph
from fxllm.compiler.targets.ort.graph import MS_DOMAIN, Builder, int64_constant, producer, static_dims, take_place
from fxllm.compiler.targets.ort.group_query_attention import as_bsd, flat_consumer, kernel_takes_head_dim
from fxllm.compiler.targets.tensorrt_audit import ORIGIN_KEY
from fxllm.runtime.contract import BLOCK_TABLES, CONTEXT_LENS, INPUT_IDS, PAGED, POSITION_IDS, parse_cache_name

NAME = "paged-attention"
LOWEST = float(np.finfo(np.float32).min)
VIEW_SLACK = 2  # the pool form runs while the slice holds at most this many times the table's blocks
VIEW_MAX_ROWS = 32  # ... and the step feeds at most this many tokens (a prefill gathers: one copy for many rows)
VIEW_MIN_SLOTS = 128  # ... and, where the gathered form is GroupQueryAttention, the slice is at least this long


@dataclass
class Site:
    attention: ir.Node
    q: ir.Value  # [B, Hq, T, D]
    new: tuple[ir.Value, ir.Value]  # the step's k and v [B, Hkv, T, D]
    pools: tuple[ir.Value, ir.Value]  # key_cache_i, value_cache_i [blocks, block_size, Hkv, D]
    gathered: tuple[ir.Node, ir.Node, ir.Node, ir.Node]  # the two Gathers and the two Concats
    layer: int
    q_heads: int
    kv_heads: int
    head_dim: int
    scale: float


def apply(model: ir.Model, context) -> int:
    graph = model.graph
    found = paged_sites(graph)
    if found is None:
        return 0
    inputs, sites = found
    pool_dims = static_dims(sites[0].pools[0])
    block_size = pool_dims[1] if pool_dims else None
    if not isinstance(block_size, int):
        return 0
    windows = list(context.spec.sliding_windows) or [0] * context.spec.num_layers
    if any(site.layer >= len(windows) for site in sites):
        return 0
    build = Builder(graph, f"lowering:ort/{NAME}")
    first = next(iter(graph))
    # the gathered form as GroupQueryAttention: no sliding window to express, a head size its kernel takes
    gqa = not any(windows) and kernel_takes_head_dim(sites[0].head_dim)
    shared = _Shared(build, inputs, sites[0], block_size, first, gqa)
    biases = shared.biases(sorted({windows[site.layer] for site in sites}))
    tables = rotary_tables(model, build, sites, inputs, context) if gqa else None
    for site in sites:
        attention = site.attention
        q3 = as_bsd(build, site.q, site.q_heads, site.head_dim, attention)
        k3 = as_bsd(build, site.new[0], site.kv_heads, site.head_dim, attention)
        v3 = as_bsd(build, site.new[1], site.kv_heads, site.head_dim, attention)
        packed = packed_form(site, q3, k3, v3) if tables is not None else None
        if packed is not None:
            _rewrite_packed(build, site, shared, biases[windows[site.layer]], packed,
                            tables[id(packed.q_rotary.inputs[1])])
        else:
            _rewrite(build, site, shared, biases[windows[site.layer]], gqa, (q3, k3, v3))
    return len(sites)


def paged_sites(graph: ir.Graph) -> tuple[dict[str, ir.Value], list[Site]] | None:
    """The graph's inputs by name and every attention's Site, or None unless it is a paged graph whose every
    attention matches (the rewrites are all or nothing)."""
    inputs = {value.name: value for value in graph.inputs}
    if BLOCK_TABLES not in inputs or CONTEXT_LENS not in inputs or INPUT_IDS not in inputs:
        return None
    attentions = [n for n in graph if n.op_type == "Attention" and n.domain in ("", "ai.onnx")]
    sites = [match_site(node, inputs) for node in attentions]
    return (inputs, sites) if sites and all(site is not None for site in sites) else None


def match_site(attention: ir.Node, inputs: dict[str, ir.Value]) -> Site | None:
    """Attention(q, Concat(Gather(Reshape(key_cache_i), rows), k), Concat(Gather(Reshape(value_cache_i), rows), v),
    bool mask), 4D, no soft-capping."""
    if len(attention.inputs) != 4 or any(v is None for v in attention.inputs):
        return None
    attributes = attention.attributes
    if attributes.get_int("is_causal", 0) or attributes.get_int("qk_matmul_output_mode", 0) or \
            attributes.get_float("softcap", 0.0) or any(value.uses() for value in attention.outputs[1:]):
        return None
    q, k, v, mask = attention.inputs
    found = []
    for value, kind in ((k, "key"), (v, "value")):
        concat = producer(value, "Concat")
        if concat is None or len(concat.inputs) != 2 or concat.attributes.get_int("axis", 0) not in (2, -2):
            return None
        gather = producer(concat.inputs[0], "Gather")
        reshape = producer(gather.inputs[0], "Reshape") if gather is not None else None
        if reshape is None or gather.attributes.get_int("axis", 0) != 0:
            return None
        pool = reshape.inputs[0]
        role = parse_cache_name(pool.name or "")
        if pool.name not in inputs or role is None or role.cache != PAGED or role.kind != kind or not role.is_input:
            return None
        found.append((gather, concat, pool, concat.inputs[1], role.layer))
    (key_gather, key_concat, key_pool, new_k, layer), (value_gather, value_concat, value_pool, new_v, other) = found
    if layer != other or mask.dtype != ir.DataType.BOOL or q.dtype != ir.DataType.FLOAT:
        return None
    q_dims, k_dims = static_dims(q), static_dims(new_k)
    if q_dims is None or k_dims is None or len(q_dims) != 4 or len(k_dims) != 4:
        return None
    q_heads, head_dim, kv_heads = q_dims[1], q_dims[3], k_dims[1]
    if not all(isinstance(d, int) for d in (q_heads, head_dim, kv_heads)) or q_heads % kv_heads:
        return None
    scale = attributes.get_float("scale", 1 / math.sqrt(head_dim))
    return Site(attention, q, (new_k, new_v), (key_pool, value_pool), (key_gather, value_gather, key_concat,
                                                                         value_concat), layer, q_heads, kv_heads,
                head_dim, scale)


class _Shared:
    """Values every layer's rewrite reads, built once in front of the graph's first node: sizes, the If
    condition, the split sizes and the reshape targets."""

    def __init__(self, build: Builder, inputs: dict[str, ir.Value], site: Site, block_size: int, before: ir.Node,
                 gqa: bool):
        self.build, self.before, self.block_size = build, before, block_size
        self.tables, self.lens, self.pool = inputs[BLOCK_TABLES], inputs[CONTEXT_LENS], site.pools[0]
        node = self._node
        self.batch = node("Shape", [self.tables], {"start": 0, "end": 1})  # [1]
        self.width = node("Shape", [self.tables], {"start": 1, "end": 2})  # [1] table entries
        self.tokens = node("Shape", [inputs[INPUT_IDS]], {"start": 1, "end": 2})  # [1]
        self.blocks = node("Shape", [self.pool], {"start": 0, "end": 1})  # [1] blocks in the slice
        self.rows = node("Mul", [self.batch, self.tokens])  # [1] B·T
        self.slots = node("Mul", [self.blocks, self._int([block_size])])  # [1]
        fits = node("And", [node("LessOrEqual", [self.blocks, node("Mul", [self.width, self._int([VIEW_SLACK])])]),
                            node("LessOrEqual", [self.rows, self._int([VIEW_MAX_ROWS])])])
        if gqa:
            fits = node("And", [fits, node("GreaterOrEqual", [self.slots, self._int([VIEW_MIN_SLOTS])])])
        self.fits = node("Squeeze", [fits], name="paged_view_fits")
        if gqa:  # GroupQueryAttention's lengths: row b holds context_lens[b] + T keys after the step
            self.seqlens, self.total = kernel_lengths(node, self._int, self.lens, self.tokens, "paged_gqa")
            one = self._int([1])
            single = node("Or", [node("Equal", [self.batch, one]), node("Equal", [self.tokens, one])])
            # the outer If of a layer: GroupQueryAttention over the gathered past when the pool form does not run
            # and the kernel takes the step (one row, or one token a row), so that path (a short decode step, a
            # prefill, a batch of decoding rows) runs one If
            self.gqa_first = node("Squeeze", [node("And", [node("Not", [fits]), single])], name="paged_gqa_first")
        self._new_rows: dict[tuple[int, int], ir.Value] = {}
        self.split = node("Concat", [self.slots, self.rows], {"axis": 0})
        heads = site.q_heads
        self.flat_shape = node("Concat", [self.batch, self.tokens, self._int([heads * site.head_dim])], {"axis": 0})
        self.head_shape = self._int([0, 0, heads, site.head_dim])
        self.query_shape = self._int([-1, site.kv_heads, heads // site.kv_heads, site.head_dim])
        self.kv_shape = self._int([-1, site.kv_heads, 1, site.head_dim])

    def _node(self, op_type: str, inputs, attributes=None, name: str | None = None) -> ir.Value:
        return self.build.node(op_type, inputs, attributes, before=self.before, name=name).outputs[0]

    def new_rows(self, kv_heads: int, head_dim: int) -> ir.Value:
        """step_rows for these KV heads, made once."""
        key = (kv_heads, head_dim)
        if key not in self._new_rows:
            self._new_rows[key] = step_rows(self._node, self._int, self.lens, self.tokens, self.batch, kv_heads,
                                            head_dim, f"paged_gqa_new_rows_{kv_heads}_{head_dim}")
        return self._new_rows[key]

    def kv_head_shape(self, kv_heads: int, head_dim: int) -> ir.Value:
        return self._int([0, 0, kv_heads, head_dim])

    def _int(self, values: list[int]) -> ir.Value:
        return int64_constant(self.build, "paged_view", values)

    def biases(self, windows: list[int]) -> dict[int, ir.Value]:
        """One bias [B·T, slots + B·T] per sliding window (0: none), computed by an If that runs only when the
        pool form will (else empty)."""
        body = Body(self.build.origin, "paged_view_bias")
        visible = {window: self._visibility(body, window) for window in windows}
        zero = body.constant(np.asarray(0.0, dtype=np.float32))
        lowest = body.constant(np.asarray(LOWEST, dtype=np.float32))
        then_outputs = [body.node("Where", [visible[window], zero, lowest]) for window in windows]
        empty = Body(self.build.origin, "paged_view_no_bias")
        else_outputs = [empty.node("Identity", [empty.constant(np.zeros((0, 0), dtype=np.float32))])
                        for _ in windows]
        node = self.build.node("If", [self.fits], {"then_branch": body.graph("paged_view_bias", then_outputs),
                                                   "else_branch": empty.graph("paged_view_no_bias", else_outputs)},
                               before=self.before, outputs=len(windows), name="paged_view_bias")
        for window, value in zip(windows, node.outputs):
            value.name, value.dtype = f"paged_view_bias_w{window}", ir.DataType.FLOAT
        return dict(zip(windows, node.outputs))

    def _visibility(self, body: Body, window: int) -> ir.Value:
        """bool [B·T, slots + B·T] (see the module docstring)."""
        n, c = body.node, body.constant
        int64 = lambda *v: c(np.asarray(v, dtype=np.int64))  # noqa: E731
        zero, one = c(np.asarray(0, dtype=np.int64)), c(np.asarray(1, dtype=np.int64))
        scalar = lambda value: n("Squeeze", [value])  # noqa: E731
        bs = self.block_size
        # one-hot [B, blocks, width]: slice block j is row b's table entry l
        blocks = n("Range", [zero, scalar(self.blocks), one])
        onehot = n("Cast", [n("Equal", [n("Unsqueeze", [blocks, int64(1)]), n("Unsqueeze", [self.tables, int64(1)])])],
                   {"to": ir.DataType.FLOAT})
        positions = n("Reshape", [n("Range", [zero, n("Mul", [scalar(self.width), c(np.asarray(bs, np.int64))]), one]),
                                  int64(-1, bs)])  # [width, bs]: the logical position of entry l, offset o
        lens = n("Reshape", [self.lens, int64(-1, 1, 1, 1)])  # [B, 1, 1, 1]
        entry_visible = n("Less", [positions, lens])  # [B, 1, width, bs]
        steps = n("Range", [zero, scalar(self.tokens), one])  # [T]
        if window > 0:
            query = n("Add", [lens, n("Reshape", [steps, int64(1, -1, 1, 1)])])  # [B, T, 1, 1]
            near = n("Less", [n("Sub", [query, positions]), c(np.asarray(window, np.int64))])  # [B, T, width, bs]
            entry_visible = n("And", [entry_visible, near])
        per_entry = n("Cast", [entry_visible], {"to": ir.DataType.FLOAT})  # [B, 1 or T, width, bs]
        slot_visible = n("Greater", [n("MatMul", [n("Unsqueeze", [onehot, int64(1)]), per_entry]),
                                     c(np.asarray(0.0, np.float32))])  # [B, 1 or T, blocks, bs]
        expanded = n("Expand", [slot_visible, n("Concat", [self.batch, self.tokens, self.blocks, int64(bs)],
                                                {"axis": 0})])
        pool_part = n("Reshape", [expanded, n("Concat", [self.rows, self.slots], {"axis": 0})])  # [B·T, slots]
        rows = n("Range", [zero, scalar(self.rows), one])
        row_seq, row_step = n("Div", [rows, scalar(self.tokens)]), n("Mod", [rows, scalar(self.tokens)])
        column = lambda value: n("Unsqueeze", [value, int64(1)])  # noqa: E731
        same = n("Equal", [column(row_seq), row_seq])
        distance = n("Sub", [column(row_step), row_step])  # [B·T, B·T]: t − t'
        new_part = n("And", [same, n("GreaterOrEqual", [distance, zero])])
        if window > 0:
            new_part = n("And", [new_part, n("Less", [distance, c(np.asarray(window, np.int64))])])
        return n("Concat", [pool_part, new_part], {"axis": 1})


def kernel_lengths(node, const, lens: ir.Value, tokens: ir.Value, prefix: str) -> tuple[ir.Value, ir.Value]:
    """GroupQueryAttention's seqlens_k (int32 [B]: row b holds context_lens[b] + T keys after the step, so
    context_lens + T − 1) and total_sequence_length (int32: max(context_lens) + T), from context_lens [B] and the
    step's token count `tokens` [1]; `node(op, inputs, attributes, name)` adds a node, `const(values)` an int64
    constant."""
    last = node("Sub", [node("Add", [lens, node("Squeeze", [tokens])]), const([1])])
    seqlens = node("Cast", [last], {"to": ir.DataType.INT32}, name=f"{prefix}_seqlens_k")
    total = node("Add", [node("ReduceMax", [lens], {"keepdims": 0}), node("Squeeze", [tokens])])
    return seqlens, node("Cast", [total], {"to": ir.DataType.INT32}, name=f"{prefix}_total_sequence_length")


def step_rows(node, const, lens: ir.Value, tokens: ir.Value, batch: ir.Value, kv_heads: int, head_dim: int,
              name: str) -> ir.Value:
    """int64 [B, Hkv, T, D] holding context_lens[b] + t: the row of GroupQueryAttention's present where row b's new
    token t lands (GatherElements on axis 2 takes the step's K/V out of it); `node` and `const` as in
    kernel_lengths."""
    steps = node("Range", [const(0), node("Squeeze", [tokens]), const(1)])
    rows = node("Add", [node("Reshape", [lens, const([-1, 1, 1, 1])]),
                        node("Reshape", [steps, const([1, 1, -1, 1])])])  # [B, 1, T, 1]
    shape = node("Concat", [batch, const([kv_heads]), tokens, const([head_dim])], {"axis": 0})
    return node("Expand", [rows, shape], name=name)


class Body:
    """Nodes of a subgraph (an If branch) under construction; they may read the outer graph's values."""

    def __init__(self, origin: str, prefix: str):
        self.origin, self.prefix = origin, prefix
        self.nodes: list[ir.Node] = []

    def node(self, op_type: str, inputs, attributes=None, domain: str = "", outputs: int = 1):
        made = ir.node(op_type, list(inputs), dict(attributes or {}), domain=domain, num_outputs=outputs,
                       name=f"{self.prefix}_{op_type}_{len(self.nodes)}")
        made.metadata_props[ORIGIN_KEY] = self.origin
        for index, value in enumerate(made.outputs):
            value.name = f"{self.prefix}_{len(self.nodes)}_{index}"
        self.nodes.append(made)
        return made.outputs[0] if outputs == 1 else made.outputs

    def copy(self, node: ir.Node, inputs=None):
        """A copy of `node` (op, attributes, domain) in this body, on `inputs` (default: the node's own)."""
        return self.node(node.op_type, list(node.inputs) if inputs is None else inputs,
                         {name: a.value for name, a in node.attributes.items()}, domain=node.domain,
                         outputs=len(node.outputs))

    def heads(self, value: ir.Value, head_shape: ir.Value) -> ir.Value:
        """[B, T, H·D] → [B, H, T, D] (head_shape: [0, 0, H, D])."""
        return self.node("Transpose", [self.node("Reshape", [value, head_shape])], {"perm": [0, 2, 1, 3]})

    def constant(self, array: np.ndarray) -> ir.Value:
        return self.node("Constant", [], {"value": ir.tensor(array)})

    def graph(self, name: str, outputs: list[ir.Value], before: list[ir.Node] = ()) -> ir.Graph:
        """The branch (after `before`, nodes moved in from the outer graph), its outputs float32 (the checker
        needs every subgraph output's type)."""
        for value in outputs:
            value.dtype = ir.DataType.FLOAT
        return ir.Graph([], outputs, nodes=[*before, *self.nodes], name=name)


def _pool_attention(view: Body, site: Site, shared: _Shared, bias: ir.Value,
                    bsd: tuple[ir.Value, ir.Value, ir.Value], flat: bool) -> ir.Value:
    """The pool form of one layer's attention (the module docstring), added to `view`, on q, k, v [B, T, H·D]:
    its output [B, T, Hq·D] when `flat`, else [B, Hq, T, D]."""
    q3, k3, v3 = bsd
    n = view.node

    def fused(a, b, **attributes):
        return n("FusedMatMul", [a, b], attributes, domain=MS_DOMAIN)

    q = n("Reshape", [q3, shared.query_shape])  # [B·T, Hkv, G, D]
    k, v = (n("Reshape", [value, shared.kv_shape]) for value in (k3, v3))  # [B·T, Hkv, 1, D]
    pool_k, pool_v = (n("Reshape", [pool, shared.kv_shape]) for pool in site.pools)  # [slots, Hkv, 1, D], no copy
    scores = {"alpha": site.scale, "transB": 1, "transBatchA": 1, "transBatchB": 1}
    logits = n("Concat", [fused(q, pool_k, **scores), fused(q, k, **scores)], {"axis": -1})  # [Hkv, G, B·T, S]
    probs = n("Softmax", [n("Add", [logits, bias])], {"axis": -1})
    pool_probs, new_probs = n("Split", [probs, shared.split], {"axis": -1}, outputs=2)
    out = n("Add", [fused(pool_probs, pool_v, transBatchB=1), fused(new_probs, v, transBatchB=1)])  # [Hkv,G,BT,D]
    out = n("Reshape", [n("Transpose", [out], {"perm": [2, 0, 1, 3]}), shared.flat_shape])  # [B, T, Hq·D]
    return out if flat else view.heads(out, shared.head_shape)  # [B, Hq, T, D]


@dataclass
class Packed:
    """q, k, v = RotaryEmbedding(Split(qkv)[0]), RotaryEmbedding(Split(qkv)[1]), Split(qkv)[2]: the form that
    GroupQueryAttention takes whole (packed qkv, do_rotary)."""

    qkv: ir.Value  # [B, T, (Hq + 2·Hkv)·D]
    split: ir.Node
    q_rotary: ir.Node
    k_rotary: ir.Node


def packed_form(site: Site, q3: ir.Value, k3: ir.Value, v3: ir.Value) -> Packed | None:
    """The site's Packed form, when its step K/V are graph outputs (new_key_i, new_value_i) and its rotaries are
    full-width ones of one cos/sin pair."""
    if not (site.new[0].is_graph_output() and site.new[1].is_graph_output()):
        return None
    q_rotary, k_rotary = producer(q3, "RotaryEmbedding"), producer(k3, "RotaryEmbedding")
    if q_rotary is None or k_rotary is None or len(q_rotary.inputs) != 3 or len(k_rotary.inputs) != 3:
        return None
    if q_rotary.inputs[1] is not k_rotary.inputs[1] or q_rotary.inputs[2] is not k_rotary.inputs[2]:
        return None
    interleaved = {r.attributes.get_int("interleaved", 0) for r in (q_rotary, k_rotary)}
    if len(interleaved) != 1 or any(r.attributes.get_int("rotary_embedding_dim", 0) for r in (q_rotary, k_rotary)):
        return None
    split = producer(q_rotary.inputs[0], "Split")
    if split is None or list(split.outputs) != [q_rotary.inputs[0], k_rotary.inputs[0], v3]:
        return None
    qkv = split.inputs[0]
    if qkv is None or qkv.shape is None or len(qkv.shape) != 3 or split.attributes.get_int("axis", 0) not in (-1, 2):
        return None
    return Packed(qkv, split, q_rotary, k_rotary)


def rotary_tables(model: ir.Model, build: Builder, sites: list[Site], inputs: dict[str, ir.Value],
                   context) -> dict[int, tuple[ir.Value, ir.Value]] | None:
    """{id(cos): (cos_table, sin_table)} for every site's rotary (attention-rotary's tables, same rules), or None
    when one site has none or its cos/sin cannot become tables."""
    positions = inputs.get(POSITION_IDS)
    if positions is None:
        return None
    rows = 2 * int(context.spec.max_positions)
    cones: dict[int, tuple[list[ir.Node], ir.Value, ir.Value]] = {}
    for site in sites:
        rotary = producer(site.q, "RotaryEmbedding")
        if rotary is None or len(rotary.inputs) != 3:
            return None
        cos, sin = rotary.inputs[1], rotary.inputs[2]
        if id(cos) not in cones:
            cone = checked_cone(model, cos, sin, positions, rows, site.head_dim)
            if cone is None:
                return None
            cones[id(cos)] = (cone, cos, sin)
    return {key: table_subgraph(build, cone, (cos, sin), positions, rows, index)
            for index, (key, (cone, cos, sin)) in enumerate(cones.items())}


def _rewrite_packed(build: Builder, site: Site, shared: _Shared, bias: ir.Value, packed: Packed,
                    tables: tuple[ir.Value, ir.Value]) -> None:
    """Replace the site's attention, its q/k/v Split and rotaries and its step K/V outputs by one If with three
    outputs (attention, new_key_i, new_value_i), the Split and rotaries copied into the branches that need them:

        If(not view_fits and (one row or one token a row),
           then: the gathered past, GroupQueryAttention(packed qkv, do_rotary): it rotates q and k itself, and the
                 step's K/V are taken out of its present at rows context_lens + t (GatherElements); no Split,
                 RotaryEmbedding, Reshape or Transpose runs (a short context's decode step: SmolLM2 fp32 at 69
                 tokens, one step 1.087x → 1.061x the contiguous artifact's, benchmarks/step_ab.py);
           else: If(view_fits,
                    then: Split, rotaries, the step's K/V to their output layout, the pool form;
                    else: Split, rotaries, the gathered past, Concat + Attention as before))

    The GroupQueryAttention path comes first because it is the common one (a decode step below VIEW_MIN_SLOTS, a
    prefill, a batch of decoding rows) and every If costs the step a subgraph execution (~20 µs on 2 cores).
    """
    attention, origin = site.attention, build.origin
    flat_chain = flat_consumer(attention.outputs[0])
    flat = flat_chain is not None
    key_gather, value_gather, key_concat, value_concat = site.gathered
    mask = attention.inputs[3]
    build.graph.remove([key_gather, value_gather, key_concat, value_concat, attention])
    kv_head_shape = shared.kv_head_shape(site.kv_heads, site.head_dim)

    fused = Body(origin, f"paged_gqa_{site.layer}")
    attributes = {"num_heads": site.q_heads, "kv_num_heads": site.kv_heads, "scale": site.scale, "do_rotary": 1,
                  "rotary_interleaved": packed.q_rotary.attributes.get_int("interleaved", 0)}
    out, present_key, present_value = fused.node(
        "GroupQueryAttention", [packed.qkv, None, None, fused.copy(key_gather), fused.copy(value_gather),
                                shared.seqlens, shared.total, *tables], attributes, domain=MS_DOMAIN, outputs=3)
    fused.nodes[-1].metadata_props.update(attention.metadata_props)  # the model's attention, fused
    rows = shared.new_rows(site.kv_heads, site.head_dim)
    new_key, new_value = (fused.node("GatherElements", [present, rows], {"axis": 2})
                          for present in (present_key, present_value))
    if not flat:
        out = fused.heads(out, shared.head_shape)
    gqa_branch = fused.graph(f"paged_gqa_{site.layer}", [out, new_key, new_value])

    def separate_rotaries(body: Body) -> tuple[ir.Value, ...]:
        """q3, k3, v3 [B, T, H·D] and the step's k, v [B, Hkv, T, D] (the outputs' layout), computed in `body`."""
        q_part, k_part, v3 = body.copy(packed.split)
        q3 = body.copy(packed.q_rotary, [q_part, *packed.q_rotary.inputs[1:]])
        k3 = body.copy(packed.k_rotary, [k_part, *packed.k_rotary.inputs[1:]])
        return q3, k3, v3, body.heads(k3, kv_head_shape), body.heads(v3, kv_head_shape)

    view = Body(origin, f"paged_view_{site.layer}")
    q3, k3, v3, k4, v4 = separate_rotaries(view)
    out = _pool_attention(view, site, shared, bias, (q3, k3, v3), flat)
    view_branch = view.graph(f"paged_view_attention_{site.layer}", [out, k4, v4])

    standard = Body(origin, f"paged_gathered_attention_{site.layer}")
    q3, _, _, k4, v4 = separate_rotaries(standard)
    keys = standard.copy(key_concat, [key_gather.outputs[0], k4])
    values = standard.copy(value_concat, [value_gather.outputs[0], v4])
    result = moved_attention(standard, attention, [q3, keys, values, mask], shared, flat)
    standard_branch = standard.graph(f"paged_gathered_attention_{site.layer}", [result, k4, v4],
                                     before=[key_gather, value_gather])

    detach([attention, key_concat, value_concat])
    replaced = flat_chain[-1].outputs[0] if flat else attention.outputs[0]
    node = _gqa_first(build, shared, site.layer, gqa_branch, view_branch, standard_branch, first_use(replaced))
    take_output(node.outputs[0], replaced, f"paged_attention_{site.layer}")
    take_place(site.new[0], node.outputs[1], "separate_rotary")
    take_place(site.new[1], node.outputs[2], "separate_rotary")
    if flat:
        build.graph.remove(flat_chain)
        detach(flat_chain)


def _gqa_first(build: Builder, shared: _Shared, layer: int, gqa: ir.Graph, view: ir.Graph, standard: ir.Graph,
               before: ir.Node) -> ir.Node:
    """The layer's If(not view_fits and the kernel takes the step, `gqa`, If(view_fits, `view`, `standard`)), one
    output per branch output, placed before `before`."""
    outputs = len(gqa.outputs)
    rest = Body(build.origin, f"paged_rest_{layer}")
    choice = rest.node("If", [shared.fits], {"then_branch": view, "else_branch": standard}, outputs=outputs)
    choice = [choice] if outputs == 1 else list(choice)
    return build.node("If", [shared.gqa_first],
                      {"then_branch": gqa, "else_branch": rest.graph(f"paged_rest_{layer}", choice)},
                      before=before, outputs=outputs, name=f"paged_attention_{layer}")


def moved_attention(body: Body, attention: ir.Node, inputs: list[ir.Value], shared: _Shared, flat: bool) -> ir.Value:
    """The model's Attention, rebuilt in `body` on (q [B, T, Hq·D], keys, values, mask) with its attributes and
    origin: its output [B, T, Hq·D] when `flat`, else [B, Hq, T, D]."""
    q3, *rest = inputs
    result = body.node(attention.op_type, [body.heads(q3, shared.head_shape), *rest],
                       {name: a.value for name, a in attention.attributes.items()}, domain=attention.domain,
                       outputs=len(attention.outputs))
    result = result[0] if len(attention.outputs) > 1 else result
    body.nodes[-1].metadata_props.update(attention.metadata_props)  # the model's attention, moved
    if flat:
        result = body.node("Reshape", [body.node("Transpose", [result], {"perm": [0, 2, 1, 3]}), shared.flat_shape])
    return result


def detach(nodes) -> None:
    """Disconnect removed nodes from their inputs (their values' uses then list only live nodes)."""
    for node in nodes:
        for index in range(len(node.inputs)):
            node.replace_input_with(index, None)


def take_output(value: ir.Value, replaced: ir.Value, name: str) -> None:
    """`value` (an If's output) replaces `replaced` everywhere, under `name`, with its dtype and shape."""
    value.name, value.dtype = name, replaced.dtype
    value.shape = None if replaced.shape is None else ir.Shape(list(replaced.shape.dims))
    replaced.replace_all_uses_with(value, replace_graph_outputs=True)


def _rewrite(build: Builder, site: Site, shared: _Shared, bias: ir.Value, gqa: bool,
             bsd: tuple[ir.Value, ir.Value, ir.Value]) -> None:
    """Replace the site's attention by If(view_fits, pool attention, the gathered attention moved into the
    else branch); where the gathered form is GroupQueryAttention, If(its form, If(view_fits, pool, Attention)).
    q, k and v enter the pool form in their [B, T, H·D] layout `bsd` (the rotary runs there, as
    group-query-attention does it; new_key_i is then that rotated k in the output's layout), and the If returns
    [B, T, Hq·D] where the attention's only consumer was the Transpose + Reshape to it: every transpose of the
    step's few rows that the pool form does not need is gone (on 2 cores each small node costs microseconds)."""
    attention = site.attention
    q3, k3, v3 = bsd
    # where as_bsd moved the rotary to the 3D form, new_key_i becomes that rotated k; where it could not (a QK-norm
    # or multi-query model rotates [B, H, T, D]), k3 reads new_key_i itself and new_key_i stays
    moved_rotary = producer(site.new[0], "RotaryEmbedding") is not None and producer(k3, "RotaryEmbedding") is not None
    if moved_rotary and site.new[0].is_graph_output():
        _output_from(build, site.new[0], k3, site.kv_heads, site.head_dim, attention)
    flat_chain = flat_consumer(attention.outputs[0])
    flat_output = flat_chain[-1].outputs[0] if flat_chain else None
    view = Body(build.origin, f"paged_view_{site.layer}")
    out = _pool_attention(view, site, shared, bias, (q3, k3, v3), flat_output is not None)
    then_branch = view.graph(f"paged_view_attention_{site.layer}", [out])

    key_gather, value_gather, key_concat, value_concat = site.gathered
    build.graph.remove([key_gather, value_gather, key_concat, value_concat, attention])
    standard = Body(build.origin, f"paged_gathered_attention_{site.layer}")  # Concat + Attention, moved
    flat = flat_output is not None
    replaced = flat_output if flat else attention.outputs[0]
    result = moved_attention(standard, attention, [q3, *attention.inputs[1:]], shared, flat)
    detach([attention])
    if not gqa:
        else_branch = standard.graph(f"paged_gathered_{site.layer}", [result],
                                     before=[key_gather, value_gather, key_concat, value_concat])
        node = build.node("If", [shared.fits], {"then_branch": then_branch, "else_branch": else_branch},
                          before=first_use(replaced), name=f"paged_attention_{site.layer}")
    else:
        # If(not view_fits and the kernel takes the step: GroupQueryAttention over the gathered past [B, Hkv,
        # table slots, D] (the op places the step's keys after each row's context_lens in its own present copy
        # and attends causally to context + new; unfilled slots are never read), else If(view_fits, the pool
        # form, Concat + Attention over a gathered past of its own)). The common path runs one If (see
        # _rewrite_packed). ONNX Runtime's kernel takes several new tokens with a past only for one row: a batch
        # of several rows feeding several tokens each (speculative verification) takes the Attention form
        fused = Body(build.origin, f"paged_gqa_{site.layer}")
        attributes = {"num_heads": site.q_heads, "kv_num_heads": site.kv_heads, "scale": site.scale}
        out = fused.node("GroupQueryAttention", [q3, k3, v3, fused.copy(key_gather), fused.copy(value_gather),
                                                 shared.seqlens, shared.total], attributes,
                         domain=MS_DOMAIN, outputs=3)[0]  # [B, T, Hq·D]
        if not flat:
            out = fused.heads(out, shared.head_shape)
        standard_branch = standard.graph(f"paged_gathered_attention_{site.layer}", [result],
                                         before=[key_gather, value_gather, key_concat, value_concat])
        node = _gqa_first(build, shared, site.layer, fused.graph(f"paged_gqa_{site.layer}", [out]), then_branch,
                          standard_branch, first_use(replaced))
    take_output(node.outputs[0], replaced, f"paged_attention_{site.layer}")
    if flat_chain:
        build.graph.remove(flat_chain)
        detach(flat_chain)


def _output_from(build: Builder, output: ir.Value, flat: ir.Value, heads: int, head_dim: int,
                 before: ir.Node) -> None:
    """The graph output `output` [B, H, T, D] becomes `flat` [B, T, H·D] split and transposed (its rotary then
    runs once, on the 3D form)."""
    shape = build.initializer(f"{output.name}_bthd_shape", np.asarray([0, 0, heads, head_dim], dtype=np.int64))
    split = build.node("Reshape", [flat, shape], before=before).outputs[0]
    back = build.node("Transpose", [split], {"perm": [0, 2, 1, 3]}, before=before).outputs[0]
    take_place(output, back, "4d_rotary")


def first_use(value: ir.Value) -> ir.Node:
    graph = value.uses()[0][0].graph
    users = {id(node) for node, _ in value.uses()}
    return next(node for node in graph if id(node) in users)
