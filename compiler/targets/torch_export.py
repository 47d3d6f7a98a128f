"""Lowering for the `torch` target: the rewritten Program saved as a serialized torch.export program (model.pt2).

The .pt2 must load where only torch is installed (the runtime never imports fxllm.compiler), so fxllm's custom ops
are not kept in it: each is replaced by its reference implementation (compiler/ops.py) before the re-export, which
traces it into ATen ops. Attention becomes `aten.scaled_dot_product_attention` with the op's own arguments — an
explicit boolean mask and `enable_gqa=True` (K/V at the model's KV heads; query head h reads KV head h // group, the
grouping the custom op defines) — so the math is the custom op's, not an approximation of it; the masks and the
paged gather become the ATen ops their reference implementations use. The program is exported with every symbolic
dim of the signature dynamic (the same dims as the ONNX), and the contract digest is stored next to it inside the
archive (extra file `fxllm.contract`) for the runtime to check the manifest against.

API used: torch.export.export, torch.export.save(extra_files=...), available since torch 2.1; nothing newer than
torch 2.9 (the oldest torch the compile extra allows).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch

from fxllm.compiler import ops
from fxllm.compiler.program import Program
from fxllm.errors import UnsupportedModelError
from fxllm.runtime.contract import CONTRACT_METADATA_KEY, contract_digest

MODEL_FILE = "model.pt2"
# The custom ops and their reference implementations (CustomOpDef keeps the decorated function as _init_fn).
CUSTOM_OPS = {getattr(torch.ops.fxllm, name).default: getattr(ops, name)
              for name in ("attention", "causal_mask", "masked_attention", "dequant_linear", "dequant_embedding",
                           "gather_blocks", "paged_mask", "moe_experts",
                           "dequantize_experts")}


def reference_function(op: torch._ops.OpOverload):
    """The plain-torch body of one of fxllm's custom ops."""
    definition = CUSTOM_OPS.get(op)
    function = getattr(definition, "_init_fn", None)
    if function is None:
        raise UnsupportedModelError(f"the torch target cannot inline {op}: no reference implementation found")
    return function


def inline_custom_ops(program: Program) -> Program:
    """A copy of the program whose graph calls the custom ops' reference implementations instead of the ops (the
    weights are shared, not copied)."""
    graph = torch.fx.Graph()
    outputs = graph.graph_copy(program.graph, {})
    graph.output(outputs)
    for node in graph.nodes:
        if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) \
                and node.target.namespace == "fxllm":
            node.target = reference_function(node.target)
    return dataclasses.replace(program, graph_module=torch.fx.GraphModule(program.graph_module, graph))


def export_for_torch(program: Program) -> torch.export.ExportedProgram:
    """The program re-exported with the custom ops inlined: ATen ops only, dynamic dims as in the signature."""
    from fxllm.compiler.targets.onnx_export import export_program

    exported = export_program(inline_custom_ops(program))
    left = sorted({str(n.target) for n in exported.graph.nodes
                   if isinstance(n.target, torch._ops.OpOverload) and n.target.namespace == "fxllm"})
    if left:
        raise UnsupportedModelError(f"the torch target could not inline {', '.join(left)}")
    _drop_metadata_asserts(exported)
    return exported


def _drop_metadata_asserts(exported: torch.export.ExportedProgram) -> None:
    """torch.export records `x.to(dtype)` as a check of x's dtype *and device* (`_assert_tensor_metadata`): the
    device is the one lowering ran on (CPU), so the program would refuse to run on CUDA. The checks compute
    nothing (the ONNX path drops them too)."""
    graph = exported.graph
    for node in list(graph.nodes):
        if node.target is torch.ops.aten._assert_tensor_metadata.default and not node.users:
            graph.erase_node(node)
    exported.graph_module.recompile()


def lower_to_torch(program: Program, path: str | os.PathLike, seconds: dict[str, float] | None = None) -> Path:
    """Write `path` (a .pt2 archive: program, weights and the contract digest)."""
    import time

    path = Path(path)
    start = time.perf_counter()
    exported = export_for_torch(program)
    if seconds is not None:
        seconds["re-export"] = time.perf_counter() - start
        start = time.perf_counter()
    digest = contract_digest(program.spec.to_dict(), program.inputs, program.outputs)
    torch.export.save(exported, str(path), extra_files={CONTRACT_METADATA_KEY: digest})
    if seconds is not None:
        seconds["save"] = time.perf_counter() - start
    return path
