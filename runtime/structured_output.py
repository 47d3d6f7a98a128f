"""Structured outputs: the output constrained to a JSON schema, any JSON object, a regular expression, one of a list of
strings, or a grammar (Lark, or llama.cpp's GBNF), by masking at every step the tokens the grammar cannot take next
(vLLM's `structured_outputs`, OpenAI's `response_format`). The grammars and masks are llguidance's (an optional
dependency, in the `serve` and `structured` extras; imported only when a request asks for a structure).

A request's output ends ("stop") as soon as its grammar can take nothing more; `max_tokens` may cut it first
("length"), as in vLLM and OpenAI's API. JSON is generated compactly (no whitespace between tokens of the syntax),
which keeps a model from padding it with whitespace.
"""

from __future__ import annotations

import copy
import json
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

from fxllm.errors import GenerationError, InvalidArgumentError, MissingDependencyError
from fxllm.runtime.checks import describe, strings, text

KINDS = ("json", "regex", "choice", "grammar", "json_object")
MAX_SPEC_CHARS = 65536  # a schema, regex or grammar: compiled when a request is added (the server: on a worker thread)
MAX_CHOICES = 256
PARAM = "structured_outputs"


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one of: `json` (a JSON schema: a dict, or its JSON text), `regex` (the whole output matches it),
    `choice` (the output is one of these strings), `grammar` (Lark, or GBNF as llama.cpp writes it), `json_object`
    (True: any JSON object). Checked at construction (types, sizes); the structure itself is compiled by the engine
    when a request is added (a schema, regex or grammar it cannot compile is an InvalidArgumentError naming
    `structured_outputs`). A dict is accepted where StructuredOutputsParams is (SamplingParams converts it)."""

    json: str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        if self.json is not None:
            set_(self, "json", _schema_text(self.json))
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None:
                text(name, value, param=PARAM)  # valid Unicode: llguidance cannot take a lone surrogate
                if len(value) > MAX_SPEC_CHARS:
                    raise InvalidArgumentError(PARAM, f"{name} has {len(value):,} characters; at most "
                                                      f"{MAX_SPEC_CHARS:,}")
        if self.choice is not None:
            if isinstance(self.choice, str):
                raise InvalidArgumentError(PARAM, "choice must be a non-empty list of strings")
            choice = strings(PARAM, self.choice, most=MAX_CHOICES, most_chars=MAX_SPEC_CHARS)
            if not choice:
                raise InvalidArgumentError(PARAM, "choice must be a non-empty list of strings")
            set_(self, "choice", choice)
        if not isinstance(self.json_object, bool):
            raise InvalidArgumentError(PARAM, f"json_object must be True or False, got {describe(self.json_object)}")
        given = [kind for kind in KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            raise InvalidArgumentError(PARAM, "give exactly one of " + ", ".join(KINDS)
                                       + (f" (got {', '.join(given)})" if given else ""))

    @classmethod
    def of(cls, value: Any) -> StructuredOutputsParams | None:
        """None, a StructuredOutputsParams, or a dict of its fields."""
        if value is None or isinstance(value, StructuredOutputsParams):
            return value
        if not isinstance(value, dict):
            raise InvalidArgumentError(PARAM, f"{PARAM} must be a dict such as {{'json': schema}}, got "
                                              f"{describe(value)}")
        unknown = sorted(map(str, set(value) - set(KINDS)))
        if unknown:
            raise InvalidArgumentError(PARAM, f"{PARAM} takes {', '.join(KINDS)}; not {', '.join(unknown)}")
        return cls(**{kind: given for kind, given in value.items() if given is not None})  # null: not given

    @property
    def kind(self) -> str:
        return next(kind for kind in KINDS if getattr(self, kind) not in (None, False))

    def grammar_text(self) -> str:
        """The llguidance grammar of this structure (InvalidArgumentError where llguidance refuses it)."""
        from llguidance import LLMatcher
        from llguidance.gbnf_to_lark import any_to_lark

        compact = {"whitespace_flexible": False}
        try:
            if self.json is not None:
                return LLMatcher.grammar_from_json_schema(self.json, overrides=compact)
            if self.json_object:
                return LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=compact)
            if self.regex is not None:
                return LLMatcher.grammar_from_regex(self.regex)
            if self.choice is not None:
                return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in self.choice))
            return LLMatcher.grammar_from_lark(any_to_lark(self.grammar))
        except Exception as exc:  # what its compilers cannot read (the GBNF converter has errors of its own type)
            raise InvalidArgumentError(PARAM, f"{self.kind}: {_first_line(exc)}") from None


def _schema_text(schema: Any) -> str:
    """A schema (a dict, or its JSON text) as strict JSON text: no NaN or Infinity, valid Unicode, bounded size."""
    if isinstance(schema, dict):
        try:
            schema_text = json.dumps(schema, allow_nan=False)
        except (TypeError, ValueError, RecursionError) as exc:
            raise InvalidArgumentError(PARAM, f"json: the schema is not JSON ({_first_line(exc)})") from None
    elif isinstance(schema, str):
        schema_text = schema
        try:
            if not isinstance(json.loads(schema_text, parse_constant=_no_constant), dict):
                raise ValueError("not an object")
        except (ValueError, RecursionError) as exc:
            raise InvalidArgumentError(PARAM, f"json: the schema must be a JSON object ({_first_line(exc)})") from None
    else:
        raise InvalidArgumentError(PARAM, f"json must be a JSON schema (a dict or its text), got {describe(schema)}")
    text("json", schema_text, param=PARAM)
    if len(schema_text) > MAX_SPEC_CHARS:
        raise InvalidArgumentError(PARAM, f"json: the schema has {len(schema_text):,} characters; at most "
                                          f"{MAX_SPEC_CHARS:,}")
    return schema_text


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


class Grammars:
    """One model's compiler of structures: llguidance's view of the tokenizer (built on first use, ~0.3 s for a
    49,152-token vocabulary) and each structure's matcher at its start (cached; every request gets a copy).
    Thread-safe: the server compiles on a worker thread and adds requests on its event loop while the core steps."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Iterable[int]):
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        # special tokens are never a structure's text (llguidance would let <|im_end|> spell itself, which the
        # request then reads as its end); only the EOS, and only as the end of a complete structure
        self._special = sorted(set(getattr(tokenizer, "all_special_ids", ())) | set(self._eos))
        self._ll_tokenizer = None
        self._lock = threading.Lock()
        self.compile = lru_cache(maxsize=64)(self._compile)

    def _ll(self):
        with self._lock:
            if self._ll_tokenizer is None:
                try:
                    from llguidance import LLTokenizer
                except ImportError:
                    raise MissingDependencyError("structured outputs need llguidance: pip install "
                                                 "'fxllm[structured]'") from None
                backend = getattr(self._tokenizer, "backend", None)
                if backend is None:
                    raise GenerationError("structured outputs need the artifact's tokenizer.json tokenizer")
                self._ll_tokenizer = LLTokenizer(backend.to_str(), n_vocab=self._vocab_size, eos_token=self._eos)
            return self._ll_tokenizer

    def _compile(self, params: StructuredOutputsParams) -> GrammarMatcher:
        """The structure's matcher at its start, which requests copy (compiling took ~45 ms for a 49 KB schema)."""
        ll_tokenizer = self._ll()  # first: without llguidance, the one-line error saying how to install it
        from llguidance import LLMatcher

        grammar = params.grammar_text()
        try:
            matcher = LLMatcher(ll_tokenizer, grammar, log_level=0)
        except (ValueError, TypeError, RuntimeError) as exc:
            raise InvalidArgumentError(PARAM, f"{params.kind}: {_first_line(exc)}") from None
        prototype = GrammarMatcher(matcher, ll_tokenizer.vocab_size, self._vocab_size, self._special, self._eos)
        # the first step: limits a structure hits at once, a language with no text, a special token's text
        _, spelled = prototype.allowed(self._vocab_size)
        if matcher.is_error():
            error = _first_line(matcher.get_error())
            raise InvalidArgumentError(PARAM, f"{params.kind}: " + (error if " " in error else
                                                                     f"no text matches it ({error})"))
        if not spelled:
            raise InvalidArgumentError(PARAM, f"{params.kind}: it starts with a special token's text (such as "
                                              "<|im_end|>), which is never generated as text")
        return prototype

    def matcher(self, params: StructuredOutputsParams) -> GrammarMatcher:
        """A new request's matcher (InvalidArgumentError: a structure that does not compile)."""
        prototype = self.compile(params)
        with self._lock:  # the cached matcher is shared between threads; a copy is the request's own
            return prototype.copy()


class GrammarMatcher:
    """One request's place in its grammar: the mask of the tokens it may take next, advanced by each token the
    request appends."""

    def __init__(self, matcher, ll_vocab_size: int, vocab_size: int, special_ids: Sequence[int] = (),
                 eos_ids: Sequence[int] = ()):
        """matcher: an llguidance LLMatcher of this request alone; ll_vocab_size: its tokenizer's vocabulary;
        vocab_size: the model's (the width of its logits); special_ids: masked as text (the EOS ids, `eos_ids`,
        stay allowed where the structure is complete)."""
        from llguidance.numpy import allocate_token_bitmask

        self._matcher = matcher
        self._bitmask = allocate_token_bitmask(1, ll_vocab_size)
        self._vocab_size = vocab_size
        self._special = np.asarray([i for i in special_ids if i < vocab_size], dtype=np.int64)
        self._special_text = np.asarray([i for i in self._special if i not in set(eos_ids)], dtype=np.int64)
        self.special_only: set[int] = set()  # output positions the last mask left only special-token text

    def mask(self, adjusted: np.ndarray, drafts: Sequence[int] = (), position: int = 0) -> None:
        """Set to -inf, in place, what the grammar forbids in each row of `adjusted` [n, V]: row i after the tokens
        appended so far and drafts[:i]. Rows after a draft the grammar refuses repeat that row's mask (a verification
        rejects that draft, so they are never sampled from)."""
        consumed = 0  # drafts the matcher has taken, each moving it one row on
        self.special_only = set()
        try:
            for row in range(adjusted.shape[0]):
                if consumed == row:
                    allowed, spelled = self.allowed(adjusted.shape[1])
                    if not spelled:
                        self.special_only.add(position + row)
                adjusted[row, ~allowed] = -np.inf
                if consumed == row and row < len(drafts) and row + 1 < adjusted.shape[0]:
                    consumed += self._matcher.try_consume_tokens([int(drafts[row])])
        finally:  # the matcher follows the appended tokens only
            if consumed:
                self._matcher.rollback(consumed)

    def copy(self) -> GrammarMatcher:
        """The same place in the same grammar, for another request (copying is ~0.003 ms; compiling is not)."""
        twin = copy.copy(self)  # shares the special-id arrays
        twin._matcher = self._matcher.deep_copy()
        twin._bitmask = self._bitmask.copy()
        twin.special_only = set()
        return twin

    def allowed(self, width: int) -> tuple[np.ndarray, bool]:
        """The ids the grammar takes next, as a bool mask of `width` (the logits' width), special tokens' text
        cleared; and False where only special-token text was allowed (then left allowed: _no_special_text)."""
        from llguidance.numpy import fill_next_token_bitmask

        fill_next_token_bitmask(self._matcher, self._bitmask)
        bits = np.unpackbits(self._bitmask.view(np.uint8), bitorder="little")
        allowed = bits[:self._vocab_size].astype(bool)
        if allowed.size < width:
            allowed = np.pad(allowed, (0, width - allowed.size))
        return allowed, self._no_special_text(allowed)

    def _no_special_text(self, allowed: np.ndarray) -> bool:
        """Clear the special tokens the structure allows as text (all of them, the EOS included, while it is not
        complete). False, and `allowed` left as it was, when nothing else is allowed: the structure's text is a
        special token there (llguidance reads "<|im_end|>" in a grammar as that token)."""
        blocked = self._special_text if self._matcher.is_accepting() else self._special
        if blocked.size and allowed[blocked].any():
            kept = allowed[blocked].copy()
            allowed[blocked] = False
            if not allowed.any():
                allowed[blocked] = kept
                return False
        return True

    def check_position(self, position: int) -> None:
        """GenerationError where the last mask found only special-token text (Request.append_token asks before it
        reads the token, which may be the EOS)."""
        if position in self.special_only:
            raise GenerationError("structured output: the structure asks for a special token's text (such as "
                                  "<|im_end|>) here, which is never generated as text")

    def accept(self, token: int) -> None:
        """Advance past an appended token (GenerationError if the grammar refuses it, or fails)."""
        if not self._matcher.consume_token(int(token)):
            raise GenerationError(f"structured output: {_first_line(self._matcher.get_error()) or 'token refused'}")

    @property
    def done(self) -> bool:
        """Whether the grammar can take no more tokens (the output is complete)."""
        return self._matcher.is_stopped()


def _first_line(value: Any, most: int = 300) -> str:
    """llguidance's message (several lines: a caret under the fault) on one line, without the parser state it may
    append, cut to `most` characters."""
    text = " ".join(line.strip() for line in str(value).split("<state>")[0].splitlines() if line.strip())
    return text if len(text) <= most else text[:most - 3] + "..."
