"""Step `split-projections`: a fused projection whose output is only split runs as one MatMul per part.

before: a, b = Split(MatMul(x, W), [n_a, n_b], axis=-1)          W [K, n_a + n_b], constant or DQ(constant codes,
                                                                  scales[, zero points]) blocked along K or with
                                                                  a scale per column
after:  a = MatMul(x, W[:, :n_a]);  b = MatMul(x, W[:, n_a:])    (the same columns, so the same numbers)

fuse-projections (a shared pass) makes one GEMV of the projections that read the same activation. The fused
q/k/v stays whole on this target (GroupQueryAttention reads it packed, attention-rotary); what is left as a fused
MatMul + Split is the MLP's gate/up, and there ONNX Runtime's CPU kernels run two MatMuls faster than one MatMul
whose [T, 2·I] output a Split then copies into two tensors: SmolLM2 fp32 decode 0.97–0.99x, a 1,035-token
prefill 0.98x, awq int4 decode 0.95–0.99x at 69 tokens of context (onnxruntime-genai builds its models the same
way). Applies where the MatMul feeds only the Split, the Split cuts the last axis and the weight has no other use.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from fxllm.compiler.quant.numerics import HALF_SUFFIX
from fxllm.compiler.targets.ort.graph import Builder, constant, packed_4bit, producer, take_place
from fxllm.compiler.targets.ort.int4_zero_points import (INT4_SUFFIX, UINT4_CODES_SUFFIX,
                                                          UINT4_ZERO_POINTS_SUFFIX)
from fxllm.compiler.targets.tensorrt_audit import ORIGIN_KEY

NAME = "split-projections"
# names later lowering steps (pack_int4_weights, store_half_scales) know the initializers by
SUFFIXES = (UINT4_CODES_SUFFIX, UINT4_ZERO_POINTS_SUFFIX, INT4_SUFFIX, HALF_SUFFIX)
FOUR_BIT = (ir.DataType.UINT4, ir.DataType.INT4)


def apply(model: ir.Model, context) -> int:
    graph = model.graph
    build = Builder(graph, f"lowering:ort/{NAME}")
    rewritten = 0
    for split in list(graph):
        match = _match(split)
        if match is None:
            continue
        matmul, dequant, sizes = match
        bounds = np.concatenate([[0], np.cumsum(sizes)]).tolist()
        for part, (start, stop) in enumerate(zip(bounds, bounds[1:])):
            weight = _columns(build, matmul.inputs[1], start, stop, part) if dequant is None else \
                _dequantized_columns(build, dequant, start, stop, part, before=matmul)
            new = build.node("MatMul", [matmul.inputs[0], weight], before=matmul, name=f"{matmul.name}_part{part}")
            if ORIGIN_KEY in matmul.metadata_props:  # the same projection: keep where it came from
                new.metadata_props[ORIGIN_KEY] = matmul.metadata_props[ORIGIN_KEY]
            take_place(split.outputs[part], new.outputs[0], "fused")
        rewritten += 1
    return rewritten


def _match(split: ir.Node) -> tuple[ir.Node, ir.Node | None, list[int]] | None:
    """Split(MatMul(x, W), last axis) whose MatMul and weight feed nothing else → (MatMul, DQ or None, sizes)."""
    if split.op_type != "Split" or split.domain not in ("", "ai.onnx"):
        return None
    matmul = producer(split.inputs[0], "MatMul")
    if matmul is None or len(matmul.outputs[0].uses()) != 1 or matmul.outputs[0].shape is None:
        return None
    weight, dequant = matmul.inputs[1], producer(matmul.inputs[1], "DequantizeLinear")
    if len(weight.uses()) != 1:
        return None
    if dequant is not None:
        if any(v is None or constant(v) is None or len(v.uses()) != 1 for v in dequant.inputs):
            return None
        columns = constant(dequant.inputs[0]).shape
        axis, blocked = dequant.attributes.get_int("axis", 1), dequant.attributes.get_int("block_size", 0) > 0
        per_column = axis % 2 == 1 and not blocked and constant(dequant.inputs[1]).ndim == 1  # int8: a scale a column
        if not (axis == 0 and blocked) and not per_column:
            return None
    else:
        if constant(weight) is None:
            return None
        columns = constant(weight).shape
    if len(columns) != 2:
        return None
    rank = len(matmul.outputs[0].shape)
    axis = split.attributes.get_int("axis", 0)
    if axis % rank != rank - 1:
        return None
    if len(split.inputs) > 1 and split.inputs[1] is not None:
        given = constant(split.inputs[1])
        sizes = None if given is None else [int(s) for s in given.ravel()]
    else:
        parts = len(split.outputs)
        sizes = [columns[1] // parts] * parts if columns[1] % parts == 0 else None
    if sizes is None or sum(sizes) != columns[1] or len(sizes) != len(split.outputs):
        return None
    return matmul, dequant, sizes


def _columns(build: Builder, value: ir.Value, start: int, stop: int, part: int) -> ir.Value:
    """An initializer holding columns [start, stop) of the constant `value` (4-bit kept packed)."""
    name = _part_name(value.name, part)
    columns = value.const_value.numpy()[..., start:stop]
    if value.dtype in FOUR_BIT:
        return build.initializer(name, packed_4bit(columns, value.dtype, name))
    return build.initializer(name, ir.tensor(np.ascontiguousarray(columns), name=name))


def _dequantized_columns(build: Builder, dequant: ir.Node, start: int, stop: int, part: int,
                         before: ir.Node) -> ir.Value:
    parts = [_columns(build, value, start, stop, part) for value in dequant.inputs]
    new = build.node("DequantizeLinear", parts, dict(dequant.attributes), before=before,
                     name=f"{dequant.name}_part{part}")
    if ORIGIN_KEY in dequant.metadata_props:
        new.metadata_props[ORIGIN_KEY] = dequant.metadata_props[ORIGIN_KEY]
    new.outputs[0].dtype = dequant.outputs[0].dtype
    new.outputs[0].shape = ir.Shape([parts[0].shape[0], stop - start])
    return new.outputs[0]


def _part_name(name: str, part: int) -> str:
    """`stem_partN` + the suffix a later lowering step recognizes the initializer by, when it has one."""
    for suffix in SUFFIXES:
        if name.endswith(suffix):
            return f"{name.removesuffix(suffix)}_part{part}{suffix}"
    return f"{name}_part{part}"
