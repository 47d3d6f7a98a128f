"""fxllm's own torch ops: what aten lacks for an inference graph, each with a reference and a fake implementation.

The reference implementations make every rewritten graph runnable in plain torch (per-pass numerics, tests); the
fake implementations keep shape propagation and torch.export working. ONNX translations live in targets/onnx_translations.py.
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


def dequantize(qweight: Tensor, scales: Tensor, block_size: int, offsets: Tensor | None = None) -> Tensor:
    """W [in, out] from integer qweight [in, out]: per output column (block_size 0, scales [out]) or in blocks of
    block_size rows along the input dim (scales [ceil(in / block_size), out]; the last block may be shorter).
    offsets (asymmetric formats; same shape as blocked scales) are added per block: w = s·q + offset."""
    if block_size == 0:
        return qweight.to(scales.dtype) * scales
    rows = qweight.shape[0]
    weight = qweight.to(scales.dtype) * scales.repeat_interleave(block_size, 0)[:rows]
    if offsets is not None:
        weight = weight + offsets.to(scales.dtype).repeat_interleave(block_size, 0)[:rows]
    return weight


@torch.library.custom_op("fxllm::dequant_linear", mutates_args=())
def dequant_linear(x: Tensor, qweight: Tensor, scales: Tensor, offsets: Tensor | None, bias: Tensor | None,
                   block_size: int) -> Tensor:
    """x @ dequantize(qweight, scales, offsets) (+ bias): a weight-only quantized linear layer; qweight [in, out]
    holds int8 values, or int4 values stored in int8 (the quantize pass names those buffers *_int4_codes; lowering
    packs them); offsets [blocks, out] (asymmetric formats) or None."""
    out = x @ dequantize(qweight, scales.to(x.dtype), block_size, offsets)
    return out + bias if bias is not None else out


@dequant_linear.register_fake
def _dequant_linear_fake(x, qweight, scales, offsets, bias, block_size):
    return x.new_empty((*x.shape[:-1], qweight.shape[1]))


@torch.library.custom_op("fxllm::dequant_embedding", mutates_args=())
def dequant_embedding(codes: Tensor, scales: Tensor, ids: Tensor, block_size: int, transposed: bool = False) -> Tensor:
    """Rows of a quantized embedding table: codes [vocab, hidden] (int8; int4 values in int8), scales
    [vocab, ceil(hidden / block_size)] → float [..., hidden] for ids [...]. transposed: codes [hidden, vocab] and
    scales [blocks, vocab], i.e. a tied lm_head's own dequant_linear weight, read column-wise (one stored copy)."""
    if transposed:
        return dequantize(codes[:, ids.reshape(-1)], scales[:, ids.reshape(-1)].to(torch.float32), block_size
                          ).t().reshape(*ids.shape, codes.shape[0])
    rows = codes[ids].to(scales.dtype)
    return rows * scales[ids].repeat_interleave(block_size, -1)[..., : codes.shape[1]]


@dequant_embedding.register_fake
def _dequant_embedding_fake(codes, scales, ids, block_size, transposed=False):
    return scales.new_empty((*ids.shape, codes.shape[0] if transposed else codes.shape[1]), dtype=torch.float32)


@torch.library.custom_op("fxllm::gather_blocks", mutates_args=())
def gather_blocks(pool: Tensor, block_tables: Tensor) -> Tensor:
    """A paged cache read: pool [num_blocks, block_size, Hkv, D], block_tables [B, n] → [B, Hkv, n*block_size, D],
    each sequence's blocks in table order (only the listed blocks are read, never the whole pool)."""
    batch, count = block_tables.shape
    rows = pool[block_tables]  # [B, n, block_size, Hkv, D]
    return rows.reshape(batch, count * pool.shape[1], pool.shape[2], pool.shape[3]).transpose(1, 2).contiguous()


@gather_blocks.register_fake
def _gather_blocks_fake(pool, block_tables):
    batch, count = block_tables.shape
    return pool.new_empty((batch, pool.shape[2], count * pool.shape[1], pool.shape[3]))


@torch.library.custom_op("fxllm::paged_mask", mutates_args=())
def paged_mask(context_lens: Tensor, block_tables: Tensor, input_ids: Tensor, block_size: int) -> Tensor:
    """Bool mask [B,1,T,S+T] for T new tokens after a gathered past of S = n*block_size slots: past slot j is
    visible when j < context_lens[b] (the rest of the last block is unfilled), new token j when j <= i."""
    past = block_tables.shape[1] * block_size
    new = input_ids.shape[1]
    key_pos = torch.arange(past + new, device=input_ids.device)
    past_visible = key_pos[None, :] < context_lens[:, None]  # [B, S+T]; false for every new position
    query = torch.arange(new, device=input_ids.device)
    new_visible = (key_pos[None, :] >= past) & (key_pos[None, :] - past <= query[:, None])  # [T, S+T]
    return (past_visible[:, None, None, :] | new_visible[None, None, :, :])


@paged_mask.register_fake
def _paged_mask_fake(context_lens, block_tables, input_ids, block_size):
    total = block_tables.shape[1] * block_size + input_ids.shape[1]
    return input_ids.new_empty((input_ids.shape[0], 1, input_ids.shape[1], total), dtype=torch.bool)


ATTENTION_OPS = (torch.ops.fxllm.attention.default, torch.ops.fxllm.masked_attention.default)
