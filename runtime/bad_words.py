"""vLLM's `bad_words`: words a request must not generate, as token sequences banned at sampling time.

A word becomes the token sequences of its text (leading whitespace stripped) as it would start the output and as it
would follow a space (" word"), whichever of those differ. A one-token sequence bans its token at every position; a
longer one bans its last token right after the output ends with the others (vLLM v1's rule: the output's tokens
only, not the prompt's). A word spelled by other tokens than these (another split of the same text) is not caught,
as in vLLM.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np


class BadWords:
    """The banned sequences of one request's bad_words. `always`: ids banned at every position (one-token words);
    `endings`: every id some sequence can ban (the check that something is left to sample)."""

    def __init__(self, sequences: Sequence[Sequence[int]]):
        self.sequences = tuple(dict.fromkeys(tuple(int(t) for t in s) for s in sequences if s))
        self.always = np.asarray(sorted({s[0] for s in self.sequences if len(s) == 1}), dtype=np.int64)
        self._after: dict[int, dict[tuple[int, ...], set[int]]] = {}  # prefix length → prefix → banned last ids
        for s in self.sequences:
            if len(s) > 1:
                self._after.setdefault(len(s) - 1, {}).setdefault(s[:-1], set()).add(s[-1])
        self.endings = frozenset(s[-1] for s in self.sequences)
        self.longest_prefix = max(self._after, default=0)

    @classmethod
    def from_words(cls, words: Sequence[str], encode: Callable[[str], list[int]]) -> BadWords:
        """`words` as SamplingParams checked them (none blank); `encode`: text → token ids without special tokens
        (no BOS)."""
        sequences = []
        for word in words:
            bare = word.lstrip()
            sequences += [encode(bare), encode(" " + bare)]
        return cls(sequences)

    def banned(self, history: Sequence[int]) -> list[int]:
        """The ids the next token may not be after `history` (the output so far), beyond `always`."""
        banned: list[int] = []
        for length, prefixes in self._after.items():
            if len(history) >= length and (ids := prefixes.get(tuple(history[-length:]))):
                banned += ids
        return banned

    @property
    def conditional(self) -> bool:
        """Whether some sequence is longer than one token (its ban depends on the output)."""
        return bool(self._after)
