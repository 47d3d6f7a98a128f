"""The unrolled draft graph: a compiled draft's one-step ONNX graph repeated k times in one model, so proposing k
draft tokens is one call instead of k (runtime/unrolled_draft.py runs it; the calling convention is
runtime/contract.py's UnrolledDraftIO).

Step 0 is the one-step graph on the caller's inputs. Step i >= 1 feeds step i-1's token: input_ids = that token,
position_ids = the first step's last position + i, attention_mask = the previous step's with a 1 appended,
logits_index = [0], the past caches = step i-1's present caches. Each step's last-position logits pick its token as
argmax(logits * draft_inv_temperature + draft_noise[:, i]) (ArgMax keeps the first maximum, as numpy's argmax does).
The copies share the initializers (the weights file is the one-step model's, referenced, not copied); every other
value and node name gets a `step{i}/` prefix, except the last step's cache outputs, which are the graph's.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import onnx
from onnx import TensorProto, helper

from fxllm.errors import UnsupportedModelError
from fxllm.runtime.contract import (ATTENTION_MASK, CONTRACT_METADATA_KEY, DRAFT_INV_TEMPERATURE, DRAFT_LOGITS,
                                    DRAFT_NOISE, DRAFT_TOKENS, INPUT_IDS, LOGITS, LOGITS_INDEX, POSITION_IDS,
                                    CacheTensor, ModelIO, ModelSpec, UnrolledDraftIO, contract_digest, parse_cache_name)

UNROLLED_MODEL_FILE = "model.unrolled.onnx"
_INT64_MAX = 2**63 - 1


def write_unrolled_draft(step_file: Path, io: ModelIO, spec: ModelSpec, k: int) -> Path:
    """Write UNROLLED_MODEL_FILE next to `step_file` (a contiguous-cache one-step model with external weights)
    for k steps; → its path. UnsupportedModelError for graphs it cannot unroll (paged caches, control flow)."""
    if io.paged:
        raise UnsupportedModelError("an unrolled draft graph needs a contiguous-cache draft, not a paged one")
    step = onnx.load(str(step_file), load_external_data=False)  # initializers keep pointing at the weights file
    model = unroll(step, io, k)
    unrolled = UnrolledDraftIO.of(io, k)
    digest = contract_digest(spec.to_dict(), list(unrolled.inputs), list(unrolled.outputs))
    helper.set_model_props(model, {**{p.key: p.value for p in step.metadata_props}, CONTRACT_METADATA_KEY: digest})
    path = step_file.with_name(UNROLLED_MODEL_FILE)
    onnx.save(model, str(path))
    return path


def unroll(step: onnx.ModelProto, io: ModelIO, k: int) -> onnx.ModelProto:
    """The k-step model of a one-step model (see the module docstring); `step` is not changed."""
    graph = step.graph
    if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for n in graph.node for a in n.attribute):
        raise UnsupportedModelError("the draft graph has control flow (a subgraph attribute); it cannot be unrolled")
    cache_outputs = [o.name for o in graph.output if parse_cache_name(o.name) is not None]
    cache_inputs = {parse_cache_name(name): name for name in (i.name for i in graph.input)
                    if parse_cache_name(name) is not None}
    past_of = {name: cache_inputs[_as_input(parse_cache_name(name))] for name in cache_outputs}
    shared = {init.name for init in graph.initializer}
    nodes: list[onnx.NodeProto] = []
    glue = _Glue(nodes)
    batch_shape = glue.node("Shape", [INPUT_IDS], "batch_dims", start=0, end=1)
    ones_shape = glue.node("Concat", [batch_shape, glue.const("one_i64", [1])], "ones_shape", axis=0)
    one_per_row = glue.node("Expand", [glue.const("one_2d", [[1]]), ones_shape], "one_per_row")
    last_position = glue.slice(POSITION_IDS, -1, _INT64_MAX, axis=1, name="last_position")
    inverse_temperature = glue.node("Unsqueeze", [DRAFT_INV_TEMPERATURE, glue.const("axes_12", [1, 2])],
                                    "inverse_temperature")
    feeds = {i.name: i.name for i in graph.input}
    tokens, logits = [], []
    mask = ATTENTION_MASK
    for i in range(k):
        last = i == k - 1
        prefix = f"step{i}/"
        renamed = dict(feeds)
        for node in graph.node:
            for name in node.output:
                if name:
                    renamed[name] = name if last and name in past_of else prefix + name
        for node in graph.node:
            copy = onnx.NodeProto()
            copy.CopyFrom(node)
            copy.name = prefix + (node.name or node.op_type)
            copy.input[:] = [renamed.get(name, name) if name not in shared else name for name in node.input]
            copy.output[:] = [renamed[name] if name else name for name in node.output]
            nodes.append(copy)
        step_logits = glue.slice(renamed[LOGITS], -1, _INT64_MAX, axis=1, name=f"{prefix}last_logits")
        scaled = glue.node("Mul", [step_logits, inverse_temperature], f"{prefix}scaled")
        noise = glue.slice(DRAFT_NOISE, i, i + 1, axis=1, name=f"{prefix}noise")
        scores = glue.node("Add", [scaled, noise], f"{prefix}scores")
        token = glue.node("ArgMax", [scores], f"{prefix}token", axis=2, keepdims=0, select_last_index=0)
        tokens.append(token)
        logits.append(step_logits)
        if last:
            break
        mask = glue.node("Concat", [mask, one_per_row], f"{prefix}next_mask", axis=1)
        feeds = {INPUT_IDS: token, ATTENTION_MASK: mask,
                 POSITION_IDS: glue.node("Add", [last_position, glue.const(f"{prefix}offset", [[i + 1]])],
                                         f"{prefix}next_position"),
                 **{past: renamed[present] for present, past in past_of.items()}}
        if LOGITS_INDEX in renamed:
            feeds[LOGITS_INDEX] = glue.const(f"{prefix}next_index", [0])
    glue.node("Concat", tokens, DRAFT_TOKENS, axis=1, exact=True)
    glue.node("Concat", logits, DRAFT_LOGITS, axis=1, exact=True)
    unrolled = UnrolledDraftIO.of(io, k)
    vocab = graph.output[0].type.tensor_type
    inputs = [*graph.input,
              helper.make_tensor_value_info(DRAFT_NOISE, TensorProto.FLOAT, ["batch", k, _dim(vocab, -1)]),
              helper.make_tensor_value_info(DRAFT_INV_TEMPERATURE, TensorProto.FLOAT, ["batch"])]
    outputs = [helper.make_tensor_value_info(DRAFT_TOKENS, TensorProto.INT64, ["batch", k]),
               helper.make_tensor_value_info(DRAFT_LOGITS, vocab.elem_type, ["batch", k, _dim(vocab, -1)]),
               *(o for o in graph.output if o.name in past_of)]
    assert [o.name for o in outputs] == [sig.name for sig in unrolled.outputs]
    new_graph = helper.make_graph(nodes, f"{graph.name}_unrolled_{k}", inputs, outputs, list(graph.initializer))
    model = helper.make_model(new_graph, opset_imports=list(step.opset_import), ir_version=step.ir_version,
                              producer_name=step.producer_name, producer_version=step.producer_version)
    return model


def _as_input(role: CacheTensor) -> CacheTensor:
    """The past-input role matching a present-output role (same kind and layer)."""
    return replace(role, is_input=True)


def _dim(tensor_type, index: int) -> int | str:
    dim = tensor_type.shape.dim[index]
    return dim.dim_value if dim.HasField("dim_value") else dim.dim_param


class _Glue:
    """The nodes between the copies (names under `unroll/`), appended to `nodes`."""

    def __init__(self, nodes: list[onnx.NodeProto]):
        self.nodes = nodes

    def node(self, op: str, inputs: list[str], name: str, exact: bool = False, **attributes) -> str:
        output = name if exact else f"unroll/{name}"
        self.nodes.append(helper.make_node(op, inputs, [output], name=output, **attributes))
        return output

    def const(self, name: str, value) -> str:
        tensor = helper.make_tensor(f"unroll/{name}", TensorProto.INT64, _shape(value), _flat(value))
        return self.node("Constant", [], name, value=tensor)

    def slice(self, source: str, start: int, end: int, axis: int, name: str) -> str:
        return self.node("Slice", [source, self.const(f"{name}_start", [start]), self.const(f"{name}_end", [end]),
                                   self.const(f"{name}_axis", [axis])], name)


def _shape(value) -> list[int]:
    return [len(value), *_shape(value[0])] if isinstance(value, list) else []


def _flat(value) -> list[int]:
    return [x for v in value for x in _flat(v)] if isinstance(value, list) else [value]
