"""select-logits: the lm_head runs only at the requested positions, with identical values there."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import torch

import fxllm
from fxllm.compiler.capture import capture
from fxllm.compiler.interface import step_inputs
from fxllm.compiler.pass_manager import run_pipeline
from fxllm.compiler.pipeline import build_pipeline, parse_pipeline
from fxllm.compiler.sources import load_model, resolve_source
from tests.conftest import PROMPTS


def test_selected_positions_equal_the_full_logits(make_tiny_model):
    program = capture(load_model(resolve_source(make_tiny_model("llama")))).program
    program, _ = run_pipeline(program, build_pipeline(parse_pipeline("cleanup,select-logits,kv-cache")))
    ids = torch.randint(0, 49152, (2, 9), generator=torch.Generator().manual_seed(2))
    inputs = step_inputs(program, ids, {})
    with torch.no_grad():
        full = program.graph_module(*inputs)[0]
        inputs[[s.name for s in program.inputs].index("logits_index")] = torch.tensor([8, 3])
        picked = program.graph_module(*inputs)[0]
    assert full.shape[1] == 9 and picked.shape[1] == 2
    torch.testing.assert_close(picked, full[:, [8, 3]], atol=1e-6, rtol=1e-6)


def test_engine_uses_the_last_position_only(make_tiny_artifact):
    artifact = make_tiny_artifact("llama")
    model = onnx.load(str(artifact / "model.onnx"), load_external_data=False)
    assert Counter(n.op_type for n in model.graph.node)["Gather"] >= 2  # embedding + logits selection
    engine = fxllm.load(artifact)
    assert engine.selects_logits
    ids = engine.encode(PROMPTS[1])
    scores = engine.score(ids)
    assert scores.shape == (len(ids), 49152)
    first = engine.generate_ids([ids], max_new_tokens=1)[0].token_ids[0]
    assert first == int(np.argmax(scores[-1]))
