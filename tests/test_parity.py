"""Greedy decoding through a compiled artifact equals transformers' own greedy generate, token for token."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import fxllm
from tests.conftest import PROMPTS

NEW_TOKENS = 32


def reference_tokens(model, tokenizer, prompt: str) -> list[int]:
    ids = torch.tensor([tokenizer(prompt)["input_ids"]])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id)
    return out[0, ids.shape[1]:].tolist()


def assert_parity(engine, model, tokenizer) -> None:
    expected = [reference_tokens(model, tokenizer, p) for p in PROMPTS]
    assert len({len(tokenizer(p)["input_ids"]) for p in PROMPTS}) == len(PROMPTS), "prompts must differ in length"
    for prompt, want in zip(PROMPTS, expected):
        assert engine.generate(prompt, max_new_tokens=NEW_TOKENS).token_ids == want, prompt
    batch = engine.generate(PROMPTS, max_new_tokens=NEW_TOKENS)
    assert [r.token_ids for r in batch] == expected


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_tiny_models_match_transformers(arch, make_tiny_model, make_tiny_artifact, tokenizer):
    model = AutoModelForCausalLM.from_pretrained(make_tiny_model(arch), dtype=torch.float32).eval()
    engine = fxllm.load(make_tiny_artifact(arch))
    assert_parity(engine, model, tokenizer)


@pytest.mark.slow
def test_smollm2_matches_transformers(smollm2_artifact, smollm2_model, tokenizer):
    engine = fxllm.load(smollm2_artifact)
    assert_parity(engine, smollm2_model, tokenizer)  # transformers' tokenizer: the reference is transformers alone
