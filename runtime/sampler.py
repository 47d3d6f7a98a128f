"""Token sampling from next-token logits: greedy, temperature, top-k and top-p (nucleus)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fxllm.errors import GenerationError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 → greedy
    top_k: int = 0  # 0 → no limit
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise GenerationError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise GenerationError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise GenerationError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def probabilities(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The distribution sampling draws from, rows of [B,V]: temperature, then top-k, then top-p, renormalized."""
    scaled = logits.astype(np.float64) / params.temperature
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
    return probs


class Sampler:
    """One random stream per sequence, each seeded with `seed`: a prompt samples the same tokens alone or in any
    batch (two identical prompts in one batch therefore sample identically, as with per-request seeds elsewhere)."""

    def __init__(self, params: SamplingParams, sequences: int = 1):
        self.params = params
        self.rngs = [np.random.default_rng(params.seed) for _ in range(sequences)]

    def __call__(self, logits: np.ndarray, sequence_of_row: list[int] | None = None) -> np.ndarray:
        """logits [B,V] → token ids [B]; row i belongs to sequence sequence_of_row[i] (default: row i)."""
        if self.params.greedy:
            return logits.argmax(-1)
        rows = sequence_of_row if sequence_of_row is not None else list(range(logits.shape[0]))
        probs = probabilities(logits, self.params)
        cumulative = np.cumsum(probs, -1)
        draws = np.array([[self.rngs[i].random()] for i in rows]) * cumulative[:, -1:]
        return np.minimum((cumulative < draws).sum(-1), probs.shape[-1] - 1)
