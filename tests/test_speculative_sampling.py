"""Speculative decoding is lossless: on tiny random Llamas, draft-then-verify samples the target's exact distribution
(chi-square against an enumerated joint), greedy verification equals greedy decoding, plus n-gram drafting units."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from fxllm.errors import GenerationError
from fxllm.runtime.sampler import SamplingParams, probabilities
from fxllm.runtime.speculative import (
    BIASED_RULE,
    EXACT_RULE,
    NgramProposer,
    SpeculativeStats,
    one_hot_probs,
    processed_probs,
    residual_probs,
    sample,
    verify_draft,
)

VOCAB = 12
PROMPT = [3, 7, 1, 4]
SAMPLES = 20_000


def _tiny_llama(seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    # initializer_range 0.2 (not the default 0.02) gives peaked, clearly different next-token distributions per seed.
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.2, tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def target():
    return _tiny_llama(seed=0)


@pytest.fixture(scope="module")
def draft():
    return _tiny_llama(seed=1)


def _next_probs(model, prefixes: list[list[int]], temperature: float = 1.0) -> np.ndarray:
    """The processed next-token distribution [N, V] after PROMPT + each prefix (all prefixes the same length)."""
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + p for p in prefixes])).logits[:, -1]
    return processed_probs(logits.double().numpy(), temperature, 0, 1.0)


def _all_prefix_probs(model) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Distributions after every generated prefix of length 0, 1, 2: shapes [V], [V, V], [V, V, V]."""
    pairs = [list(p) for p in itertools.product(range(VOCAB), repeat=2)]
    return (
        _next_probs(model, [[]])[0],
        _next_probs(model, [[t] for t in range(VOCAB)]),
        _next_probs(model, pairs).reshape(VOCAB, VOCAB, VOCAB),
    )


def _chi_square_p(counts: np.ndarray, probs: np.ndarray, min_expected: float = 5.0) -> float:
    """Pearson chi-square goodness-of-fit p-value; the cells expected below min_expected are pooled into one (grown
    with the next-smallest cells until the pool itself reaches min_expected)."""
    expected = probs.ravel() * counts.sum()
    order = np.argsort(expected)
    expected, observed = expected[order], counts.ravel()[order].astype(np.float64)
    n_small = int((expected < min_expected).sum())
    if n_small:
        n_pool = max(n_small, int(np.searchsorted(np.cumsum(expected), min_expected)) + 1)
        expected = np.append(expected[n_pool:], expected[:n_pool].sum())
        observed = np.append(observed[n_pool:], observed[:n_pool].sum())
    if observed[expected == 0].sum() > 0:
        return 0.0  # a sample the distribution cannot produce
    keep = expected > 0
    statistic = float((((observed - expected) ** 2)[keep] / expected[keep]).sum())
    df = int(keep.sum()) - 1
    a, x = torch.tensor(df / 2, dtype=torch.float64), torch.tensor(statistic / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(a, x))  # chi2 survival function = regularized upper incomplete gamma


def _speculative_first_two(draft_probs, target_probs, rng: np.random.Generator, rule: str, stats: SpeculativeStats):
    """The first two generated tokens by speculative sampling: the draft proposes k=2 by sampling itself, the target
    verifies; if only one token came out, a second round proposes k=1 (only one more token is needed)."""
    (d0, d1, _), (t0, t1, t2) = draft_probs, target_probs
    x1 = sample(d0, rng)
    x2 = sample(d1[x1], rng)
    out, accepted = verify_draft(
        np.array([x1, x2]), np.stack([d0, d1[x1]]), np.stack([t0, t1[x1], t2[x1, x2]]), rng, greedy=False, rule=rule
    )
    stats.record(2, accepted)
    if len(out) >= 2:
        return out[0], out[1]
    first = out[0]
    y = sample(d1[first], rng)
    out, accepted = verify_draft(
        np.array([y]), d1[first][None], np.stack([t1[first], t2[first, y]]), rng, greedy=False, rule=rule
    )
    stats.record(1, accepted)
    return first, out[0]


@pytest.fixture(scope="module")
def distributions(target, draft):
    return _all_prefix_probs(draft), _all_prefix_probs(target)


def _empirical_p(distributions, rule: str, seed: int) -> tuple[float, SpeculativeStats]:
    draft_probs, target_probs = distributions
    exact = target_probs[0][:, None] * target_probs[1]  # P(t1) * P(t2 | t1), [V, V]
    rng, stats = np.random.default_rng(seed), SpeculativeStats()
    counts = np.zeros((VOCAB, VOCAB), dtype=np.int64)
    for _ in range(SAMPLES):
        counts[_speculative_first_two(draft_probs, target_probs, rng, rule, stats)] += 1
    return _chi_square_p(counts, exact), stats


def test_speculative_sampling_matches_target_distribution(distributions):
    (draft0, _, _), (target0, _, _) = distributions
    assert 0.5 * np.abs(draft0 - target0).sum() > 0.3  # the draft is a genuinely different model
    p_value, stats = _empirical_p(distributions, EXACT_RULE, seed=1234)
    print(f"\nexact rule: {SAMPLES} samples, chi-square p = {p_value:.4g}, acceptance {stats.acceptance_rate:.3f}")
    # Both the accept and the residual-resample paths were exercised many times.
    assert 0.1 < stats.acceptance_rate < 0.9
    assert p_value > 1e-3


def test_biased_rule_is_detected(distributions):
    """The same test rejects the common bug (resampling from p_target after a rejection): it can fail."""
    p_value, _ = _empirical_p(distributions, BIASED_RULE, seed=1234)
    print(f"\nbiased rule: {SAMPLES} samples, chi-square p = {p_value:.4g}")
    assert p_value < 1e-6


def test_one_hot_draft_is_lossless():
    """A deterministic (n-gram) draft: accept x with prob p_t(x), else resample p_t with x zeroed — output is p_t."""
    rng = np.random.default_rng(7)
    p_target = rng.dirichlet(np.ones(VOCAB))
    proposed = int(np.argmax(p_target))
    counts = np.zeros(VOCAB, dtype=np.int64)
    for _ in range(SAMPLES):
        out, _ = verify_draft(
            np.array([proposed]), one_hot_probs([proposed], VOCAB), np.stack([p_target, p_target]), rng, greedy=False
        )
        counts[out[0]] += 1
    assert _chi_square_p(counts, p_target) > 1e-3


def _greedy_decode(model, n: int) -> list[int]:
    tokens: list[int] = []
    with torch.no_grad():
        for _ in range(n):
            tokens.append(int(model(torch.tensor([PROMPT + tokens])).logits[0, -1].argmax()))
    return tokens


def test_greedy_verification_equals_greedy_decoding(target):
    n = 10
    reference = _greedy_decode(target, n)
    rng = np.random.default_rng(3)
    for _ in range(4):
        generated: list[int] = []
        while len(generated) < n:
            k = int(rng.integers(1, 4))
            # Random proposals, each token right (the greedy continuation) half the time so runs get accepted.
            upcoming = reference[len(generated) :] + [0] * k
            proposal = [upcoming[i] if rng.random() < 0.5 else int(rng.integers(VOCAB)) for i in range(k)]
            with torch.no_grad():
                logits = target(torch.tensor([PROMPT + generated + proposal])).logits[0, -(k + 1) :]
            target_probs = processed_probs(logits.double().numpy(), 0.0)
            out, accepted = verify_draft(
                np.array(proposal), one_hot_probs(proposal, VOCAB), target_probs, rng, greedy=True
            )
            assert len(out) == accepted + 1 and out[:accepted] == proposal[:accepted]
            generated += out
        assert generated[:n] == reference


def test_greedy_ignores_draft_probabilities():
    target_probs = np.eye(VOCAB)[[5, 2, 9]]
    out, accepted = verify_draft(np.array([5, 3]), None, target_probs, np.random.default_rng(0), greedy=True)
    assert (out, accepted) == ([5, 2], 1)
    out, accepted = verify_draft(np.array([5, 2]), None, target_probs, np.random.default_rng(0), greedy=True)
    assert (out, accepted) == ([5, 2, 9], 2)


def test_residual_all_zero_samples_target():
    """p_target == p_draft: the residual is empty; a rejection (here: a proposed token neither model gives mass, so
    u * 0 < 0 fails) must fall back to sampling p_target instead of dividing by zero."""
    p = np.array([0.5, 0.5, 0.0, 0.0])
    np.testing.assert_allclose(residual_probs(p, p), p)
    rng = np.random.default_rng(0)
    seen = set()
    for _ in range(200):
        out, accepted = verify_draft(np.array([2]), p[None], np.stack([p, p]), rng, greedy=False)
        assert accepted == 0 and len(out) == 1
        seen.add(out[0])
    assert seen == {0, 1}
    # Identical distributions accept every token the draft can propose.
    for token in (0, 1):
        out, accepted = verify_draft(np.array([token]), p[None], np.stack([p, p]), rng, greedy=False)
        assert accepted == 1 and out[0] == token


def test_residual_is_normalized_positive_part():
    target_probs, draft_probs = np.array([0.6, 0.3, 0.1]), np.array([0.2, 0.5, 0.3])
    np.testing.assert_allclose(residual_probs(target_probs, draft_probs), [1.0, 0.0, 0.0])


def test_verify_rejects_bad_shapes_and_rules():
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="target_probs"):
        verify_draft(np.array([1, 2]), np.full((2, 4), 0.25), np.full((2, 4), 0.25), rng, greedy=False)
    with pytest.raises(ValueError, match="draft_probs"):
        verify_draft(np.array([1, 2]), np.full((1, 4), 0.25), np.full((3, 4), 0.25), rng, greedy=False)
    with pytest.raises(ValueError, match="rule"):
        verify_draft(np.array([1]), np.full((1, 4), 0.25), np.full((2, 4), 0.25), rng, greedy=False, rule="nope")


def test_no_draft_tokens_samples_target():
    out, accepted = verify_draft(np.array([], dtype=np.int64), np.zeros((0, 3)), np.array([[0.0, 1.0, 0.0]]),
                                 np.random.default_rng(0), greedy=False)
    assert (out, accepted) == ([1], 0)


def test_processed_probs_matches_sampler():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 3, VOCAB)).astype(np.float32)
    probs = processed_probs(logits, 0.7, 5, 0.8)
    assert probs.shape == logits.shape and probs.dtype == np.float64
    expected = probabilities(logits.reshape(-1, VOCAB), SamplingParams(temperature=0.7, top_k=5, top_p=0.8))
    np.testing.assert_allclose(probs.reshape(-1, VOCAB), expected)
    np.testing.assert_allclose(probs.sum(-1), 1.0)
    assert ((probs > 0).sum(-1) <= 5).all()
    greedy = processed_probs(logits, 0.0)
    np.testing.assert_array_equal(greedy.argmax(-1), logits.argmax(-1))
    np.testing.assert_array_equal(greedy.sum(-1), 1.0)
    with pytest.raises(GenerationError):
        processed_probs(logits, 1.0, 0, 0.0)


def test_ngram_longest_match_wins():
    tokens = [1, 2, 3, 9, 4, 5, 3, 8, 1, 2, 3]
    assert NgramProposer(k=2, max_ngram=3).propose(tokens) == [9, 4]  # the 3-gram, not the more recent 1-gram "3"
    assert NgramProposer(k=2, max_ngram=1).propose(tokens) == [8, 1]


def test_ngram_most_recent_occurrence():
    assert NgramProposer(k=2, max_ngram=2).propose([4, 5, 6, 4, 5, 7, 4, 5]) == [7, 4]


def test_ngram_no_match():
    proposer = NgramProposer(k=3)
    assert proposer.propose([1, 2, 3, 4]) == []
    assert proposer.propose([1]) == []
    assert proposer.propose([]) == []
    assert NgramProposer(k=3, max_ngram=3, min_ngram=2).propose([1, 2, 3, 1]) == []  # only a 1-gram recurs


def test_ngram_proposal_capped_at_k():
    assert NgramProposer(k=3).propose([1, 2, 3, 4, 5, 6, 7, 1]) == [2, 3, 4]
    assert NgramProposer(k=5).propose([1, 2, 1]) == [2, 1]  # runs out at the end of the sequence


def test_ngram_bad_settings():
    with pytest.raises(GenerationError):
        NgramProposer(k=0)
    with pytest.raises(GenerationError):
        NgramProposer(k=2, max_ngram=1, min_ngram=2)


def test_stats():
    stats = SpeculativeStats()
    assert stats.acceptance_rate == 0.0 and stats.tokens_per_target_call == 0.0
    stats.record(proposed=4, accepted=3)
    stats.record(proposed=4, accepted=1)
    assert stats.acceptance_rate == 0.5
    assert stats.tokens_per_target_call == 3.0  # (3 + 1) + (1 + 1) tokens over 2 calls
