"""Incremental detokenization: text deltas for streaming, stop strings, and no half-decoded UTF-8 characters."""

from __future__ import annotations


class IncrementalDetokenizer:
    """Streams only text that can no longer change: an open multi-byte character, or a tail that could still grow
    into a stop string, is held back until it resolves (and flushed by finish())."""

    def __init__(self, tokenizer, stop: list[str] | None = None):
        self.tokenizer = tokenizer
        self.stop = [s for s in (stop or []) if s]
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.token_ids: list[int] = []
        self.text = ""  # the generated text so far, cut before a stop string
        self.emitted = 0  # characters of self.text already handed out
        self.stopped = False
        self.stop_string: str | None = None  # the stop string that ended the text

    def add(self, token_id: int) -> str:
        """Append a token; return the text that became final."""
        self.token_ids.append(token_id)
        text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        for stop in self.stop:
            found = text.find(stop, max(0, len(self.text) - len(stop)))  # a stop may straddle two tokens
            if found != -1:  # searched in text already cut by an earlier stop: a later find cuts earlier
                text = text[:found]
                self.stopped, self.stop_string = True, stop
        self.text = text
        if self.stopped:
            return self.finish()
        stable = len(text.rstrip("\ufffd")) if text.endswith("\ufffd") else len(text)
        return self._emit_until(max(self.emitted, stable - self.holdback))

    def finish(self) -> str:
        """The rest of the text, including any held-back tail."""
        return self._emit_until(len(self.text))

    def _emit_until(self, end: int) -> str:
        delta = self.text[self.emitted:end]
        self.emitted = max(self.emitted, end)
        return delta
