"""Lowering: Program → torch.export (dynamic batch/tokens/past) → ONNX (opset 23, standard ops, external weights)."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import onnx
import onnx_ir as ir
import torch

from fxllm.compiler.interface import make_input, sample_dims
from fxllm.compiler.targets.ort import LegalizationContext
from fxllm.compiler.targets.ort import legalize as ort_legalize
from fxllm.compiler.targets.ort.graph import packed_4bit
from fxllm.compiler.targets.ort.int4_zero_points import INT4_SUFFIX
from fxllm.compiler.program import Program
from fxllm.compiler.quant.numerics import HALF_SUFFIX
from fxllm.compiler.targets.tensorrt_audit import ORIGIN_KEY
from fxllm.compiler.targets.torch_onnx import export_to_onnx
from fxllm.errors import UnsupportedModelError
from fxllm.runtime.contract import CONTRACT_METADATA_KEY, TensorSig, contract_digest

OPSET = 23
TARGETS = ("ort", "tensorrt")


def export_program(program: Program) -> torch.export.ExportedProgram:
    """Re-export the rewritten graph; every symbolic dim in the signature becomes a torch.export.Dim.
    Without the fake-tensor cache: storing each op's symbolic result costs about what it saves on a graph traced
    once (SmolLM2's re-export 19.7 s without it, 20.3 s with, means of two), and more than it saves on a small one
    (a 2-layer model's 1.1 s against 1.8 s)."""
    names = sorted({d for sig in program.inputs for d in sig.dims if isinstance(d, str)})
    dims = {name: torch.export.Dim(name) for name in names}
    sizes = sample_dims()
    args = tuple(make_input(sig, sizes) for sig in program.inputs)
    dynamic = tuple({i: dims[d] for i, d in enumerate(sig.dims) if isinstance(d, str)} for sig in program.inputs)
    with torch.no_grad(), torch._dynamo.config.patch(fake_tensor_cache_enabled=False):
        return torch.export.export(program.graph_module, args, dynamic_shapes=dynamic, strict=False)


@dataclass
class Lowered:
    """The written model (proto without weights, checked) and its calling convention, which the `ort` target's
    legalization may change from the program's (a shared KV buffer): the manifest records this one."""

    model: onnx.ModelProto
    inputs: list[TensorSig]
    outputs: list[TensorSig]
    legalized: dict[str, int] = field(default_factory=dict)  # ort: sites rewritten per legalization step


def lower_to_onnx(program: Program, path: str | os.PathLike, target: str = "ort",
                  seconds: dict[str, float] | None = None, ort_steps: tuple[str, ...] | None = None,
                  kv_cache_scales: list | None = None) -> Lowered:
    """Write `path` (+ `path`.data with the weights) and return the checked model and its signature.
    The exporter's model is finished in memory (dimension names, node origins, the `ort` target's legalization
    steps — all of them, or only those named in `ort_steps` — packed INT4, float16 GGUF scales) and written once.
    `seconds` (optional) receives the time of each lowering step. `kv_cache_scales` (target ort): per layer the
    (K, V) scales of an int8 cache (compiler/quant/kv_cache.py), which the int8-kv-cache step writes in."""
    if target not in TARGETS:
        raise UnsupportedModelError(f"unknown target '{target}' (available: {', '.join(TARGETS)})")
    timer = _Timer(seconds)
    with timer("re-export"):
        exported = export_program(program)
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    with timer("onnx export"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            onnx_program = export_to_onnx(exported, OPSET, [sig.name for sig in program.inputs],
                                          [sig.name for sig in program.outputs])
        except Exception as exc:  # the exporter's multi-page report: one line naming the op it could not translate
            raise UnsupportedModelError(f"lowering to ONNX failed: {conversion_failure(exc)}") from exc
    with timer("optimize"):
        optimize_graph(onnx_program.model)
        align_norm_types(onnx_program.model)
    path = Path(path)
    with timer("finish"):
        model = onnx_program.model
        name_dimensions(model, program)
        record_origins(model, exported.graph)
        share_rotary_tables(model)
    context = LegalizationContext(program.spec, list(program.inputs), list(program.outputs),
                                  kv_cache_scales=kv_cache_scales)
    if target == "ort":
        ort_legalize(model, context, timer.seconds, only=ort_steps)
    with timer("finish"):
        pack_int4_weights(model)
        if target == "ort":
            store_half_scales(model)
        model.metadata_props[CONTRACT_METADATA_KEY] = contract_digest(program.spec.to_dict(), context.inputs,
                                                                      context.outputs)
    with timer("save"):
        onnx_program.save(str(path), external_data=True)
    with timer("check"):
        checked = check_onnx(path)
    return Lowered(checked, context.inputs, context.outputs, context.rewritten)


def conversion_failure(exc: Exception) -> str:
    """The op torch.onnx's exporter could not translate and why, from its report (the innermost 'No ONNX function
    found for <OpOverload(op='aten.x', ...)>. Failure message: ...'); else the report's first line."""
    text = " ".join(str(exc).split())
    for cause in (exc.__cause__, exc.__context__):
        if cause is not None:
            text += " " + " ".join(str(cause).split())
    found = re.search(r"No ONNX function found for <OpOverload\(op='([^']+)'[^>]*>\.? ?"
                      r"(?:Failure message: ([^.⬆]+))?", text)
    if found:
        reason = f" ({found.group(2).strip()})" if found.group(2) else ""
        complex_hint = "; complex arithmetic (e.g. a rotary embedding in complex numbers) has no ONNX form" \
            if "complex" in (found.group(2) or "") else ""
        return f"no ONNX translation for {found.group(1)}{reason}{complex_hint}"
    return f"{type(exc).__name__}: {text[:400]}"


def optimize_graph(model: ir.Model) -> None:
    """The exporter's `optimize=True` minus its general pattern-rewrite rule set: constant folding, the no-op
    eliminations, the opset-23 fusions (RMSNormalization, RotaryEmbedding), then dead-node removal, constants lifted
    to initializers, deduplication and CSE. The general rules (cast/transpose/reshape chains, slice collapsing,
    conv/batch-norm fusions...) matched about 370,000 times per SmolLM2 graph for a 5-node difference (one Squeeze,
    two Unsqueeze, two Reshape), and took 33 of the optimizer's 35 s; ONNX Runtime simplifies those at load."""
    import onnx_ir.passes.common as common
    import onnxscript.rewriter.onnx_fusions
    from onnxscript import rewriter
    from onnxscript.optimizer import _constant_folding

    def fold():
        return _constant_folding.FoldConstantsPass(
            shape_inference=True, input_size_limit=_constant_folding.DEFAULT_CONSTANT_FOLD_INPUT_SIZE_LIMIT,
            output_size_limit=_constant_folding.DEFAULT_CONSTANT_FOLD_OUTPUT_SIZE_LIMIT, should_fold=lambda node: None)

    for step in (common.InlinePass(), fold(), rewriter.RewritePass(exact_no_op_rules()), common.RemoveUnusedNodesPass(),
                 fold(), common.RemoveUnusedNodesPass(), common.LiftConstantsToInitializersPass(
                     lift_all_constants=True, size_limit=0), common.DeduplicateInitializersPass(),
                 common.CommonSubexpressionEliminationPass(), common.OutputFixPass(), common.NameFixPass()):
        step(model)
    existing = list(model.graph.all_nodes())  # held, so no new node can take a removed one's id
    known = {id(node) for node in existing}
    onnxscript.rewriter.onnx_fusions.fuse(model)
    for node in model.graph.all_nodes():  # the fused nodes copy a matched node's fx metadata: not its origin
        if id(node) not in known:
            node.metadata_props[ORIGIN_KEY] = "lowering"
    common.RemoveUnusedNodesPass()(model)


def exact_no_op_rules():
    """onnxscript's no-op eliminations (x + 0, x - 0, x * 1, x / 1, inference Dropout) matched only where the
    constant is exactly 0 or 1. onnxscript's own rules accept a constant within a tolerance (|c| <= 1e-8 counts as
    0, 1 ± 1e-5 as 1): they removed the `+ 1e-8` of an RMSNorm whose epsilon is 1e-8, so an all-zero row (a
    padding token's embedding) normalized to 0/0 and every batched call produced NaN."""
    from onnxscript.rewriter import RewriteRule, RewriteRuleSet
    from onnxscript.rewriter.rules.common import _no_op

    def add(op, x, c):
        return op.Add(x, c)

    def sub(op, x, c):
        return op.Sub(x, c)

    def mul(op, x, c):
        return op.Mul(x, c)

    def div(op, x, c):
        return op.Div(x, c)

    def identity(op, x, **_):
        return op.Identity(x)

    def exactly(value: float):
        def condition(context, x, c, **_) -> bool:
            return _is_scalar_constant(c, value)
        return condition

    rules = [RewriteRule(pattern, identity, exactly(value)) for pattern, value in ((add, 0.0), (mul, 1.0))]
    rules = [commuted for rule in rules for commuted in rule.commute()]
    rules += [RewriteRule(sub, identity, exactly(0.0)), RewriteRule(div, identity, exactly(1.0)),
              _no_op.dropout_zero_rule, _no_op.dropout_inference_rule]
    return RewriteRuleSet(rules)


def _is_scalar_constant(value: ir.Value, expected: float) -> bool:
    """Whether `value` is a constant scalar (rank 0, as onnxscript's rules require) equal to `expected` exactly."""
    from onnxscript.rewriter import _ir_utils

    array = _ir_utils.get_numpy_value(value)
    return array is not None and array.ndim == 0 and array.item() == expected


def align_norm_types(model: ir.Model) -> int:
    """A norm that a half-precision model computes in float32 (Gemma normalizes x.float(), Cohere scales by
    weight.float(), each casting the result back) fuses into an RMSNormalization whose X and scale differ in type:
    ONNX's shape inference then types Y as X where the schema says scale, so the checker refuses the model, and
    TensorRT's parser wants one type. Cast both inputs to float32 (the precision the source computes in) and the
    output back to the type its users read: exact. → the number of nodes aligned."""
    graph, wide, aligned = model.graph, ir.DataType.FLOAT, 0
    for node in list(graph):
        if node.op_type != "RMSNormalization" or node.domain not in ("", "ai.onnx") or len(node.inputs) < 2:
            continue
        x, scale, y = node.inputs[0], node.inputs[1], node.outputs[0]
        if x is None or scale is None or None in (x.dtype, scale.dtype, y.dtype) or x.dtype == scale.dtype:
            continue
        for index, value in ((0, x), (1, scale)):
            if value.dtype != wide:
                node.replace_input_with(index, _cast(graph, value, wide, before=node))
        read_as, uses = y.dtype, list(y.uses())
        y.dtype = wide
        if read_as != wide:
            back = _cast(graph, y, read_as, after=node)
            for user, index in uses:  # a norm's output is never a graph output (logits, K/V are)
                user.replace_input_with(index, back)
        aligned += 1
    return aligned


def _cast(graph: ir.Graph, value: ir.Value, to: ir.DataType, *, before: ir.Node | None = None,
          after: ir.Node | None = None, name: str | None = None) -> ir.Value:
    """`value` cast to `to` by a new node placed before or after the given one (stamped as lowering's; with `name`,
    the node is `name`_cast and its output `name`_float)."""
    cast = ir.node("Cast", inputs=[value], attributes={"to": to}, name=f"{name}_cast" if name else None)
    if name:
        cast.outputs[0].name = f"{name}_float"
    cast.outputs[0].dtype, cast.outputs[0].shape = to, value.shape
    cast.metadata_props[ORIGIN_KEY] = "lowering"
    if before is not None:
        graph.insert_before(before, cast)
    else:
        graph.insert_after(after, cast)
    return cast.outputs[0]


class _Timer:
    def __init__(self, seconds: dict[str, float] | None):
        self.seconds = seconds if seconds is not None else {}

    @contextlib.contextmanager
    def __call__(self, step: str):
        start = time.perf_counter()
        yield
        self.seconds[step] = self.seconds.get(step, 0.0) + time.perf_counter() - start


def _values(graph: ir.Graph):
    yield from graph.inputs
    for node in graph.all_nodes():
        yield from node.outputs


def name_dimensions(model: ir.Model, program: Program) -> None:
    """Replace export's symbols (s0, s70, 's1 + s70'...) by the signature's names (batch, tokens, past, total) on
    the graph's inputs, outputs and every intermediate that uses the same symbols, so ONNX users (and TensorRT
    optimization profiles) see meaningful dynamic dimensions."""
    graph = model.graph
    renames: dict[str, str] = {}
    for value, sig in list(zip(graph.inputs, program.inputs)) + list(zip(graph.outputs, program.outputs)):
        if value.shape is None:
            continue
        for dim, name in zip(value.shape.dims, sig.dims):
            if isinstance(name, str) and isinstance(dim, ir.SymbolicDim) and dim.value:
                renames.setdefault(dim.value, name)
    for value in _values(graph):
        if value.shape is not None and any(isinstance(d, ir.SymbolicDim) and d.value in renames
                                           for d in value.shape.dims):
            value.shape = ir.Shape([renames.get(d.value, d.value) if isinstance(d, ir.SymbolicDim) else d
                                    for d in value.shape.dims])


def record_origins(model: ir.Model, graph: torch.fx.Graph) -> None:
    """Copy each fx node's origin pass onto the ONNX nodes lowered from it, matched through the exporter's
    pkg.torch.onnx.fx_node metadata or its node_<fx name> naming. Nodes lowering made itself keep the "lowering"
    their maker stamped (optimize_graph's fusions: RMSNormalization, RotaryEmbedding; align_norm_types' casts), as
    does any node no fx node explains."""
    from fxllm.compiler.pass_manager import origin_of

    origins = {node.name: origin_of(node) for node in graph.nodes}
    for node in model.graph.all_nodes():
        if ORIGIN_KEY in node.metadata_props:
            continue
        fx_node = node.metadata_props.get("pkg.torch.onnx.fx_node", "")
        name = fx_node.split(" ", 1)[0].lstrip("%") or (node.name or "").removeprefix("node_")
        node.metadata_props[ORIGIN_KEY] = origins.get(name) or "lowering"


def share_rotary_tables(model: ir.Model) -> int:
    """The exporter recomputes the rotary cos/sin in every layer from the same angles (60 `Cos` + 60 `Sin` for
    SmolLM2); keep one `Cos` and one `Sin` per distinct input and feed every RotaryEmbedding from them (exact: the
    same op on the same value). ONNX Runtime's own CSE does this at session creation; TensorRT's parser and anyone
    reading the file see the shared form. → the number of nodes removed."""
    graph = model.graph
    first: dict[tuple[str, int], ir.Node] = {}
    removed = 0
    for node in list(graph):
        if node.op_type not in ("Cos", "Sin") or node.domain not in ("", "ai.onnx") or node.inputs[0] is None:
            continue
        key = (node.op_type, id(node.inputs[0]))
        if key not in first:
            first[key] = node
            continue
        if node.outputs[0].is_graph_output():
            continue
        node.outputs[0].replace_all_uses_with(first[key].outputs[0])
        graph.remove(node, safe=True)
        removed += 1
    return removed


def _initializers_feeding(model: ir.Model, op_type: str, suffix: str, blocked: bool = False) -> list[ir.Value]:
    found = []
    for name, value in model.graph.initializers.items():
        if not name.endswith(suffix) or value.const_value is None:
            continue
        consumers = value.consumers()
        if consumers and all(n.op_type == op_type and (not blocked or n.attributes.get_int("block_size", 0) > 0)
                             for n in consumers):
            found.append(value)
    return found


def pack_int4_weights(model: ir.Model) -> None:
    """4-bit weights are exported as INT8 initializers holding -8..7 (torch has no int4 buffers); the quantize pass
    names them `*_int4_codes`. Where one feeds blocked DequantizeLinears, store it as packed INT4, two per byte,
    which is what TensorRT and ONNX Runtime's MatMulNBits expect."""
    for value in _initializers_feeding(model, "DequantizeLinear", INT4_SUFFIX, blocked=True):
        if value.dtype != ir.DataType.INT8:
            continue
        values = value.const_value.numpy()
        if values.min() < -8 or values.max() > 7:
            raise UnsupportedModelError(f"initializer '{value.name}' feeds a blocked DequantizeLinear but holds "
                                        "values outside int4")
        value.const_value = packed_4bit(values, ir.DataType.INT4, value.name)
        value.dtype = ir.DataType.INT4


def store_half_scales(model: ir.Model) -> None:
    """Scales that hold float16 values (GGUF blocks; buffers named *_f16 by the quantize pass) are stored as
    float16, bit for bit, with a Cast to float32 in front of their users: ONNX Runtime folds the Cast when it loads
    the model, so the DequantizeLinear → MatMul fusion still sees float32 constants (ort target only: TensorRT's
    dequantize wants its scales as plain initializers)."""
    import numpy as np

    graph = model.graph
    for name, value in list(graph.initializers.items()):
        if not name.endswith(HALF_SUFFIX) or value.const_value is None or value.dtype != ir.DataType.FLOAT:
            continue
        values = value.const_value.numpy()
        half = values.astype(np.float16)
        if not np.array_equal(half.astype(np.float32), values):
            raise UnsupportedModelError(f"initializer '{name}' is marked float16 but holds other values")
        uses = list(value.uses())
        value.const_value = ir.Tensor(half, name=name)
        value.dtype = ir.DataType.FLOAT16
        as_float = _cast(graph, value, ir.DataType.FLOAT, before=graph.node(0), name=name)
        for user, index in uses:
            user.replace_input_with(index, as_float)


def check_onnx(path: Path) -> onnx.ModelProto:
    """onnx.checker (reads external data by path) plus strict shape inference, which must type every output;
    → the model proto without weights."""
    onnx.checker.check_model(str(path), full_check=True)
    model = onnx.load(str(path), load_external_data=False)
    inferred = onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True)
    for output in inferred.graph.output:
        if not output.type.tensor_type.HasField("shape"):
            raise UnsupportedModelError(f"ONNX shape inference left output '{output.name}' without a shape")
    return model
