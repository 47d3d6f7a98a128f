"""Pass `select-logits`: compute the lm_head only at the positions the caller asks for.

before: logits = lm_head(hidden [B,T,H]) → [B,T,V]
→ after: logits = lm_head(index_select(hidden, 1, logits_index)) → [B,K,V], with a new input logits_index [K] (a
scaling or soft-capping of the logits after the lm_head stays where it is and sees only the selected positions):
prefill asks for its last position only, decode for its one token, eval and speculative verification for all.
"""

from __future__ import annotations

import torch

from fxllm.compiler import ops  # noqa: F401 - registers torch.ops.fxllm.*
from fxllm.compiler.pass_registry import register_pass
from fxllm.compiler.patterns import logits_projection
from fxllm.compiler.program import Program
from fxllm.runtime.contract import LOGITS_INDEX, TensorSig
from fxllm.errors import UnsupportedModelError

PROJECTIONS = {torch.ops.aten.linear.default, torch.ops.fxllm.dequant_linear.default}


@register_pass("select-logits", requires=("captured",), provides=("selected-logits",), forbids=("selected-logits",))
def select_logits(program: Program) -> Program:
    """Add a logits_index input and apply the lm_head only at those positions."""
    graph = program.graph
    logits = program.output_node().args[0][0]
    head = logits_projection(logits, PROJECTIONS)
    if head is None:
        raise UnsupportedModelError(f"select-logits: the logits come from {logits.target} (node '{logits.name}'), "
                                    "not from a linear lm_head (optionally scaled or soft-capped)")
    last_input = [n for n in graph.nodes if n.op == "placeholder"][-1]
    with graph.inserting_after(last_input):
        index = graph.placeholder(LOGITS_INDEX)
    with graph.inserting_before(head):
        selected = graph.call_function(torch.ops.aten.index_select.default, (head.args[0], 1, index))
    head.args = (selected, *head.args[1:])
    position = [n.name for n in graph.nodes if n.op == "placeholder"].index(LOGITS_INDEX)
    program.inputs.insert(position, TensorSig(LOGITS_INDEX, ("select",), "int64"))
    logits = program.outputs[0]
    program.outputs[0] = TensorSig(logits.name, (logits.dims[0], "select", *logits.dims[2:]), logits.dtype)
    return program
