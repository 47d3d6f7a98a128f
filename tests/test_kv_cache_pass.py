"""The kv-cache pass: new inputs/outputs, KV heads only, and steps of any size over the cache equal a full pass."""

from __future__ import annotations

import torch

from fxllm.compiler.capture import capture
from fxllm.compiler.interface import run_sequence, step_inputs
from fxllm.compiler.pass_manager import run_pipeline
from fxllm.compiler.pipeline import build_pipeline, parse_pipeline
from fxllm.compiler.sources import load_model, resolve_source


def compiled_program(directory):
    program = capture(load_model(resolve_source(directory))).program
    reference = program
    ids = torch.randint(0, 49152, (2, 12), generator=torch.Generator().manual_seed(3))
    expected = run_sequence(reference, ids)
    program, records = run_pipeline(program, build_pipeline(parse_pipeline("cleanup,kv-cache")))
    return program, records, ids, expected


def test_signature_and_drift(make_tiny_model):
    program, records, ids, expected = compiled_program(make_tiny_model("llama"))
    names = [s.name for s in program.inputs]
    assert names[:3] == ["input_ids", "position_ids", "attention_mask"]
    assert names[3:] == [f"past_{kind}_{i}" for i in range(2) for kind in ("key", "value")]
    assert [s.name for s in program.outputs][1:] == [f"present_{k}_{i}" for i in range(2) for k in ("key", "value")]
    assert all(s.dims[1] == program.spec.num_kv_heads for s in program.inputs[3:])
    assert records[-1].name == "kv-cache" and records[-1].drift.max_abs_logit <= 1e-5
    assert records[-1].drift.greedy_agreement == 1.0
    assert not any(n.target is torch.ops.fxllm.attention.default for n in program.graph.nodes)


def test_token_by_token_and_multi_token_steps_match_full_pass(make_tiny_model):
    program, _, ids, expected = compiled_program(make_tiny_model("qwen2"))
    # Steps of 5, 1, 4 and 2 tokens: prefill, single-token decode, and speculative-style multi-token verification.
    past: dict[str, torch.Tensor] = {}
    pieces = []
    start = 0
    for size in (5, 1, 4, 2):
        chunk = ids[:, start:start + size]
        with torch.no_grad():
            outputs = program.graph_module(*step_inputs(program, chunk, past))
        pieces.append(outputs[0])
        past = {s.name: o for s, o in zip(program.outputs, outputs) if s.name.startswith("present_")}
        start += size
    assert past["present_key_0"].shape == (2, program.spec.num_kv_heads, 12, program.spec.head_dim)
    torch.testing.assert_close(torch.cat(pieces, 1), expected, atol=1e-5, rtol=1e-5)


def test_left_padding_matches_unpadded(make_tiny_model):
    program, _, ids, _ = compiled_program(make_tiny_model("mistral"))
    short = ids[:1, :7]
    alone = run_sequence(program, short)
    padded_ids = torch.cat([torch.zeros(1, 5, dtype=torch.int64), short], 1)
    inputs = step_inputs(program, padded_ids, {})
    mask = torch.cat([torch.zeros(1, 5, dtype=torch.int64), torch.ones(1, 7, dtype=torch.int64)], 1)
    positions = (mask.cumsum(1) - 1).clamp_min(0)
    names = [s.name for s in program.inputs]
    inputs[names.index("attention_mask")] = mask
    inputs[names.index("position_ids")] = positions
    with torch.no_grad():
        logits = program.graph_module(*inputs)[0]
    assert torch.isfinite(logits).all()
    torch.testing.assert_close(logits[:, 5:], alone, atol=1e-5, rtol=1e-5)
