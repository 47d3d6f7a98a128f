"""Step `paged-run`: the paged pool becomes head-major, and a step of one sequence whose blocks form one ascending
run attends in the pool itself, at the contiguous artifact's cost, instead of gathering its context.

before: key_cache_i [blocks, block_size, Hkv, D]; past_k = Gather(Reshape(key_cache_i), rows);
        out = Attention(q, Concat(past_k, k), Concat(past_v, v), mask); outputs new_key_i = k [B, Hkv, T, D]
after:  key_cache_i [1, Hkv, pool_slots_b{block_size}, D]: the runtime's view of a head-major pool that starts at the
        first block the step reads (runtime/contract.py), block tables counted from there, and per layer
        out, new_key_i, new_value_i = If(run,
            then: GroupQueryAttention(q, k, v, key_cache_i, value_cache_i, seqlens_k = context_lens + T − 1,
                  total = context_lens + T): its past is the view itself; the runtime binds new_key_i to the same
                  memory, so the kernel writes the step's K/V at rows context_lens + t in place and reads the
                  context where it lies (nothing copied, no mask, no gather),
            else: If(one row, or one token a row (the kernel's rule),
                     then: GroupQueryAttention over the gathered past, new K/V taken out of its present,
                     else: the gathered past, Concat + the model's Attention (a batch verifying several drafts a row)))
        run = one row whose table is 0, 1, ..., n − 1 (contract.is_block_run: the runtime computes the same test).
packed: where q, k, v = RotaryEmbedding(Split(qkv)) of one fused projection and the rotary's cos/sin fold into
        tables (paged-attention's rules), GroupQueryAttention takes qkv whole and rotates q and k itself
        (do_rotary), and the Split and rotaries run only in the branch that reads them.

The gather reads whole blocks: row h·(slots / block_size) + table[b, l] of the view seen as
[Hkv·slots / block_size, block_size·D] is block l of head h (one Gather of block-sized rows a layer and K/V).
Why the run form: GroupQueryAttention takes its past only as [batch, Hkv, capacity, D], so a block-major pool can
only be read through a copy (the gather) or strided plain ops (paged-attention's pool form); in a head-major pool a
run of blocks is such a tensor, and the kernel's cost does not depend on the capacity (docs/paged.md).

Applies where the gathered form is GroupQueryAttention (no sliding window, a head size the kernel takes), all or
nothing; elsewhere paged-attention keeps the block-major pool and its pool form.
"""

from __future__ import annotations

import onnx_ir as ir

from fxllm.compiler.targets.ort.graph import MS_DOMAIN, Builder, copy_shape, int64_constant, static_dims
from fxllm.compiler.targets.ort.group_query_attention import as_bsd, flat_consumer, kernel_takes_head_dim
from fxllm.compiler.targets.ort.paged_attention import (Body, Packed, Site, detach, first_use, kernel_lengths,
                                                        moved_attention, packed_form, paged_sites, rotary_tables,
                                                        step_rows, take_output)
from fxllm.runtime.contract import BLOCK_TABLES, CONTEXT_LENS, INPUT_IDS, head_major_pool_dims, parse_cache_name

NAME = "paged-run"


def apply(model: ir.Model, context) -> int:
    graph = model.graph
    found = paged_sites(graph)
    if found is None:
        return 0
    inputs, sites = found
    if any(context.spec.sliding_windows) or not all(value.is_graph_output() for site in sites for value in site.new):
        return 0
    shape = {(site.q_heads, site.kv_heads, site.head_dim) for site in sites}
    pool_dims = static_dims(sites[0].pools[0])
    if len(shape) != 1 or not kernel_takes_head_dim(sites[0].head_dim) or pool_dims is None \
            or not isinstance(pool_dims[1], int):
        return 0
    block_size = pool_dims[1]
    build = Builder(graph, f"lowering:ort/{NAME}")
    shared = _Shared(build, inputs, sites[0], block_size, next(iter(graph)))
    tables = rotary_tables(model, build, sites, inputs, context)
    for site in sites:
        bsd = tuple(as_bsd(build, value, heads, site.head_dim, site.attention)
                    for value, heads in ((site.q, site.q_heads), (site.new[0], site.kv_heads),
                                         (site.new[1], site.kv_heads)))
        packed = packed_form(site, *bsd) if tables is not None else None
        rotary = tables[id(packed.q_rotary.inputs[1])] if packed is not None else None
        _rewrite(build, site, shared, bsd, packed, rotary)
    _head_major_signature(graph, context, block_size, sites[0].kv_heads, sites[0].head_dim)
    return len(sites)


class _Shared:
    """Values every layer reads, built once in front of the graph's first node: the branch conditions, the
    kernel's lengths, the gather's rows and the reshape targets."""

    def __init__(self, build: Builder, inputs: dict[str, ir.Value], site: Site, block_size: int, before: ir.Node):
        self.build, self.before = build, before
        tables, lens = inputs[BLOCK_TABLES], inputs[CONTEXT_LENS]
        node, const = self._node, self._int
        batch = node("Shape", [tables], {"start": 0, "end": 1})  # [1]
        width = node("Shape", [tables], {"start": 1, "end": 2})  # [1]
        tokens = node("Shape", [inputs[INPUT_IDS]], {"start": 1, "end": 2})  # [1]
        one_row = node("Equal", [batch, const([1])])
        entries = node("Range", [const(0), node("Squeeze", [width]), const(1)])
        in_order = node("Equal", [node("ReduceMax", [node("Abs", [node("Sub", [tables, entries])])], {"keepdims": 0}),
                                  const(0)])
        self.run = node("Squeeze", [node("And", [one_row, in_order])], name="paged_run")
        self.single = node("Squeeze", [node("Or", [one_row, node("Equal", [tokens, const([1])])])],
                           name="paged_run_single")
        self.seqlens, self.total = kernel_lengths(node, const, lens, tokens, "paged_run")
        kv_heads, head_dim, heads = site.kv_heads, site.head_dim, site.q_heads
        # the gather: row h·(slots / block_size) + table[b, l] of the view as [Hkv·slots/block_size, block_size·D]
        pool_blocks = node("Div", [node("Shape", [site.pools[0]], {"start": 2, "end": 3}), const([block_size])])
        head_rows = node("Mul", [node("Range", [const(0), const(kv_heads), const(1)]), pool_blocks])  # [Hkv]
        self.rows = node("Add", [node("Unsqueeze", [tables, const([1])]),
                                 node("Reshape", [head_rows, const([1, -1, 1])])], name="paged_run_rows")  # [B,Hkv,n]
        self.block_rows = const([-1, block_size * head_dim])
        self.gathered_shape = node("Concat", [batch, const([kv_heads, -1, head_dim])], {"axis": 0})
        self.new_rows = step_rows(node, const, lens, tokens, batch, kv_heads, head_dim, "paged_run_new_rows")
        self.head_shape = const([0, 0, heads, head_dim])
        self.kv_head_shape = const([0, 0, kv_heads, head_dim])
        self.flat_shape = node("Concat", [batch, tokens, const([heads * head_dim])], {"axis": 0})

    def _node(self, op_type: str, inputs, attributes=None, name: str | None = None) -> ir.Value:
        return self.build.node(op_type, inputs, attributes, before=self.before, name=name).outputs[0]

    def _int(self, values: int | list[int]) -> ir.Value:
        return int64_constant(self.build, "paged_run", values)

    def gathered(self, body: Body, pool: ir.Value) -> ir.Value:
        """The context of every row [B, Hkv, n·block_size, D], gathered in `body` from the view `pool`."""
        blocks = body.node("Gather", [body.node("Reshape", [pool, self.block_rows]), self.rows], {"axis": 0})
        return body.node("Reshape", [blocks, self.gathered_shape])


def _rewrite(build: Builder, site: Site, shared: _Shared, bsd: tuple[ir.Value, ir.Value, ir.Value],
             packed: Packed | None, rotary: tuple[ir.Value, ir.Value] | None) -> None:
    """Replace the site's attention (and, packed, its Split and rotaries) and its step K/V outputs by the layer's
    If (the module docstring), placed before the attention output's first consumer."""
    attention, origin, layer = site.attention, build.origin, site.layer
    flat_chain = flat_consumer(attention.outputs[0])
    flat = flat_chain is not None
    key_gather, value_gather, key_concat, value_concat = site.gathered
    mask = attention.inputs[3]
    build.graph.remove([key_gather, value_gather, key_concat, value_concat, attention])
    attributes = {"num_heads": site.q_heads, "kv_num_heads": site.kv_heads, "scale": site.scale}
    if packed is not None:
        attributes |= {"do_rotary": 1, "rotary_interleaved": packed.q_rotary.attributes.get_int("interleaved", 0)}

    def kernel(body: Body, past_k: ir.Value, past_v: ir.Value) -> tuple[ir.Value, ir.Value, ir.Value]:
        """GroupQueryAttention in `body` over the past given: (its output [B, T, Hq·D], present K, present V)."""
        qkv = [packed.qkv, None, None] if packed is not None else list(bsd)
        made = body.node("GroupQueryAttention", [*qkv, past_k, past_v, shared.seqlens, shared.total, *(rotary or ())],
                         attributes, domain=MS_DOMAIN, outputs=3)
        body.nodes[-1].metadata_props.update(attention.metadata_props)  # the model's attention, fused
        return made

    def shaped(body: Body, out: ir.Value) -> ir.Value:
        return out if flat else body.heads(out, shared.head_shape)

    in_pool = Body(origin, f"paged_run_{layer}")
    out, present_key, present_value = kernel(in_pool, *site.pools)
    run_branch = in_pool.graph(f"paged_run_{layer}", [shaped(in_pool, out), present_key, present_value])

    fused = Body(origin, f"paged_run_gqa_{layer}")
    out, present_key, present_value = kernel(fused, *(shared.gathered(fused, pool) for pool in site.pools))
    if packed is not None:  # the step's K/V, rotated by the kernel, out of its present
        new = [fused.node("GatherElements", [present, shared.new_rows], {"axis": 2})
               for present in (present_key, present_value)]
    else:
        new = [fused.heads(value, shared.kv_head_shape) for value in bsd[1:]]
    gqa_branch = fused.graph(f"paged_run_gqa_{layer}", [shaped(fused, out), *new])

    standard = Body(origin, f"paged_run_gathered_{layer}")
    if packed is not None:
        q_part, k_part, v3 = standard.copy(packed.split)
        q3 = standard.copy(packed.q_rotary, [q_part, *packed.q_rotary.inputs[1:]])
        k3 = standard.copy(packed.k_rotary, [k_part, *packed.k_rotary.inputs[1:]])
    else:
        q3, k3, v3 = bsd
    k4, v4 = (standard.heads(value, shared.kv_head_shape) for value in (k3, v3))
    keys = standard.copy(key_concat, [shared.gathered(standard, site.pools[0]), k4])
    values = standard.copy(value_concat, [shared.gathered(standard, site.pools[1]), v4])
    result = moved_attention(standard, attention, [q3, keys, values, mask], shared, flat)
    standard_branch = standard.graph(f"paged_run_gathered_{layer}", [result, k4, v4])

    detach([attention, key_concat, value_concat, key_gather, value_gather])
    replaced = flat_chain[-1].outputs[0] if flat else attention.outputs[0]
    rest = Body(origin, f"paged_run_rest_{layer}")
    choice = list(rest.node("If", [shared.single], {"then_branch": gqa_branch, "else_branch": standard_branch},
                            outputs=3))
    node = build.node("If", [shared.run],
                      {"then_branch": run_branch, "else_branch": rest.graph(f"paged_run_rest_{layer}", choice)},
                      before=first_use(replaced), outputs=3, name=f"paged_run_attention_{layer}")
    take_output(node.outputs[0], replaced, f"paged_run_attention_{layer}")
    for old, new_value in zip(site.new, node.outputs[1:]):
        _replace_graph_output(build.graph, old, new_value)
    if flat:
        build.graph.remove(flat_chain)
        detach(flat_chain)


def _replace_graph_output(graph: ir.Graph, old: ir.Value, new: ir.Value) -> None:
    """`new` becomes the graph output `old` was, under its name, dtype and declared shape (a run step returns the
    pool view instead, which its symbolic dims allow). Only the output: the step's k may still be computed from
    `old` (a QK-norm model's rotary)."""
    index = next(i for i, value in enumerate(graph.outputs) if value is old)
    name = old.name
    old.name = f"{name}_step"
    new.name, new.dtype, new.shape = name, old.dtype, copy_shape(old)
    graph.outputs[index] = new


def _head_major_signature(graph: ir.Graph, context, block_size: int, kv_heads: int, head_dim: int) -> None:
    """The pool inputs become head-major views (graph and signature)."""
    dims = head_major_pool_dims(block_size, kv_heads, head_dim)
    for value in graph.inputs:
        role = parse_cache_name(value.name or "")
        if role is not None and role.is_input:
            value.shape = ir.Shape(list(dims))
    context.inputs = [sig if (role := parse_cache_name(sig.name)) is None or not role.is_input
                      else type(sig)(sig.name, dims, sig.dtype) for sig in context.inputs]
