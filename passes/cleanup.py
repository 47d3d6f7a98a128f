"""Pass `cleanup`: drop export's runtime asserts and shape guards, identity casts and dead code.

before: `_assert_tensor_metadata` / `_guards_fn(...)` / `to(x, same dtype)` / unused mask bookkeeping
→ after: only ops that compute (lowering re-exports, which derives its own guards).
"""

from __future__ import annotations

import torch

from fxllm.compiler.pass_registry import register_pass
from fxllm.compiler.program import Program

aten = torch.ops.aten
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
    return program
