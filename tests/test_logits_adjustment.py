"""logit_bias, the repetition / frequency / presence penalties and min-p: their formulas against a direct reading of
vLLM's and OpenAI's definitions, their checks, and the engine's greedy tokens with them against a loop that scores
the whole sequence at every token and applies them by hand — contiguous, paged, and with prompt-lookup speculation
(which must give the same tokens). The speculative path's sampled distribution with them is checked in
tests/test_speculative_paged.py."""

from __future__ import annotations

import re
from dataclasses import replace

import numpy as np
import pytest

import fxllm
from fxllm.errors import InvalidArgumentError
from fxllm.runtime.logits_adjustment import LogitsAdjuster, adjuster
from fxllm.runtime.request import MAX_LOGIT_BIAS, MAX_TOKEN_IDS, SamplingParams
from fxllm.runtime.sampler import probabilities

ADJUSTED = dict(repetition_penalty=1.3, frequency_penalty=0.6, presence_penalty=0.4)


def reference_adjust(logits: np.ndarray, params: SamplingParams, prompt: list[int], output: list[int],
                     ending: tuple[int, ...] = ()) -> np.ndarray:
    """One row [V], token by token: ids outside allowed_token_ids -inf; bias added; the `ending` ids (EOS, stop
    ids) -inf while the output is shorter than min_tokens; then each token seen in prompt or output: positive logit
    divided by the repetition penalty, negative multiplied; then minus frequency × count in output, minus presence
    if in it."""
    row = logits.astype(np.float64).copy()
    if params.allowed_token_ids is not None:
        row = np.where(np.isin(np.arange(row.size), params.allowed_token_ids), row, -np.inf)
    for token, bias in params.logit_bias:
        row[token] += bias
    if len(output) < params.min_tokens:
        for token in ending:
            row[token] = -np.inf
    for token in set(prompt) | set(output):
        penalty = params.repetition_penalty
        row[token] = row[token] / penalty if row[token] > 0 else row[token] * penalty
    for token in set(output):
        row[token] -= params.frequency_penalty * output.count(token) + params.presence_penalty
    return row


def test_adjustment_follows_the_formulas_row_by_row():
    rng = np.random.default_rng(0)
    vocab = 50
    params = SamplingParams(logit_bias={3: 5.0, 7: -100, 11: 0.25}, **ADJUSTED)
    prompt = [1, 2, 3, 3, 40]
    output = [7, 9, 9, 9, 2]
    drafts = [9, 12, 12, 40, 7]  # in the output, new (twice), in the prompt only, in the output
    logits = rng.normal(size=(len(drafts) + 1, vocab)).astype(np.float32) * 3
    before = logits.copy()
    adjusted = LogitsAdjuster(params, prompt)(logits, output, drafts)
    assert adjusted.dtype == np.float32 and adjusted is not logits
    for row in range(len(drafts) + 1):  # row i follows the output and the drafts before it
        expected = reference_adjust(logits[row], params, prompt, output + drafts[:row])
        np.testing.assert_allclose(adjusted[row], expected, rtol=1e-6, atol=1e-5)
    np.testing.assert_array_equal(logits, before)  # the model's logits are left as they were (logprobs read them)


def test_allowed_ids_and_min_tokens_row_by_row():
    """allowed_token_ids masks every other id; min_tokens masks the EOS and stop ids in the rows before the
    min_tokens-th token (a speculative round's later rows are further along)."""
    rng = np.random.default_rng(3)
    params = SamplingParams(max_tokens=20, min_tokens=4, stop_token_ids=[6], allowed_token_ids=[0, 2, 5, 6, 9, 9],
                            logit_bias={5: 2.0}, repetition_penalty=1.5)
    prompt, output, drafts = [5, 9], [2, 9], [6, 0, 6]
    logits = rng.normal(size=(4, 12)).astype(np.float32)
    adjusted = LogitsAdjuster(params, prompt, eos_token_ids=[0])(logits, output, drafts)
    for row in range(4):
        expected = reference_adjust(logits[row], params, prompt, output + drafts[:row], ending=(0, 6))
        np.testing.assert_allclose(adjusted[row], expected, rtol=1e-6)
    assert np.isinf(adjusted[:2, [0, 6]]).all() and np.isfinite(adjusted[2:, [0, 6]]).all()
    ignoring = LogitsAdjuster(replace(params, ignore_eos=True), prompt, eos_token_ids=[0])(logits, output)
    assert np.isfinite(ignoring[0, 0]) and np.isinf(ignoring[0, 6])  # ignore_eos: only the stop id is held back


def test_counts_follow_a_growing_output_across_calls():
    """The adjuster keeps the output's counts between calls (updated with the tokens appended since): every call, a
    plain step or a speculative round with repeated drafts, equals the formulas over the whole history."""
    rng = np.random.default_rng(2)
    params = SamplingParams(logit_bias={2: 1.0}, **ADJUSTED)
    prompt, output = [1, 2, 3, 3], []
    adjust = LogitsAdjuster(params, prompt)
    for step in range(40):
        drafts = rng.integers(0, 20, size=int(rng.integers(0, 4))).tolist()
        logits = rng.normal(size=(len(drafts) + 1, 20)).astype(np.float32) * 3
        adjusted = adjust(logits, output, drafts)
        for row in range(len(drafts) + 1):
            expected = reference_adjust(logits[row], params, prompt, output + drafts[:row])
            np.testing.assert_allclose(adjusted[row], expected, rtol=1e-6, atol=1e-5, err_msg=f"step {step}")
        output += rng.integers(0, 20, size=int(rng.integers(1, 3))).tolist()
    logits = rng.normal(size=(1, 20)).astype(np.float32)
    np.testing.assert_allclose(adjust(logits, output[:5])[0], reference_adjust(logits[0], params, prompt, output[:5]),
                               rtol=1e-6, atol=1e-5)  # a shorter history than the last call's is counted afresh


@pytest.mark.parametrize("settings", [dict(repetition_penalty=0.8), dict(frequency_penalty=-1.0),
                                      dict(presence_penalty=2.0), dict(logit_bias={0: 1.5})])
def test_each_setting_alone(settings):
    rng = np.random.default_rng(1)
    params, prompt, output = SamplingParams(**settings), [0, 4, 5], [5, 6, 6]
    logits = rng.normal(size=(1, 10)).astype(np.float32)
    adjusted = adjuster(params, prompt)(logits, output)
    np.testing.assert_allclose(adjusted[0], reference_adjust(logits[0], params, prompt, output), rtol=1e-6)


def test_requests_without_adjustments_sample_from_the_models_logits():
    assert adjuster(SamplingParams(temperature=0.7, top_k=5, min_p=0.1), [1, 2]) is None
    assert not SamplingParams(repetition_penalty=1.0, frequency_penalty=0, logit_bias={}).adjusts_logits


def test_min_p_drops_the_unlikely_and_keeps_the_rest_in_proportion():
    logits = np.log(np.array([[0.5, 0.3, 0.1, 0.06, 0.04]]))
    probs = probabilities(logits, SamplingParams(temperature=1.0, min_p=0.15))  # floor 0.075
    np.testing.assert_allclose(probs[0], [0.5 / 0.9, 0.3 / 0.9, 0.1 / 0.9, 0, 0])
    assert probabilities(logits, SamplingParams(temperature=1.0, min_p=1.0))[0].tolist() == [1, 0, 0, 0, 0]
    # after temperature: at 2.0 the distribution flattens, so the same min_p keeps more tokens
    assert (probabilities(logits, SamplingParams(temperature=2.0, min_p=0.15))[0] > 0).sum() == 5


@pytest.mark.parametrize("settings, message", [
    (dict(min_p=1.5), "min_p must be <= 1"),
    (dict(min_p=-0.1), "min_p must be >= 0"),
    (dict(repetition_penalty=0), "repetition_penalty must be >= 0.01, got 0"),
    (dict(repetition_penalty=1e-40), "repetition_penalty must be >= 0.01"),  # overflowed float32 logits to inf
    (dict(repetition_penalty=1e39), "repetition_penalty must be <= 100"),  # inf in float32: 0 × inf was NaN
    (dict(presence_penalty=2.5), "presence_penalty must be <= 2"),
    (dict(frequency_penalty=float("nan")), "frequency_penalty must be a finite number"),
    (dict(logit_bias={1: 101}), "logit_bias[1]: logit_bias must be <= 100"),
    (dict(logit_bias={-3: 1}), "a logit_bias key (a token id) must be >= 0"),
    (dict(logit_bias={"5": 1}), "a logit_bias key (a token id) must be an integer"),
    (dict(logit_bias=[5, 1]), "logit_bias must be a mapping of token ids to biases"),
    (dict(logit_bias={i: 1 for i in range(MAX_LOGIT_BIAS + 1)}), f"more than {MAX_LOGIT_BIAS} entries"),
    (dict(min_tokens=17), "min_tokens (17) must be <= max_tokens (16)"),
    (dict(min_tokens=-1), "min_tokens must be >= 0"),
    (dict(allowed_token_ids=[]), "allowed_token_ids is empty"),
    (dict(allowed_token_ids=[3, -1]), "allowed_token_ids[1] must be >= 0"),
    (dict(allowed_token_ids=range(MAX_TOKEN_IDS + 1)), f"more than {MAX_TOKEN_IDS:,} token ids"),
    (dict(stop_token_ids=range(MAX_TOKEN_IDS + 1)), f"more than {MAX_TOKEN_IDS:,} token ids"),
])
def test_bad_values_are_refused_naming_the_field(settings, message):
    with pytest.raises(InvalidArgumentError, match=re.escape(message)) as caught:
        SamplingParams(**settings)
    assert caught.value.param == next(iter(settings))


def greedy_by_hand(engine, prompt: list[int], params: SamplingParams, new_tokens: int) -> list[int]:
    """Each token: the whole sequence scored in one prefill, its last row adjusted by reference_adjust, argmax."""
    output: list[int] = []
    for _ in range(new_tokens):
        logits = engine.score(prompt + output)[-1]
        output.append(int(np.argmax(reference_adjust(logits, params, prompt, output))))
    return output


@pytest.fixture(scope="module")
def prompts(tiny_paged_artifact):
    engine = fxllm.load(tiny_paged_artifact)
    return [engine.encode(text) for text in ("The capital of France is", "def fibonacci(n):\n    return")]


@pytest.mark.parametrize("kind", ["contiguous", "paged", "paged-ngram", "contiguous-ngram"])
def test_greedy_tokens_with_penalties_and_bias_match_a_loop_by_hand(kind, make_tiny_artifact, tiny_paged_artifact,
                                                                    prompts):
    artifact = tiny_paged_artifact if kind.startswith("paged") else make_tiny_artifact("llama")
    engine = fxllm.load(artifact, speculative="ngram" if kind.endswith("ngram") else False)
    plain = engine.generate_ids(prompts, max_new_tokens=12)
    bias = {plain[0].token_ids[2]: -100.0, prompts[1][-1]: 3.0}  # one token banned, one favoured
    results = engine.generate_ids(prompts, max_new_tokens=12, logit_bias=bias, **ADJUSTED)
    params = SamplingParams(logit_bias=bias, **ADJUSTED)
    for prompt, result in zip(prompts, results):
        assert result.token_ids == greedy_by_hand(engine, prompt, params, 12), kind
    assert [r.token_ids for r in results] != [r.token_ids for r in plain]  # the settings changed something
    assert all(plain[0].token_ids[2] not in r.token_ids for r in results)
    if kind.endswith("ngram"):
        assert engine.stats().speculative.proposed > 0


@pytest.mark.parametrize("kind", ["contiguous", "paged", "paged-ngram"])
def test_min_tokens_and_allowed_token_ids_through_the_engine(kind, make_tiny_artifact, tiny_paged_artifact, prompts):
    """EOS pushed up by +100 comes exactly at min_tokens; allowed_token_ids gives the by-hand loop's tokens, all of
    them allowed; a stop id ends the output."""
    artifact = tiny_paged_artifact if kind.startswith("paged") else make_tiny_artifact("llama")
    engine = fxllm.load(artifact, speculative="ngram" if kind.endswith("ngram") else False)
    eos = min(engine.core.eos_token_ids)
    for result in engine.generate_ids(prompts, max_new_tokens=12, min_tokens=5, logit_bias={eos: 100.0}):
        assert len(result.token_ids) == 6 and result.token_ids[-1] == eos and eos not in result.token_ids[:5]
    plain = engine.generate_ids(prompts, max_new_tokens=12)
    allowed = sorted({token for r in plain for token in r.token_ids[1:6]} | set(range(300, 340)))
    params = SamplingParams(max_tokens=12, allowed_token_ids=allowed, repetition_penalty=1.3)
    results = engine.generate_ids(prompts, max_new_tokens=12, allowed_token_ids=allowed, repetition_penalty=1.3)
    for prompt, result in zip(prompts, results):
        assert result.token_ids == greedy_by_hand(engine, prompt, params, 12) and set(result.token_ids) <= set(allowed)
    stop = results[0].token_ids[3]
    stopped = engine.generate_ids(prompts[:1], max_new_tokens=12, allowed_token_ids=allowed, repetition_penalty=1.3,
                                  stop_token_ids=[stop])[0]
    assert stopped.token_ids == results[0].token_ids[:results[0].token_ids.index(stop) + 1]
    text = engine.tokenizer.decode(plain[0].token_ids[:1])  # a stop string the output starts with
    early = engine.generate_ids(prompts[:1], max_new_tokens=12, stop=text)[0]
    late = engine.generate_ids(prompts[:1], max_new_tokens=12, stop=text, min_tokens=6)[0]
    assert len(early.token_ids) == 1 and early.text == "" and len(late.token_ids) >= 6  # vLLM v1's rule


def test_logit_bias_ids_are_checked_against_the_vocabulary(tiny_paged_artifact, prompts):
    engine = fxllm.load(tiny_paged_artifact)
    vocab = engine.spec.vocab_size
    with pytest.raises(InvalidArgumentError, match=rf"logit_bias keys\[0\] = {vocab} is not a token id of this "
                                                   rf"model \(0 to {vocab - 1}\)") as caught:
        engine.generate_ids(prompts, max_new_tokens=2, logit_bias={vocab: 1.0})
    assert caught.value.param == "logit_bias"
    assert engine.generate_ids(prompts, max_new_tokens=2, logit_bias={vocab - 1: 1.0})[0].token_ids  # nothing lost
    with pytest.raises(InvalidArgumentError, match=r"allowed_token_ids\[1\] = \d+ is not a token id"):
        engine.generate_ids(prompts, max_new_tokens=2, allowed_token_ids=[1, vocab])
    eos = sorted(engine.core.eos_token_ids)
    with pytest.raises(InvalidArgumentError, match="allowed_token_ids holds only end-of-sequence or stop token ids, "
                                                   r"which min_tokens \(2\) forbids") as caught:
        engine.generate_ids(prompts, max_new_tokens=4, min_tokens=2, allowed_token_ids=eos)  # nothing to sample
    assert caught.value.param == "allowed_token_ids"
    with pytest.raises(InvalidArgumentError, match="stop_token_ids and the end-of-sequence ids cover the whole "
                                                   r"vocabulary, which min_tokens \(1\) forbids") as caught:
        engine.generate_ids(prompts, max_new_tokens=4, min_tokens=1, stop_token_ids=range(vocab))  # a -inf row
    assert caught.value.param == "stop_token_ids"
    with pytest.raises(InvalidArgumentError, match="^temprature is not a generation option") as caught:
        engine.generate_ids(prompts, max_new_tokens=2, temprature=0.5)  # not a TypeError naming check_request
    assert caught.value.param == "temprature"
    one_left = engine.generate_ids(prompts, max_new_tokens=2, min_tokens=1, stop_token_ids=range(vocab - 1))
    assert all(result.token_ids[0] == vocab - 1 for result in one_left)  # the one id neither EOS nor a stop id


def test_with_seed_copies_checked_params_with_another_seed():
    params = SamplingParams(temperature=0.7, seed=3, max_tokens=8, stop_token_ids=range(1000), logit_bias={4: 1.0})
    other = params.with_seed(9)
    assert other.seed == 9 and params.seed == 3 and other.stop_token_ids is params.stop_token_ids
    assert replace(other, seed=3) == params and params.with_seed(None).seed is None
    with pytest.raises(InvalidArgumentError, match="seed must be an integer"):
        params.with_seed("9")
