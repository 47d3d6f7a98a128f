"""Step `untie-quantized-head`: let ONNX Runtime fuse a tied quantized lm_head into MatMulNBits.

before: W = DQ(codes, scales) → MatMul (the lm_head); Gather(codes, ids) and Gather(scales, ids) (the embedding
        reads the same initializers, one stored copy)
after:  the same, with the embedding's Gathers reading Reshape(codes) / Reshape(scales) to the same shape

ONNX Runtime's DQ → MatMulNBits fusion skips a weight initializer that another node also reads, so a tied
quantized lm_head (a GGUF's Q8_0 token_embd, `--quant-lm-head` with tied embeddings) was dequantized to float32
on every step and multiplied as a float32 MatMul. A Reshape in front of the embedding's Gathers is constant-folded
by ONNX Runtime into an in-memory copy of the (small) codes at session creation; the DQ then has its initializers to
itself and fuses. The file keeps one copy; the session holds the copy the Gather reads plus MatMulNBits's packed
weights.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from fxllm.compiler.targets.ort.graph import Builder, constant, copy_shape

NAME = "untie-quantized-head"


def apply(model: ir.Model, context) -> int:
    graph = model.graph
    build = Builder(graph, f"lowering:ort/{NAME}")
    rewritten = 0
    for dequant in list(graph):
        if dequant.op_type != "DequantizeLinear" or dequant.domain not in ("", "ai.onnx"):
            continue
        if not any(user.op_type == "MatMul" for user, _ in dequant.outputs[0].uses()):
            continue
        for value in dequant.inputs[:2]:
            if value is None or not value.is_initializer() or constant(value) is None:
                continue
            others = [(user, index) for user, index in value.uses() if user is not dequant]
            if not others or not all(user.op_type == "Gather" for user, _ in others):
                continue
            shape = build.initializer(f"{value.name}_shape", np.asarray(constant(value).shape, dtype=np.int64))
            for user, index in others:
                copy = build.node("Reshape", [value, shape], before=user, name=f"{value.name}_private_{user.name}")
                copy.outputs[0].name = f"{value.name}_private_{index}_{rewritten}"
                copy.outputs[0].shape, copy.outputs[0].dtype = copy_shape(value), value.dtype
                user.replace_input_with(index, copy.outputs[0])
            rewritten += 1
    return rewritten
