"""Incremental detokenization: text deltas for streaming, stop strings, and no half-decoded UTF-8 characters."""

from __future__ import annotations

from bisect import bisect_right
from functools import partial

# Tokens decoded again in front of the new ones: how a token's text joins the text before it (a byte-level
# character split over tokens, a WordPiece '##' piece, SentencePiece's '▁', a cleaned-up space) depends only on
# the last few tokens, so decoding that window instead of the whole text keeps a token's cost independent of the
# text's length (a whole decode per token made a generation quadratic: 0.5 ms a token at 2,048 tokens).
WINDOW_TOKENS = 6
# Characters held back when the tokenizer cleans up spaces (transformers' clean_up_tokenization_spaces): a space
# before "n't" is removed once those three characters arrive, so the last three may still change.
CLEAN_UP_HOLDBACK = 3


class IncrementalDetokenizer:
    """Streams only text that can no longer change: an open multi-byte character, a tail that could still grow
    into a stop string, a space a clean-up rule could still remove, or the text of a run of byte-fallback tokens
    that a later byte could still turn into U+FFFD, is held back until it resolves (and flushed by finish()).
    `text` equals the tokenizer's decode of every token added (cut before a stop string, or after it with
    include_stop) whenever it ends in a complete character, and after finish(). As vLLM's, no stop string ends the
    text before min_tokens tokens: the text of those is not searched, and a later match must end past it.
    skip_special_tokens=False decodes special tokens as their text."""

    def __init__(self, tokenizer, stop: list[str] | None = None, *, include_stop: bool = False, min_tokens: int = 0,
                 skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.decode = _decoder(tokenizer, skip_special_tokens)
        self.stop = [s for s in (stop or []) if s]
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        if getattr(tokenizer, "clean_up_spaces", False):  # " n't", " 's", " ." ...: a later token removes a space
            self.holdback = max(self.holdback, CLEAN_UP_HOLDBACK)
        self.token_ids: list[int] = []
        self.text = ""  # the generated text so far, cut before a stop string
        self.emitted = 0  # characters of self.text already handed out
        self.stopped = False
        self.stop_string: str | None = None  # the stop string that ended the text
        self._searched = 0  # characters of text searched for stop strings (without an open character's U+FFFD)
        self.include_stop = include_stop
        self.min_tokens = min_tokens
        self._floor = 0  # a stop string must end past this character: the text of the first min_tokens tokens
        self._settled = ""  # the decode of token_ids[:self._boundaries[-1]], which ends in no open character
        self._boundaries = [0]  # every settled token count so far, ascending: where a window may start
        self._is_fallback_byte = getattr(tokenizer, "is_fallback_byte", None)
        # decode drops them: a run goes on
        self._skipped = frozenset(getattr(tokenizer, "all_special_ids", ()) if skip_special_tokens else ())
        self._byte_run_start: int | None = None  # characters of text before the open run of byte-fallback tokens

    def add(self, token_id: int) -> str:
        """Append a token; return the text that became final."""
        self.token_ids.append(token_id)
        if self._is_fallback_byte is not None and token_id not in self._skipped:
            if not self._is_fallback_byte(token_id):
                self._byte_run_start = None
            elif self._byte_run_start is None:
                self._byte_run_start = len(self.text)
        self.text = text = self._decoded()
        settled = len(text.rstrip("\ufffd")) if text.endswith("\ufffd") else len(text)
        # a stop in an open byte-fallback run matches at once (a "\n" is the byte token <0x0A> in Llama 2's
        # vocabulary): stopping freezes the run as decoded; only its streaming waits for the run to resolve
        if len(self.token_ids) <= self.min_tokens:
            self._searched = self._floor = settled
        elif self._cut_at_stop(settled):
            return self.finish()
        stable = settled if self._byte_run_start is None else min(settled, self._byte_run_start)
        return self._emit_until(max(self.emitted, stable - self.holdback))

    def finish(self) -> str:
        """The rest of the text, including any held-back tail (an open character at the end as the whole decode
        reads it), cut before a stop string that lies in that tail."""
        if not self.stopped:
            if self.text.endswith("\ufffd"):
                self.text = self.decode(self.token_ids)
            if len(self.token_ids) > self.min_tokens:
                self._cut_at_stop(len(self.text))
        return self._emit_until(len(self.text))

    def _cut_at_stop(self, end: int) -> bool:
        """Cut the text before the earliest stop string that lies wholly in text[:end] (without the placeholder U+FFFD
        of a character still open at its end, which must not match) and was not searched before; a stop may straddle
        tokens, and the earliest in the text wins whatever the order of the list."""
        found = [(at, stop) for stop in self.stop
                 if (at := self.text.find(stop, max(0, self._searched - len(stop) - CLEAN_UP_HOLDBACK,
                                                    self._floor - len(stop) + 1), end)) != -1]
        self._searched = max(self._searched, end)
        if not found:
            return False
        at, stop = min(found, key=lambda item: item[0])
        self.text = self.text[:at + len(stop)] if self.include_stop else self.text[:at]
        self.stopped, self.stop_string = True, stop
        return True

    def _decoded(self) -> str:
        """The decode of every token so far: the settled text, plus what the new tokens add to a decode of a window
        that starts at a settled point at least WINDOW_TOKENS back (a character boundary, so a byte-fallback run
        decodes alike in the window and in the whole). The whole sequence is decoded instead where the window
        could disagree with it: its text does not extend its settled part (a rule reached across the window's
        start, or its settled tokens decode to nothing), or the new text holds a U+FFFD before its end (an invalid
        byte, which a byte-fallback decoder resolves over the whole run of byte tokens). A U+FFFD at the end (an
        open character) stays unsettled: the next tokens decode it again."""
        decode, settled_tokens = self.decode, self._boundaries[-1]
        start = self._boundaries[max(0, bisect_right(self._boundaries, settled_tokens - WINDOW_TOKENS) - 1)]
        settled_part = decode(self.token_ids[start:settled_tokens])
        window = decode(self.token_ids[start:])
        new = window[len(settled_part):]
        extends = window.startswith(settled_part) and (settled_part or not self._settled)
        if extends and "\ufffd" not in new.rstrip("\ufffd"):
            text = self._settled + new
        else:
            text = decode(self.token_ids)
        if not text.endswith("\ufffd"):
            self._settled = text
            self._boundaries.append(len(self.token_ids))
        return text

    def _emit_until(self, end: int) -> str:
        delta = self.text[self.emitted:end]
        self.emitted = max(self.emitted, end)
        return delta


class FinalDetokenizer:
    """For a request that wants only its final text and has no stop strings (SamplingParams.output_kind "final"):
    tokens are collected and decoded once, by finish() — the text IncrementalDetokenizer's finish() ends with, without
    its two window decodes a token (3% of a SmolLM2 int4 decode step's time, measured)."""

    stopped = False
    stop_string: str | None = None

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.decode = _decoder(tokenizer, skip_special_tokens)
        self.token_ids: list[int] = []
        self.text = ""  # empty until finish()
        self.emitted = 0

    def add(self, token_id: int) -> str:
        self.token_ids.append(token_id)
        return ""

    def finish(self) -> str:
        """The whole text (once; later calls return "")."""
        if self.emitted == 0 and self.token_ids:
            self.text = self.decode(self.token_ids)
        delta, self.emitted = self.text[self.emitted:], len(self.text)
        return delta


def _decoder(tokenizer, skip_special_tokens: bool):
    """tokenizer.decode, keeping special tokens' text when asked (the default call otherwise: a tokenizer whose decode
    takes no such keyword still works when it is not needed)."""
    return tokenizer.decode if skip_special_tokens else partial(tokenizer.decode, skip_special_tokens=False)
