"""How lowering calls torch.onnx's exporter: the model `torch.onnx.export(exported, dynamo=True, optimize=False,
custom_translation_table=TRANSLATIONS, ...)` would give, without the exporter's work that is redundant for the
passes' graphs. For a tiny two-layer model these three steps were ~6 of a compile's 17 s:

- the torchlib registry (plus our translations) is built once per process, not once per export: building it
  parses the source of ~500 onnxscript functions (~2 s);
- the decomposition re-trace is skipped when every op already has a translation (`_shortcuts`' `decompose`);
- the type-promotion pass (a symbolic fake-tensor run of the whole graph, ~2 s for the tiny model, longer for a
  real one) is skipped when no node would get a cast: `needs_type_promotion` decides that from the node.meta['val']
  the export recorded, by the pass's own rules.

Each shortcut runs the exporter's own step whenever its condition does not hold; where these torch internals are
missing (another torch version), `export_to_onnx` is the public `torch.onnx.export`."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch

from fxllm.compiler.targets.onnx_translations import TRANSLATIONS


def export_to_onnx(exported: torch.export.ExportedProgram, opset: int, input_names: list[str],
                   output_names: list[str]) -> Any:
    """The exporter's ONNXProgram for `exported`, unoptimized (lowering runs its own optimizer)."""
    registry = _registry(opset)
    with _shortcuts():
        if registry is None:
            return torch.onnx.export(exported, dynamo=True, opset_version=opset,
                                     custom_translation_table=TRANSLATIONS, input_names=input_names,
                                     output_names=output_names, optimize=False, verbose=False)
        from torch.onnx._internal.exporter import _core

        return _core.export(exported, registry=registry, input_names=input_names, output_names=output_names,
                            optimize=False, verbose=False, opset_version=opset)


@functools.cache
def _registry(opset: int) -> Any:
    """torchlib's registry for `opset` with TRANSLATIONS registered, as torch.onnx.export builds it per call; None
    where the internals differ. The exporter only reads it, so one instance serves every export."""
    try:
        from torch.onnx._internal.exporter import _constants, _core, _registration  # noqa: F401
    except ImportError:
        return None
    if opset < _constants.TORCHLIB_OPSET:
        return None  # torch.onnx.export converts such models between opsets; leave that to it
    registry = _registration.ONNXRegistry.from_torchlib(opset_version=opset)
    for torch_op, onnx_op in TRANSLATIONS.items():
        registry.register_op(torch_op, onnx_op, is_complex=False)
    return registry


@contextlib.contextmanager
def _shortcuts() -> Iterator[None]:
    """Swap the exporter's decomposition and type-promotion steps for ones that skip them when they would change
    nothing; restored on exit."""
    try:
        from torch.onnx._internal.exporter import _fx_passes
    except ImportError:
        yield
        return
    saved = _fx_passes.decompose_with_registry, _fx_passes.insert_type_promotion_nodes
    decompose_original, promote_original = saved

    def decompose(exported_program, registry):
        """torch.onnx.export re-traces the whole program (with symbolic shapes) to decompose the ops that have no
        ONNX translation. The passes' graphs need that only for `aten.to.dtype` and the `_assert_tensor_metadata`
        checks, which `prepare_for_onnx` rewrites in place first; when nothing else needs decomposing, no
        re-trace (any other op takes torch's own path, unchanged)."""
        from torch.onnx._internal.exporter import _decomp

        registered = set(_decomp.get_onnx_implemented_overloads(registry))
        prepare_for_onnx(exported_program.graph_module)
        if all(node.target in registered for node in exported_program.graph.nodes
               if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload)):
            return exported_program
        return decompose_original(exported_program, registry)

    def promote(graph_module):
        if needs_type_promotion(graph_module):
            promote_original(graph_module)

    _fx_passes.decompose_with_registry, _fx_passes.insert_type_promotion_nodes = decompose, promote
    try:
        yield
    finally:
        _fx_passes.decompose_with_registry, _fx_passes.insert_type_promotion_nodes = saved


def prepare_for_onnx(graph_module: torch.fx.GraphModule) -> None:
    """Drop `_assert_tensor_metadata` checks and spell `x.to(dtype)` as `_to_copy`, which ONNX translates."""
    aten = torch.ops.aten
    for node in list(graph_module.graph.nodes):
        if node.target is aten._assert_tensor_metadata.default and not node.users:
            graph_module.graph.erase_node(node)
        elif node.target is aten.to.dtype:
            node.target = aten._to_copy.default
            node.args, node.kwargs = (node.args[0],), {"dtype": node.args[1]}
    graph_module.recompile()


def needs_type_promotion(graph_module: torch.fx.GraphModule) -> bool:
    """Whether the exporter's InsertTypePromotion pass would change `graph_module` (or any graph in it): some node
    with a promotion rule has an input whose dtype differs from the one the rule promotes it to. Decided the way
    the pass decides (its rules, its scalar-to-dtype mapping) but on the recorded node.meta['val'] instead of a
    fresh fake-tensor run; True whenever an input has no recorded value or the rules cannot be consulted, so that
    the pass runs."""
    try:
        from torch.onnx._internal.fx import type_utils
        from torch.onnx._internal.fx.passes import type_promotion
    except ImportError:
        return True
    table = type_promotion.TypePromotionTable()
    for module in graph_module.modules():
        if not isinstance(module, torch.fx.GraphModule):
            return True
        for node in module.graph.nodes:
            rule = type_promotion.get_type_promotion_rule(node, table) if node.op == "call_function" else None
            if rule is None:
                continue
            missing = []

            def value(arg: torch.fx.Node) -> Any:
                if "val" not in arg.meta:
                    missing.append(arg)
                return arg.meta.get("val")

            args = torch.fx.node.map_arg(node.args, value)
            kwargs = torch.fx.node.map_arg(node.kwargs, value)
            if missing:
                return True
            try:
                snapshot = rule.preview_type_promotion(args, kwargs)
            except Exception:  # the pass would meet the same problem; let it report it
                return True
            targets = [(args[i], dtype) for i, dtype in snapshot.args_dtypes.items() if i < len(args)]
            targets += [(kwargs[name], dtype) for name, dtype in snapshot.kwargs_dtypes.items() if name in kwargs]
            if any(_would_cast(arg, dtype, type_utils) for arg, dtype in targets):
                return True
    return False


def _would_cast(value: Any, dtype: torch.dtype | None, type_utils: Any) -> bool:
    """The pass's `_maybe_promote_arg` test: a tensor of another dtype, or a (symbolic) scalar whose equivalent dtype
    differs, gets a cast; lists are checked element by element; anything it does not know raises there, so True."""
    if dtype is None or value is None:
        return False
    if isinstance(value, torch.Tensor):
        return value.dtype != dtype
    if isinstance(value, (list, tuple)):
        return any(_would_cast(element, dtype, type_utils) for element in value)
    equivalent = type_utils.from_scalar_type_to_torch_dtype(type(value))
    return equivalent is None or equivalent != dtype
