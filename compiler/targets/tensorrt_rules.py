"""What TensorRT's ONNX parser accepts, as one table: every rule names the TensorRT version it comes from.

Sources: the onnx-tensorrt operator matrix (docs/operators.md, TensorRT 10.0: opsets 9-20, the "not supported"
rows and per-op restrictions) and the TensorRT 10.14 / 10.15 / 11.x release notes as recorded in shared design
notes (Attention since 10.14 with 4D inputs and no past/present; RMSNormalization, RotaryEmbedding and
TensorScatter since 10.15; opsets up to 24 in 10.15 and 25 in 11.x).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import onnx

Version = tuple[int, int]

# 10.14 parses opset-23 Attention, so it accepts opset 23 at least.
MAX_OPSET: dict[Version, int] = {(10, 0): 20, (10, 14): 23, (10, 15): 24, (11, 0): 25}
MIN_OPSET = 9

# Ops the parser does not import at all (onnx-tensorrt matrix, TensorRT 10.0, rows marked N), restricted to those
# an LLM export can plausibly produce.
NOT_PARSED: dict[str, str] = {
    "DynamicQuantizeLinear": "dynamic activation quantization is not imported (TensorRT 10.0 matrix)",
    "MatMulInteger": "integer matmul is not imported; use DequantizeLinear → MatMul (TensorRT 10.0 matrix)",
    "QLinearMatMul": "QLinear ops are not imported; use Q/DQ → MatMul (TensorRT 10.0 matrix)",
    "QLinearConv": "QLinear ops are not imported (TensorRT 10.0 matrix)",
    "ConcatFromSequence": "Sequence ops are not imported (TensorRT 10.0 matrix)",
    "SequenceAt": "Sequence ops are not imported (TensorRT 10.0 matrix)",
    "SequenceConstruct": "Sequence ops are not imported (TensorRT 10.0 matrix)",
    "SequenceEmpty": "Sequence ops are not imported (TensorRT 10.0 matrix)",
    "SequenceInsert": "Sequence ops are not imported (TensorRT 10.0 matrix)",
    "SequenceLength": "Sequence ops are not imported (TensorRT 10.0 matrix)",
    "SplitToSequence": "Sequence ops are not imported (TensorRT 10.0 matrix)",
    "Unique": "Unique is not imported (TensorRT 10.0 matrix)",
    "StringNormalizer": "string ops are not imported (TensorRT 10.0 matrix)",
}

# Ops that exist only from a given TensorRT version on.
SINCE: dict[str, tuple[Version, str]] = {
    "Attention": ((10, 14), "ONNX Attention is parsed from TensorRT 10.14"),
    "RMSNormalization": ((10, 15), "RMSNormalization is parsed from TensorRT 10.15"),
    "RotaryEmbedding": ((10, 15), "RotaryEmbedding is parsed from TensorRT 10.15"),
    "TensorScatter": ((10, 15), "TensorScatter is parsed from TensorRT 10.15"),
}


@dataclass(frozen=True)
class Violation:
    rule: str


def _initializer_or_constant(name: str, constants: set[str]) -> bool:
    return name == "" or name in constants


def _attention(node: onnx.NodeProto, constants: set[str], ranks: dict[str, int]) -> list[Violation]:
    found = []
    if len(node.input) > 4 and any(node.input[4:6]):
        found.append(Violation("Attention with past_key/past_value inputs is not supported (TensorRT 10.14+: "
                               "keep the cache concatenation outside the op)"))
    if sum(1 for o in node.output if o) > 1:
        found.append(Violation("Attention supports only its first output (no present_key/present_value/qk)"))
    for name in node.input[:3]:
        if ranks.get(name, 4) != 4:
            found.append(Violation(f"Attention input '{name}' is {ranks[name]}D; TensorRT takes 4D Q/K/V only"))
    return found


def _dequantize(node: onnx.NodeProto, constants: set[str], ranks: dict[str, int]) -> list[Violation]:
    if len(node.input) > 2 and node.input[2] and node.input[2] not in constants:
        return [Violation("DequantizeLinear x_zero_point must be absent or a zero initializer (TensorRT 10.0)")]
    if ranks.get(node.input[1], 0) > 2:
        return [Violation(f"DequantizeLinear scale '{node.input[1]}' is {ranks[node.input[1]]}D; TensorRT takes "
                          "scales of rank <= 2 (IDequantizeLayer)")]
    return []


def _axes_input(index: int, what: str) -> Callable:
    def check(node: onnx.NodeProto, constants: set[str], ranks: dict[str, int]) -> list[Violation]:
        if len(node.input) > index and not _initializer_or_constant(node.input[index], constants):
            return [Violation(f"{node.op_type} {what} must be an initializer (TensorRT 10.0)")]
        return []

    return check


def _scatter_nd(node: onnx.NodeProto, constants: set[str], ranks: dict[str, int]) -> list[Violation]:
    reduction = next((a.s.decode() for a in node.attribute if a.name == "reduction"), "none")
    return [Violation(f"ScatterND reduction '{reduction}' is not supported (TensorRT 10.0)")] if reduction != "none" else []


RESTRICTIONS: dict[str, Callable] = {
    "Attention": _attention,
    "DequantizeLinear": _dequantize,
    "ScatterND": _scatter_nd,
    "Squeeze": _axes_input(1, "axes"),
    "Unsqueeze": _axes_input(1, "axes"),
    "Slice": _axes_input(3, "axes"),
    **{op: _axes_input(1, "axes") for op in ("ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceProd",
                                              "ReduceL1", "ReduceL2", "ReduceLogSumExp", "ReduceSumSquare")},
}


def parse_version(text: str) -> Version:
    """'10.15', '10.15.1' or '11' → (major, minor); versions before 10.0 are not supported targets."""
    from fxllm.errors import FxllmError

    try:
        parts = [int(part) for part in text.split(".")]
    except ValueError:
        raise FxllmError(f"TensorRT version '{text}' is not of the form MAJOR[.MINOR]") from None
    version = (parts[0], parts[1] if len(parts) > 1 else 0)
    if version < (10, 0):
        raise FxllmError(f"TensorRT {text} is not supported: fxllm targets TensorRT 10.0 and newer")
    return version


def max_opset(version: Version) -> int:
    return max(opset for since, opset in MAX_OPSET.items() if since <= version)
