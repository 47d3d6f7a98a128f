"""fxllm's own torch ops: what aten lacks for an inference graph, each with a reference and a fake implementation.

The reference implementations make every rewritten graph runnable in plain torch (per-pass numerics, tests); the
fake implementations keep shape propagation and torch.export working. ONNX translations live in onnx_translations.py.
"""

import torch
import torch.nn.functional as F

Tensor = torch.Tensor


@torch.library.custom_op("fxllm::attention", mutates_args=())
def attention(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """Causal attention without a cache. q [B,Hq,T,D]; k, v [B,Hkv,T,D] (Hkv divides Hq, never repeated)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)


@attention.register_fake
def _attention_fake(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    return torch.empty_like(q)


@torch.library.custom_op("fxllm::causal_mask", mutates_args=())
def causal_mask(attention_mask: Tensor, input_ids: Tensor) -> Tensor:
    """Bool mask [B,1,T,S] for T new tokens after S-T cached ones: key j is visible to query i when j <= S-T+i and
    attention_mask[b, j] is set. Every query also sees itself, so padded rows stay finite (never all -inf)."""
    total = attention_mask.shape[1]
    new = input_ids.shape[1]
    query_pos = torch.arange(new, device=attention_mask.device) + (total - new)
    key_pos = torch.arange(total, device=attention_mask.device)
    causal = key_pos[None, :] <= query_pos[:, None]
    is_self = key_pos[None, :] == query_pos[:, None]
    visible = causal[None] & attention_mask.bool()[:, None, :]
    return (visible | is_self[None])[:, None]


@causal_mask.register_fake
def _causal_mask_fake(attention_mask: Tensor, input_ids: Tensor) -> Tensor:
    batch, total = attention_mask.shape
    return attention_mask.new_empty((batch, 1, input_ids.shape[1], total), dtype=torch.bool)


@torch.library.custom_op("fxllm::masked_attention", mutates_args=())
def masked_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float) -> Tensor:
    """Attention under an explicit bool mask (True = visible). q [B,Hq,T,D]; k, v [B,Hkv,S,D] (cache included);
    mask [B,1,T,S]."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)


@masked_attention.register_fake
def _masked_attention_fake(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float) -> Tensor:
    return torch.empty_like(q)


def dequantize(qweight: Tensor, scales: Tensor, block_size: int) -> Tensor:
    """W [in, out] from integer qweight [in, out]: per output column (block_size 0, scales [out]) or in blocks of
    block_size rows along the input dim (scales [in / block_size, out])."""
    if block_size == 0:
        return qweight.to(scales.dtype) * scales
    rows, cols = qweight.shape
    blocks = qweight.to(scales.dtype).reshape(rows // block_size, block_size, cols) * scales[:, None, :]
    return blocks.reshape(rows, cols)


@torch.library.custom_op("fxllm::dequant_linear", mutates_args=())
def dequant_linear(x: Tensor, qweight: Tensor, scales: Tensor, bias: Tensor | None, block_size: int) -> Tensor:
    """x @ dequantize(qweight, scales) (+ bias): a weight-only quantized linear layer; qweight [in, out] holds int8
    values (int4 values when block_size > 0, packed to INT4 in ONNX)."""
    out = x @ dequantize(qweight, scales, block_size)
    return out + bias if bias is not None else out


@dequant_linear.register_fake
def _dequant_linear_fake(x, qweight, scales, bias, block_size):
    return x.new_empty((*x.shape[:-1], qweight.shape[1]))


ATTENTION_OPS = (torch.ops.fxllm.attention.default, torch.ops.fxllm.masked_attention.default)
