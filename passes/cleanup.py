"""Pass `cleanup`: drop export's runtime asserts and shape guards, identity casts and dead code; spell a Conv1D
projection (GPT-2's addmm with a constant [in, out] weight) and a product with a transposed constant weight
(Falcon's `x @ W.T`) as the linear every later pass recognizes.

before: `_assert_tensor_metadata` / `_guards_fn(...)` / `to(x, same dtype)` / unused mask bookkeeping /
        addmm(b, x, W) / matmul(x, W.T)
→ after: only ops that compute (lowering re-exports, which derives its own guards); linear(x, Wᵀ, b) / linear(x, W).
"""

from __future__ import annotations

import torch

from fxllm.compiler.pass_registry import register_pass
from fxllm.compiler.program import Program
from fxllm.compiler.projections import constant, drop_unused_attributes

aten = torch.ops.aten
TRANSPOSES = {aten.numpy_T.default, aten.t.default}
ASSERT_OPS = {aten._assert_tensor_metadata.default, aten._assert_scalar.default}
GUARDS_MODULE = "_guards_fn"  # torch.export's unlifted module checks input shapes with this submodule
CAST_OPS = {aten.to.dtype, aten._to_copy.default, aten.to.dtype_layout, aten.to.device}


def _is_identity_cast(node: torch.fx.Node) -> bool:
    if node.target not in CAST_OPS or not isinstance(node.args[0], torch.fx.Node):
        return False
    source, result = node.args[0].meta.get("val"), node.meta.get("val")
    return (
        source is not None
        and result is not None
        and source.dtype == result.dtype
        and source.device == result.device
        and not node.kwargs.get("memory_format")
    )


@register_pass("cleanup")
def cleanup(program: Program) -> Program:
    """Remove runtime asserts, shape guards, identity casts and dead code."""
    graph = program.graph
    for node in list(graph.nodes):
        if node.op == "call_module" and node.target == GUARDS_MODULE and not node.users:
            graph.erase_node(node)
            program.graph_module.delete_submodule(GUARDS_MODULE)
        if node.op != "call_function":
            continue
        if node.target in ASSERT_OPS:
            graph.erase_node(node)
        elif _is_identity_cast(node):
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
    graph.eliminate_dead_code()
    _linears_from_addmm(program)
    _linears_from_transposed_matmul(program)
    return program


def _linears_from_addmm(program: Program) -> None:
    """addmm(b, x, W) with constant W [in, out] and b [out] (Conv1D) → linear(x, Wᵀ, b): the same product, in the
    form quantize, fuse-projections and the lowerings look for (GPT-2 was otherwise left unquantized). Wᵀ is stored
    contiguous and replaces W."""
    graph = program.graph
    converted = 0
    for index, node in enumerate([n for n in graph.nodes if n.target is aten.addmm.default and not n.kwargs]):
        bias, x, weight_node = node.args
        weight, bias_value = constant(program, weight_node), constant(program, bias)
        if weight is None or weight.dim() != 2 or bias_value is None or bias_value.shape != weight.shape[1:]:
            continue
        name = f"linear_from_addmm_{index}_weight"
        program.graph_module.register_buffer(name, weight.detach().t().contiguous())
        with graph.inserting_before(node):
            linear = graph.call_function(aten.linear.default, (x, graph.get_attr(name), bias))
        linear.meta.update({key: value for key, value in node.meta.items() if key != "val"})
        node.replace_all_uses_with(linear)
        graph.erase_node(node)
        converted += 1
    if converted:
        drop_unused_attributes(program)


def _linears_from_transposed_matmul(program: Program) -> None:
    """matmul(x, Wᵀ) with a constant 2-D W [out, in] (Falcon's FalconLinear computes `x @ self.weight.T`) →
    linear(x, W): the same product, in the form quantize, fuse-projections and the lowerings look for (Falcon had
    no linear for --quant to find). A transpose spelled as transpose(W, 0, 1) or permute(W, [1, 0]) counts too."""
    graph = program.graph
    for node in [n for n in graph.nodes if n.target is aten.matmul.default and not n.kwargs]:
        x, transposed = node.args
        if not isinstance(transposed, torch.fx.Node) or not _is_2d_transpose(transposed):
            continue
        weight = constant(program, transposed.args[0])
        if weight is None or weight.dim() != 2:
            continue
        with graph.inserting_before(node):
            linear = graph.call_function(aten.linear.default, (x, transposed.args[0]))
        linear.meta.update(node.meta)
        node.replace_all_uses_with(linear)
        graph.erase_node(node)
        if not transposed.users:
            graph.erase_node(transposed)


def _is_2d_transpose(node: torch.fx.Node) -> bool:
    if node.target in TRANSPOSES:
        return True
    if node.target is aten.transpose.int:
        return sorted(d % 2 for d in node.args[1:3]) == [0, 1]
    return node.target is aten.permute.default and [d % 2 for d in node.args[1]] == [1, 0]
