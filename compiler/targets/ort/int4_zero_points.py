"""Step `int4-zero-points`: asymmetric int4 as a DequantizeLinear with a zero point instead of the offset term.

before: y = MatMul(x, DQ(c, s)) + MatMul(block_sums(x), o)      c signed int4 codes, o = s·(8 − z) per block
after:  y = MatMul(x, DQ(u, s, z))                               u = c + 8 (UINT4), z (UINT4) per block

The standard form carries the zero point as an exact offset term (Reshape → ReduceSum → MatMul → Add per
projection) because TensorRT's INT4 dequantize takes none. ONNX Runtime does take one: it fuses the DQ → MatMul
with its zero point into one MatMulNBits (at the accuracy level the runtime chooses), so the four to six offset
nodes of every projection disappear. Applies where every block's offset is s·(8 − z) for an integer z in [0, 15]
(int4-rtn/gptq/awq with zero_point=true, to float rounding); a GGUF Q4_1 block's offset (its min) is not, and
keeps the offset term.
Same math, rounded once instead of twice: (u − z)·s against c·s + o.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from fxllm.compiler.targets.ort.graph import Builder, constant, copy_shape, packed_4bit, producer

NAME = "int4-zero-points"
INT4_SUFFIX = "_int4_codes"
UINT4_CODES_SUFFIX, UINT4_ZERO_POINTS_SUFFIX = "_uint4_codes", "_uint4_zero_points"


def apply(model: ir.Model, context) -> int:
    graph = model.graph
    build = Builder(graph, f"lowering:ort/{NAME}")
    rewritten = 0
    for add in list(graph):
        match = _match(add)
        if match is None:
            continue
        dequant, matmul, offsets_value = match
        codes, scales = constant(dequant.inputs[0]), constant(dequant.inputs[1])
        offsets = constant(offsets_value)
        zeros = _integer_zero_points(scales, offsets)
        if zeros is None:
            continue
        name = dequant.inputs[0].name.removesuffix(INT4_SUFFIX)
        codes_name, zeros_name = f"{name}{UINT4_CODES_SUFFIX}", f"{name}{UINT4_ZERO_POINTS_SUFFIX}"
        unsigned = build.initializer(codes_name, packed_4bit(codes.astype(np.int16) + 8, ir.DataType.UINT4, codes_name))
        zero_points = build.initializer(zeros_name, packed_4bit(zeros, ir.DataType.UINT4, zeros_name))
        new = build.node("DequantizeLinear", [unsigned, dequant.inputs[1], zero_points],
                         {"axis": 0, "block_size": dequant.attributes.get_int("block_size")}, before=dequant,
                         name=f"{dequant.name}_zp")
        new.outputs[0].name = f"{dequant.outputs[0].name}_zp"
        new.outputs[0].shape, new.outputs[0].dtype = copy_shape(dequant.outputs[0]), dequant.outputs[0].dtype
        matmul.replace_input_with(1, new.outputs[0])
        add.outputs[0].replace_all_uses_with(matmul.outputs[0], replace_graph_outputs=True)
        rewritten += 1
    return rewritten


def _match(add: ir.Node):
    """Add(MatMul(x, DQ(codes, scales)), MatMul(sums, offsets)) with constant int4 codes → (DQ, MatMul, offsets)."""
    if add.op_type != "Add" or add.domain not in ("", "ai.onnx") or len(add.inputs) != 2:
        return None
    for main_index in (0, 1):
        matmul = producer(add.inputs[main_index], "MatMul")
        offset_matmul = producer(add.inputs[1 - main_index], "MatMul")
        if matmul is None or offset_matmul is None:
            continue
        dequant = producer(matmul.inputs[1], "DequantizeLinear")
        if dequant is None or len(dequant.inputs) != 2 or dequant.attributes.get_int("block_size", 0) <= 0:
            continue
        if not (dequant.inputs[0].name or "").endswith(INT4_SUFFIX) or constant(dequant.inputs[0]) is None:
            continue
        if dequant.attributes.get_int("axis", 1) != 0 or constant(dequant.inputs[1]) is None:
            continue
        if producer(offset_matmul.inputs[0], "ReduceSum") is None:
            continue
        offsets = offset_matmul.inputs[1]
        value = constant(offsets)
        if value is None or value.shape != constant(dequant.inputs[1]).shape:
            continue
        if len(matmul.outputs[0].uses()) != 1 or len(dequant.outputs[0].uses()) != 1:
            continue
        return dequant, matmul, offsets
    return None


def _integer_zero_points(scales: np.ndarray, offsets: np.ndarray) -> np.ndarray | None:
    """Integer z in [0, 15] with offsets = scales·(8 − z) to within a millionth of a quantization step (the
    quantize pass computes them so; folded or fused scales can round the product differently by an ulp), else
    None: a GGUF Q4_1 block's min is no such multiple."""
    scales, offsets = scales.astype(np.float32), offsets.astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        zeros = np.rint(np.float32(8) - offsets / scales)
    if not np.all(np.isfinite(zeros)) or zeros.min() < 0 or zeros.max() > 15:
        return None
    if np.any(np.abs(scales * (np.float32(8) - zeros) - offsets) > 1e-6 * np.abs(scales)):
        return None
    return zeros.astype(np.uint8)

