"""ONNX translations of fxllm's torch ops (compiler/ops.py), for torch.onnx.export's custom_translation_table.

Plain functions over onnxscript's opset 23 (a @script function fails to inline across opsets). Only standard ONNX
ops: the same graph must stay parseable by TensorRT's ONNX parser later (see docs/targets.md).
"""

from __future__ import annotations

import torch
from onnxscript import opset23 as op

from fxllm.compiler import ops  # noqa: F401 - registers torch.ops.fxllm.*

BOOL = 9  # onnx.TensorProto.BOOL


def attention(q, k, v, scale: float):
    """fxllm::attention → Attention(is_causal=1); 4D q/k/v, GQA from the head counts of q and k."""
    out, _, _, _ = op.Attention(q, k, v, is_causal=1, scale=scale)
    return out


def causal_mask(attention_mask, input_ids):
    """fxllm::causal_mask → bool [B,1,T,S]: (key ≤ query position ∧ key not padding) ∨ key = query."""
    one = op.Constant(value_int=1)
    total = op.Squeeze(op.Shape(attention_mask, start=1, end=2))
    new = op.Squeeze(op.Shape(input_ids, start=1, end=2))
    query_pos = op.Unsqueeze(op.Range(op.Sub(total, new), total, one), op.Constant(value_ints=[1]))
    key_pos = op.Range(op.Constant(value_int=0), total, one)
    causal = op.LessOrEqual(key_pos, query_pos)
    is_self = op.Equal(key_pos, query_pos)
    not_padding = op.Unsqueeze(op.Cast(attention_mask, to=BOOL), op.Constant(value_ints=[1, 2]))
    return op.Or(op.And(causal, not_padding), is_self)


def masked_attention(q, k, v, mask, scale: float):
    """fxllm::masked_attention → Attention(q, k, v, attn_mask): 4D, no past inputs (the cache concatenation is a
    plain Concat in front), the form both ONNX Runtime and TensorRT's parser accept."""
    out, _, _, _ = op.Attention(q, k, v, mask, scale=scale)
    return out


def dequant_linear(x, qweight, scales, bias, block_size: int):
    """fxllm::dequant_linear → DequantizeLinear (opset 21+: per output column, or blocked along the input axis,
    no zero point) → MatMul (+ Add): the weight-only pattern TensorRT builds quantized GEMMs from and ONNX Runtime
    fuses into MatMulNBits. INT4 weights are packed by lowering (see lower_onnx.pack_int4_weights)."""
    if block_size == 0:
        weight = op.DequantizeLinear(qweight, scales, axis=1)
    else:
        weight = op.DequantizeLinear(qweight, scales, axis=0, block_size=block_size)
    out = op.MatMul(x, weight)
    return op.Add(out, bias) if bias is not None else out


TRANSLATIONS = {
    torch.ops.fxllm.attention.default: attention,
    torch.ops.fxllm.causal_mask.default: causal_mask,
    torch.ops.fxllm.masked_attention.default: masked_attention,
    torch.ops.fxllm.dequant_linear.default: dequant_linear,
}
