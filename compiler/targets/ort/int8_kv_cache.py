"""Step `int8-kv-cache`: GroupQueryAttention's quantized cache, when the compile asks for it
(`--kv-cache-dtype int8`; the step does nothing otherwise).

before: out, present_k, present_v = GroupQueryAttention(q, k, v, past_k, past_v, ...)      float32 caches
after:  the same node with kv_cache_bit_width=8, k_quant_type=v_quant_type=PER_CHANNEL and constant k_scale /
        v_scale [1, kv_heads, 1, head_dim]: past and present are int8 codes, code·scale the cached value

ONNX Runtime's CPU kernel quantizes each new K/V row into the cache (round to nearest, saturated to ±127) and
attends over the dequantized cache, the step's own rows included. The scales are the compile's calibration
(compiler/quant/kv_cache.py: each layer's largest |K| and |V| per KV head and channel over a calibration text, the
rotary embedding applied, / 127). What it buys: a quarter of the cache's bytes (SmolLM2: 46,080 → 11,520 a token),
and decode attention over ~1,000 cached tokens reads a quarter of them (docs/targets.md, "an int8 KV cache"). What
it costs is drift: the compile measures it on the written artifact and records it in the manifest.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from fxllm.compiler.targets.ort.graph import MS_DOMAIN, Builder
from fxllm.errors import UnsupportedModelError
from fxllm.runtime.contract import CONTIGUOUS, TensorSig, parse_cache_name

NAME = "int8-kv-cache"
K_SCALE_INPUT, V_SCALE_INPUT = 12, 13  # GroupQueryAttention's k_scale and v_scale


def apply(model: ir.Model, context) -> int:
    scales = context.kv_cache_scales
    if scales is None:
        return 0
    graph = model.graph
    build = Builder(graph, f"lowering:ort/{NAME}")
    rewritten: set[int] = set()
    for node in graph:
        if node.op_type != "GroupQueryAttention" or node.domain != MS_DOMAIN:
            continue
        role = parse_cache_name(node.inputs[3].name or "") if node.inputs[3] is not None else None
        if role is None or role.cache != CONTIGUOUS or not 0 <= role.layer < len(scales):
            continue
        key_scale, value_scale = scales[role.layer]
        heads, head_dim = key_scale.shape
        if len(node.inputs) < V_SCALE_INPUT + 1:
            node.resize_inputs(V_SCALE_INPUT + 1)
        for index, name, scale in ((K_SCALE_INPUT, "k", key_scale), (V_SCALE_INPUT, "v", value_scale)):
            array = np.asarray(scale, dtype=np.float32).reshape(1, heads, 1, head_dim)
            node.replace_input_with(index, build.initializer(f"kv_cache_{name}_scale_{role.layer}", array))
        for attribute in (ir.AttrString("k_quant_type", "PER_CHANNEL"), ir.AttrString("v_quant_type", "PER_CHANNEL"),
                          ir.AttrInt64("kv_cache_bit_width", 8)):
            node.attributes[attribute.name] = attribute
        for value in (node.inputs[3], node.inputs[4], node.outputs[1], node.outputs[2]):
            value.dtype = ir.DataType.INT8
        rewritten.add(role.layer)
    if len(rewritten) != len(scales):
        raise UnsupportedModelError(
            f"--kv-cache-dtype int8 needs every layer's attention as ONNX Runtime's GroupQueryAttention; "
            f"{len(scales) - len(rewritten)} of {len(scales)} layers kept another form (compile without it)")
    context.inputs = [_int8(sig) for sig in context.inputs]
    context.outputs = [_int8(sig) for sig in context.outputs]
    return len(rewritten)


def _int8(sig: TensorSig) -> TensorSig:
    return TensorSig(sig.name, sig.dims, "int8") if parse_cache_name(sig.name) is not None else sig
