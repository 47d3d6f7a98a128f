"""Step `skip-rms-norm`: residual Add + RMSNormalization → com.microsoft.SkipSimplifiedLayerNormalization.

before: s = Add(a, b); y = RMSNormalization(s, gamma, axis=-1, epsilon)   (s also feeds the next residual Add)
after:  y, _, _, s = SkipSimplifiedLayerNormalization(a, b, gamma, epsilon)

One kernel reads a and b once and writes both the normalized value and the sum the residual stream continues
with. ONNX Runtime does not fuse opset-23 RMSNormalization with the Add in front of it by itself (checked with its
optimized model). Exact up to float summation order inside the kernel.
"""

from __future__ import annotations

import onnx_ir as ir

from fxllm.compiler.targets.ort.graph import MS_DOMAIN, Builder, constant, copy_shape, producer

NAME = "skip-rms-norm"


def apply(model: ir.Model, context) -> int:
    graph = model.graph
    build = Builder(graph, f"lowering:ort/{NAME}")
    rewritten = 0
    for norm in list(graph):
        if norm.op_type != "RMSNormalization" or norm.domain not in ("", "ai.onnx") or len(norm.inputs) < 2:
            continue
        add = producer(norm.inputs[0], "Add")
        gamma = norm.inputs[1]
        if add is None or not _same_shape(add.inputs[0], add.inputs[1]) or constant(gamma) is None:
            continue
        if norm.attributes.get_int("axis", -1) not in (-1, _rank(norm.inputs[0]) - 1):
            continue
        if constant(gamma).ndim != 1 or norm.attributes.get_int("stash_type", 1) != 1:
            continue
        epsilon = norm.attributes.get_float("epsilon", 1e-5)
        fused = build.node("SkipSimplifiedLayerNormalization", [add.inputs[0], add.inputs[1], gamma],
                           {"epsilon": epsilon}, before=norm, domain=MS_DOMAIN, outputs=4,
                           name=f"{norm.name}_skip")
        out, total = fused.outputs[0], fused.outputs[3]
        for value, like in ((out, norm.outputs[0]), (total, add.outputs[0])):
            value.shape, value.dtype = copy_shape(like), like.dtype
        total.name = f"{add.outputs[0].name}_skip_sum"
        out.name = f"{norm.outputs[0].name}_skip_out"
        norm.outputs[0].replace_all_uses_with(out, replace_graph_outputs=True)
        add.outputs[0].replace_all_uses_with(total, replace_graph_outputs=True)
        rewritten += 1
    return rewritten


def _rank(value: ir.Value) -> int:
    return len(value.shape) if value.shape is not None else -1


def _same_shape(a: ir.Value, b: ir.Value) -> bool:
    """Both operands of the residual Add have one known, equal shape (the op does not broadcast)."""
    if a.shape is None or b.shape is None or len(a.shape) != len(b.shape) or len(a.shape) not in (2, 3):
        return False
    return all(x == y for x, y in zip(a.shape.dims, b.shape.dims))
