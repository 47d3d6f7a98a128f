"""fxllm's own torch ops: what aten lacks for an inference graph, each with a reference and a fake implementation.

The reference implementations make every rewritten graph runnable in plain torch (per-pass numerics, tests); the
fake implementations keep shape propagation and torch.export working. ONNX translations live in targets/onnx_translations.py.
"""

import torch
import torch.nn.functional as F

Tensor = torch.Tensor


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float, softcap: float = 0.0,
           sinks: Tensor | None = None) -> Tensor:
    """softmax(cap(q·kᵀ·scale) where mask, else −inf ‖ sinks) · v, as transformers' eager attention computes it.
    q [B,Hq,T,D]; k, v [B,Hkv,S,D] (query head h reads KV head h // (Hq / Hkv)); mask bool, broadcastable to
    [B,Hq,T,S] (True = visible). softcap > 0: scores become tanh(s / softcap)·softcap before the mask (Gemma 2).
    sinks [Hq]: one extra logit per head that takes part in the softmax and has no value (GPT-OSS)."""
    if not softcap and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = (q @ k.transpose(-1, -2)) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf")).float()
    if sinks is not None:
        sink = sinks.float().reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        scores = torch.cat([scores, sink], dim=-1)
    probs = scores.softmax(-1)
    if sinks is not None:
        probs = probs[..., :-1]
    return probs.to(v.dtype) @ v


def causal_window(query_pos: Tensor, key_pos: Tensor, window: int) -> Tensor:
    """Bool [..., T, S] for query positions [T] and key positions [S]: key j visible to query i when j <= i and,
    with a sliding window W > 0, i - j < W (the query and its W - 1 predecessors, transformers' convention)."""
    distance = query_pos[:, None] - key_pos[None, :]
    visible = distance >= 0
    return visible & (distance < window) if window > 0 else visible


@torch.library.custom_op("fxllm::attention", mutates_args=())
def attention(q: Tensor, k: Tensor, v: Tensor, scale: float, window: int = 0, softcap: float = 0.0,
              sinks: Tensor | None = None) -> Tensor:
    """Causal attention without a cache. q [B,Hq,T,D]; k, v [B,Hkv,T,D] (Hkv divides Hq, never repeated).
    window > 0: sliding-window attention (see causal_window); softcap, sinks: see attend."""
    if not window and not softcap and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    positions = torch.arange(q.shape[2], device=q.device)
    return attend(q, k, v, causal_window(positions, positions, window), scale, softcap, sinks)


@attention.register_fake
def _attention_fake(q: Tensor, k: Tensor, v: Tensor, scale: float, window: int = 0, softcap: float = 0.0,
                    sinks: Tensor | None = None) -> Tensor:
    return torch.empty_like(q)


@torch.library.custom_op("fxllm::causal_mask", mutates_args=())
def causal_mask(attention_mask: Tensor, input_ids: Tensor, window: int = 0) -> Tensor:
    """Bool mask [B,1,T,S] for T new tokens after S-T cached ones: key j is visible to query i when j <= S-T+i
    (and, with window W > 0, S-T+i - j < W) and attention_mask[b, j] is set. Every query also sees itself, so
    padded rows stay finite (never all -inf)."""
    total = attention_mask.shape[1]
    new = input_ids.shape[1]
    query_pos = torch.arange(new, device=attention_mask.device) + (total - new)
    key_pos = torch.arange(total, device=attention_mask.device)
    causal = causal_window(query_pos, key_pos, window)
    is_self = key_pos[None, :] == query_pos[:, None]
    visible = causal[None] & attention_mask.bool()[:, None, :]
    return (visible | is_self[None])[:, None]


@causal_mask.register_fake
def _causal_mask_fake(attention_mask: Tensor, input_ids: Tensor, window: int = 0) -> Tensor:
    batch, total = attention_mask.shape
    return attention_mask.new_empty((batch, 1, input_ids.shape[1], total), dtype=torch.bool)


@torch.library.custom_op("fxllm::masked_attention", mutates_args=())
def masked_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float, softcap: float = 0.0,
                     sinks: Tensor | None = None) -> Tensor:
    """Attention under an explicit bool mask (True = visible; a sliding window is in the mask). q [B,Hq,T,D];
    k, v [B,Hkv,S,D] (cache included); mask [B,1,T,S]; softcap, sinks: see attend."""
    return attend(q, k, v, mask, scale, softcap, sinks)


@masked_attention.register_fake
def _masked_attention_fake(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float, softcap: float = 0.0,
                           sinks: Tensor | None = None) -> Tensor:
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
def paged_mask(context_lens: Tensor, block_tables: Tensor, input_ids: Tensor, block_size: int,
               window: int = 0) -> Tensor:
    """Bool mask [B,1,T,S+T] for T new tokens after a gathered past of S = n*block_size slots (slot j holds
    position j): past slot j is visible when j < context_lens[b] (the rest of the last block is unfilled), new
    token j when j <= i; with a sliding window W > 0, only keys within W - 1 positions before the query (so past
    blocks wholly before the window are never read and may be released)."""
    past = block_tables.shape[1] * block_size
    new = input_ids.shape[1]
    key_pos = torch.arange(past + new, device=input_ids.device)
    past_visible = key_pos[None, :] < context_lens[:, None]  # [B, S+T]; false for every new position
    query = torch.arange(new, device=input_ids.device)
    new_visible = (key_pos[None, :] >= past) & (key_pos[None, :] - past <= query[:, None])  # [T, S+T]
    visible = past_visible[:, None, None, :] | new_visible[None, None, :, :]
    if window > 0:
        # absolute positions: query i is at context_lens + i; past slot j at j, new token j at context_lens + j
        query_abs = context_lens[:, None] + query[None, :]  # [B, T]
        key_abs = torch.where(key_pos[None, :] >= past, context_lens[:, None] + key_pos[None, :] - past,
                              key_pos[None, :])  # [B, S+T]
        visible = visible & ((query_abs[:, :, None] - key_abs[:, None, :]) < window)[:, None]
    return visible


@paged_mask.register_fake
def _paged_mask_fake(context_lens, block_tables, input_ids, block_size, window=0):
    total = block_tables.shape[1] * block_size + input_ids.shape[1]
    return input_ids.new_empty((input_ids.shape[0], 1, input_ids.shape[1], total), dtype=torch.bool)


GATES = ("none", "concatenated", "interleaved", "clamped-swiglu")
ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "relu")


def activate(x: Tensor, activation: str) -> Tensor:
    if activation == "silu":
        return F.silu(x)
    if activation == "gelu":
        return F.gelu(x)
    if activation == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    if activation == "relu":
        return F.relu(x)
    raise ValueError(f"unknown activation '{activation}'")


def apply_gate(h: Tensor, gate: str, activation: str, alpha: float, limit: float) -> Tensor:
    """An expert's gated activation of its up projection h [..., F]: none: act(h); concatenated: act(g)·u with
    h = [g ‖ u]; interleaved: the same with g, u in the even and odd columns; clamped-swiglu (GPT-OSS): g, u
    interleaved, g ≤ limit, |u| ≤ limit, (u + 1)·g·sigmoid(alpha·g)."""
    if gate == "none":
        return activate(h, activation)
    if gate == "concatenated":
        g, u = h.chunk(2, dim=-1)
    else:
        g, u = h[..., ::2], h[..., 1::2]
    if gate == "clamped-swiglu":
        g, u = g.clamp(max=limit), u.clamp(-limit, limit)
        return (u + 1) * g * torch.sigmoid(g * alpha)
    return activate(g, activation) * u


@torch.library.custom_op("fxllm::moe_experts", mutates_args=())
def moe_experts(x: Tensor, top_k_index: Tensor, top_k_weights: Tensor, up: Tensor, up_bias: Tensor | None,
                down: Tensor, down_bias: Tensor | None, transposed: bool, gate: str, activation: str,
                alpha: float = 0.0, limit: float = 0.0) -> Tensor:
    """A mixture-of-experts layer's experts: x [N, H], each token routed to experts top_k_index [N, k] with
    weights top_k_weights [N, k]. up [E, F, H] and down [E, H, I] as linear weights (out × in), or [E, H, F] and
    [E, I, H] when `transposed`; biases [E, F], [E, H] or None; the gate: see apply_gate. Computed densely: every
    expert on every token, weighted by the routing weights scattered to [N, E] (zero for experts not chosen)."""
    if not transposed:
        up, down = up.transpose(1, 2), down.transpose(1, 2)
    h = torch.matmul(x.unsqueeze(0), up)  # [E, N, F]
    if up_bias is not None:
        h = h + up_bias.unsqueeze(1)
    out = torch.matmul(apply_gate(h, gate, activation, alpha, limit), down)  # [E, N, H]
    if down_bias is not None:
        out = out + down_bias.unsqueeze(1)
    dense = torch.zeros(x.shape[0], up.shape[0], dtype=top_k_weights.dtype, device=x.device)
    dense = dense.scatter(1, top_k_index, top_k_weights)  # [N, E]
    return (out * dense.t().unsqueeze(-1).to(out.dtype)).sum(0).to(x.dtype)


@moe_experts.register_fake
def _moe_experts_fake(x, top_k_index, top_k_weights, up, up_bias, down, down_bias, transposed, gate, activation,
                      alpha=0.0, limit=0.0):
    return torch.empty_like(x)


@torch.library.custom_op("fxllm::dequantize_experts", mutates_args=())
def dequantize_experts(codes: Tensor, scales: Tensor, offsets: Tensor | None, block_size: int,
                       experts: int) -> Tensor:
    """Quantized expert weights → float [E, in, out]: codes [E·in, out] (int8; int4 values in int8), scales (and
    offsets) [E·in / block_size, out], blocks of block_size rows never straddling two experts: one 2D blocked
    dequantize of all experts (the form TensorRT takes), then a reshape."""
    weight = dequantize(codes, scales, block_size, offsets)
    return weight.reshape(experts, -1, codes.shape[1])


@dequantize_experts.register_fake
def _dequantize_experts_fake(codes, scales, offsets, block_size, experts):
    return scales.new_empty((experts, codes.shape[0] // experts, codes.shape[1]))


ATTENTION_OPS = (torch.ops.fxllm.attention.default, torch.ops.fxllm.masked_attention.default)
