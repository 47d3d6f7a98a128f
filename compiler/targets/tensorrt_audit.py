"""TensorRT compatibility audit of an ONNX model, runnable anywhere: every node that breaks the support table in
tensorrt_rules.py, with the rule it breaks and the fxllm pass that produced it."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path

import onnx

from fxllm.compiler.targets.tensorrt_rules import (
    MIN_OPSET,
    NOT_PARSED,
    RESTRICTIONS,
    SINCE,
    Version,
    max_opset,
)

DEFAULT_TRT_VERSION: Version = (10, 15)
ORIGIN_KEY = "fxllm.origin"  # ONNX node metadata written by lowering: the pass (or "capture") behind the node


@dataclass(frozen=True)
class Finding:
    node: str
    op: str
    rule: str
    origin: str  # the fxllm pass (or "capture") that produced the node, "?" when unknown

    def to_dict(self) -> dict[str, str]:
        return asdict(self)

    def __str__(self) -> str:
        return f"{self.node} ({self.op}, from {self.origin}): {self.rule}"


def _constants(graph: onnx.GraphProto) -> set[str]:
    names = {init.name for init in graph.initializer}
    names |= {out for node in _nodes(graph) if node.op_type == "Constant" for out in node.output}
    return names


def _ranks(model: onnx.ModelProto) -> dict[str, int]:
    values = list(model.graph.value_info) + list(model.graph.input) + list(model.graph.output)
    ranks = {v.name: len(v.type.tensor_type.shape.dim) for v in values if v.type.tensor_type.HasField("shape")}
    ranks.update({init.name: len(init.dims) for init in model.graph.initializer})
    return ranks


def audit_model(model: onnx.ModelProto, trt_version: Version = DEFAULT_TRT_VERSION) -> list[Finding]:
    findings: list[Finding] = []
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    if not MIN_OPSET <= opset <= max_opset(trt_version):
        findings.append(Finding("<model>", "opset", f"opset {opset} is outside the {MIN_OPSET}-"
                                f"{max_opset(trt_version)} range TensorRT {trt_version[0]}.{trt_version[1]} parses",
                                "lowering"))
    constants = _constants(model.graph)
    ranks = _ranks(model)
    for node in _nodes(model.graph):
        origin = next((p.value for p in node.metadata_props if p.key == ORIGIN_KEY), "?")
        name = node.name or f"<{node.op_type} → {node.output[0]}>"
        for rule in _node_rules(node, constants, ranks, trt_version):
            findings.append(Finding(name, node.op_type if not node.domain else f"{node.domain}.{node.op_type}",
                                    rule, origin))
    return findings


def _nodes(graph: onnx.GraphProto):
    """The graph's nodes and, after each, those of its subgraphs (If branches, Loop and Scan bodies)."""
    for node in graph.node:
        yield node
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                yield from _nodes(attribute.g)
            elif attribute.type == onnx.AttributeProto.GRAPHS:
                for subgraph in attribute.graphs:
                    yield from _nodes(subgraph)


def _node_rules(node: onnx.NodeProto, constants: set[str], ranks: dict[str, int], version: Version) -> list[str]:
    if node.domain not in ("", "ai.onnx"):
        return [f"custom-domain op '{node.domain}.{node.op_type}' has no TensorRT importer (ONNX Runtime only)"]
    if node.op_type in NOT_PARSED:
        return [NOT_PARSED[node.op_type]]
    rules = []
    if node.op_type in SINCE and version < SINCE[node.op_type][0]:
        rules.append(f"{SINCE[node.op_type][1]}; targeting {version[0]}.{version[1]}")
    if node.op_type in RESTRICTIONS:
        rules += [v.rule for v in RESTRICTIONS[node.op_type](node, constants, ranks)]
    return rules


def audit_file(path: str | os.PathLike, trt_version: Version = DEFAULT_TRT_VERSION) -> list[Finding]:
    """Audit an .onnx file or an artifact directory (its model file), without loading weights."""
    return audit_model(read_graph(path), trt_version)


def read_graph(path: str | os.PathLike) -> onnx.ModelProto:
    """The ONNX model of an .onnx file or an artifact directory (its model file), without its weights' data."""
    path = Path(path)
    if path.is_dir():
        from fxllm.runtime.manifest import load_manifest

        path = load_manifest(path, verify=False).model_file
    return onnx.load(str(path), load_external_data=False)


def unverified_forms(model: onnx.ModelProto) -> list[str]:
    """Forms the audit passes but nobody has checked on TensorRT: blocked DequantizeLinear of INT8 weights (TensorRT
    documents blocked quantization for INT4 weights), of rows a Gather took from the weights (a quantized
    embedding), and of weights whose last block is shorter (the ONNX spec and ONNX Runtime allow it). One line per
    kind, with the number of nodes; empty when there are none."""
    initializers = {init.name: init for init in model.graph.initializer}
    producers = {output: node for node in model.graph.node for output in node.output}
    blocked_int8 = gathered = ragged = 0
    for node in model.graph.node:
        block = next((a.i for a in node.attribute if a.name == "block_size"), 0)
        if node.op_type != "DequantizeLinear" or block <= 0:
            continue
        source, producer = node.input[0], producers.get(node.input[0])
        gather = producer is not None and producer.op_type == "Gather" and producer.input[0] in initializers
        if gather:
            source = producer.input[0]
        if source not in initializers:
            continue
        weight = initializers[source]
        axis = -1 if gather else next((a.i for a in node.attribute if a.name == "axis"), 1)  # rows keep the columns
        blocked_int8 += weight.data_type == onnx.TensorProto.INT8
        gathered += gather
        ragged += bool(weight.dims) and weight.dims[axis] % block != 0
    notes = []
    if blocked_int8:
        notes.append(f"{blocked_int8} blocked INT8 DequantizeLinear(s) (an int8 lm_head or embedding, GGUF Q8_0): "
                     "TensorRT documents blocked dequantization for INT4 weights; INT8 blocks are not verified on it")
    if gathered:
        notes.append(f"{gathered} blocked DequantizeLinear(s) of rows a Gather took from the weights (a quantized "
                     "embedding): TensorRT documents blocked dequantization of weights; of gathered rows it is not "
                     "verified (--quant-embedding float avoids it; for a GGUF kept as its own blocks, --requantize)")
    if ragged:
        notes.append(f"{ragged} blocked DequantizeLinear(s) with a shorter last block (the input size is not a multiple "
                     "of the group size): allowed by ONNX and ONNX Runtime, not verified on TensorRT")
    return notes


def format_findings(findings: list[Finding], trt_version: Version = DEFAULT_TRT_VERSION) -> str:
    target = f"TensorRT {trt_version[0]}.{trt_version[1]}"
    if not findings:
        return f"tensorrt audit ({target}): no findings"
    lines = [f"tensorrt audit ({target}): {len(findings)} finding(s)"]
    lines += [f"  {finding}" for finding in findings]
    return "\n".join(lines)
