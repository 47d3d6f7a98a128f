"""Pass `quantize`: weight-only quantization of linear layers.

before: linear(x, W [out, in], b)
→ after: dequant_linear(x, Q [in, out], S, b, block): int8 per output channel (S [out]) or int4 round-to-nearest in
blocks of `group_size` along the input dim (S [in/group_size, out]); symmetric, no zero point. In ONNX:
DequantizeLinear → MatMul. The lm_head (the linear producing the logits) stays float unless lm_head=true.
"""

from __future__ import annotations

import torch

from fxllm.compiler.pass_registry import register_pass
from fxllm.compiler.program import Program
from fxllm.compiler.projections import constant, drop_unused_attributes
from fxllm.errors import PipelineError

aten = torch.ops.aten
METHODS = ("int8", "int4-rtn")
PLANNED = ("int4-gptq", "int4-awq")
QMAX = {"int8": 127, "int4-rtn": 7}
QMIN = {"int8": -127, "int4-rtn": -8}


def quantize_int8(weight_t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight_t [in, out] → (int8 [in, out], scales [out]): symmetric per output channel."""
    scales = weight_t.abs().amax(0).clamp_min(1e-12) / QMAX["int8"]
    q = torch.round(weight_t / scales).clamp(QMIN["int8"], QMAX["int8"]).to(torch.int8)
    return q, scales.to(weight_t.dtype)


def quantize_int4_rtn(weight_t: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """weight_t [in, out] → (int8 holding -8..7 [in, out], scales [in/group_size, out]): symmetric, blockwise."""
    rows, cols = weight_t.shape
    blocks = weight_t.reshape(rows // group_size, group_size, cols)
    scales = blocks.abs().amax(1).clamp_min(1e-12) / QMAX["int4-rtn"]
    q = torch.round(blocks / scales[:, None, :]).clamp(QMIN["int4-rtn"], QMAX["int4-rtn"]).to(torch.int8)
    return q.reshape(rows, cols), scales.to(weight_t.dtype)


def _logits_linear(program: Program) -> torch.fx.Node | None:
    logits = program.output_node().args[0][0]
    return logits if getattr(logits, "target", None) is aten.linear.default else None


@register_pass("quantize", requires=("captured",), provides=("quantized",), forbids=("quantized", "kv-cache"),
               exact=False)
def quantize(program: Program, *, method: str = "int8", group_size: int = 128, lm_head: bool = False) -> Program:
    """Weight-only quantization of linear layers (int8 per channel, int4 RTN blockwise)."""
    if method in PLANNED:
        raise PipelineError(f"quantize method '{method}' is not implemented yet (available: {', '.join(METHODS)})")
    if method not in METHODS:
        raise PipelineError(f"unknown quantize method '{method}' (available: {', '.join(METHODS)})")
    if method != "int8" and (group_size < 16 or group_size & (group_size - 1)):
        raise PipelineError(f"quantize: group_size must be a power of two >= 16, got {group_size}")
    graph = program.graph
    head = _logits_linear(program)
    targets = [n for n in graph.nodes if n.target is aten.linear.default and (lm_head or n is not head)
               and constant(program, n.args[1]) is not None]
    for index, node in enumerate(targets):
        weight = constant(program, node.args[1])
        if method != "int8" and weight.shape[1] % group_size:
            raise PipelineError(
                f"quantize: input dim {weight.shape[1]} of '{node.name}' is not a multiple of group_size "
                f"{group_size}; choose a group size that divides it (fxllm does not pad)"
            )
        weight_t = weight.detach().t().contiguous()
        if method == "int8":
            qweight, scales, block = *quantize_int8(weight_t), 0
        else:
            qweight, scales, block = *quantize_int4_rtn(weight_t, group_size), group_size
        bits = 8 if method == "int8" else 4
        program.graph_module.register_buffer(f"qweight{bits}_{index}", qweight)
        program.graph_module.register_buffer(f"qscale{bits}_{index}", scales)
        bias = node.args[2] if len(node.args) > 2 else None
        with graph.inserting_before(node):
            replacement = graph.call_function(torch.ops.fxllm.dequant_linear.default, (
                node.args[0], graph.get_attr(f"qweight{bits}_{index}"), graph.get_attr(f"qscale{bits}_{index}"),
                bias, block))
        node.replace_all_uses_with(replacement)
        graph.erase_node(node)
    drop_unused_attributes(program)
    program.spec.notes.append(f"quantize: {method}" + (f", group size {group_size}" if method != "int8" else "")
                              + (", lm_head quantized" if lm_head else ", lm_head float"))
    return program
