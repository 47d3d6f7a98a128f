"""The served model behind the HTTP routes: one AsyncEngine (one engine core), the names it answers to, admission
(--max-queue), tokenization and the per-service metrics. The routes (app.py) get it from an injected provider, so
`fxllm serve` and a Ray Serve replica (#13) each own one and share the route code.

Admission counts engine requests (an HTTP request with `n` choices over `P` prompts is n × P of them): at most
`max_batch + max_queue` are admitted at once; more get 429 while that many are unfinished, and an HTTP request
that alone asks for more than that gets 400 (retrying would not help).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from functools import partial

from fxllm.errors import GenerationError
from fxllm.runtime import checks
from fxllm.runtime.async_engine import AsyncEngine
from fxllm.runtime.request import SamplingParams
from fxllm.runtime.request_validation import check_token_ids, check_tokenized, encode_within_context
from fxllm.serving.errors import APIError, bad_request, not_accepting
from fxllm.serving.logprobs import TokenTexts
from fxllm.serving.metrics import ServingMetrics
from fxllm.serving.protocol import ModelCard
from fxllm.serving.run import GenerationRun

MAX_CHOICES = 128  # most choices (`n`) per request, as the OpenAI API allows


@dataclass(frozen=True)
class ServingConfig:
    """model_names: the names requests may use (the first is the one reported); max_queue: engine requests that
    may wait for a batch slot beyond `max_batch` (None: no limit)."""

    model_names: tuple[str, ...]
    max_queue: int | None = 256

    def __post_init__(self) -> None:
        if not self.model_names or not all(isinstance(n, str) and n for n in self.model_names):
            raise GenerationError("the served model needs at least one non-empty name")
        if self.max_queue is not None and (isinstance(self.max_queue, bool) or not isinstance(self.max_queue, int)
                                           or self.max_queue < 0):
            raise GenerationError(f"max_queue must be an integer >= 0, got {self.max_queue!r}")


@dataclass(frozen=True)
class Choice:
    """One engine request of an HTTP request: choice `index` of the response. `prompt_name` (`prompt[2]`) names its
    prompt among several in the errors about it."""

    index: int
    prompt_ids: list[int]
    params: SamplingParams
    prompt_name: str = ""


MAX_NAME_SHOWN = 100  # characters of an unknown model name that its 404 repeats


def check_model_name(served: tuple[str, ...], name: str) -> None:
    """404 unless `name` is one of the served names."""
    if name not in served:
        shown = name if len(name) <= MAX_NAME_SHOWN else name[:MAX_NAME_SHOWN] + "..."
        raise APIError(404, f"the model '{shown}' does not exist; this server serves "
                            f"{', '.join(repr(n) for n in served)}", param="model", code="model_not_found")


class OpenAIService:
    def __init__(self, engine: AsyncEngine, config: ServingConfig, metric_labels: dict[str, str] | None = None):
        self.engine = engine
        self.config = config
        self.core = engine.engine.core
        self.tokenizer = engine.engine.tokenizer
        self.max_context: int = engine.engine.max_context
        # the most tokens one sequence can hold: what a request without max_tokens may fill (a KV pool or budget
        # smaller than the context would refuse a default of "the rest of the context")
        self.max_sequence_tokens: int = min(self.max_context, engine.engine.capacity_tokens())
        self.max_batch: int = engine.engine.max_batch
        self.created = int(time.time())
        labels = {"model_name": self.model_id} if metric_labels is None else metric_labels
        self.metrics = ServingMetrics(engine.stats, labels)
        self.token_texts = TokenTexts(self.tokenizer)
        self._admitted = 0

    @property
    def model_id(self) -> str:
        return self.config.model_names[0]

    @property
    def model_names(self) -> tuple[str, ...]:
        return self.config.model_names

    # -- what the routes call (app.py) --------------------------------------------------------------------------------

    async def completion(self, request):
        from fxllm.serving.completions import create_completion  # (those modules build on this one)

        return await create_completion(self, request)

    async def chat_completion(self, request):
        from fxllm.serving.chat import create_chat_completion

        return await create_chat_completion(self, request)

    async def card(self, name: str) -> ModelCard:
        return ModelCard(id=name, created=self.created, max_model_len=self.max_sequence_tokens)

    async def health(self) -> str:
        return "ok" if self.engine.accepting else "shutting down"

    async def render_metrics(self) -> tuple[bytes, str]:
        return self.metrics.render()

    # -- checks -------------------------------------------------------------------------------------------------------

    def check_model(self, name: str) -> None:
        check_model_name(self.config.model_names, name)

    def check_accepting(self) -> None:
        if not self.engine.accepting:
            raise not_accepting()

    def stop_accepting(self) -> None:
        """From now on new requests get 503 and /health says "shutting down"; running requests go on."""
        self.engine.driver.accepting = False

    def check_choice(self, choice: Choice, fields: Mapping[str, str] | None = None) -> None:
        """The engine core's own checks of a request (400 with its one-line message, `param` from an
        InvalidArgumentError, renamed by `fields` as bad_request does), made before anything starts, so that a bad
        choice refuses the whole HTTP request."""
        try:
            self.core.check(choice.prompt_ids, choice.params)
        except GenerationError as exc:
            error = bad_request(exc, fields)
            if choice.prompt_name:
                error = APIError(error.status, f"{choice.prompt_name}: {error.message}", error.param, error.code)
            raise error from None

    def token_ids(self, name: str, ids: list[int]) -> list[int]:
        """One token-id prompt, checked against the vocabulary under its own name (`prompt[2]`): 400 if bad."""
        try:
            return check_token_ids(name, ids, self.core.vocab_size, param="prompt")
        except GenerationError as exc:
            raise bad_request(exc) from None

    # -- tokenization -------------------------------------------------------------------------------------------------

    # Both run on a worker thread: a prompt near the body size limit takes seconds to tokenize, and the event loop
    # must go on streaming the other requests meanwhile (the tokenizer releases the GIL while it works).

    async def encode(self, text: str) -> list[int]:
        """A completion prompt's token ids, as Engine.generate tokenizes it."""
        try:
            return await asyncio.to_thread(self.core.encode, text)
        except GenerationError as exc:
            raise bad_request(exc) from None

    async def encode_chat(self, messages: list[dict], variables: Mapping[str, object] | None = None) -> list[int]:
        """A conversation through the model's chat template, as Engine.generate(chat=True) tokenizes it; `variables`:
        extra names the template sees (a request's chat_template_kwargs)."""
        try:
            return await asyncio.to_thread(self._encode_chat, messages, dict(variables or {}))
        except GenerationError as exc:
            raise APIError(400, str(exc), param="messages") from None

    def _encode_chat(self, messages: list[dict], variables: dict[str, object]) -> list[int]:
        for where, value in _strings(messages, "messages"):  # named where the client wrote it, not in the render
            checks.text(where, value, param="messages")
        rendered = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, **variables)
        text = checks.text("messages", rendered)
        ids = encode_within_context(partial(self.tokenizer.encode, add_special_tokens=False), text,
                                    self.core.max_context, param="messages")
        return check_tokenized(ids, self.core.vocab_size, param="messages")

    # -- admission ----------------------------------------------------------------------------------------------------

    @property
    def capacity(self) -> int | None:
        return None if self.config.max_queue is None else self.max_batch + self.config.max_queue

    def check_room(self, count: int, param: str = "n") -> None:
        """Before a request's prompt is tokenized or rendered (seconds of CPU for a large one): 400 when it alone
        asks for more engine requests than the server ever admits at once (`param`: what the client asked too many
        of), 429 while the server has no room for them now (`admit` checks again once the prompt is ready)."""
        capacity = self.capacity
        if capacity is not None and count > capacity:
            raise APIError(400, f"this request asks for {count} completions at once; the server runs at most "
                                f"{capacity} (max_batch {self.max_batch} + max_queue {self.config.max_queue})",
                           param=param)
        self._check_not_busy(count)

    def admit(self, count: int) -> None:
        """Count `count` engine requests in, or 429 while the server has too many unfinished."""
        self._check_not_busy(count)
        self._admitted += count
        self.metrics.admitted.set(self._admitted)

    def _check_not_busy(self, count: int) -> None:
        capacity = self.capacity
        if capacity is not None and self._admitted + count > capacity:
            raise APIError(429, f"the server is busy: {self._admitted} requests are running or queued, at most "
                                f"{capacity}; retry later", code="queue_full")

    def release(self, count: int = 1) -> None:
        self._admitted -= count
        self.metrics.admitted.set(self._admitted)

    @property
    def admitted(self) -> int:
        return self._admitted

    async def prepare(self, choices: list[Choice], fields: Mapping[str, str] | None = None) -> None:
        """The slow part of the checks, on a worker thread: the choices' bad_words tokenized and structure compiled
        (the core caches both, so start's checks on the event loop find them ready; 256 words of 256 rare
        characters took ~1 s of the loop). A refusal is a 400 as check_choice's."""
        work = {(choice.params.bad_words, choice.params.structured_outputs) for choice in choices}

        def run() -> None:
            for words, structure in work:
                self.core.tokenized_bad_words(words)
                if structure is not None:
                    self.core.grammars.compile(structure)

        try:
            await asyncio.to_thread(run)
        except GenerationError as exc:
            raise bad_request(exc, fields) from None

    def start(self, choices: list[Choice], request_id: str, fields: Mapping[str, str] | None = None) -> GenerationRun:
        """Check every choice (a bad one refuses them all: 400; `fields` as check_choice), admit them together (429)
        and start them; returns the running GenerationRun."""
        self.check_accepting()
        self.check_room(len(choices))
        for choice in choices:
            self.check_choice(choice, fields)
        self.admit(len(choices))
        return GenerationRun(self, choices, request_id)


def _strings(value: object, where: str) -> Iterator[tuple[str, str]]:
    """Every string inside a JSON value, with where it is (`messages.0.content`, as the request's other errors say)."""
    if isinstance(value, str):
        yield where, value
    elif isinstance(value, Mapping):
        for key, item in value.items():
            yield from _strings(item, f"{where}.{key}")
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _strings(item, f"{where}.{index}")
