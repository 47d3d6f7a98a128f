"""ONNX translations of fxllm's torch ops (compiler/ops.py), for torch.onnx.export's custom_translation_table.

Plain functions over onnxscript's opset 23 (a @script function fails to inline across opsets). Only standard ONNX
ops: the same graph must stay parseable by TensorRT's ONNX parser later (see docs/targets.md).
"""

from __future__ import annotations

import torch
from onnxscript import opset23 as op

from fxllm.compiler import ops  # noqa: F401 - registers torch.ops.fxllm.*

BOOL = 9  # onnx.TensorProto.BOOL


def attention(q, k, v, scale: float, window: int = 0, softcap: float = 0.0, sinks=None):
    """fxllm::attention → Attention(is_causal=1); 4D q/k/v, GQA from the head counts of q and k. A sliding window,
    soft-capping or sinks go through masked_attention with the causal (windowed) mask built here."""
    if not window and not softcap and sinks is None:
        out, _, _, _ = op.Attention(q, k, v, is_causal=1, scale=scale)
        return out
    one = op.Constant(value_int=1)
    positions = op.Range(op.Constant(value_int=0), op.Squeeze(op.Shape(q, start=2, end=3)), one)
    return masked_attention(q, k, v, _causal_window(op.Unsqueeze(positions, op.Constant(value_ints=[1])), positions,
                                                    window), scale, softcap, sinks)


def _causal_window(query_pos, key_pos, window: int):
    """bool [T,S] from query positions [T,1] and key positions [S]: 0 <= query − key (< window when window > 0)."""
    distance = op.Sub(query_pos, key_pos)
    visible = op.GreaterOrEqual(distance, op.Constant(value_int=0))
    return op.And(visible, op.Less(distance, op.Constant(value_int=window))) if window > 0 else visible


def causal_mask(attention_mask, input_ids, window: int = 0):
    """fxllm::causal_mask → bool [B,1,T,S]: (key causally visible, within the window if any ∧ key not padding) ∨
    key = query."""
    one = op.Constant(value_int=1)
    total = op.Squeeze(op.Shape(attention_mask, start=1, end=2))
    new = op.Squeeze(op.Shape(input_ids, start=1, end=2))
    query_pos = op.Unsqueeze(op.Range(op.Sub(total, new), total, one), op.Constant(value_ints=[1]))
    key_pos = op.Range(op.Constant(value_int=0), total, one)
    causal = _causal_window(query_pos, key_pos, window)
    is_self = op.Equal(key_pos, query_pos)
    not_padding = op.Unsqueeze(op.Cast(attention_mask, to=BOOL), op.Constant(value_ints=[1, 2]))
    return op.Or(op.And(causal, not_padding), is_self)


def masked_attention(q, k, v, mask, scale: float, softcap: float = 0.0, sinks=None):
    """fxllm::masked_attention → Attention(q, k, v, attn_mask): 4D, no past inputs (the cache concatenation is a
    plain Concat in front), the form both ONNX Runtime and TensorRT's parser accept. With soft-capping or sinks, the
    attention is written out in standard ops instead (explicit_attention): the Attention op has no sinks, and its
    softcap is applied after the mask by some implementations (ONNX Runtime's kernel included), which leaks
    probability onto masked keys."""
    if softcap or sinks is not None:
        return explicit_attention(q, k, v, mask, scale, softcap, sinks)
    out, _, _, _ = op.Attention(q, k, v, mask, scale=scale)
    return out


def explicit_attention(q, k, v, mask, scale: float, softcap: float, sinks):
    """softmax(cap(q·kᵀ·scale) where mask else −inf ‖ sinks)·v in MatMul/Tanh/Where/Softmax (compiler/ops.attend):
    K/V are repeated to the query heads (static head counts), the sink logit [Hq] is one more softmax column that
    is dropped after the softmax. Scores are float32 whatever the model's dtype, as in transformers."""
    q_heads, kv_heads = q.shape[1], k.shape[1]
    if q_heads != kv_heads:
        k, v = _repeat_heads(k, q_heads // kv_heads), _repeat_heads(v, q_heads // kv_heads)
    float32 = 1  # onnx.TensorProto.FLOAT
    scores = op.Mul(op.Cast(op.MatMul(q, op.Transpose(k, perm=[0, 1, 3, 2])), to=float32),
                    op.Constant(value_float=scale))
    if softcap:
        cap = op.Constant(value_float=softcap)
        scores = op.Mul(op.Tanh(op.Div(scores, cap)), cap)
    scores = op.Where(mask, scores, op.Constant(value_float=float("-inf")))
    if sinks is not None:
        column = op.Reshape(op.Cast(sinks, to=float32), op.Constant(value_ints=[1, q_heads, 1, 1]))
        shape = op.Concat(op.Shape(scores, start=0, end=3), op.Constant(value_ints=[1]), axis=0)
        scores = op.Concat(scores, op.Expand(column, shape), axis=-1)
    probs = op.Softmax(scores, axis=-1)
    if sinks is not None:
        probs = op.Slice(probs, op.Constant(value_ints=[0]), op.Constant(value_ints=[-1]),
                         op.Constant(value_ints=[-1]))
    return op.MatMul(op.CastLike(probs, v), v)


def _repeat_heads(states, groups: int):
    """[B,Hkv,S,D] → [B,Hkv·groups,S,D], head h reading source head h // groups (transformers' repeat_kv)."""
    expanded = op.Unsqueeze(states, op.Constant(value_ints=[2]))
    shape = op.Concat(op.Shape(states, start=0, end=2), op.Constant(value_ints=[groups]),
                      op.Shape(states, start=2, end=4), axis=0)
    flat = op.Concat(op.Constant(value_ints=[0, -1]), op.Shape(states, start=2, end=4), axis=0)
    return op.Reshape(op.Expand(expanded, shape), flat)


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
    padded with zeros first. With x's rank known (the exporter's usual case) the padding and the block reshape take
    constant operands (Pad, Reshape to [0, .., 0, -1, block]): the dynamic form's Shape → Concat per projection are
    two more nodes that ONNX Runtime runs every step (a GGUF Q4_1 artifact has 120 such sums; see docs/targets.md)."""
    pad = -in_features % block_size
    rank = len(x.shape) if getattr(x, "shape", None) is not None else None
    if rank:
        if pad:
            x = op.Pad(x, op.Constant(value_ints=[0] * (2 * rank - 1) + [pad]))
        shape = op.Constant(value_ints=[0] * (rank - 1) + [-1, block_size])
    else:
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


def paged_mask(context_lens, block_tables, input_ids, block_size: int, window: int = 0):
    """fxllm::paged_mask → bool [B,1,T,S+T]: (key < context_len) ∨ (key ≥ S ∧ key − S ≤ query); with a sliding
    window, ∧ query − key < window on absolute positions (query i at context_len + i, past slot j at j, new token
    j at context_len + j)."""
    zero, one = op.Constant(value_int=0), op.Constant(value_int=1)
    past = op.Mul(op.Squeeze(op.Shape(block_tables, start=1, end=2)), op.Constant(value_int=block_size))
    new = op.Squeeze(op.Shape(input_ids, start=1, end=2))
    key_pos = op.Range(zero, op.Add(past, new), one)
    lens = op.Unsqueeze(context_lens, op.Constant(value_ints=[1]))  # [B,1]
    past_visible = op.Unsqueeze(op.Less(key_pos, lens), op.Constant(value_ints=[1, 2]))  # [B,1,1,S+T]
    query = op.Unsqueeze(op.Range(zero, new, one), op.Constant(value_ints=[1]))  # [T,1]
    relative = op.Sub(key_pos, past)
    new_visible = op.And(op.GreaterOrEqual(relative, zero), op.LessOrEqual(relative, query))  # [T,S+T]
    visible = op.Or(past_visible, new_visible)
    if window <= 0:
        return visible
    is_new = op.GreaterOrEqual(relative, zero)  # [S+T]
    key_abs = op.Where(is_new, op.Add(lens, relative), key_pos)  # [B,S+T]
    query_abs = op.Add(lens, op.Reshape(query, op.Constant(value_ints=[1, -1])))  # [B,T]
    distance = op.Sub(op.Unsqueeze(query_abs, op.Constant(value_ints=[2])),
                      op.Unsqueeze(key_abs, op.Constant(value_ints=[1])))  # [B,T,S+T]
    in_window = op.Unsqueeze(op.Less(distance, op.Constant(value_int=window)), op.Constant(value_ints=[1]))
    return op.And(visible, in_window)


def moe_experts(x, top_k_index, top_k_weights, up, up_bias, down, down_bias, transposed: bool, gate: str,
                activation: str, alpha: float = 0.0, limit: float = 0.0):
    """fxllm::moe_experts → dense experts in standard ops: MatMul of x [1, N, H] with every expert's up weight
    [E, H, F] (a Transpose of the stored [E, F, H] unless `transposed`; constant-folded), the gate, MatMul with
    the down weights [E, I, H], each expert's output weighted by the routing weights scattered to [E, N, 1]
    (ScatterElements; zero for experts a token did not choose) and summed over the experts."""
    if not transposed:
        up, down = op.Transpose(up, perm=[0, 2, 1]), op.Transpose(down, perm=[0, 2, 1])
    h = op.MatMul(op.Unsqueeze(x, op.Constant(value_ints=[0])), up)  # [E, N, F]
    if up_bias is not None:
        h = op.Add(h, op.Unsqueeze(up_bias, op.Constant(value_ints=[1])))
    out = op.MatMul(_gate(h, gate, activation, alpha, limit), down)  # [E, N, H]
    if down_bias is not None:
        out = op.Add(out, op.Unsqueeze(down_bias, op.Constant(value_ints=[1])))
    experts = op.Shape(up, start=0, end=1)
    zeros = op.ConstantOfShape(op.Concat(op.Shape(x, start=0, end=1), experts, axis=0))  # [N, E] float32
    dense = op.ScatterElements(op.CastLike(zeros, top_k_weights), top_k_index, top_k_weights, axis=1)
    weights = op.Unsqueeze(op.Transpose(op.CastLike(dense, out), perm=[1, 0]), op.Constant(value_ints=[2]))
    return op.ReduceSum(op.Mul(out, weights), op.Constant(value_ints=[0]), keepdims=0)


def _gate(h, gate: str, activation: str, alpha: float, limit: float):
    """compiler/ops.apply_gate in standard ops."""
    if gate == "none":
        return _activate(h, activation)
    if gate == "concatenated":
        g, u = op.Split(h, num_outputs=2, axis=-1)
    else:
        pairs = op.Reshape(h, op.Concat(op.Shape(h, start=0, end=-1), op.Constant(value_ints=[-1, 2]), axis=0))
        g = op.Squeeze(op.Slice(pairs, op.Constant(value_ints=[0]), op.Constant(value_ints=[1]),
                                op.Constant(value_ints=[-1])), op.Constant(value_ints=[-1]))
        u = op.Squeeze(op.Slice(pairs, op.Constant(value_ints=[1]), op.Constant(value_ints=[2]),
                                op.Constant(value_ints=[-1])), op.Constant(value_ints=[-1]))
    if gate == "clamped-swiglu":
        cap = op.CastLike(op.Constant(value_float=limit), h)
        g = op.Min(g, cap)
        u = op.Max(op.Min(u, cap), op.Neg(cap))
        one = op.CastLike(op.Constant(value_float=1.0), h)
        return op.Mul(op.Add(u, one), op.Mul(g, op.Sigmoid(op.Mul(g, op.CastLike(op.Constant(value_float=alpha), h)))))
    return op.Mul(_activate(g, activation), u)


def _activate(x, activation: str):
    if activation == "silu":
        return op.Mul(x, op.Sigmoid(x))
    if activation == "gelu":
        return op.Gelu(x)
    if activation == "gelu_tanh":
        return op.Gelu(x, approximate="tanh")
    return op.Relu(x)


def dequantize_experts(codes, scales, offsets, block_size: int, experts: int):
    """fxllm::dequantize_experts → one 2D DequantizeLinear blocked along axis 0 (no zero point; TensorRT's form),
    offsets added per block, then Reshape to [E, in, out]."""
    weight = op.DequantizeLinear(codes, scales, axis=0, block_size=block_size)
    if offsets is not None:
        blocks = op.Reshape(weight, op.Concat(op.Constant(value_ints=[-1, block_size]), op.Shape(weight, start=1),
                                              axis=0))
        weight = op.Reshape(op.Add(blocks, op.Unsqueeze(offsets, op.Constant(value_ints=[1]))), op.Shape(weight))
    return op.Reshape(weight, op.Concat(op.Constant(value_ints=[experts, -1]), op.Shape(weight, start=1), axis=0))


TRANSLATIONS = {
    torch.ops.fxllm.attention.default: attention,
    torch.ops.fxllm.causal_mask.default: causal_mask,
    torch.ops.fxllm.masked_attention.default: masked_attention,
    torch.ops.fxllm.dequant_linear.default: dequant_linear,
    torch.ops.fxllm.dequant_embedding.default: dequant_embedding,
    torch.ops.fxllm.gather_blocks.default: gather_blocks,
    torch.ops.fxllm.paged_mask.default: paged_mask,
    torch.ops.fxllm.moe_experts.default: moe_experts,
    torch.ops.fxllm.dequantize_experts.default: dequantize_experts,
}
