"""vLLM's `bad_words`: words a request must not generate, as token sequences banned at sampling time.

A word becomes the token sequences of its text (leading whitespace stripped) as it would start the output and, where
that is as many tokens starting with another one (a word token of its own), as it would follow a space (" word").
A one-token sequence bans its token at every position; a longer one bans its last token right after the output ends
with the others (the output's tokens only, not the prompt's). All of this is vLLM v1's rule; a word spelled by other
tokens than these (another split of the same text) is not caught, as in vLLM.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np


class BadWords:
    """The banned sequences of one request's bad_words. `always`: ids banned at every position (one-token words);
    the longer sequences' prefixes are kept in a trie of reversed prefixes, so that the ids banned after an output
    cost a walk back over its last tokens while they match some prefix (not a comparison per word)."""

    def __init__(self, sequences: Sequence[Sequence[int]]):
        self.sequences = tuple(dict.fromkeys(tuple(int(t) for t in s) for s in sequences if s))
        self.always = np.asarray(sorted({s[0] for s in self.sequences if len(s) == 1}), dtype=np.int64)
        self._root: _Node = _Node()
        for s in self.sequences:
            if len(s) > 1:
                node = self._root
                for token in reversed(s[:-1]):
                    node = node.children.setdefault(token, _Node())
                node.banned.append(s[-1])
        self.longest_prefix = max((len(s) - 1 for s in self.sequences), default=0)

    @classmethod
    def from_words(cls, words: Sequence[str], encode: Callable[[str], list[int]]) -> BadWords:
        """`words` as SamplingParams checked them (none blank); `encode`: text → token ids without special tokens
        (no BOS). As vLLM: the spaced form is kept when it is as many tokens as the bare one and starts with another
        token (a word token of its own, not a space token before the bare form)."""
        sequences = []
        for word in words:
            bare, spaced = encode(word.lstrip()), encode(" " + word.lstrip())
            sequences.append(bare)
            if len(spaced) == len(bare) and spaced[:1] != bare[:1]:
                sequences.append(spaced)
        return cls(sequences)

    def banned(self, history: Sequence[int]) -> list[int]:
        """The ids the next token may not be after `history` (the output so far), beyond `always`."""
        banned: list[int] = []
        node = self._root
        for token in reversed(history):
            node = node.children.get(token)
            if node is None:
                break
            banned += node.banned
        return banned

    @property
    def conditional(self) -> bool:
        """Whether some sequence is longer than one token (its ban depends on the output)."""
        return bool(self._root.children)


class _Node:
    __slots__ = ("children", "banned")

    def __init__(self) -> None:
        self.children: dict[int, _Node] = {}
        self.banned: list[int] = []  # the last ids of the sequences whose prefix ends here
