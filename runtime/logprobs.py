"""Logprobs of chosen tokens and their top-N alternatives, from raw model logits (before temperature/top-k/top-p)."""

from __future__ import annotations

import numpy as np

from fxllm.runtime.request import TokenLogprobs


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Rows of [N,V] → float64 log-probabilities."""
    rows = np.asarray(logits, dtype=np.float64)
    shifted = rows - rows.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def token_logprobs(logits: np.ndarray, token_ids: list[int], top: int) -> list[TokenLogprobs]:
    """Row i of logits [N,V] is the distribution token_ids[i] was drawn from: its logprob and the `top` most likely
    (id, logprob) pairs, most likely first (ties: lower id first)."""
    logprobs = log_softmax(logits)
    results = []
    for row, token in zip(logprobs, token_ids):
        alternatives: tuple[tuple[int, float], ...] = ()
        if top:
            best = np.argpartition(-row, top - 1)[:top] if top < row.shape[0] else np.arange(row.shape[0])
            best = best[np.lexsort((best, -row[best]))]
            alternatives = tuple((int(i), float(row[i])) for i in best)
        results.append(TokenLogprobs(int(token), float(row[token]), alternatives))
    return results
