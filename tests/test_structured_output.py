"""Structured outputs (vLLM's structured_outputs, OpenAI's response_format): every kind's output matches its structure
on a random-weight model (which left alone writes anything), greedy tokens equal a loop that scores the whole
sequence at every token and masks it with a fresh llguidance matcher (contiguous, paged, and with prompt-lookup
speculation, which must give the same tokens), sampled outputs match too, and bad structures are one-line errors
that lose nothing. Over HTTP: tests/serving/test_openai_api.py."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

import fxllm
from fxllm.errors import GenerationError, InvalidArgumentError
from fxllm.runtime.request import SamplingParams
from fxllm.runtime.structured_output import StructuredOutputsParams

ANSWER = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["answer", "n"], "additionalProperties": False}
REPEATED = {"type": "array", "items": {"enum": ["yes", "no"]}, "minItems": 8, "maxItems": 8}
GBNF = 'root ::= "The answer is " ("A" | "B" | "C") "."'


def _nested(depth: int) -> dict:
    """An array schema nested `depth` deep (llguidance's compiler stops at its recursion limit)."""
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


@pytest.fixture(scope="module")
def engine(tiny_paged_artifact):
    return fxllm.load(tiny_paged_artifact)


def test_each_kind_of_structure_is_followed(engine):
    prompt = "The capital of France is"
    result = engine.generate(prompt, max_new_tokens=40, structured_outputs={"json": ANSWER})
    value = json.loads(result.text)
    assert result.finish_reason == "stop" and value["answer"] in ("yes", "no") and 0 <= value["n"] <= 99
    assert set(value) == {"answer", "n"}
    result = engine.generate(prompt, max_new_tokens=40, structured_outputs={"json": REPEATED})
    assert result.finish_reason == "stop" and len(json.loads(result.text)) == 8
    result = engine.generate(prompt, max_new_tokens=20, structured_outputs={"regex": r"\d{3}-[a-c]{2}"})
    assert result.finish_reason == "stop" and re.fullmatch(r"\d{3}-[a-c]{2}", result.text)
    result = engine.generate(prompt, max_new_tokens=20, structured_outputs={"choice": ["red", "green", "blue"]})
    assert result.finish_reason == "stop" and result.text in ("red", "green", "blue")
    result = engine.generate(prompt, max_new_tokens=20, structured_outputs={"grammar": GBNF})
    assert result.finish_reason == "stop" and re.fullmatch(r"The answer is [ABC]\.", result.text)
    result = engine.generate(prompt, max_new_tokens=24, structured_outputs={"json_object": True})
    assert result.text.startswith("{")  # a random model may not close it within 24 tokens
    if result.finish_reason == "stop":
        assert isinstance(json.loads(result.text), dict)
    nulls = engine.generate(prompt, max_new_tokens=20, structured_outputs={"choice": ["red", "green"], "json": None,
                                                                          "json_object": None})  # a vLLM client's
    assert nulls.text in ("red", "green")
    free = engine.generate(prompt, max_new_tokens=12)
    assert not free.text.startswith("{")  # the structure made the difference


def reference_greedy(engine, prompt: list[int], params: StructuredOutputsParams, new_tokens: int) -> list[int]:
    """Each token: the whole sequence scored, masked by a fresh matcher fed the output so far, argmax; stops where
    the grammar is complete."""
    from llguidance import LLMatcher, LLTokenizer

    ll = LLTokenizer(engine.tokenizer.backend.to_str(), n_vocab=engine.spec.vocab_size,
                     eos_token=sorted(engine.core.eos_token_ids))
    output: list[int] = []
    for _ in range(new_tokens):
        matcher = LLMatcher(ll, params.grammar_text(), log_level=0)
        assert matcher.consume_tokens(output) if output else True
        if matcher.is_stopped():
            break
        allowed = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), np.uint8), bitorder="little")
        logits = engine.score(prompt + output)[-1].copy()
        logits[~allowed[:logits.size].astype(bool)] = -np.inf
        output.append(int(np.argmax(logits)))
        if output[-1] in engine.core.eos_token_ids:
            break
    return output


@pytest.mark.parametrize("kind", ["contiguous", "paged", "paged-ngram", "contiguous-ngram"])
def test_greedy_tokens_match_a_loop_by_hand(kind, make_tiny_artifact, tiny_paged_artifact):
    artifact = tiny_paged_artifact if kind.startswith("paged") else make_tiny_artifact("llama")
    engine = fxllm.load(artifact, speculative="ngram" if kind.endswith("ngram") else False)
    prompts = [engine.encode(text) for text in ("Answer in JSON:", "def fibonacci(n):\n    return")]
    structure = StructuredOutputsParams(json=REPEATED)
    results = engine.generate_ids(prompts, max_new_tokens=40, structured_outputs=structure)
    for prompt, result in zip(prompts, results):
        assert result.token_ids == reference_greedy(engine, prompt, structure, 40), kind
        assert len(json.loads(result.text)) == 8
    if kind.endswith("ngram"):
        assert engine.stats().speculative.proposed > 0 and engine.stats().speculative.accepted > 0


def test_sampled_outputs_follow_the_structure(engine):
    prompt = engine.encode("Pick one:")
    results = engine.generate_ids([prompt] * 12, max_new_tokens=30, temperature=1.0, seed=0,
                                  structured_outputs={"json": ANSWER})
    values = [json.loads(r.text) for r in results]
    assert all(v["answer"] in ("yes", "no") and 0 <= v["n"] <= 99 for v in values)
    options = dict(max_new_tokens=30, temperature=1.0, seed=5, structured_outputs={"json": ANSWER})
    first, again = (engine.generate_ids([prompt], **options)[0].token_ids for _ in range(2))
    assert first == again


@pytest.mark.parametrize("structure, says", [
    ({"regex": "a(b"}, "regex: "),
    ({"json": {"type": "foo"}}, "json: "),
    ({"json": "{not json"}, "json: the schema must be a JSON object"),
    ({"grammar": "root ::= ("}, "grammar: "),
    ({"json": ANSWER, "regex": "x"}, "give exactly one of json, regex, choice, grammar, json_object (got json, regex)"),
    ({}, "give exactly one of"),
    ({"choice": []}, "choice must be a non-empty list of strings"),
    ({"choice": "yes"}, "choice must be a non-empty list of strings"),
    ({"jsn": {}}, "structured_outputs takes json, regex, choice, grammar, json_object; not jsn"),
    ("json", "structured_outputs must be a dict"),
    ({"json": {"type": "number", "maximum": float("nan")}}, "json: the schema is not JSON (Out of range float"),
    ({"json": '{"type": "number", "maximum": NaN}'}, "json: the schema must be a JSON object (NaN is not JSON)"),
    ({"regex": "a\ud800"}, "regex is not valid Unicode: a lone surrogate"),
    ({"json": {"type": "string", "pattern": "\udc80"}}, "surrogate"),  # json.dumps writes it as an escape
    ({"json_object": 1}, "json_object must be True or False, got int 1"),
    ({"json": _nested(300)}, "json: "),
    ({"regex": "[^\\s\\S]"}, "regex: no text matches it"),
    ({"grammar": 'start: start "a"'}, "grammar: no text matches it"),
    ({"choice": ["<|im_end|>"]}, "choice: it starts with a special token's text"),
])
def test_bad_structures_are_one_line_errors_that_lose_nothing(engine, structure, says):
    prompt = engine.encode("x")
    with pytest.raises(InvalidArgumentError, match=re.escape(says)) as caught:
        engine.generate_ids([prompt], max_new_tokens=3, structured_outputs=structure)
    assert caught.value.param == "structured_outputs" and "\n" not in str(caught.value)
    assert engine.generate_ids([prompt], max_new_tokens=2)[0].token_ids  # the engine serves on


@pytest.mark.parametrize("other", [dict(min_tokens=2), dict(bad_words=["x"]), dict(allowed_token_ids=[1, 2]),
                                   dict(ignore_eos=True)])
def test_options_that_could_leave_the_grammar_nothing_are_refused(other):
    with pytest.raises(InvalidArgumentError, match=f"structured_outputs cannot be combined with {next(iter(other))}"):
        SamplingParams(max_tokens=4, structured_outputs={"choice": ["a"]}, **other)


def test_without_llguidance_a_structure_is_a_one_line_error(tiny_paged_artifact, monkeypatch):
    """The runtime alone (`pip install fxllm`) has no llguidance: a request with a structure says how to get it, and
    requests without one are served."""
    import sys

    from fxllm.errors import MissingDependencyError

    monkeypatch.setitem(sys.modules, "llguidance", None)  # import llguidance raises ImportError
    engine = fxllm.load(tiny_paged_artifact)
    prompt = engine.encode("x")
    with pytest.raises(MissingDependencyError, match=re.escape("structured outputs need llguidance: pip install "
                                                        "'fxllm[structured]'")):
        engine.generate_ids([prompt], max_new_tokens=3, structured_outputs={"choice": ["a", "b"]})
    assert engine.generate_ids([prompt], max_new_tokens=2)[0].token_ids


def test_a_special_tokens_text_inside_a_structure_fails_the_request_not_the_structure(engine):
    """llguidance reads "<|im_end|>" in a structure as that token, which would end the request mid-structure: the
    request fails with a one-line error instead of returning half a JSON as a finished reply."""
    eos_text = engine.tokenizer.decode(sorted(engine.core.eos_token_ids)[:1], skip_special_tokens=False)
    schema = {"type": "object", "properties": {"a": {"const": eos_text}}, "required": ["a"]}
    with pytest.raises(GenerationError, match="the structure asks for a special token's text"):
        engine.generate("x", max_new_tokens=20, structured_outputs={"json": schema})
    assert engine.generate("x", max_new_tokens=2).token_ids  # the engine serves on
