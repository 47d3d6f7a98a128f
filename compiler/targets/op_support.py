"""Which ops the ONNX lowering understands: torchlib's registry, its decompositions, and fxllm's own translations."""

from __future__ import annotations

import functools

import torch

# Nodes the exporter drops or folds rather than translates.
IGNORED_TARGETS = {
    "aten._assert_tensor_metadata.default",
    "aten._assert_scalar.default",
    "aten.sym_constrain_range_for_size.default",
    "aten._assert_async.msg",
}


@functools.cache
def _registry():
    import logging

    logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)
    from torch.onnx._internal.exporter import _registration

    return _registration.ONNXRegistry.from_torchlib()


@functools.cache  # a graph calls a few dozen distinct targets thousands of times, and lint asks after every pass
def is_supported(target) -> bool:
    from fxllm.compiler.targets.onnx_translations import TRANSLATIONS

    if target in TRANSLATIONS or str(target) in IGNORED_TARGETS:
        return True
    if not isinstance(target, torch._ops.OpOverload):
        return True  # python callables (operator.getitem, sym ops) are handled by export itself
    if _registry().is_registered(target) or target in torch._decomp.decomposition_table:
        return True
    # CompositeImplicitAutograd ops (to.dtype, linear, diff...) decompose into supported ones during export.
    return target._can_decompose()


def first_unsupported_node(graph_module: torch.fx.GraphModule) -> torch.fx.Node | None:
    for node in graph_module.graph.nodes:
        if node.op == "call_function" and not is_supported(node.target):
            return node
    return None
