"""Pass `dtype`: run the finished graph in half precision (float16 or bfloat16), the way transformers does.

before: every weight, activation, KV cache and logit in float32
→ after: weights, activations and the KV cache in `to`; logits still float32 (one cast at the end). What stays
float32 follows transformers' own half-precision models:
- **position-only computation** (rotary cos/sin tables from `inv_freq` and the positions, masks): nothing that
  depends only on positions is converted, and its result is cast to the activation's dtype where the two meet
  (transformers: `cos.to(x.dtype)`);
- **norm statistics**: the inputs of `pow`, `mean`, `sum`, `rsqrt`, `softmax`, `layer_norm`... are cast to float32
  (transformers' RMSNorm: `hidden.to(float32)`, variance and rsqrt in float32), and what they produce stays float32
  until it meets a weight, where it is cast back (RMSNorm: `weight * hidden.to(dtype)`; a matmul casts its inputs);
- softmax inside attention accumulates in float32 in every SDPA kernel and in ONNX `Attention`.
The rules are structural (what depends on the hidden state, which op reads a weight), not per architecture; where a
model rounds elsewhere (Gemma multiplies its norm weight in float32), the result differs from transformers' in the
last bits, so the drift against float32 is reported, not assumed.
Run it last: it converts the cache signature that `kv-cache` / `paged` created.
"""

from __future__ import annotations

import torch

from fxllm.compiler import ops  # noqa: F401 - registers torch.ops.fxllm.*
from fxllm.compiler.lint import refresh_meta
from fxllm.compiler.pass_registry import register_pass
from fxllm.compiler.program import Program
from fxllm.errors import PipelineError
from fxllm.runtime.contract import LOGITS, TensorSig, parse_cache_name

aten = torch.ops.aten
fxllm_ops = torch.ops.fxllm
HALF_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
# Ops whose float inputs run in the model dtype (weights meet activations here).
MATMUL_OPS = {aten.linear.default, aten.mm.default, aten.bmm.default, aten.matmul.default, aten.addmm.default,
              aten.baddbmm.default, fxllm_ops.attention.default, fxllm_ops.masked_attention.default}
# Ops whose float inputs are cast to float32: statistics that transformers computes in float32.
FLOAT32_OPS = {aten.pow.Tensor_Scalar, aten.pow.Tensor_Tensor, aten.mean.dim, aten.mean.default, aten.sum.dim_IntList,
               aten.sum.default, aten.rsqrt.default, aten.var.correction, aten.var_mean.correction,
               aten.softmax.int, aten._softmax.default, aten.log_softmax.int, aten._log_softmax.default,
               aten.layer_norm.default, aten.native_layer_norm.default}
# Ops that read the model's embedding tables: their output is an activation whatever their indices are.
EMBEDDING_OPS = {aten.embedding.default, fxllm_ops.dequant_embedding.default}
CAST = aten._to_copy.default


@register_pass("dtype", requires=("kv-cache",), provides=("half-precision",), forbids=("half-precision",),
               exact=False)
def convert_dtype(program: Program, *, to: str = "bfloat16") -> Program:
    """Half precision (to=float16|bfloat16): weights, activations and KV cache; norms accumulate in float32."""
    if to not in HALF_DTYPES:
        raise PipelineError(f"pass 'dtype': to must be one of {', '.join(HALF_DTYPES)}, not '{to}'")
    if "quantized" in program.facts:
        raise PipelineError("pass 'dtype': quantized graphs stay float32 for now (their dequantize ops are lowered "
                            "for float32); drop --quant (GGUF sources: add --requantize) or use --dtype float32")
    dtype = HALF_DTYPES[to]
    graph = program.graph
    active = _activation_nodes(program)
    _convert_weights(program, active, dtype)
    for node in list(graph.nodes):
        if node.op != "call_function" or node not in active:
            continue
        if node.target in MATMUL_OPS or node.target is aten.cat.default and _reads_cache(node):
            _cast_inputs(graph, node, dtype)
        elif node.target in FLOAT32_OPS:
            _cast_inputs(graph, node, torch.float32)
    _cast_outputs(program, dtype)
    program.inputs = [_retyped(sig, to) for sig in program.inputs]
    program.outputs = [_retyped(sig, to) for sig in program.outputs]
    _meet_activation_dtype(program, active)
    program.spec.dtype = to
    return program


def _activation_nodes(program: Program) -> set[torch.fx.Node]:
    """Nodes that carry the model's hidden state: embedding lookups, float graph inputs (the KV cache) and
    everything computed from them. Nodes outside this set depend on positions and constants only."""
    active: set[torch.fx.Node] = set()
    for node in program.graph.nodes:
        value = node.meta.get("val")
        if node.op == "placeholder" and isinstance(value, torch.Tensor) and value.is_floating_point():
            active.add(node)
        elif node.target in EMBEDDING_OPS or any(arg in active for arg in node.all_input_nodes):
            active.add(node)
    return active


def _convert_weights(program: Program, active: set[torch.fx.Node], dtype: torch.dtype) -> None:
    """Float tensors read by the hidden-state computation become `dtype`; position-only constants (inv_freq) stay."""
    module = program.graph_module
    for node in program.graph.nodes:
        if node.op != "get_attr" or not any(user in active for user in node.users):
            continue
        owner_name, _, attr = node.target.rpartition(".")
        owner = module.get_submodule(owner_name) if owner_name else module
        tensor = getattr(owner, attr)
        if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point() or tensor.dtype == dtype:
            continue
        if isinstance(tensor, torch.nn.Parameter):
            tensor.data = tensor.data.to(dtype)
        elif attr in owner._buffers:
            owner._buffers[attr] = tensor.to(dtype)
        else:
            setattr(owner, attr, tensor.to(dtype))


def _reads_cache(node: torch.fx.Node) -> bool:
    """The kv-cache concatenation (past or gathered pool, then this step's K/V): it must stay in the cache dtype."""
    return any(arg.op == "placeholder" or arg.target is fxllm_ops.gather_blocks.default
               for arg in node.all_input_nodes)


def _cast(graph: torch.fx.Graph, value: torch.fx.Node, dtype: torch.dtype, before: torch.fx.Node) -> torch.fx.Node:
    """value cast to dtype; one cast node per (value, dtype), shared by all its users (the rotary tables are
    read by every layer's q and k)."""
    for user in value.users:
        if user.target is CAST and user.kwargs.get("dtype") == dtype and len(user.args) == 1:
            if _precedes(user, before):
                return user
    with graph.inserting_before(before):
        return graph.call_function(CAST, (value,), {"dtype": dtype})


def _precedes(node: torch.fx.Node, other: torch.fx.Node) -> bool:
    while node is not None and node.op != "root":
        if node is other:
            return True
        node = node.next
    return False


def _is_float(value) -> bool:
    meta = value.meta.get("val") if isinstance(value, torch.fx.Node) else None
    return isinstance(meta, torch.Tensor) and meta.is_floating_point()


def _cast_inputs(graph: torch.fx.Graph, node: torch.fx.Node, dtype: torch.dtype) -> None:
    def convert(arg):
        if isinstance(arg, (list, tuple)):
            return type(arg)(convert(a) for a in arg)
        return _cast(graph, arg, dtype, node) if _is_float(arg) else arg

    node.args = tuple(convert(a) for a in node.args)
    node.kwargs = {k: convert(v) for k, v in node.kwargs.items()}


def _cast_outputs(program: Program, dtype: torch.dtype) -> None:
    """Caches leave in `dtype`; logits leave in float32 (the sampler's dtype)."""
    output = program.output_node()
    values = list(output.args[0])
    for index, sig in enumerate(program.outputs):
        if sig.name == LOGITS:
            values[index] = _cast(program.graph, values[index], torch.float32, output)
        elif parse_cache_name(sig.name) is not None:
            values[index] = _cast(program.graph, values[index], dtype, output)
    output.args = (tuple(values),)


def _meet_activation_dtype(program: Program, active: set[torch.fx.Node], rounds: int = 4) -> None:
    """Where the hidden state meets a constant of the other precision in an elementwise op, the half precision
    side wins, as in transformers: a float32 position-only value is cast to the activation's dtype (rotary's
    q * cos.to(q.dtype)), and a float32 activation is cast to the weight's dtype (RMSNorm's
    weight * hidden.to(dtype)). Repeated until no cast is added (each cast can turn later activations half
    precision too); identity casts are removed at the end."""
    graph = program.graph
    for _ in range(rounds):
        refresh_meta(program)
        added = False
        for node in list(graph.nodes):
            if node.op != "call_function" or node not in active or node.target in MATMUL_OPS | FLOAT32_OPS:
                continue
            floats = [a for a in node.args if _is_float(a)]
            inner = [a for a in floats if a in active]
            outer = [a for a in floats if a not in active]
            half = {a.meta["val"].dtype for a in floats} - {torch.float32}
            if not inner or not outer or len(half) != 1:
                continue
            target = half.pop()
            inner_half = any(a.meta["val"].dtype == target for a in inner)
            for arg in (outer if inner_half else inner):
                if arg.meta["val"].dtype == torch.float32:
                    node.replace_input_with(arg, _cast(graph, arg, target, node))
                    added = True
        if not added:
            break
    refresh_meta(program)
    for node in list(graph.nodes):
        if node.target is CAST and _is_float(node.args[0]) and node.args[0].meta["val"].dtype == node.kwargs["dtype"]:
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)


def _retyped(sig: TensorSig, dtype: str) -> TensorSig:
    return TensorSig(sig.name, sig.dims, dtype) if parse_cache_name(sig.name) is not None else sig
