"""Pass `paged`: the KV cache becomes a pool of fixed-size blocks per layer, addressed through a block table.

before: present_k = cat(past_key_i [B,Hkv,past,D], k); causal+padding mask from attention_mask; outputs present_k_i
→ after: cat(gather_blocks(key_cache_i [blocks,block_size,Hkv,D], block_tables [B,n]), k) under a mask that hides
unfilled slots (context_lens [B]) and, per sliding window, keys the window cannot see; outputs only the step's
new_key_i/new_value_i [B,Hkv,T,D], which the runtime writes into their slots. A step reads the blocks its sequences own and never copies the pool.
"""

from __future__ import annotations

import torch

from fxllm.compiler.pass_registry import register_pass
from fxllm.compiler.patterns import call_arguments
from fxllm.compiler.program import Program
from fxllm.runtime.contract import (ATTENTION_MASK, BLOCK_TABLES, CONTEXT_LENS, CONTIGUOUS, INPUT_IDS, PAGED, TensorSig,
                                    cache_input, cache_output, parse_cache_name)
from fxllm.errors import PipelineError

aten = torch.ops.aten
fxllm_ops = torch.ops.fxllm


def _check_options(*, block_size: int) -> None:
    if block_size < 1 or block_size & (block_size - 1):
        raise PipelineError(f"paged: block_size must be a power of two, got {block_size}")


@register_pass("paged", requires=("kv-cache",), provides=("paged",), forbids=("paged",), check=_check_options)
def paged(program: Program, *, block_size: int = 16) -> Program:
    """Block-table KV cache: a per-layer block pool, block_tables and context_lens inputs, new K/V outputs."""
    _check_options(block_size=block_size)
    graph, spec = program.graph, program.spec
    if block_size > spec.max_positions:  # every sequence takes a block: a larger one only wastes the pool
        raise PipelineError(f"paged: block_size {block_size} is larger than the model's context "
                            f"({spec.max_positions} tokens); a block holds tokens of one sequence")
    mask_nodes = [n for n in graph.nodes if n.target is fxllm_ops.causal_mask.default]
    if not mask_nodes:
        raise PipelineError("paged: the graph has no fxllm.causal_mask (the kv-cache pass's shared mask) to replace")
    attention_mask = program.placeholder(ATTENTION_MASK)
    roles = [parse_cache_name(sig.name) for sig in program.inputs]
    layers = sum(1 for role in roles if role is not None and role.cache == CONTIGUOUS and role.kind == "key")
    pool_dims = ("blocks", block_size, spec.num_kv_heads, spec.head_dim)
    new_dims = ("batch", spec.num_kv_heads, "tokens", spec.head_dim)

    anchor = [n for n in graph.nodes if n.op == "placeholder"][-1]

    def add_after_anchor(make):
        nonlocal anchor
        with graph.inserting_after(anchor):
            anchor = make()
        return anchor

    block_tables = add_after_anchor(lambda: graph.placeholder(BLOCK_TABLES))
    context_lens = add_after_anchor(lambda: graph.placeholder(CONTEXT_LENS))
    signatures = {BLOCK_TABLES: TensorSig(BLOCK_TABLES, ("batch", "table"), "int64"),
                  CONTEXT_LENS: TensorSig(CONTEXT_LENS, ("batch",), "int64")}
    kinds = [(kind, layer) for layer in range(layers) for kind in ("key", "value")]
    pasts = [program.placeholder(cache_input(CONTIGUOUS, kind, layer)) for kind, layer in kinds]
    pool_names = [cache_input(PAGED, kind, layer) for kind, layer in kinds]
    pools = [add_after_anchor(lambda name=name: graph.placeholder(name)) for name in pool_names]
    signatures |= {name: TensorSig(name, pool_dims, "float32") for name in pool_names}
    for past, pool in zip(pasts, pools):
        gathered = add_after_anchor(lambda pool=pool: graph.call_function(fxllm_ops.gather_blocks.default,
                                                                            (pool, block_tables)))
        past.replace_all_uses_with(gathered)
        graph.erase_node(past)
    replaced = {ATTENTION_MASK} | {past.name for past in pasts}
    for mask_node in mask_nodes:  # one per sliding window
        window = call_arguments(mask_node)["window"]
        with graph.inserting_before(mask_node):
            mask = graph.call_function(fxllm_ops.paged_mask.default,
                                       (context_lens, block_tables, program.placeholder(INPUT_IDS), block_size,
                                        *((window,) if window else ())))
        mask_node.replace_all_uses_with(mask)
        graph.erase_node(mask_node)
    graph.erase_node(attention_mask)

    output = program.output_node()
    values = list(output.args[0])
    new_outputs = []
    for index, sig in enumerate(program.outputs):
        role = parse_cache_name(sig.name)
        if role is not None:
            present = values[index]
            if present.target is not aten.cat.default:
                raise PipelineError(f"paged: output '{sig.name}' is not the kv-cache concatenation")
            values[index] = present.args[0][1]  # the step's own K/V: the runtime writes them into their slots
            new_outputs.append(TensorSig(cache_output(PAGED, role.kind, role.layer), new_dims, "float32"))
        else:
            new_outputs.append(sig)
    output.args = (tuple(values),)
    known = {sig.name: sig for sig in program.inputs if sig.name not in replaced} | signatures
    program.inputs = [known[n.name] for n in graph.nodes if n.op == "placeholder"]
    program.outputs = new_outputs
    program.spec.notes.append(f"paged: block size {block_size}")
    return program
