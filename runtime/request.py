"""A request's public types: SamplingParams (what to generate), Request (its state in the engine core) and
RequestOutput (what one engine step produced for it)."""

from __future__ import annotations

import copy
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from itertools import islice
from typing import Any

from fxllm.errors import InvalidArgumentError
from fxllm.runtime.bad_words import BadWords
from fxllm.runtime.checks import describe, flag, integer, integers, real, strings
from fxllm.runtime.detokenizer import FinalDetokenizer, IncrementalDetokenizer
from fxllm.runtime.metrics import RequestMetrics
from fxllm.runtime.structured_output import GrammarMatcher, StructuredOutputsParams

MAX_LOGPROBS = 20  # most alternatives per position (the OpenAI API's top_logprobs limit)
# Stop strings are searched for after every token of every choice, on the step loop all requests share: a request
# with 330,000 of them (a 3 MB body) slowed every other request 18x. OpenAI's API takes 4; these bounds leave room.
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024
# logit_bias entries are applied to every row a request samples from; OpenAI bounds each bias to [-100, 100] (-100
# bans a token, 100 all but forces it). The count bound keeps a request body from carrying a vocabulary-sized table.
MAX_LOGIT_BIAS = 1024
MAX_TOKEN_IDS = 65536  # stop_token_ids, allowed_token_ids: each id is checked, on the server's event loop
# bad_words are tokenized (twice each) when a request is added, on the server's event loop
MAX_BAD_WORDS = 256
MAX_BAD_WORD_CHARS = 256
MAX_BIAS = 100.0
MAX_PENALTY = 2.0  # presence/frequency penalties: OpenAI's range [-2, 2]
# repetition_penalty: vLLM takes any value > 0, but past these a logit is divided or multiplied into saturation (and
# 1e-40 overflowed float32 logits to inf, 1e39 is inf itself); 1.0-1.3 is the common range.
REPETITION_PENALTY_RANGE = (0.01, 100.0)
OUTPUT_KINDS = ("delta", "final")
# SamplingParams fields that the Python API's generate()/stream() take as keyword options and the server as request
# fields (null: the field's default), beside the ones each names itself (temperature, top_k, top_p, seed, stop, ...)
ADJUSTMENT_FIELDS = ("min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
                     "min_tokens", "stop_token_ids", "allowed_token_ids", "ignore_eos", "include_stop_str_in_output",
                     "bad_words", "skip_special_tokens", "structured_outputs")

# Temperatures in (0, MIN_TEMPERATURE) sample greedily (argmax). As the temperature falls the distribution
# concentrates on the argmax; at 1e-5 a logit gap of 1e-3 is already a probability ratio of e^100, so below it
# sampling is greedy in all but name, and dividing by still smaller values overflows float64 (at ~1e-300) into
# NaN probabilities. So: 0 and anything below 1e-5 mean greedy, documented, never an overflow.
MIN_TEMPERATURE = 1e-5
MIN_SEED = -(2**63)  # any int64 seed, as OpenAI's API and vLLM take one; a negative one seeds as seed mod 2**64


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops. Construction checks the type and range of every value
    (runtime/checks.py: InvalidArgumentError naming the field) and stores plain Python values.

    temperature: a finite number >= 0; 0, or anything below MIN_TEMPERATURE, is greedy. top_k: an int >= 0, 0 → no
    limit. top_p: a finite number in (0, 1]. seed: None or an int >= 0 (each request samples from its own stream,
    so its tokens do not depend on its batch).
    max_tokens: most tokens to generate (>= 1; prompt + max_tokens must fit the model's context).
    stop: strings that end generation (the text is cut before them; at most MAX_STOP_STRINGS of at most
    MAX_STOP_CHARS characters); stop_token_ids: ids that end it (the id is the last output token, its text is not
    shown); ignore_eos: do not stop at the model's EOS ids. min_tokens: an int >= 0 (at most max_tokens): the EOS ids
    (unless ignore_eos) and stop_token_ids cannot be sampled before this many tokens, and no stop string ends the
    output before them (vLLM v1's rule: the text of those tokens is not searched, a later match must end past it).
    include_stop_str_in_output: the text ends after the stop string instead of before it. allowed_token_ids: None
    (all), or the only ids that may be sampled (a non-empty list).
    stop_token_ids and allowed_token_ids hold at most MAX_TOKEN_IDS ids each.
    bad_words: words that may not be generated (vLLM's; at most MAX_BAD_WORDS of at most MAX_BAD_WORD_CHARS
    characters): each word's token sequences, as it starts the output and after a space, are banned at sampling time
    (runtime/bad_words.py). skip_special_tokens: False keeps special tokens' text (e.g. "<|im_end|>" generated with
    ignore_eos) in the output text; the EOS or stop token that ends a request is never in it.
    structured_outputs: None, or a StructuredOutputsParams (or a dict of its fields: {"json": schema}, {"regex": ...},
    {"choice": [...]}, {"grammar": ...}, {"json_object": True}) that the output must match
    (runtime/structured_output.py); not combined with min_tokens, allowed_token_ids, bad_words or ignore_eos, which
    could leave its grammar nothing to take.
    logprobs: None, or N >= 0: every generated token's logprob plus the N most likely alternatives;
    prompt_logprobs: the same for every prompt token (the first has none), in the first output.
    Logprobs are log-softmax of the model's logits, before logit_bias, penalties, temperature, min-p, top-k, top-p.
    min_p: a finite number in [0, 1]: after temperature, tokens less likely than min_p times the most likely one are
    dropped (0: off).
    logit_bias: {token id: bias in [-100, 100]} added to those logits before sampling (at most MAX_LOGIT_BIAS
    entries; stored as sorted (id, bias) pairs). Then, as vLLM: repetition_penalty (0.01 to 100, 1: off) divides
    the positive logits and multiplies the negative ones of every token in the prompt or the output so far;
    frequency_penalty and presence_penalty (each in [-2, 2], 0: off) subtract penalty × the token's count in the
    output so far, and penalty once for a token that occurs in it (OpenAI's formula). All of these apply to greedy
    requests too (their argmax is then taken over the adjusted logits); runtime/logits_adjustment.py.
    output_kind: "delta" (an output every step, with that step's tokens, text and logprobs: streaming) or "final"
    (one output when the request finishes, with all of them: vLLM's FINAL_ONLY; no per-step outputs, and without
    stop strings the text is decoded once at the end). A request that fails gets its error, not its tokens."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    output_kind: str = "delta"
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] | tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    allowed_token_ids: tuple[int, ...] | None = None
    include_stop_str_in_output: bool = False
    bad_words: tuple[str, ...] = ()
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "temperature", real("temperature", self.temperature, minimum=0.0))
        set_(self, "top_k", integer("top_k", self.top_k, minimum=0))
        set_(self, "top_p", real("top_p", self.top_p, above=0.0, maximum=1.0))
        if self.seed is not None:
            set_(self, "seed", integer("seed", self.seed, minimum=MIN_SEED))
        set_(self, "max_tokens", integer("max_tokens", self.max_tokens, minimum=1))
        set_(self, "stop", strings("stop", self.stop, most=MAX_STOP_STRINGS, most_chars=MAX_STOP_CHARS))
        set_(self, "stop_token_ids", integers("stop_token_ids", self.stop_token_ids, minimum=0, most=MAX_TOKEN_IDS))
        flag("ignore_eos", self.ignore_eos)
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                set_(self, name, integer(name, getattr(self, name), minimum=0, maximum=MAX_LOGPROBS))
        set_(self, "min_p", real("min_p", self.min_p, minimum=0.0, maximum=1.0))
        for name in ("presence_penalty", "frequency_penalty"):
            set_(self, name, real(name, getattr(self, name), minimum=-MAX_PENALTY, maximum=MAX_PENALTY))
        set_(self, "repetition_penalty", real("repetition_penalty", self.repetition_penalty,
                                               *REPETITION_PENALTY_RANGE))
        set_(self, "logit_bias", _logit_bias(self.logit_bias))
        set_(self, "min_tokens", integer("min_tokens", self.min_tokens, minimum=0))
        flag("include_stop_str_in_output", self.include_stop_str_in_output)
        set_(self, "bad_words", strings("bad_words", self.bad_words, most=MAX_BAD_WORDS,
                                        most_chars=MAX_BAD_WORD_CHARS))
        blank = next((i for i, word in enumerate(self.bad_words) if not word.strip()), None)
        if blank is not None:  # it would ban nothing, or a bare space
            raise InvalidArgumentError("bad_words", f"bad_words[{blank}] is empty or only whitespace")
        flag("skip_special_tokens", self.skip_special_tokens)
        set_(self, "structured_outputs", StructuredOutputsParams.of(self.structured_outputs))
        if self.structured_outputs is not None:
            clash = next((name for name, value in (("min_tokens", self.min_tokens), ("bad_words", self.bad_words),
                                                   ("allowed_token_ids", self.allowed_token_ids is not None),
                                                   ("ignore_eos", self.ignore_eos)) if value), None)
            if clash:
                raise InvalidArgumentError("structured_outputs", f"structured_outputs cannot be combined with {clash}")
        if self.min_tokens > self.max_tokens:
            raise InvalidArgumentError("min_tokens", f"min_tokens ({self.min_tokens}) must be <= max_tokens "
                                                     f"({self.max_tokens})")
        if self.allowed_token_ids is not None:
            allowed = integers("allowed_token_ids", self.allowed_token_ids, minimum=0, most=MAX_TOKEN_IDS)
            if not allowed:
                raise InvalidArgumentError("allowed_token_ids", "allowed_token_ids is empty: nothing could be "
                                                                "sampled (leave it out to allow every token)")
            set_(self, "allowed_token_ids", allowed)
        if not isinstance(self.output_kind, str) or self.output_kind not in OUTPUT_KINDS:
            raise InvalidArgumentError("output_kind", f"output_kind must be one of {', '.join(OUTPUT_KINDS)}, got "
                                                      f"{describe(self.output_kind)}")

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE

    def with_seed(self, seed: int | None) -> SamplingParams:
        """These params with another seed, the seed checked and nothing else again (a server request's n choices
        share lists of up to MAX_TOKEN_IDS ids, which dataclasses.replace would check once per choice)."""
        params = copy.copy(self)
        object.__setattr__(params, "seed", None if seed is None else integer("seed", seed, minimum=MIN_SEED))
        return params

    @property
    def penalizes(self) -> bool:
        """Whether a repetition, presence or frequency penalty is set."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def adjusts_logits(self) -> bool:
        """Whether logit_bias, a penalty, min_tokens, allowed_token_ids, bad_words or a structure changes the logits
        this request samples from."""
        return (bool(self.logit_bias) or self.penalizes or self.min_tokens > 0 or self.allowed_token_ids is not None
                or bool(self.bad_words) or self.structured_outputs is not None)


def _logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """{token id: bias} (or (id, bias) pairs) → sorted (id, bias) pairs; ids are checked against the vocabulary by
    the engine core."""
    if value is None:
        return ()
    if isinstance(value, Mapping):
        items = list(islice(value.items(), MAX_LOGIT_BIAS + 1))
    elif isinstance(value, tuple) and all(isinstance(pair, tuple) and len(pair) == 2 for pair in value):
        items = list(value)  # the stored form (dataclasses.replace passes it again)
    else:
        raise InvalidArgumentError("logit_bias", f"logit_bias must be a mapping of token ids to biases, got "
                                                 f"{describe(value)}")
    if len(items) > MAX_LOGIT_BIAS:
        raise InvalidArgumentError("logit_bias", f"logit_bias holds more than {MAX_LOGIT_BIAS} entries")
    pairs = {}
    for token, bias in items:
        token = integer("a logit_bias key (a token id)", token, minimum=0, param="logit_bias")
        try:
            pairs[token] = real("logit_bias", bias, minimum=-MAX_BIAS, maximum=MAX_BIAS)
        except InvalidArgumentError as exc:
            raise InvalidArgumentError("logit_bias", f"logit_bias[{token}]: {exc}") from None
    return tuple(sorted(pairs.items()))


@dataclass(frozen=True)
class TokenLogprobs:
    """One position: the chosen token's logprob and the `top` (id, logprob) alternatives, most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class RequestOutput:
    """What one step produced for one request. `new_token_ids`/`text_delta` are this step's; the final output
    (finished=True) carries finish_reason: "stop" (stop_reason: the EOS or stop token id, or the stop string),
    "length" (max_tokens), "abort" or "error" (with `error`)."""

    request_id: str
    new_token_ids: list[int]
    text_delta: str
    finished: bool
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_token_ids: list[int] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # the request's first output only
    error: str | None = None
    metrics: RequestMetrics | None = None


class RequestStatus(str, Enum):
    WAITING = "waiting"  # queued, or preempted and queued again
    RUNNING = "running"  # holds KV cache
    FINISHED = "finished"


class Request:
    """One request inside the engine core: its ids, status and outcome are public; the scheduler and the core
    update it. `num_computed_tokens` counts tokens whose KV is in the cache."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, tokenizer,
                 prompt: str | None = None, seq_id: int = 0, eos_token_ids: Iterable[int] = (),
                 bad_words: BadWords | None = None, grammar: GrammarMatcher | None = None):
        """eos_token_ids: the model's, which min_tokens holds back (unless ignore_eos); bad_words: params.bad_words
        tokenized, grammar: params.structured_outputs' matcher (each required when the params have one)."""
        from fxllm.runtime.logits_adjustment import adjuster
        from fxllm.runtime.sampler import Sampler

        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.params = params
        self.stop_token_ids = frozenset(params.stop_token_ids)  # looked up after every token
        self.status = RequestStatus.WAITING
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.error: str | None = None
        self.metrics = RequestMetrics(arrival_time=time.monotonic())
        self.seq_id = seq_id  # the block manager's key
        self.num_computed_tokens = 0
        self.sampler = Sampler(params, 1)  # this request's own seeded stream
        self.grammar = grammar
        self.logits_adjuster = adjuster(params, self.prompt_token_ids, eos_token_ids, bad_words, grammar)
        self.final_only = params.output_kind == "final"
        skip_special = params.skip_special_tokens
        self.detokenizer = (FinalDetokenizer(tokenizer, skip_special_tokens=skip_special)
                            if self.final_only and not params.stop
                            else IncrementalDetokenizer(tokenizer, list(params.stop),
                                                        include_stop=params.include_stop_str_in_output,
                                                        min_tokens=params.min_tokens, skip_special_tokens=skip_special))
        self.pending_logprobs: list[TokenLogprobs] = []  # a final-only request's, until its one output
        self.prompt_logprobs: list[TokenLogprobs | None] | None = None if params.prompt_logprobs is None else [None]
        self.prompt_logprobs_sent = False
        # Speculative decoding on the paged cache: the draft's proposals for the next round (None: none yet) and,
        # when sampling, the distributions they were drawn from ([n, V]).
        self.spec_token_ids: list[int] | None = None
        self.spec_probs = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    @property
    def needs_prompt_logits(self) -> bool:
        """Whether its prefill must return every prompt position's logits (prompt_logprobs not computed yet)."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_token_ids)

    @property
    def text(self) -> str:
        """The generated text so far (cut before a stop string; a final-only request without stop strings: empty
        until it finishes)."""
        return self.detokenizer.text

    def sampling_logits(self, logits, drafts: list[int] | tuple[int, ...] = ()):
        """The logits [n, V] this request samples from (logit_bias and penalties applied; the same array when its
        params have none): row i comes after its output so far and drafts[:i]."""
        if self.logits_adjuster is None:
            return logits
        return self.logits_adjuster(logits, self.output_token_ids, drafts)

    @property
    def starved(self) -> bool:
        """Whether bad_words left the next token nothing to be sampled from (with allowed_token_ids, min_tokens, or
        on a small vocabulary): the request then ends (finish_starved) instead of taking the token sampled from the
        unmasked row."""
        adjuster = self.logits_adjuster
        return adjuster is not None and len(self.output_token_ids) in adjuster.exhausted

    def finish_starved(self) -> str:
        """End the request where bad_words left nothing: "stop", stop_reason "bad_words", the text so far kept."""
        self.finish_reason, self.stop_reason = "stop", "bad_words"
        return self.detokenizer.finish()

    def append_token(self, token: int, eos_token_ids: Iterable[int]) -> str:
        """Record a sampled token; returns the text that became final. Sets finish_reason when the token ends the
        request (EOS or stop token, a stop string, max_tokens); the caller then finishes it."""
        if self.grammar is not None:
            self.grammar.check_position(len(self.output_token_ids))
        self.output_token_ids.append(token)
        params = self.params
        if (token in eos_token_ids and not params.ignore_eos) or token in self.stop_token_ids:
            self.finish_reason, self.stop_reason = "stop", token
            return self.detokenizer.finish()
        if self.grammar is not None:
            self.grammar.accept(token)
        delta = self.detokenizer.add(token)
        if self.detokenizer.stopped:
            self.finish_reason, self.stop_reason = "stop", self.detokenizer.stop_string
        elif self.grammar is not None and self.grammar.done:  # the structure is complete
            self.finish_reason = "stop"
        elif len(self.output_token_ids) >= params.max_tokens:
            self.finish_reason = "length"
        return delta + self.detokenizer.finish() if self.finish_reason else delta

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {len(self.prompt_token_ids)} prompt + {len(self.output_token_ids)} "
                f"output tokens, {self.status.value})")

