"""Token sampling from next-token logits: greedy, temperature, min-p, top-k and top-p (nucleus). A request's
logit_bias and penalties are applied before (runtime/logits_adjustment.py, through Request.sampling_logits)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from fxllm.errors import GenerationError
from fxllm.runtime.request import MIN_TEMPERATURE, SamplingParams

__all__ = ["MIN_TEMPERATURE", "SampledTokens", "Sampler", "SamplingParams", "checked_logits", "greedy_tokens",
           "probabilities", "sample_rows"]


@dataclass
class SampledTokens:
    """What one model call produced for one request: tokens in order, the logits rows they were drawn from
    ([n, V]), the prompt positions' logits when asked for, and how many of the tokens fed for it keep their KV in
    the cache (None: all; a speculative round keeps its last sampled token and the accepted drafts)."""

    token_ids: list[int]
    logits: np.ndarray | None = None
    prompt_logits: np.ndarray | None = None
    cached: int | None = None


def greedy_tokens(logits: np.ndarray) -> np.ndarray:
    """argmax of each row of logits [B,V], refused as checked_logits refuses, in one pass: argmax stops at a row's
    first NaN and takes its first +inf, so a row has a NaN, a +inf or no finite value exactly when its peak is not
    finite. The peaks are checked one scalar a row: right after a model call numpy's fancy indexing runs cold and
    cost ~70 µs a decode step, three times the argmax itself."""
    tokens = logits.argmax(-1)
    if not all(math.isfinite(logits[row, token]) for row, token in enumerate(tokens.tolist())):
        checked_logits(logits)  # raises with its message
    return tokens


def checked_logits(logits: np.ndarray) -> np.ndarray:
    """logits [B,V], refused when a row holds NaN or +inf or no finite value: a broken model must fail loudly
    rather than sample token 0 forever. -inf is allowed (a masked token)."""
    peak = logits.max(-1)  # one pass: NaN in a row makes its max NaN, +inf makes it +inf, all -inf leaves -inf
    if not np.isfinite(peak).all():
        raise GenerationError("the model produced non-finite logits (NaN or inf); the artifact's numerics are broken "
                              "(check it with `fxllm eval`, or recompile it)")
    return logits


def probabilities(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The distribution sampling draws from, rows of [B,V]: temperature, then min-p, top-k and top-p, renormalized
    (float64). Greedy params give the one-hot argmax. Never returns non-finite probabilities: it raises instead."""
    if params.greedy:
        probs = np.zeros(logits.shape, dtype=np.float64)
        probs[np.arange(logits.shape[0]), greedy_tokens(logits)] = 1.0
        return probs
    logits = checked_logits(logits)
    scaled = logits.astype(np.float64) / params.temperature
    if params.min_p > 0:  # p / p_max >= min_p, in log space: no softmax needed for it
        floor = scaled.max(-1, keepdims=True) + np.log(params.min_p)
        scaled = np.where(scaled < floor, -np.inf, scaled)
    if params.top_k and params.top_k < scaled.shape[-1]:
        kth = np.partition(scaled, -params.top_k, axis=-1)[:, -params.top_k][:, None]
        scaled = np.where(scaled < kth, -np.inf, scaled)
    probs = np.exp(scaled - scaled.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    if params.top_p < 1.0:
        order = np.argsort(-probs, axis=-1)
        sorted_probs = np.take_along_axis(probs, order, -1)
        # Keep the smallest prefix whose mass reaches top_p (the token that crosses the threshold stays).
        drop_sorted = np.cumsum(sorted_probs, -1) - sorted_probs >= params.top_p
        drop = np.zeros_like(drop_sorted)
        np.put_along_axis(drop, order, drop_sorted, -1)
        probs = np.where(drop, 0.0, probs)
        probs /= probs.sum(-1, keepdims=True)
    if not np.isfinite(probs).all():  # unreachable for finite logits and checked params; a guard, not a branch
        raise GenerationError(f"sampling produced non-finite probabilities ({params})")
    return probs


class Sampler:
    """One random stream per sequence, each seeded with `seed`: a prompt samples the same tokens alone or in any
    batch (two identical prompts in one batch therefore sample identically, as with per-request seeds elsewhere)."""

    def __init__(self, params: SamplingParams, sequences: int = 1):
        self.params = params
        seed = params.seed
        if seed is not None and seed < 0:  # numpy takes no negative seed: an int64 one as its uint64 bits
            seed %= 2**64
        self.rngs = [np.random.default_rng(seed) for _ in range(sequences)]

    def __call__(self, logits: np.ndarray, sequence_of_row: list[int] | None = None) -> np.ndarray:
        """logits [B,V] → token ids [B]; row i belongs to sequence sequence_of_row[i] (default: row i)."""
        if self.params.greedy:
            return greedy_tokens(logits)
        rows = sequence_of_row if sequence_of_row is not None else list(range(logits.shape[0]))
        probs = probabilities(logits, self.params)
        cumulative = np.cumsum(probs, -1)
        draws = np.array([[self.rngs[i].random()] for i in rows]) * cumulative[:, -1:]
        # The first token whose cumulative mass exceeds the draw: a token of probability 0 is never chosen, even for
        # a draw of exactly 0 or one that rounding puts at the total.
        last_possible = probs.shape[-1] - 1 - (probs[:, ::-1] > 0).argmax(-1)
        return np.minimum((cumulative <= draws).sum(-1), last_possible)


def sample_rows(logits: np.ndarray, samplers: list[Sampler]) -> np.ndarray:
    """logits [B,V] → token ids [B], row i drawn by samplers[i] (each request has its own parameters and seeded
    stream). Greedy rows share one argmax."""
    greedy = [i for i, sampler in enumerate(samplers) if sampler.params.greedy]
    if len(greedy) == len(samplers):
        return samplers[0](logits)
    tokens = np.zeros(len(samplers), dtype=np.int64)
    if greedy:
        tokens[greedy] = samplers[greedy[0]](logits[greedy])
    for i, sampler in enumerate(samplers):
        if not sampler.params.greedy:
            tokens[i] = sampler(logits[i:i + 1])[0]
    return tokens
