"""Lint after every pass: a well-formed graph, a signature that matches it, fresh node.meta['val'], known ops."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from fxllm.compiler.interface import make_input, sample_dims
from fxllm.compiler.targets.op_support import first_unsupported_node
from fxllm.compiler.program import Program


class LintError(RuntimeError):
    """A pass produced an invalid graph: a bug in that pass, reported with the pass name by the pass manager."""


def lint(program: Program) -> None:
    graph = program.graph
    graph.lint()
    placeholders = [n.name for n in graph.nodes if n.op == "placeholder"]
    declared = [sig.name for sig in program.inputs]
    if placeholders != declared:
        raise LintError(f"graph inputs {placeholders} do not match the declared signature {declared}")
    results = program.output_node().args[0]
    if not isinstance(results, (tuple, list)) or len(results) != len(program.outputs):
        raise LintError(f"graph returns {results!r}, but the signature declares {len(program.outputs)} outputs")
    unsupported = first_unsupported_node(program.graph_module)
    if unsupported is not None:
        raise LintError(f"node '{unsupported.name}' calls {unsupported.target}, which the lowering cannot translate")
    refresh_meta(program)


def refresh_meta(program: Program) -> None:
    """Re-derive node.meta['val'] for every node by fake-tensor propagation on sample shapes, so each pass can rely
    on shapes and dtypes being current (and a shape error surfaces here, naming the node, not at export)."""
    dims = sample_dims()
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        fake_inputs = [mode.from_tensor(make_input(sig, dims)) for sig in program.inputs]
    try:
        FakeTensorProp(program.graph_module, mode).propagate_dont_convert_inputs(*fake_inputs)
    except Exception as exc:
        raise LintError(f"shape propagation failed: {exc}") from exc
    for sig, value in zip(program.outputs, program.output_node().args[0]):
        meta = value.meta.get("val") if isinstance(value, torch.fx.Node) else None
        if meta is not None and str(meta.dtype).removeprefix("torch.") != sig.dtype:
            raise LintError(f"output '{sig.name}' is {meta.dtype}, declared {sig.dtype}")
