"""Lint after every pass: a well-formed graph, a signature that matches it, fresh node.meta['val'], known ops."""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass, field

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
    on shapes and dtypes being current (and a shape error surfaces here, naming the node, not at export).

    Incremental: a call node whose target and arguments are unchanged since its last propagation, and whose inputs'
    metadata (shape, dtype, strides) is unchanged too, keeps its value; everything else is propagated again. A pass
    that rewrites a few nodes so costs those nodes and whatever their changed metadata reaches, not the graph."""
    state = _propagation_state(program.graph_module)
    dims = sample_dims()
    fake_inputs = []
    with state.mode:
        for sig in program.inputs:
            key = (sig.name, sig.dtype, tuple(d if isinstance(d, int) else dims[d] for d in sig.dims))
            if key not in state.inputs:
                state.inputs[key] = state.mode.from_tensor(make_input(sig, dims))
            fake_inputs.append(state.inputs[key])
    try:
        _IncrementalProp(program.graph_module, state).propagate_dont_convert_inputs(*fake_inputs)
    except Exception as exc:
        raise LintError(f"shape propagation failed: {exc}") from exc
    for sig, value in zip(program.outputs, program.output_node().args[0]):
        meta = value.meta.get("val") if isinstance(value, torch.fx.Node) else None
        if meta is not None and str(meta.dtype).removeprefix("torch.") != sig.dtype:
            raise LintError(f"output '{sig.name}' is {meta.dtype}, declared {sig.dtype}")


_KEY = "fxllm_lint_key"  # node.meta: what the node's value was propagated from
_VERSION = "fxllm_lint_version"  # node.meta: changes whenever the metadata of the node's value changes
_versions = itertools.count(1)


@dataclass
class _PropagationState:
    """One fake-tensor mode per graph module for its whole life (values from two modes cannot meet in one op),
    and the fake sample inputs, reused so that unchanged inputs keep their identity."""

    mode: FakeTensorMode
    token: int = field(default_factory=lambda: next(_versions))
    inputs: dict[tuple, torch.Tensor] = field(default_factory=dict)


_states: weakref.WeakKeyDictionary[torch.fx.GraphModule, _PropagationState] = weakref.WeakKeyDictionary()


def _propagation_state(module: torch.fx.GraphModule) -> _PropagationState:
    if module not in _states:
        _states[module] = _PropagationState(FakeTensorMode(allow_non_fake_inputs=True))
    return _states[module]


class _IncrementalProp(FakeTensorProp):
    def __init__(self, module: torch.fx.GraphModule, state: _PropagationState) -> None:
        super().__init__(module, state.mode)
        self.state = state

    def run_node(self, node: torch.fx.Node):
        key = self._key(node) if node.op in ("call_function", "call_method") else None  # a submodule may change
        if key is not None and node.meta.get(_KEY) == key and "val" in node.meta:
            return node.meta["val"]
        old = node.meta.get("val")
        old_version = node.meta.get(_VERSION)
        result = super().run_node(node)
        current = (old_version is not None and old_version[0] == self.state.token
                   and _same_metadata(old, node.meta.get("val")))
        node.meta[_VERSION] = old_version if current else (self.state.token, next(_versions))
        if key is not None:
            node.meta[_KEY] = key
        else:
            node.meta.pop(_KEY, None)
        return result

    def _key(self, node: torch.fx.Node) -> tuple | None:
        """(mode, target, arguments with each input node replaced by its value's version); None when an argument
        holds a tensor (no cheap comparison) or an input has no version yet."""
        unkeyable = []

        def version(value):
            if isinstance(value, torch.fx.Node):
                found = value.meta.get(_VERSION)
                if found is None or found[0] != self.state.token:
                    unkeyable.append(value)
                return ("node", found)
            if isinstance(value, torch.Tensor):
                unkeyable.append(value)
            return value

        key = (self.state.token, node.op, node.target, torch.fx.node.map_aggregate(node.args, version),
               torch.fx.node.map_aggregate(node.kwargs, version))
        return None if unkeyable else key


def _same_metadata(a, b) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return (a.shape == b.shape and a.dtype == b.dtype and a.stride() == b.stride()
                and a.storage_offset() == b.storage_offset() and a.device == b.device)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same_metadata(x, y) for x, y in zip(a, b))
    if a is None or b is None:
        return a is None and b is None
    if isinstance(a, (bool, int, float)) and type(a) is type(b):
        return a == b
    return False
