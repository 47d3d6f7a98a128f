"""fuse-projections: projections that read one activation become one linear + split, with bit-identical logits."""

from __future__ import annotations

import pytest
import torch

from fxllm.compiler.capture import capture
from fxllm.compiler.pass_manager import run_pipeline
from fxllm.compiler.pipeline import build_pipeline, parse_pipeline
from fxllm.compiler.sources import load_model, resolve_source


def linear_count(program) -> int:
    return sum(1 for n in program.graph.nodes if n.target is torch.ops.aten.linear.default)


def stored_elements(program) -> int:
    module = program.graph_module
    return sum(t.numel() for t in list(module.parameters()) + list(module.buffers()))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2 has q/k/v biases
def test_fusion_is_exact_and_merges_qkv_and_gate_up(arch, make_tiny_model):
    program = capture(load_model(resolve_source(make_tiny_model(arch)))).program
    layers = program.spec.num_layers
    assert linear_count(program) == 7 * layers + 1  # q k v o gate up down per layer, plus lm_head
    parameters_before = stored_elements(program)
    program, records = run_pipeline(program, build_pipeline(parse_pipeline("cleanup,fuse-projections")))
    assert linear_count(program) == 4 * layers + 1  # qkv, o, gate+up, down
    assert records[-1].drift.max_abs_logit == 0.0
    assert stored_elements(program) == parameters_before, "old weights must be dropped, not duplicated"
