"""Lowering: Program → torch.export (dynamic batch/tokens/past) → ONNX (opset 23, standard ops, external weights)."""

from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path

import onnx
import torch

from fxllm.compiler.interface import make_input, sample_dims
from fxllm.compiler.targets.onnx_translations import TRANSLATIONS
from fxllm.compiler.program import Program
from fxllm.compiler.targets.tensorrt_audit import ORIGIN_KEY
from fxllm.errors import UnsupportedModelError
from fxllm.runtime.contract import CONTRACT_METADATA_KEY, contract_digest

OPSET = 23
TARGETS = ("ort", "tensorrt")


def export_program(program: Program) -> torch.export.ExportedProgram:
    """Re-export the rewritten graph; every symbolic dim in the signature becomes a torch.export.Dim."""
    names = sorted({d for sig in program.inputs for d in sig.dims if isinstance(d, str)})
    dims = {name: torch.export.Dim(name) for name in names}
    sizes = sample_dims()
    args = tuple(make_input(sig, sizes) for sig in program.inputs)
    dynamic = tuple({i: dims[d] for i, d in enumerate(sig.dims) if isinstance(d, str)} for sig in program.inputs)
    with torch.no_grad():
        return torch.export.export(program.graph_module, args, dynamic_shapes=dynamic, strict=False)


def lower_to_onnx(program: Program, path: str | os.PathLike, target: str = "ort") -> onnx.ModelProto:
    """Write `path` (+ `path`.data with the weights) and return the model proto without weights, checked."""
    if target not in TARGETS:
        raise UnsupportedModelError(f"unknown target '{target}' (available: {', '.join(TARGETS)})")
    exported = export_program(program)
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        onnx_program = torch.onnx.export(
            exported,
            dynamo=True,
            opset_version=OPSET,
            custom_translation_table=TRANSLATIONS,
            input_names=[sig.name for sig in program.inputs],
            output_names=[sig.name for sig in program.outputs],
            optimize=True,
            verbose=False,
        )
    path = Path(path)
    onnx_program.save(str(path), external_data=True)
    name_dimensions(path, program)  # also records the contract digest the runtime checks the manifest against
    record_origins(path, exported.graph)
    pack_int4_weights(path)
    check_onnx(path)
    return onnx.load(str(path), load_external_data=False)


def name_dimensions(path: Path, program: Program) -> None:
    """Replace export's symbols (s0, s70, 's1 + s70'...) by the signature's names (batch, tokens, past, total) on
    the graph's inputs, outputs and every intermediate that uses the same symbols, so ONNX users (and TensorRT
    optimization profiles) see meaningful dynamic dimensions."""
    model = onnx.load(str(path), load_external_data=False)  # rewriting the proto keeps the external data as is
    renames: dict[str, str] = {}
    io = list(zip(model.graph.input, program.inputs)) + list(zip(model.graph.output, program.outputs))
    for value, sig in io:
        for dim, name in zip(value.type.tensor_type.shape.dim, sig.dims):
            if isinstance(name, str) and dim.dim_param:
                renames.setdefault(dim.dim_param, name)
                dim.dim_param = name
    for value in model.graph.value_info:
        for dim in value.type.tensor_type.shape.dim:
            if dim.dim_param in renames:
                dim.dim_param = renames[dim.dim_param]
    digest = contract_digest(program.spec.to_dict(), program.inputs, program.outputs)
    model.metadata_props.add(key=CONTRACT_METADATA_KEY, value=digest)
    onnx.save(model, str(path))


def record_origins(path: Path, graph: torch.fx.Graph) -> None:
    """Copy each fx node's origin pass onto the ONNX nodes lowered from it, matched through the exporter's
    pkg.torch.onnx.fx_node metadata or its node_<fx name> naming; nodes the exporter's own fusions created
    (RMSNormalization, RotaryEmbedding...) are marked "lowering"."""
    from fxllm.compiler.pass_manager import origin_of

    origins = {node.name: origin_of(node) for node in graph.nodes}
    model = onnx.load(str(path), load_external_data=False)
    for node in model.graph.node:
        fx_node = next((p.value for p in node.metadata_props if p.key == "pkg.torch.onnx.fx_node"), "")
        name = fx_node.split(" ", 1)[0].lstrip("%") or node.name.removeprefix("node_")
        node.metadata_props.add(key=ORIGIN_KEY, value=origins.get(name) or "lowering")
    onnx.save(model, str(path))


INT4_SUFFIX = "_int4_codes"


def pack_int4(values) -> bytes:
    """int values in -8..7 → ONNX INT4 raw bytes: two per byte, the first element in the low nibble."""
    import numpy as np

    nibbles = (values.astype(np.int8).ravel() & 0x0F).astype(np.uint8)
    if nibbles.size % 2:
        nibbles = np.append(nibbles, np.uint8(0))
    return (nibbles[0::2] | (nibbles[1::2] << 4)).tobytes()


def pack_int4_weights(path: Path) -> None:
    """4-bit weights are exported as INT8 initializers holding -8..7 (torch has no int4 buffers); the quantize pass
    names them `*_int4_codes`. Where one feeds a blocked DequantizeLinear, store it as packed INT4, two per byte,
    which is what TensorRT and ONNX Runtime's MatMulNBits expect."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    header = onnx.load(str(path), load_external_data=False)
    blocked = {n.input[0] for n in header.graph.node if n.op_type == "DequantizeLinear"
               and any(a.name == "block_size" and a.i > 0 for a in n.attribute) and n.input[0].endswith(INT4_SUFFIX)}
    if not blocked:
        return
    model = onnx.load(str(path))  # with weights
    data_file = path.with_name(path.name + ".data")
    for index, tensor in enumerate(model.graph.initializer):
        if tensor.name in blocked and tensor.data_type == TensorProto.INT8:
            values = numpy_helper.to_array(tensor)
            if values.min() < -8 or values.max() > 7:
                raise UnsupportedModelError(f"initializer '{tensor.name}' feeds a blocked DequantizeLinear but holds "
                                            "values outside int4")
            packed = helper.make_tensor(tensor.name, TensorProto.INT4, values.shape, pack_int4(values), raw=True)
            model.graph.initializer[index].CopyFrom(packed)
    stale = [v for v in model.graph.value_info if v.name in blocked]  # typed INT8 by the exporter
    for value in stale:
        model.graph.value_info.remove(value)
    data_file.unlink()
    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=data_file.name, size_threshold=1024)


def check_onnx(path: Path) -> None:
    """onnx.checker (reads external data by path) plus strict shape inference, which must type every output."""
    onnx.checker.check_model(str(path), full_check=True)
    model = onnx.load(str(path), load_external_data=False)
    inferred = onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True)
    for output in inferred.graph.output:
        if not output.type.tensor_type.HasField("shape"):
            raise UnsupportedModelError(f"ONNX shape inference left output '{output.name}' without a shape")
