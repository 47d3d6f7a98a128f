"""Pass `kv-cache`: give every attention layer a contiguous KV cache, so a step computes only its new tokens.

before: attention(q, k, v) over the whole sequence
→ after: present_k = cat(past_k, k); masked_attention(q, present_k, present_v, mask) with one causal+padding mask
shared by the layers of each sliding window (one for all full-attention layers; the cache keeps the whole context, the
mask hides what a window cannot see); soft-capping and sinks carry over; new inputs attention_mask +
past_key_i/past_value_i, new outputs present_key_i/present_value_i. The cache holds the model's KV heads only: a
repeat of K/V to the query heads (see `gqa`) is moved behind the cache.
"""

from __future__ import annotations

import torch

from fxllm.compiler.patterns import build_repeat_kv, call_arguments, match_repeat_kv
from fxllm.compiler.pass_registry import register_pass
from fxllm.compiler.program import Program
from fxllm.runtime.contract import ATTENTION_MASK, CONTIGUOUS, INPUT_IDS, TensorSig, cache_input, cache_output

aten = torch.ops.aten
fxllm_ops = torch.ops.fxllm


@register_pass("kv-cache", requires=("fxllm-attention",), provides=("kv-cache",), forbids=("kv-cache",))
def kv_cache(program: Program) -> Program:
    """Insert past/present K/V per layer, an attention mask input and one shared causal+padding mask."""
    graph = program.graph
    spec = program.spec
    attention_nodes = [n for n in graph.nodes if n.target is fxllm_ops.attention.default]
    last_input = [n for n in graph.nodes if n.op == "placeholder"][-1]
    cache_dims = ("batch", spec.num_kv_heads, "past", spec.head_dim)
    present_dims = ("batch", spec.num_kv_heads, "total", spec.head_dim)

    with graph.inserting_after(last_input):
        attention_mask = graph.placeholder(ATTENTION_MASK)
    new_inputs = [TensorSig(ATTENTION_MASK, ("batch", "total"), "int64")]
    anchor = attention_mask
    past_nodes = []
    for layer in range(len(attention_nodes)):
        with graph.inserting_after(anchor):
            past_key = graph.placeholder(cache_input(CONTIGUOUS, "key", layer))
        with graph.inserting_after(past_key):
            past_value = graph.placeholder(cache_input(CONTIGUOUS, "value", layer))
        anchor = past_value
        past_nodes.append((past_key, past_value))
        new_inputs += [TensorSig(past_key.name, cache_dims, "float32"),
                       TensorSig(past_value.name, cache_dims, "float32")]
    masks: dict[int, torch.fx.Node] = {}  # sliding window (0: none) → its mask, shared by the layers using it
    for node in attention_nodes:
        window = call_arguments(node)["window"]
        if window not in masks:
            with graph.inserting_after(anchor):
                anchor = masks[window] = graph.call_function(
                    fxllm_ops.causal_mask.default,
                    (attention_mask, program.placeholder(INPUT_IDS), *((window,) if window else ())))

    presents = []
    for layer, node in enumerate(attention_nodes):
        arguments = call_arguments(node)
        q, k, v, scale = (arguments[name] for name in ("q", "k", "v", "scale"))
        variant = {name: arguments[name] for name in ("softcap", "sinks") if arguments[name] not in (None, 0.0)}
        attended = []
        with graph.inserting_before(node):
            for past, new in zip(past_nodes[layer], (k, v)):
                repeat = match_repeat_kv(new)
                present = graph.call_function(aten.cat.default, ([past, repeat[0] if repeat else new], 2))
                presents.append(present)
                attended.append(build_repeat_kv(graph, present, repeat[1]) if repeat else present)
            out = graph.call_function(fxllm_ops.masked_attention.default,
                                      (q, *attended, masks[arguments["window"]], scale), variant)
        node.replace_all_uses_with(out)
        graph.erase_node(node)
    graph.eliminate_dead_code()  # the per-step repeats of the new K/V alone are no longer used

    output = program.output_node()
    output.args = (tuple(output.args[0]) + tuple(presents),)
    program.inputs += new_inputs
    for layer in range(len(attention_nodes)):
        program.outputs += [TensorSig(cache_output(CONTIGUOUS, kind, layer), present_dims, "float32")
                            for kind in ("key", "value")]
    return program
