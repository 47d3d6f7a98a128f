"""Step `group-query-attention`: each layer's cache Concat + Attention → com.microsoft.GroupQueryAttention over a
preallocated KV buffer that the step updates in place (the contiguous cache's calling convention changes).

before: q/k/v [B,S,H·D] → Reshape → Transpose → (RotaryEmbedding) → [B,H,S,D];
        present_k = Concat(past_k, k); out = Attention(q, present_k, present_v, mask) → Transpose → Reshape
after:  q/k/v stay [B,S,H·D] (RotaryEmbedding on the 3D form); out, present_k, present_v =
        GroupQueryAttention(q, k, v, past_k, past_v, seqlens_k, total_len[, attention_bias])

The cache inputs become buffers of a capacity the runtime chooses and the step updates in place, returning the
same buffer as present_* (the runtime binds both to one array, so nothing is copied; without that binding ONNX
Runtime would copy the buffer); total = attention_mask's length. Two conventions (runtime/contract.py):
- rows from buffer row 0 (dim `capacity_per_row`, KV_CAPACITY_PER_ROW), where no layer slides: the runtime
  right-pads, row b's mask is 1 on its first n_b columns, seqlens_k = n_b − 1 (the mask's row sums), and
  GroupQueryAttention's own per-row lengths and causal rule are the whole mask: no attention bias (all zeros at
  batch 1; SmolLM2 int4's calls ran 0.96-0.99x without it, docs/targets.md);
- left-padded rows (dim `capacity`, KV_CAPACITY), where a layer slides (its window lives in the mask): rows
  [0, total − S) hold the past, the step writes its S new rows at [total − S, total), seqlens_k = total − 1 for
  every row and attention_bias = 0 where the layer's mask is true and the float32 minimum elsewhere, so padding
  and the window stay hidden and every query still sees itself (exactly the standard form's mask:
  GroupQueryAttention's own causal rule, bottom-right aligned, agrees with it).
The rotary embedding stays outside here, on the 3D q and k; the next step, attention-rotary, moves it into the op
where the tables allow.

All or nothing: when one attention does not match the pattern the graph keeps the standard form, so an artifact
has one calling convention.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from fxllm.compiler.targets.ort.graph import MS_DOMAIN, Builder, copy_shape, producer, static_dims, take_place
from fxllm.runtime.contract import (ATTENTION_MASK, CONTIGUOUS, KV_CAPACITY, KV_CAPACITY_PER_ROW, TensorSig,
                                    cache_input, cache_output, parse_cache_name)

NAME = "group-query-attention"
ROW_LENGTHS = "gqa_row_lengths"  # the ReduceSum of the mask's rows (rows from buffer row 0), once per graph
LOWEST = float(np.finfo(np.float32).min)


@dataclass
class Site:
    attention: ir.Node
    q: ir.Value  # [B, Hq, S, D]
    keys: tuple[ir.Node, ir.Node]  # the K and V cache Concats
    layer: int
    q_heads: int
    kv_heads: int
    head_dim: int


def apply(model: ir.Model, context) -> int:
    graph = model.graph
    inputs = {value.name: value for value in graph.inputs}
    if ATTENTION_MASK not in inputs:
        return 0
    attentions = [n for n in graph if n.op_type == "Attention" and n.domain in ("", "ai.onnx")]
    sites = [_match(node, inputs) for node in attentions]
    if not sites or any(site is None for site in sites):
        return 0
    build = Builder(graph, f"lowering:ort/{NAME}")
    first = next(iter(graph))
    per_row = rows_from_start(context.spec, sites)
    seqlens, total = _lengths(build, inputs[ATTENTION_MASK], before=first, per_row=per_row)
    biases: dict[int, ir.Value] | None = None if per_row else {}
    for site in sites:
        _rewrite(build, site, seqlens, total, biases)
    _update_signature(graph, context, sites, KV_CAPACITY_PER_ROW if per_row else KV_CAPACITY)
    return len(sites)


def rows_from_start(spec, sites: list[Site]) -> bool:
    """Whether the buffers keep each row's tokens from row 0 (right-padded rows, no attention bias): where the one
    mask every attention reads says only "causal, and not the padding" — no layer slides (a window lives in the
    mask), which GroupQueryAttention's per-row lengths say by themselves."""
    return not any(spec.sliding_windows) and len({id(site.attention.inputs[3]) for site in sites}) == 1


def kernel_takes_head_dim(head_dim: int) -> bool:
    """ONNX Runtime's CPU GroupQueryAttention refuses, at run time, a head size that is not a multiple of 8."""
    return head_dim % 8 == 0


def _match(attention: ir.Node, inputs: dict[str, ir.Value]) -> Site | None:
    """The Attention of one kv-cache layer: q, Concat(past_key_i, k), Concat(past_value_i, v), a bool mask; 4D."""
    if len(attention.inputs) != 4 or any(v is None for v in attention.inputs):
        return None
    if attention.attributes.get_int("is_causal", 0) or attention.attributes.get_int("qk_matmul_output_mode", 0):
        return None
    if any(value.uses() for value in attention.outputs[1:]):
        return None
    q, k, v, mask = attention.inputs
    concats = (producer(k, "Concat"), producer(v, "Concat"))
    roles = []
    for concat, kind in zip(concats, ("key", "value")):
        if concat is None or len(concat.inputs) != 2 or concat.attributes.get_int("axis", 0) not in (2, -2):
            return None
        past = concat.inputs[0]
        role = parse_cache_name(past.name or "")
        if past.name not in inputs or role is None or role.cache != CONTIGUOUS or role.kind != kind:
            return None
        if not concat.outputs[0].is_graph_output():
            return None
        roles.append(role.layer)
    if roles[0] != roles[1] or mask.dtype != ir.DataType.BOOL:
        return None
    q_dims, k_dims = static_dims(q), static_dims(concats[0].inputs[1])
    if q_dims is None or k_dims is None or len(q_dims) != 4 or len(k_dims) != 4:
        return None
    q_heads, head_dim, kv_heads = q_dims[1], q_dims[3], k_dims[1]
    if not all(isinstance(d, int) for d in (q_heads, head_dim, kv_heads)) or k_dims[3] != head_dim:
        return None
    if q_heads % kv_heads or not kernel_takes_head_dim(head_dim):  # else the standard Attention stays
        return None
    return Site(attention, q, concats, roles[0], q_heads, kv_heads, head_dim)


def _lengths(build: Builder, attention_mask: ir.Value, before: ir.Node,
             per_row: bool) -> tuple[ir.Value, ir.Value]:
    """seqlens_k [B] int32 (each row's length − 1: the row's ones in the mask when rows start at buffer row 0, else
    total − 1 in every row) and total_sequence_length (int32 scalar: the mask's length)."""
    total = build.node("Shape", [attention_mask], {"start": 1, "end": 2}, before=before).outputs[0]
    total32 = build.node("Cast", [total], {"to": ir.DataType.INT32}, before=before).outputs[0]
    one = build.initializer("gqa_one_int32", np.asarray([1], dtype=np.int32))
    if per_row:
        axis = build.initializer("gqa_mask_axis", np.asarray([1], dtype=np.int64))
        lengths = build.node("ReduceSum", [attention_mask, axis], {"keepdims": 0}, before=before,
                             name=ROW_LENGTHS).outputs[0]
        lengths32 = build.node("Cast", [lengths], {"to": ir.DataType.INT32}, before=before).outputs[0]
        seqlens = build.node("Sub", [lengths32, one], before=before, name="gqa_seqlens_k").outputs[0]
    else:
        last = build.node("Sub", [total32, one], before=before).outputs[0]
        batch = build.node("Shape", [attention_mask], {"start": 0, "end": 1}, before=before).outputs[0]
        seqlens = build.node("Expand", [last, batch], before=before, name="gqa_seqlens_k").outputs[0]
    scalar = build.node("Squeeze", [total32], before=before, name="gqa_total_sequence_length").outputs[0]
    seqlens.name, scalar.name = "gqa_seqlens_k", "gqa_total_sequence_length"
    seqlens.dtype, scalar.dtype = ir.DataType.INT32, ir.DataType.INT32
    seqlens.shape, scalar.shape = ir.Shape([attention_mask.shape[0] if attention_mask.shape else None]), ir.Shape([])
    return seqlens, scalar


def _bias(build: Builder, mask: ir.Value, before: ir.Node, biases: dict[int, ir.Value]) -> ir.Value:
    """attention_bias [B,1,S,T]: 0 where the mask shows a key, the float32 minimum where it hides one (once per mask)."""
    if id(mask) not in biases:
        zero = build.initializer(f"gqa_bias_zero_{len(biases)}", np.asarray(0.0, dtype=np.float32))
        lowest = build.initializer(f"gqa_bias_lowest_{len(biases)}", np.asarray(LOWEST, dtype=np.float32))
        bias = build.node("Where", [mask, zero, lowest], before=before,
                          name=f"gqa_attention_bias_{len(biases)}").outputs[0]
        bias.name, bias.dtype, bias.shape = f"gqa_attention_bias_{len(biases)}", ir.DataType.FLOAT, copy_shape(mask)
        biases[id(mask)] = bias
    return biases[id(mask)]


def _rewrite(build: Builder, site: Site, seqlens: ir.Value, total: ir.Value,
             biases: dict[int, ir.Value] | None) -> None:
    """One layer's GroupQueryAttention; `biases` None: no attention bias (rows from buffer row 0)."""
    attention = site.attention
    key_concat, value_concat = site.keys
    q = as_bsd(build, site.q, site.q_heads, site.head_dim, attention)
    k = as_bsd(build, key_concat.inputs[1], site.kv_heads, site.head_dim, attention)
    v = as_bsd(build, value_concat.inputs[1], site.kv_heads, site.head_dim, attention)
    bias = None if biases is None else _bias(build, attention.inputs[3], attention, biases)
    attributes = {"num_heads": site.q_heads, "kv_num_heads": site.kv_heads,
                  "scale": attention.attributes.get_float("scale", 1 / math.sqrt(site.head_dim))}
    softcap = attention.attributes.get_float("softcap", 0.0)
    if softcap:
        attributes["softcap"] = softcap
    optional = [None, None, None, bias] if bias is not None else []
    gqa = build.node("GroupQueryAttention",
                     [q, k, v, key_concat.inputs[0], value_concat.inputs[0], seqlens, total, *optional],
                     attributes, before=attention, domain=MS_DOMAIN, outputs=3, name=f"gqa_{site.layer}")
    out, present_key, present_value = gqa.outputs
    out.name, out.dtype = f"gqa_{site.layer}_output", ir.DataType.FLOAT
    batch, tokens = q.shape[0] if q.shape else None, q.shape[1] if q.shape else None
    out.shape = ir.Shape([batch, tokens, site.q_heads * site.head_dim])
    for concat, new in ((key_concat, present_key), (value_concat, present_value)):
        take_place(concat.outputs[0], new, "concat")
    _replace_output(build, attention.outputs[0], out, site)


def as_bsd(build: Builder, value: ir.Value, heads: int, head_dim: int, before: ir.Node) -> ir.Value:
    """A [B, S, heads·head_dim] value equal to the [B, heads, S, head_dim] `value` transposed: the 3D source when
    value = Transpose(Reshape(x3d)) or a RotaryEmbedding of such (the rotary then runs on the 3D form), else an
    explicit Transpose + Reshape."""
    source = _bsd_source(value, heads, head_dim)
    if source is not None:
        return source
    rotary = producer(value, "RotaryEmbedding")
    if rotary is not None and not rotary.attributes.get_int("num_heads", 0) in (0, heads):
        rotary = None
    if rotary is not None:
        inner = _bsd_source(rotary.inputs[0], heads, head_dim)
        if inner is not None:
            attributes = {name: attr.value for name, attr in rotary.attributes.items()} | {"num_heads": heads}
            node = build.node("RotaryEmbedding", [inner, *rotary.inputs[1:]], attributes, before=before,
                              name=f"{rotary.name}_3d")
            node.outputs[0].name = f"{rotary.outputs[0].name}_3d"
            node.outputs[0].dtype, node.outputs[0].shape = inner.dtype, copy_shape(inner)
            return node.outputs[0]
    transposed = build.node("Transpose", [value], {"perm": [0, 2, 1, 3]}, before=before).outputs[0]
    shape = build.initializer(f"{value.name}_bsd_shape", np.asarray([0, 0, heads * head_dim], dtype=np.int64))
    flat = build.node("Reshape", [transposed, shape], before=before).outputs[0]
    flat.dtype = value.dtype
    return flat


def _bsd_source(value: ir.Value, heads: int, head_dim: int) -> ir.Value | None:
    """x3d when value = Transpose(Reshape(x3d [B,S,heads·head_dim] → [B,S,heads,head_dim]), perm=[0,2,1,3])."""
    transpose = producer(value, "Transpose")
    if transpose is None or list(transpose.attributes.get_ints("perm", [])) != [0, 2, 1, 3]:
        return None
    reshape = producer(transpose.inputs[0], "Reshape")
    if reshape is None:
        return None
    source = reshape.inputs[0]
    source_dims, split_dims = static_dims(source), static_dims(reshape.outputs[0])
    if source_dims is None or split_dims is None or len(source_dims) != 3 or len(split_dims) != 4:
        return None
    if source_dims[2] != heads * head_dim or tuple(split_dims[2:]) != (heads, head_dim):
        return None
    return source


def _replace_output(build: Builder, attention_out: ir.Value, out: ir.Value, site: Site) -> None:
    """Feed the attention's consumers from the 3D output: Transpose([0,2,1,3]) → Reshape([B,S,H·D]) becomes `out`
    itself; any other consumer gets `out` reshaped and transposed back to [B,H,S,D]."""
    chain = flat_consumer(attention_out)
    if chain is not None:
        chain[-1].outputs[0].replace_all_uses_with(out, replace_graph_outputs=True)
        return
    shape = build.initializer(f"{out.name}_bshd_shape",
                              np.asarray([0, 0, site.q_heads, site.head_dim], dtype=np.int64))
    split = build.node("Reshape", [out, shape], before=site.attention).outputs[0]
    back = build.node("Transpose", [split], {"perm": [0, 2, 1, 3]}, before=site.attention).outputs[0]
    back.dtype, back.shape = attention_out.dtype, copy_shape(attention_out)
    attention_out.replace_all_uses_with(back, replace_graph_outputs=True)


def flat_consumer(value: ir.Value) -> list[ir.Node] | None:
    """value's only consumer chain Transpose([0,2,1,3]) → Reshape to a 3D [B, S, H·D], or None."""
    uses = value.uses()
    if len(uses) != 1 or uses[0][0].op_type != "Transpose":
        return None
    transpose = uses[0][0]
    if list(transpose.attributes.get_ints("perm", [])) != [0, 2, 1, 3]:
        return None
    after = transpose.outputs[0].uses()
    if len(after) != 1 or after[0][0].op_type != "Reshape":
        return None
    reshaped = after[0][0].outputs[0]
    return [transpose, after[0][0]] if reshaped.shape is not None and len(reshaped.shape) == 3 else None


def _update_signature(graph: ir.Graph, context, sites: list[Site], capacity: str) -> None:
    """Cache inputs and outputs become [batch, kv_heads, capacity, head_dim] buffers (graph and signature), dim 2
    named `capacity` (KV_CAPACITY or KV_CAPACITY_PER_ROW: runtime/contract.py)."""
    names = {cache_input(CONTIGUOUS, kind, site.layer) for site in sites for kind in ("key", "value")}
    names |= {cache_output(CONTIGUOUS, kind, site.layer) for site in sites for kind in ("key", "value")}
    for value in list(graph.inputs) + list(graph.outputs):
        if value.name in names and value.shape is not None:
            dims = list(value.shape.dims)
            dims[2] = capacity
            value.shape = ir.Shape(dims)

    def buffer(sig: TensorSig) -> TensorSig:
        if sig.name not in names:
            return sig
        return TensorSig(sig.name, (sig.dims[0], sig.dims[1], capacity, sig.dims[3]), sig.dtype)

    context.inputs = [buffer(sig) for sig in context.inputs]
    context.outputs = [buffer(sig) for sig in context.outputs]
