"""Lossless speculative decoding core (Leviathan et al. 2023, Chen et al. 2023): the accept/reject rule that keeps the
output distributed exactly as the target model's, prompt-lookup (n-gram) drafting, and acceptance statistics."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from fxllm.errors import GenerationError
from fxllm.runtime.metrics import SpeculativeStats  # noqa: F401 - re-exported: the counters' home is metrics.py
from fxllm.runtime.sampler import SamplingParams, probabilities

EXACT_RULE = "exact"
# Test-only: on rejection, resample from p_target instead of the residual (the common bug). Its output is biased
# towards the draft whenever the draft differs from the target; it exists so the statistical test can prove it can fail.
BIASED_RULE = "biased-resample-target"
RULES = (EXACT_RULE, BIASED_RULE)

# A residual with less mass than this is rounding noise (p_target == p_draft): sample from p_target instead. Rejection
# happens with probability equal to the residual mass, so this changes the output by at most this much.
_RESIDUAL_EPS = 1e-12


def processed_probs(logits: np.ndarray, temperature: float, top_k: int = 0, top_p: float = 1.0,
                    min_p: float = 0.0) -> np.ndarray:
    """logits [..., V] → float64 probabilities [..., V]: temperature, then min-p, top-k and top-p, renormalized — the
    same processing as the sampler (sampler.probabilities). The target's rows go through it with the request's
    settings; greedy (temperature 0 or below sampler.MIN_TEMPERATURE) gives the one-hot argmax."""
    logits = np.asarray(logits)
    rows = logits.reshape(-1, logits.shape[-1])
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    return probabilities(rows, params).reshape(logits.shape)


def one_hot_probs(tokens: list[int] | np.ndarray, vocab_size: int) -> np.ndarray:
    """The draft distribution [k, V] of a deterministic proposer (NgramProposer): one-hot at each proposed token."""
    probs = np.zeros((len(tokens), vocab_size), dtype=np.float64)
    probs[np.arange(len(tokens)), np.asarray(tokens, dtype=np.int64)] = 1.0
    return probs


def sample(probs: np.ndarray, rng: np.random.Generator) -> int:
    """One token id drawn from the distribution probs [V] (need not sum exactly to 1)."""
    cumulative = np.cumsum(probs)
    index = int(np.searchsorted(cumulative, rng.random() * cumulative[-1], side="right"))
    return min(index, probs.shape[-1] - 1)


def residual_probs(target: np.ndarray, draft: np.ndarray) -> np.ndarray:
    """normalize(max(0, p_target - p_draft)): where to resample after a rejection. When the residual has no mass
    (p_target == p_draft, so a rejection can only come from rounding or a token the draft could not propose),
    p_target itself."""
    residual = np.maximum(target - draft, 0.0)
    mass = residual.sum()
    if mass <= _RESIDUAL_EPS:
        return target / target.sum()
    return residual / mass


def _verify_greedy(draft_tokens: np.ndarray, target_probs: np.ndarray) -> tuple[list[int], int]:
    """Accept while the draft token is the target's argmax; then append the target's argmax (correction or bonus)."""
    accepted: list[int] = []
    for i, token in enumerate(draft_tokens):
        best = int(np.argmax(target_probs[i]))
        if int(token) != best:
            return accepted + [best], i
        accepted.append(best)
    return accepted + [int(np.argmax(target_probs[len(draft_tokens)]))], len(draft_tokens)


def verify_draft(
    draft_tokens: np.ndarray,
    draft_probs: np.ndarray | None,
    target_probs: np.ndarray,
    rng: np.random.Generator,
    greedy: bool,
    rule: str = EXACT_RULE,
) -> tuple[list[int], int]:
    """Verify k draft tokens against the target; return (tokens to emit, number of draft tokens accepted).

    draft_tokens [k] were sampled from draft_probs [k, V] (row i: the draft's distribution given the prefix and
    draft_tokens[:i]); target_probs [k+1, V] are the target's distributions at the same k positions plus the one after.
    Both are the ALREADY processed distributions (temperature/top-k/top-p applied identically, see processed_probs).
    Token i is accepted with probability min(1, p_t(x_i) / p_d(x_i)); at the first rejection one token is drawn from
    normalize(max(0, p_t - p_d)) and verification stops; if all k are accepted a bonus token is drawn from
    target_probs[k]. The emitted tokens are then distributed exactly as sampling the target alone. With a one-hot
    draft (NgramProposer) this reduces to accepting x with probability p_t(x) and resampling from p_t with x zeroed.
    greedy: accept while the draft token is the target's argmax, then emit the target's argmax (draft_probs unused,
    may be None).
    rule: EXACT_RULE, or BIASED_RULE (test-only, deliberately wrong)."""
    draft_tokens = np.asarray(draft_tokens, dtype=np.int64).reshape(-1)
    k = draft_tokens.shape[0]
    target_probs = np.asarray(target_probs, dtype=np.float64)
    if target_probs.ndim != 2 or target_probs.shape[0] != k + 1:
        raise ValueError(f"target_probs must be [k+1, V] = [{k + 1}, V], got {list(target_probs.shape)}")
    if greedy:
        return _verify_greedy(draft_tokens, target_probs)
    if rule not in RULES:
        raise ValueError(f"unknown rule {rule!r}; expected one of {RULES}")
    draft_probs = np.asarray(draft_probs, dtype=np.float64)
    if draft_probs.shape != (k, target_probs.shape[1]):
        raise ValueError(f"draft_probs must be [k, V] = {[k, target_probs.shape[1]]}, got {list(draft_probs.shape)}")
    accepted: list[int] = []
    for i, token in enumerate(draft_tokens.tolist()):
        p_target, p_draft = target_probs[i, token], draft_probs[i, token]
        # u < p_t / p_d without dividing: a token the draft gave no mass is accepted iff the target gives it some.
        if rng.random() * p_draft < p_target:
            accepted.append(token)
            continue
        resample = residual_probs(target_probs[i], draft_probs[i]) if rule == EXACT_RULE else target_probs[i]
        return accepted + [sample(resample, rng)], i
    return accepted + [sample(target_probs[k], rng)], k


class NgramProposer:
    """Prompt-lookup decoding: propose the tokens that followed the most recent earlier occurrence of the longest
    suffix n-gram (max_ngram down to min_ngram) of the sequence. Deterministic, so its draft distribution is one-hot
    (one_hot_probs): verify_draft then accepts a proposed x with probability p_t(x) and on rejection samples from p_t
    with x zeroed and renormalized — which keeps the output distributed exactly as p_t."""

    def __init__(self, *, k: int, max_ngram: int = 3, min_ngram: int = 1):
        if k < 1:
            raise GenerationError(f"the number of speculative tokens k must be >= 1, got {k}")
        if not 1 <= min_ngram <= max_ngram:
            raise GenerationError(f"need 1 <= min_ngram <= max_ngram, got min {min_ngram}, max {max_ngram}")
        self.k, self.max_ngram, self.min_ngram = k, max_ngram, min_ngram

    def propose(self, token_ids: list[int]) -> list[int]:
        """Up to k proposed continuation tokens of token_ids; [] when no suffix n-gram occurs earlier."""
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_ngram, len(tokens) - 1), self.min_ngram - 1, -1):
            # Windows starting at j <= len - n - 1: every occurrence before the suffix itself, with a token after it.
            windows = sliding_window_view(tokens[:-1], n)
            matches = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if matches.size:
                start = int(matches[-1]) + n
                return tokens[start : start + self.k].tolist()
        return []
