"""Weight-only quantization of mixture-of-experts weights (the `quantize` pass's part for fxllm::moe_experts).

Each expert's up and down matrices are rounded to nearest in the pass's format (int8: one scale per output
channel, int4: blocks of `group_size` input rows, optionally asymmetric), whatever the method: GPTQ and AWQ
calibrate the dense linears, whose inputs the calibration walk sees; an expert sees only the tokens routed to it.
The codes of all experts are stored as one [E·in, out] matrix, so one 2D blocked DequantizeLinear per weight
dequantizes them (fxllm::dequantize_experts); the MoE node then reads the weights transposed ([E, in, out]).
"""

from __future__ import annotations

import dataclasses

import torch

from fxllm.compiler.projections import constant
from fxllm.compiler.quant.numerics import QuantFormat, dequantize_codes, relative_error, round_to_nearest

UP, DOWN, TRANSPOSED = 3, 5, 7  # argument positions of fxllm::moe_experts


def quantize_experts(program, fmt: QuantFormat) -> tuple[list[dict], list[str]]:
    """Rewrite every fxllm.moe_experts node's constant expert weights to dequantize_experts of stored codes;
    → (per-weight report rows, notes on weights left in float)."""
    graph = program.graph
    rows, notes = [], []
    for index, node in enumerate([n for n in graph.nodes if n.target is torch.ops.fxllm.moe_experts.default]):
        weights = [constant(program, node.args[position]) for position in (UP, DOWN)]
        if any(w is None for w in weights):
            notes.append(f"{node.name}: expert weights are not constants; left in float")
            continue
        matrices = [_as_out_in(w.detach(), node.args[TRANSPOSED]) for w in weights]  # [E, out, in] each
        if any(m.shape[2] % (fmt.group_size or m.shape[2]) for m in matrices):
            notes.append(f"{node.name}: expert input widths {[m.shape[2] for m in matrices]} are not whole blocks "
                         f"of {fmt.group_size}; left in float")
            continue
        replacements = []
        for kind, matrix in zip(("up", "down"), matrices):
            # per output channel == one block spanning the expert's whole input
            expert_fmt = dataclasses.replace(fmt, group_size=fmt.group_size or matrix.shape[2])
            replacements.append(_store(program, node, f"experts_{index}_{kind}", matrix, expert_fmt))
            rows.append(_report(node, kind, matrix, expert_fmt, program, f"experts_{index}_{kind}"))
        node.update_arg(UP, replacements[0])
        node.update_arg(DOWN, replacements[1])
        node.update_arg(TRANSPOSED, True)
    return rows, notes


def _as_out_in(weight: torch.Tensor, transposed: bool) -> torch.Tensor:
    """Expert weights as [E, out, in] (transposed storage is [E, in, out])."""
    return weight.transpose(1, 2) if transposed else weight


def _store(program, node, prefix: str, matrix: torch.Tensor, fmt: QuantFormat):
    """Quantize [E, out, in] per expert, register codes [E·in, out] and scales/offsets [E·blocks, out], and insert
    the dequantize_experts node in front of `node`."""
    parts = [round_to_nearest(expert, fmt) for expert in matrix]
    codes = torch.cat([p.codes.t() for p in parts])
    scales = torch.cat([p.scales for p in parts])
    offsets = torch.cat([p.offsets for p in parts]) if parts[0].offsets is not None else None
    names = {"codes": f"{prefix}_int{fmt.bits}_codes", "scales": f"{prefix}_scales", "offsets": f"{prefix}_offsets"}
    module = program.graph_module
    module.register_buffer(names["codes"], codes.contiguous())
    module.register_buffer(names["scales"], scales.contiguous())
    if offsets is not None:
        module.register_buffer(names["offsets"], offsets.contiguous())
    graph = program.graph
    with graph.inserting_before(node):
        return graph.call_function(torch.ops.fxllm.dequantize_experts.default, (
            graph.get_attr(names["codes"]), graph.get_attr(names["scales"]),
            graph.get_attr(names["offsets"]) if offsets is not None else None, fmt.group_size, matrix.shape[0]))


def _report(node, kind: str, matrix: torch.Tensor, fmt: QuantFormat, program, prefix: str) -> dict:
    module = program.graph_module
    codes = getattr(module, f"{prefix}_int{fmt.bits}_codes")
    scales = getattr(module, f"{prefix}_scales")
    offsets = getattr(module, f"{prefix}_offsets", None)
    experts, out_features, in_features = matrix.shape
    dequantized = dequantize_codes(codes.t(), scales, fmt, offsets)  # [out, E·in]
    dequantized = dequantized.reshape(out_features, experts, in_features).transpose(0, 1)
    return {"layer": node.name, "weight": f"{node.name}.{kind} ({experts} experts)",
            "shape": [experts * in_features, out_features], "bits": fmt.bits, "group_size": fmt.group_size,
            "symmetric": fmt.symmetric,
            "bits_per_weight": round(fmt.bits_per_weight(in_features, out_features), 4),
            "weight_error": round(relative_error(matrix, dequantized), 6), "output_error": None,
            "rtn_output_error": None, "note": "experts: round to nearest"}
