"""A request's logits before sampling: allowed_token_ids, bad_words, a structure's grammar, logit_bias and
min_tokens, then the repetition, frequency and presence penalties (vLLM's order and formulas; OpenAI's for the last
two). Temperature, min-p, top-k and top-p come after, in sampler.probabilities. Logprobs are reported from the logits
before any of this (vLLM's raw logprobs)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from fxllm.runtime.bad_words import BadWords
from fxllm.runtime.request import SamplingParams
from fxllm.runtime.structured_output import GrammarMatcher


class LogitsAdjuster:
    """One request's adjustment. `prompt_ids` count for the repetition penalty only (as vLLM and transformers do);
    the frequency and presence penalties count the output so far. The output's token counts are kept across calls
    and updated with the tokens appended since the last one (the output only grows), so a step costs O(V), not a
    sort of the whole history."""

    def __init__(self, params: SamplingParams, prompt_ids: Sequence[int], eos_token_ids: Iterable[int] = (),
                 bad_words: BadWords | None = None, grammar: GrammarMatcher | None = None):
        if params.bad_words and bad_words is None:
            raise ValueError("params.bad_words given without their token sequences (BadWords.from_words)")
        if params.structured_outputs is not None and grammar is None:
            raise ValueError("params.structured_outputs given without its matcher (Grammars.matcher)")
        self.params = params
        self._bad_words = bad_words if params.bad_words else None
        self._grammar = grammar
        # bad_words may leave a row nothing (with allowed_token_ids, min_tokens, or on a small vocabulary; the
        # up-front check counts only the ids banned everywhere): the request ends there (Request.starved)
        self.exhausted: set[int] = set()  # output positions the last call left nothing to sample
        eos = () if params.ignore_eos else tuple(eos_token_ids)
        # what min_tokens holds back: every id that would end the request
        self._stop_ids = np.asarray(sorted({*eos, *params.stop_token_ids}), dtype=np.int64)
        self._allowed = None if params.allowed_token_ids is None else np.unique(
            np.asarray(params.allowed_token_ids, dtype=np.int64))
        self._bias_ids = np.fromiter((token for token, _ in params.logit_bias), dtype=np.int64)
        self._biases = np.fromiter((bias for _, bias in params.logit_bias), dtype=np.float32)
        self._prompt_ids = np.asarray(prompt_ids, dtype=np.int64)
        self._counts: np.ndarray | None = None  # [V] int32, each token's count in the output so far
        self._seen: np.ndarray | None = None  # [V] in the prompt or the output so far
        self._counted = 0  # output tokens in _counts

    def __call__(self, logits: np.ndarray, output_ids: Sequence[int], drafts: Sequence[int] = ()) -> np.ndarray:
        """logits [n, V] → adjusted float32 copy. Row i follows `output_ids` and then drafts[:i] (a speculative
        round scores its drafts in one call: each position's penalties count the drafts before it)."""
        params = self.params
        if self._allowed is None:
            adjusted = np.array(logits, dtype=np.float32)
        else:  # every other id masked
            adjusted = np.full(np.shape(logits), -np.inf, dtype=np.float32)
            adjusted[:, self._allowed] = np.asarray(logits)[:, self._allowed]
        if self._bad_words is not None:
            self._ban(adjusted, output_ids, drafts)
        if self._grammar is not None:  # the matcher follows output_ids: Request.append_token advances it
            self._grammar.mask(adjusted, drafts, len(output_ids))
        adjusted[:, self._bias_ids] += self._biases
        held = params.min_tokens - len(output_ids)  # rows 0..held-1 come before the min_tokens-th token
        if held > 0 and self._stop_ids.size:
            adjusted[:held, self._stop_ids] = -np.inf
        if self._bad_words is not None:
            self._keep_rows_alive(adjusted, logits, len(output_ids))
        if not params.penalizes:
            return adjusted
        self._count(output_ids, adjusted.shape[-1])
        drafts = [int(token) for token in drafts[:adjusted.shape[0] - 1]]
        if params.repetition_penalty != 1:
            self._repeat(adjusted, slice(None), np.flatnonzero(self._seen))
            for j, token in enumerate(drafts):  # rows after a draft never seen before see it too
                if not self._seen[token] and token not in drafts[:j]:
                    self._repeat(adjusted, slice(j + 1, None), token)
        if params.frequency_penalty or params.presence_penalty:
            output = np.flatnonzero(self._counts)
            adjusted[:, output] -= params.frequency_penalty * self._counts[output] + params.presence_penalty
            for j, token in enumerate(drafts):
                first = not self._counts[token] and token not in drafts[:j]
                adjusted[j + 1:, token] -= params.frequency_penalty + (params.presence_penalty if first else 0.0)
        return adjusted

    def _ban(self, adjusted: np.ndarray, output_ids: Sequence[int], drafts: Sequence[int]) -> None:
        bad_words = self._bad_words
        adjusted[:, bad_words.always] = -np.inf
        if not bad_words.conditional:
            return
        history = list(output_ids[max(0, len(output_ids) - bad_words.longest_prefix):])  # all a match can reach
        for row in range(adjusted.shape[0]):
            banned = bad_words.banned(history + [int(token) for token in drafts[:row]])
            if banned:
                adjusted[row, banned] = -np.inf

    def _keep_rows_alive(self, adjusted: np.ndarray, logits: np.ndarray, position: int) -> None:
        """A row with no finite logit left takes the model's own (the sampler refuses a row without one, for the
        whole call) and its position is recorded in `exhausted`: the request ends there, its token unused."""
        self.exhausted = set()
        for row in range(adjusted.shape[0]):
            left = adjusted[row] if self._allowed is None else adjusted[row, self._allowed]
            if not np.isfinite(left).any():
                adjusted[row] = np.asarray(logits[row], dtype=np.float32)
                self.exhausted.add(position + row)

    def _count(self, output_ids: Sequence[int], vocab_size: int) -> None:
        if self._counts is None or len(output_ids) < self._counted:  # first call (or another history: recount)
            self._counts = np.zeros(vocab_size, dtype=np.int32)
            self._seen = np.zeros(vocab_size, dtype=bool)
            self._seen[self._prompt_ids] = True
            self._counted = 0
        new = np.asarray(output_ids[self._counted:], dtype=np.int64)
        if new.size:
            np.add.at(self._counts, new, 1)
            self._seen[new] = True
            self._counted = len(output_ids)

    def _repeat(self, adjusted: np.ndarray, rows: slice, tokens) -> None:
        values = adjusted[rows, tokens]
        penalty = self.params.repetition_penalty
        adjusted[rows, tokens] = np.where(values > 0, values / penalty, values * penalty)


def adjuster(params: SamplingParams, prompt_ids: Sequence[int], eos_token_ids: Iterable[int] = (),
             bad_words: BadWords | None = None, grammar: GrammarMatcher | None = None) -> LogitsAdjuster | None:
    """The request's adjuster, or None when its params change no logit (the common case costs nothing)."""
    if not params.adjusts_logits:
        return None
    return LogitsAdjuster(params, prompt_ids, eos_token_ids, bad_words, grammar)
