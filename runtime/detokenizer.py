"""Incremental detokenization: text deltas for streaming, stop strings, and no half-decoded UTF-8 characters."""

from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop: list[str] | None = None):
        self.tokenizer = tokenizer
        self.stop = [s for s in (stop or []) if s]
        self.token_ids: list[int] = []
        self.text = ""
        self.stopped = False

    def add(self, token_id: int) -> str:
        """Append a token; return the newly finished text (may be empty while a multi-byte character is open)."""
        self.token_ids.append(token_id)
        text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return ""
        for stop in self.stop:
            # Search from just before the old end: a stop string may straddle two tokens.
            found = text.find(stop, max(0, len(self.text) - len(stop)))
            if found != -1:
                text = text[:found]
                self.stopped = True
        delta = text[len(self.text):] if text.startswith(self.text) else ""
        self.text = text
        return delta
