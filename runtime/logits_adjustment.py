"""A request's logits before sampling: logit_bias, then the repetition, frequency and presence penalties (vLLM's
order and formulas; OpenAI's for the last two). Temperature, min-p, top-k and top-p come after, in
sampler.probabilities. Logprobs are reported from the logits before any of this (vLLM's raw logprobs)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from fxllm.runtime.request import SamplingParams


class LogitsAdjuster:
    """One request's adjustment. `prompt_ids` count for the repetition penalty only (as vLLM and transformers do);
    the frequency and presence penalties count the output so far."""

    def __init__(self, params: SamplingParams, prompt_ids: Sequence[int]):
        self.params = params
        self._bias_ids = np.fromiter((token for token, _ in params.logit_bias), dtype=np.int64)
        self._biases = np.fromiter((bias for _, bias in params.logit_bias), dtype=np.float64)
        self._prompt_ids = np.unique(np.asarray(prompt_ids, dtype=np.int64)) if params.repetition_penalty != 1 \
            else np.zeros(0, dtype=np.int64)

    def __call__(self, logits: np.ndarray, output_ids: Sequence[int], drafts: Sequence[int] = ()) -> np.ndarray:
        """logits [n, V] → adjusted float32 copy. Row i follows `output_ids` and then drafts[:i] (a speculative
        round scores its drafts in one call: each position's penalties count the drafts before it)."""
        adjusted = np.array(logits, dtype=np.float32)
        history = list(output_ids)
        for row in range(adjusted.shape[0]):
            if row:
                history.append(drafts[row - 1])
            self._adjust_row(adjusted[row], history)
        return adjusted

    def _adjust_row(self, row: np.ndarray, output_ids: list[int]) -> None:
        params = self.params
        if self._bias_ids.size:
            row[self._bias_ids] += self._biases
        output, counts = np.unique(np.asarray(output_ids, dtype=np.int64), return_counts=True)
        if params.repetition_penalty != 1:
            seen = np.union1d(self._prompt_ids, output)
            values = row[seen]
            row[seen] = np.where(values > 0, values / params.repetition_penalty, values * params.repetition_penalty)
        if output.size and (params.frequency_penalty or params.presence_penalty):
            row[output] -= params.frequency_penalty * counts + params.presence_penalty


def adjuster(params: SamplingParams, prompt_ids: Sequence[int]) -> LogitsAdjuster | None:
    """The request's adjuster, or None when its params change no logit (the common case costs nothing)."""
    return LogitsAdjuster(params, prompt_ids) if params.adjusts_logits else None
