"""Weight-only quantization of mixture-of-experts weights (the `quantize` pass's part for fxllm::moe_experts).

Each expert's up and down matrices are rounded to nearest in the pass's format (int8: one scale per output
channel, int4: blocks of `group_size` input rows, optionally asymmetric), whatever the method: GPTQ and AWQ
calibrate the dense linears, whose inputs the calibration walk sees; an expert sees only the tokens routed to it.
The codes of all experts are stored as one [E·in, out] matrix, so one 2D blocked DequantizeLinear per weight
dequantizes them (fxllm::dequantize_experts); the MoE node then reads the weights transposed ([E, in, out]).

A GGUF source's experts keep the file's own blocks instead (`keep_gguf_experts`, the quantize pass's method gguf):
each expert's rows in blocks of 32 inputs, the same layout.
"""

from __future__ import annotations

import dataclasses

import torch

from fxllm.compiler.projections import constant
from fxllm.compiler.quant.gguf_exact import (EXACT_TYPES, FLOAT_TYPES, Fallback, GGUFBlocks, GGUFWeights,
                                             shared_form, stack_experts)
from fxllm.compiler.quant.numerics import HALF_SUFFIX, QuantFormat, dequantize_codes, relative_error, round_to_nearest

UP, DOWN, TRANSPOSED, GATE = 3, 5, 7, 8  # argument positions of fxllm::moe_experts
GGUF_GATES = ("concatenated", "none")  # gate layouts whose up weight is the GGUF's gate then up tensors, row for row


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
            parts = [round_to_nearest(expert, expert_fmt) for expert in matrix]
            stored = StoredExperts(torch.cat([p.codes.t() for p in parts]), torch.cat([p.scales for p in parts]),
                                   torch.cat([p.offsets for p in parts]) if parts[0].offsets is not None else None,
                                   expert_fmt)
            replacements.append(_store(program, node, f"experts_{index}_{kind}", stored, matrix.shape[0]))
            rows.append(_report(node, kind, matrix, stored, "experts: round to nearest"))
        _replace_weights(node, replacements)
    return rows, notes


def keep_gguf_experts(program, weights: GGUFWeights) -> tuple[list[dict], list[Fallback]]:
    """Method gguf's part for fxllm.moe_experts nodes: every expert weight whose GGUF tensors (the stacked
    ffn_{gate,up,down}_exps) share an exact block form becomes dequantize_experts of those blocks as stored, checked
    to dequantize to the float weight the graph holds (ValueError otherwise, as for linears). → (report rows, the
    quantized GGUF weights left float and why)."""
    rows, fallbacks = [], []
    for index, node in enumerate([n for n in program.graph.nodes if n.target is torch.ops.fxllm.moe_experts.default]):
        found = {kind: _gguf_expert_blocks(program, node, position, weights)
                 for kind, position in (("up", UP), ("down", DOWN))}
        if not any(isinstance(result, tuple) for result in found.values()):
            fallbacks += [result for result in found.values() if result is not None]
            continue
        replacements = []
        for kind, position in (("up", UP), ("down", DOWN)):
            result = found[kind]
            prefix = f"gguf_experts_{index}_{kind}"
            if not isinstance(result, tuple):  # this one stays float, in the [E, in, out] layout its sibling gets
                fallbacks += [result] if result is not None else []
                replacements.append(_store_float(program, node, prefix, position))
                continue
            matrix, blocks = result
            stored = StoredExperts(blocks.codes.t(), blocks.scales, blocks.offsets, blocks.fmt, half_scales=True)
            replacements.append(_store(program, node, prefix, stored, matrix.shape[0]))
            rows.append(_report(node, kind, matrix, stored, f"gguf {blocks.type_name} kept"))
        _replace_weights(node, replacements)
    return rows, fallbacks


def _gguf_expert_blocks(program, node, position: int, weights: GGUFWeights
                        ) -> tuple[torch.Tensor, GGUFBlocks] | Fallback | None:
    """(float weight [E, out, in], its GGUF blocks stacked as dequantize_experts stores them) for one expert weight
    of `node`; else the Fallback saying why it stays float, or None when the file stores it as floats."""
    weight = constant(program, node.args[position])
    if weight is None:
        return None
    name = str(node.args[position].target)
    parts = _gguf_part_names(name)
    types = [weights.type_of(part) for part in parts]
    if all(kind in FLOAT_TYPES for kind in types):
        return None
    if node.args[GATE] not in GGUF_GATES or None in types:
        return _fallback(node, name, parts, types, weights, "experts-layout")
    if shared_form(types) is None:
        return _fallback(node, name, parts, types, weights, "no-form" if not set(types) <= set(EXACT_TYPES)
                         else "experts-fused")
    matrix = _as_out_in(weight.detach(), node.args[TRANSPOSED])
    experts, rows = matrix.shape[0], matrix.shape[1] // len(parts)
    blocks = [weights.blocks(part, matrix[:, i * rows:(i + 1) * rows].reshape(experts * rows, -1), 1, 1)
              for i, part in enumerate(parts)]
    return matrix, stack_experts(blocks, experts)


def _gguf_part_names(name: str) -> list[str]:
    """transformers' names for the GGUF tensors behind an experts parameter: its fused gate_up_proj is the file's
    gate then up tensors."""
    prefix, _, leaf = name.rpartition(".")
    return [f"{prefix}.gate_proj", f"{prefix}.up_proj"] if leaf == "gate_up_proj" else [name]


def _fallback(node, name: str, parts: list[str], types: list[str | None], weights: GGUFWeights,
              reason: str) -> Fallback:
    """The Fallback of the expert weight `name`, whose GGUF `parts` (of `types`) stay float."""
    return Fallback(name, [weights.gguf_name(part) for part in parts if weights.gguf_name(part)],
                    "+".join(dict.fromkeys(map(str, types))), reason, label=f"{node.name} {name.rpartition('.')[2]}")


@dataclasses.dataclass
class StoredExperts:
    """One expert weight as dequantize_experts reads it: codes [E·in, out], scales (offsets) [E·blocks, out]."""

    codes: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor | None
    fmt: QuantFormat
    half_scales: bool = False  # the scales hold float16 values though fmt does not say so (GGUF blocks)


def _as_out_in(weight: torch.Tensor, transposed: bool) -> torch.Tensor:
    """Expert weights as [E, out, in] (transposed storage is [E, in, out])."""
    return weight.transpose(1, 2) if transposed else weight


def _store(program, node, prefix: str, stored: StoredExperts, experts: int):
    """Register the stored codes, scales and offsets and insert the dequantize_experts node in front of `node`."""
    half = stored.half_scales or stored.fmt.half_scales
    names = {"codes": f"{prefix}_int{stored.fmt.bits}_codes", "scales": f"{prefix}_scales" + (HALF_SUFFIX if half
                                                                                               else ""),
             "offsets": f"{prefix}_offsets"}
    module = program.graph_module
    module.register_buffer(names["codes"], stored.codes.contiguous())
    module.register_buffer(names["scales"], stored.scales.contiguous())
    if stored.offsets is not None:
        module.register_buffer(names["offsets"], stored.offsets.contiguous())
    graph = program.graph
    with graph.inserting_before(node):
        return graph.call_function(torch.ops.fxllm.dequantize_experts.default, (
            graph.get_attr(names["codes"]), graph.get_attr(names["scales"]),
            graph.get_attr(names["offsets"]) if stored.offsets is not None else None, stored.fmt.group_size,
            experts))


def _store_float(program, node, prefix: str, position: int):
    """A float expert weight as [E, in, out] (the layout the node reads once TRANSPOSED is set)."""
    matrix = _as_out_in(constant(program, node.args[position]).detach(), node.args[TRANSPOSED])
    program.graph_module.register_buffer(f"{prefix}_float", matrix.transpose(1, 2).contiguous())
    with program.graph.inserting_before(node):
        return program.graph.get_attr(f"{prefix}_float")


def _replace_weights(node, replacements: list) -> None:
    """The MoE node reads its up and down weights from the dequantize_experts nodes, as [E, in, out]."""
    node.update_arg(UP, replacements[0])
    node.update_arg(DOWN, replacements[1])
    node.update_arg(TRANSPOSED, True)


def _report(node, kind: str, matrix: torch.Tensor, stored: StoredExperts, note: str) -> dict:
    fmt = stored.fmt
    experts, out_features, in_features = matrix.shape
    dequantized = dequantize_codes(stored.codes.t(), stored.scales, fmt, stored.offsets)  # [out, E·in]
    dequantized = dequantized.reshape(out_features, experts, in_features).transpose(0, 1)
    return {"layer": node.name, "weight": f"{node.name}.{kind} ({experts} experts)",
            "shape": [experts * in_features, out_features], "bits": fmt.bits, "group_size": fmt.group_size,
            "symmetric": fmt.symmetric,
            "bits_per_weight": round(fmt.bits_per_weight(in_features, out_features), 4),
            "weight_error": round(relative_error(matrix, dequantized), 6), "output_error": None,
            "rtn_output_error": None, "note": note}
