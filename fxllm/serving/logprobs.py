"""The engine's TokenLogprobs in the OpenAI shapes: completions (`tokens`, `token_logprobs`, `top_logprobs` as
{token text: logprob}, `text_offset`) and chat (`content`: token, logprob, UTF-8 bytes, top_logprobs).

A token's text is the bytes it adds to the text (tokenizer.token_bytes), decoded as UTF-8; a token holding part of
a multi-byte character is written `bytes:\\xNN...` as the OpenAI API does. A special token keeps its text in
`tokens`, but adds nothing to a generated text (which is decoded without special tokens), so its `text_offset` is
that of the next character. In the completions shape the chosen token is always among `top_logprobs` (so a position
may list N + 1 tokens, as the reference says); tokens whose texts coincide share one key there.

A logprob of -inf (a token the model masks with a logit of -inf) is sent as LOGPROB_FLOOR: JSON has no -Infinity
(a non-streamed response carried null, the shape's "no logprob"; a stream, a token strict parsers refuse); vLLM
sends the same.
"""

from __future__ import annotations

import codecs
from functools import lru_cache

from fxllm.runtime.request import TokenLogprobs
from fxllm.serving.protocol import CompletionLogprobs, TokenLogprob, TopLogprob

LOGPROB_FLOOR = -9999.0


def finite(logprob: float) -> float:
    """The logprob, or LOGPROB_FLOOR where it is below it (-inf)."""
    return logprob if logprob > LOGPROB_FLOOR else LOGPROB_FLOOR


class TokenTexts:
    """Token id → (text, bytes), cached per tokenizer."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.text = lru_cache(maxsize=65536)(self._text)
        self.special_ids = frozenset(getattr(tokenizer, "all_special_ids", ()))  # generated text drops them

    def bytes(self, token_id: int) -> bytes:
        return self.tokenizer.token_bytes(token_id)

    def _text(self, token_id: int) -> str:
        raw = self.bytes(token_id)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


class TextOffsets:
    """`text_offset`s of a choice's tokens: the characters of its text completed before each token. A token holding
    part of a multi-byte character adds no character; the token that completes it adds the whole character (as
    the text's own UTF-8 decode does, invalid bytes becoming U+FFFD)."""

    def __init__(self, start: int = 0):
        self.chars = start
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def advance(self, raw: bytes) -> int:
        """The offset of a token of these bytes; moves past them."""
        offset = self.chars
        self.chars += len(self._decoder.decode(raw))
        return offset


def completion_logprobs(texts: TokenTexts, positions: list[TokenLogprobs], offsets: TextOffsets,
                        generated: bool = True) -> CompletionLogprobs:
    """Positions at the choice's next characters (`offsets` moves past them). Generated positions (not an echoed
    prompt's, whose text keeps its special tokens) move past nothing for a special token."""
    result = CompletionLogprobs()
    for position in positions:
        token = texts.text(position.token_id)
        top = {texts.text(i): finite(lp) for i, lp in position.top}
        top.setdefault(token, finite(position.logprob))
        result.tokens.append(token)
        result.token_logprobs.append(finite(position.logprob))
        result.top_logprobs.append(top)
        skipped = generated and position.token_id in texts.special_ids
        result.text_offset.append(offsets.advance(b"" if skipped else texts.bytes(position.token_id)))
    return result


def first_prompt_position(texts: TokenTexts, token_id: int, offsets: TextOffsets) -> CompletionLogprobs:
    """The first prompt token (echo): its text, no logprob."""
    return CompletionLogprobs(tokens=[texts.text(token_id)], token_logprobs=[None], top_logprobs=[None],
                              text_offset=[offsets.advance(texts.bytes(token_id))])


def extend(a: CompletionLogprobs, b: CompletionLogprobs) -> CompletionLogprobs:
    """Append b's positions to a, in place (amortized O(len(b))); returns a."""
    a.text_offset.extend(b.text_offset)
    a.token_logprobs.extend(b.token_logprobs)
    a.tokens.extend(b.tokens)
    a.top_logprobs.extend(b.top_logprobs)
    return a


def chat_logprobs(texts: TokenTexts, positions: list[TokenLogprobs]) -> list[TokenLogprob]:
    return [TokenLogprob(token=texts.text(p.token_id), logprob=finite(p.logprob), bytes=list(texts.bytes(p.token_id)),
                         top_logprobs=[TopLogprob(token=texts.text(i), logprob=finite(lp), bytes=list(texts.bytes(i)))
                                       for i, lp in p.top])
            for p in positions]
