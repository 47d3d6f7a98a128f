"""POST /v1/completions: a prompt (a string, a list of strings, a list of token ids, or a list of those) → `n`
choices per prompt, choice `prompt_index * n + i`, as one JSON body or as server-sent events.

`echo` puts the prompt in front of each choice's text (with `logprobs`, the prompt tokens' logprobs too; the first
prompt token has none). `max_tokens: 0` with `echo` scores the prompt without generating (the legacy API's way,
which lm-evaluation-harness uses for log-likelihoods): the engine samples the one token a prefill gives, and the
response leaves it out. `usage` counts each prompt once and every choice's generated tokens.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fxllm.serving.errors import APIError
from fxllm.serving.logprobs import TextOffsets, TokenTexts, completion_logprobs, extend, first_prompt_position
from fxllm.serving.protocol import CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse, Usage
from fxllm.serving.run import GenerationRun
from fxllm.serving.sampling import check_supported, choices_per_prompt, field_names, max_new_tokens, sampling_params
from fxllm.serving.service import Choice, OpenAIService
from fxllm.serving.streaming import EventStream, event, respond


@dataclass
class Prompt:
    text: str | None  # a text prompt (None: token ids, which echo decodes once the engine has checked them)
    token_ids: list[int]


@dataclass
class _ChoiceState:
    text: list[str] = field(default_factory=list)
    logprobs: CompletionLogprobs = field(default_factory=CompletionLogprobs)  # all positions so far
    offsets: TextOffsets = field(default_factory=TextOffsets)  # logprobs' text_offset: characters so far
    started: bool = False
    finish_reason: str | None = None
    output_tokens: int = 0


async def create_completion(service: OpenAIService, request: CompletionRequest) -> CompletionResponse | EventStream:
    service.check_model(request.model)
    check_supported(request)
    n = choices_per_prompt(request.n)
    fields = field_names(request)
    # before tokenizing: a huge list, or a full server
    service.check_room(prompt_count(request.prompt) * n, param="n" if n > 1 else "prompt")
    scoring = request.max_tokens == 0
    if scoring and not request.echo:
        raise APIError(400, "max_tokens 0 generates nothing; with echo (and logprobs) it returns the prompt and its "
                            "logprobs, which scores a prompt", param="max_tokens")
    prompts = await read_prompts(service, request.prompt)
    top = request.logprobs
    choices = []
    for p, prompt in enumerate(prompts):
        limit = 1 if scoring else max_new_tokens(request.max_tokens, len(prompt.token_ids),
                                                   service.max_sequence_tokens)
        params = sampling_params(request, n, limit, logprobs=top, prompt_logprobs=top if request.echo else None,
                                 fields=fields)
        name = f"prompt[{p}]" if len(prompts) > 1 else ""
        choices += [Choice(p * n + i, prompt.token_ids, params[i], name) for i in range(n)]
    writer = CompletionWriter(service, request, prompts, n, f"cmpl-{uuid.uuid4().hex}")
    await service.prepare(choices, fields)
    return await respond(writer, service.start(choices, writer.id, fields), bool(request.stream))


def prompt_count(prompt) -> int:
    """How many prompts `prompt` holds (one string, one list of token ids, or a list of either)."""
    if isinstance(prompt, str) or not prompt or all(isinstance(item, int) for item in prompt):
        return 1
    return len(prompt)


async def read_prompts(service: OpenAIService, prompt) -> list[Prompt]:
    """The request's prompts, tokenized or checked against the vocabulary (400 naming the one at fault)."""
    if isinstance(prompt, str):
        return [Prompt(prompt, await service.encode(prompt))]
    if not prompt:
        raise APIError(400, "prompt must not be empty", param="prompt")
    if all(isinstance(item, int) for item in prompt):
        return [Prompt(None, list(prompt))]
    if all(isinstance(item, str) for item in prompt):
        prompts = [Prompt(text, await service.encode(text)) for text in prompt]
    else:
        prompts = [Prompt(None, service.token_ids(f"prompt[{p}]", ids)) for p, ids in enumerate(prompt)]
    for p, each in enumerate(prompts):
        if not each.token_ids:  # named here: the engine's own refusal cannot say which prompt of the list it was
            raise APIError(400, f"prompt[{p}] is empty (no tokens)", param="prompt")
    return prompts


class CompletionWriter:
    """Builds the response (or its chunks) from the merged outputs of a request's choices."""

    def __init__(self, service: OpenAIService, request: CompletionRequest, prompts: list[Prompt], n: int,
                 response_id: str):
        self.service, self.request, self.prompts, self.n = service, request, prompts, n
        self.id, self.created = response_id, int(time.time())
        self.texts: TokenTexts = service.token_texts
        self.states = [_ChoiceState() for _ in range(len(prompts) * n)]
        self.scoring = request.max_tokens == 0  # echo only: the one token generated is left out

    def add(self, index: int, output) -> tuple[str, CompletionLogprobs | None]:
        """Record one output of choice `index`; returns its new text and logprobs."""
        state = self.states[index]
        text, logprobs = ("" if self.scoring else output.text_delta), None
        if not state.started:
            state.started = True
            if self.request.echo:
                prompt = self.prompts[index // self.n]
                if prompt.text is None:
                    prompt.text = self.service.tokenizer.decode(prompt.token_ids, skip_special_tokens=False)
                text = prompt.text + text
                if self.request.logprobs is not None and output.prompt_logprobs is not None:
                    in_prompt = TextOffsets()
                    first = first_prompt_position(self.texts, prompt.token_ids[0], in_prompt)
                    rest = completion_logprobs(self.texts, output.prompt_logprobs[1:], in_prompt, generated=False)
                    logprobs = extend(first, rest)
                state.offsets = TextOffsets(len(prompt.text))
        if output.logprobs is not None and not self.scoring:
            generated = completion_logprobs(self.texts, output.logprobs, state.offsets)
            logprobs = generated if logprobs is None else extend(logprobs, generated)
        state.text.append(text)
        if logprobs is not None:
            extend(state.logprobs, logprobs)
        if output.finished:
            state.finish_reason, state.output_tokens = output.finish_reason, output.num_output_tokens
            if self.scoring:
                state.finish_reason, state.output_tokens = "length", 0
        return text, logprobs

    def usage(self) -> Usage:
        prompt_tokens = sum(len(p.token_ids) for p in self.prompts)
        completion_tokens = sum(s.output_tokens for s in self.states)
        return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens)

    def response(self) -> CompletionResponse:
        choices = [CompletionChoice(index=i, text="".join(s.text), finish_reason=s.finish_reason,
                                    logprobs=s.logprobs if self.request.logprobs is not None else None)
                   for i, s in enumerate(self.states)]
        return CompletionResponse(id=self.id, created=self.created, model=self.request.model, choices=choices,
                                  usage=self.usage())

    async def events(self, run: GenerationRun) -> AsyncIterator[str]:
        include_usage = bool(self.request.stream_options and self.request.stream_options.include_usage)
        async for index, output in run:
            text, logprobs = self.add(index, output)
            if text or logprobs is not None or output.finished:
                choice = {"index": index, "text": text,
                          "logprobs": None if logprobs is None else logprobs.model_dump(),
                          "finish_reason": self.states[index].finish_reason if output.finished else None}
                yield event(self._chunk([choice], include_usage))
        if include_usage:
            yield event({**self._chunk([], False), "usage": self.usage().model_dump()})

    def _chunk(self, choices: list[dict], include_usage: bool) -> dict:
        chunk = {"id": self.id, "object": "text_completion", "created": self.created, "model": self.request.model,
                 "choices": choices}
        if include_usage:
            chunk["usage"] = None
        return chunk
