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


def dequant_linear(x, qweight, scales, offsets, bias, block_size: int):
    """fxllm::dequant_linear → DequantizeLinear (opset 21+: per output column, or blocked along the input axis,
    no zero point) → MatMul (+ Add): the weight-only pattern TensorRT builds quantized GEMMs from and ONNX Runtime
    fuses into MatMulNBits. INT4 weights are packed by lowering (see onnx_export.pack_int4_weights). Asymmetric
    formats add their per-block offsets exactly, in standard ops: the input summed per block, times the small
    [blocks, out] offset matrix (TensorRT's INT4 path takes no zero point; see block_sums)."""
    if block_size == 0:
        weight = op.DequantizeLinear(qweight, scales, axis=1)
    else:
        weight = op.DequantizeLinear(qweight, scales, axis=0, block_size=block_size)
    out = op.MatMul(x, weight)
    if offsets is not None:
        out = op.Add(out, op.MatMul(block_sums(x, block_size, qweight.shape[0]), offsets))
    return op.Add(out, bias) if bias is not None else out


def block_sums(x, block_size: int, in_features: int):
    """[..., K] → [..., ceil(K / block_size)]: x summed over each block of the last dim; a ragged last block is
    padded with zeros first."""
    pad = -in_features % block_size
    if pad:
        zeros = op.ConstantOfShape(op.Concat(op.Shape(x, start=0, end=-1), op.Constant(value_ints=[pad]), axis=0))
        x = op.Concat(x, zeros, axis=-1)
    shape = op.Concat(op.Shape(x, start=0, end=-1), op.Constant(value_ints=[-1, block_size]), axis=0)
    return op.ReduceSum(op.Reshape(x, shape), op.Constant(value_ints=[-1]), keepdims=0)


def dequant_embedding(codes, scales, ids, block_size: int, transposed: bool = False):
    """fxllm::dequant_embedding → Gather the rows' codes and scales, then a DequantizeLinear blocked along the hidden
    axis: only the looked-up rows are dequantized. Done on 2D [ids, hidden] (TensorRT's dequantize takes rank <= 2
    scales), then reshaped to [..., hidden]. transposed: the tied lm_head's [hidden, vocab] weight, gathered by
    column, dequantized along axis 0 and transposed."""
    flat_ids = op.Reshape(ids, op.Constant(value_ints=[-1]))
    axis = 1 if transposed else 0
    rows = op.Gather(codes, flat_ids, axis=axis)
    row_scales = op.Gather(scales, flat_ids, axis=axis)
    values = op.DequantizeLinear(rows, row_scales, axis=1 - axis, block_size=block_size)
    if transposed:
        values = op.Transpose(values, perm=[1, 0])
    hidden = op.Shape(codes, start=1 - axis, end=2 - axis)
    return op.Reshape(values, op.Concat(op.Shape(ids), hidden, axis=0))


def gather_blocks(pool, block_tables):
    """fxllm::gather_blocks → one Gather of head_dim-wide rows straight into [B, Hkv, n*bs, D]: the pool viewed as
    [blocks*bs*Hkv, D] rows, row index (table[b, s // bs]·bs + s % bs)·Hkv + h for head h and position s. The index
    depends on the block table only, so CSE leaves one per graph; no Transpose of the gathered context follows
    (gathering whole blocks needs one: [B, n, bs, Hkv, D] → [B, Hkv, n·bs, D])."""
    zero, one = op.Constant(value_int=0), op.Constant(value_int=1)
    block_size = op.Squeeze(op.Shape(pool, start=1, end=2))
    heads = op.Squeeze(op.Shape(pool, start=2, end=3))
    positions = op.Range(zero, op.Mul(op.Squeeze(op.Shape(block_tables, start=1, end=2)), block_size), one)  # [S]
    blocks = op.Gather(block_tables, op.Div(positions, block_size), axis=1)  # [B, S]
    slots = op.Add(op.Mul(blocks, block_size), op.Mod(positions, block_size))  # [B, S]
    head = op.Unsqueeze(op.Range(zero, heads, one), op.Constant(value_ints=[0, 2]))  # [1, Hkv, 1]
    rows = op.Add(op.Mul(op.Unsqueeze(slots, op.Constant(value_ints=[1])), heads), head)  # [B, Hkv, S]
    flat = op.Reshape(pool, op.Concat(op.Constant(value_ints=[-1]), op.Shape(pool, start=3, end=4), axis=0))
    return op.Gather(flat, rows, axis=0)


def paged_mask(context_lens, block_tables, input_ids, block_size: int):
    """fxllm::paged_mask → bool [B,1,T,S+T]: (key < context_len) ∨ (key ≥ S ∧ key − S ≤ query)."""
    zero, one = op.Constant(value_int=0), op.Constant(value_int=1)
    past = op.Mul(op.Squeeze(op.Shape(block_tables, start=1, end=2)), op.Constant(value_int=block_size))
    new = op.Squeeze(op.Shape(input_ids, start=1, end=2))
    key_pos = op.Range(zero, op.Add(past, new), one)
    lens = op.Unsqueeze(context_lens, op.Constant(value_ints=[1]))
    past_visible = op.Unsqueeze(op.Less(key_pos, lens), op.Constant(value_ints=[1, 2]))  # [B,1,1,S+T]
    query = op.Unsqueeze(op.Range(zero, new, one), op.Constant(value_ints=[1]))  # [T,1]
    relative = op.Sub(key_pos, past)
    new_visible = op.And(op.GreaterOrEqual(relative, zero), op.LessOrEqual(relative, query))  # [T,S+T]
    return op.Or(past_visible, new_visible)


TRANSLATIONS = {
    torch.ops.fxllm.attention.default: attention,
    torch.ops.fxllm.causal_mask.default: causal_mask,
    torch.ops.fxllm.masked_attention.default: masked_attention,
    torch.ops.fxllm.dequant_linear.default: dequant_linear,
    torch.ops.fxllm.dequant_embedding.default: dequant_embedding,
    torch.ops.fxllm.gather_blocks.default: gather_blocks,
    torch.ops.fxllm.paged_mask.default: paged_mask,
}
