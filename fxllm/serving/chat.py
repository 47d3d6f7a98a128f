"""POST /v1/chat/completions: `messages` through the artifact's chat template (as Engine.generate(chat=True)
renders a conversation) → `n` assistant messages, as one JSON body or as server-sent events (a first chunk per
choice with the role, content deltas, a last chunk per choice with the finish reason).

Message content is a string or a list of text parts (joined with newlines; a part of another type, such as an image,
is refused naming it); a `developer` message is given to the template as `system` (templates written before that
role know only `system`). `max_completion_tokens` (or its deprecated alias `max_tokens`) defaults to what the context
leaves after the prompt.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fxllm.errors import GenerationError
from fxllm.runtime.chat_template import RENDERER_VARIABLES, plain_json
from fxllm.runtime.request import MAX_LOGPROBS
from fxllm.serving.errors import APIError
from fxllm.serving.logprobs import chat_logprobs
from fxllm.serving.protocol import (AssistantMessage, ChatChoice, ChatCompletionRequest, ChatCompletionResponse,
                                    ChatMessage, ChoiceLogprobs, ContentPart, TokenLogprob, Usage)
from fxllm.serving.run import GenerationRun
from fxllm.serving.sampling import (check_supported, choices_per_prompt, field_names, max_new_tokens,
                                    sampling_params)
from fxllm.serving.service import Choice, OpenAIService
from fxllm.serving.streaming import EventStream, event, respond


@dataclass
class _ChoiceState:
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    output_tokens: int = 0


async def create_chat_completion(service: OpenAIService,
                                 request: ChatCompletionRequest) -> ChatCompletionResponse | EventStream:
    service.check_model(request.model)
    check_supported(request)
    n = choices_per_prompt(request.n)
    if request.top_logprobs is not None and not request.logprobs:
        raise APIError(400, "top_logprobs needs logprobs set to true", param="top_logprobs")
    if request.top_logprobs is not None and not 0 <= request.top_logprobs <= MAX_LOGPROBS:
        raise APIError(400, f"top_logprobs must be between 0 and {MAX_LOGPROBS}, got {request.top_logprobs}",
                       param="top_logprobs")
    top = (request.top_logprobs or 0) if request.logprobs else None
    variables = template_variables(request.chat_template_kwargs)
    service.check_room(n)  # before the template renders
    prompt_ids = await service.encode_chat(template_messages(request.messages), variables)
    requested = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
    # the engine's max_tokens is whichever field the client set
    fields = field_names(request, {"max_tokens": "max_completion_tokens"}
                         if request.max_completion_tokens is not None else None)
    params = sampling_params(request, n, max_new_tokens(requested, len(prompt_ids), service.max_sequence_tokens),
                             logprobs=top, fields=fields)
    writer = ChatWriter(service, request, len(prompt_ids), n, f"chatcmpl-{uuid.uuid4().hex}")
    choices = [Choice(i, prompt_ids, params[i]) for i in range(n)]
    await service.prepare(choices, fields)
    try:
        run = service.start(choices, writer.id, fields)
    except APIError as exc:
        if exc.param == "prompt":  # the engine's name for the rendered conversation: what the client sent is messages
            exc.param = "messages"
        raise
    return await respond(writer, run, bool(request.stream))


PASSED_ON = ("name", "tool_calls", "tool_call_id")  # message fields given to the template as sent, when set


def template_messages(messages: list[ChatMessage]) -> list[dict]:
    """The conversation as the plain dicts a chat template reads, PASSED_ON fields included (a template that renders
    an assistant's tool calls and the tool results' call ids gets them); an empty conversation is refused by the
    template's renderer."""
    plain = []
    for index, message in enumerate(messages):
        item = {"role": "system" if message.role == "developer" else message.role}
        content = message.content
        if isinstance(content, list):
            content = "\n".join(part_text(f"messages.{index}.content.{j}", part) for j, part in enumerate(content))
        item["content"] = "" if content is None else content
        for key in PASSED_ON:
            if getattr(message, key) is not None:
                item[key] = getattr(message, key)
        plain.append(item)
    return plain


# Names a template variable cannot have: what the renderer sets itself (runtime/chat_template.RENDERER_VARIABLES)
# and `chat_template`, which would pick the template: a client does not get to send the code the server runs.
RENDER_ARGUMENTS = (*RENDERER_VARIABLES, "chat_template")


def template_variables(kwargs: dict | None) -> dict:
    """A request's chat_template_kwargs: variables the template sees besides the conversation (as vLLM takes them:
    `enable_thinking` and the like); 400 for a name in RENDER_ARGUMENTS or a value nested too deeply."""
    taken = sorted(set(kwargs or ()) & set(RENDER_ARGUMENTS))
    if taken:
        raise APIError(400, f"chat_template_kwargs cannot set {', '.join(taken)}", param="chat_template_kwargs")
    try:
        return plain_json(dict(kwargs or {}))  # what the renderer would refuse, refused here naming this field
    except GenerationError as exc:
        raise APIError(400, str(exc), param="chat_template_kwargs") from None


def part_text(where: str, part: ContentPart) -> str:
    """The text of a content part at `where` (`messages.0.content.1`); 400 naming a part of another type (an image
    cannot be given to a text model), 400 for a text part without its text."""
    if part.type != "text":
        shown = part.type if len(part.type) <= MAX_TYPE_SHOWN else part.type[:MAX_TYPE_SHOWN] + "..."
        raise APIError(400, f"{where} is a content part of type '{shown}'; this server takes text only (parts of "
                            "type 'text')", param=f"{where}.type")
    if part.text is None:
        raise APIError(400, f"missing required parameter '{where}.text'", param=f"{where}.text")
    return part.text


MAX_TYPE_SHOWN = 40  # characters of an unknown part type that its error repeats


class ChatWriter:
    """Builds the response (or its chunks) from the merged outputs of a request's choices."""

    def __init__(self, service: OpenAIService, request: ChatCompletionRequest, prompt_tokens: int, n: int,
                 response_id: str):
        self.service, self.request, self.prompt_tokens = service, request, prompt_tokens
        self.id, self.created = response_id, int(time.time())
        self.states = [_ChoiceState() for _ in range(n)]

    def add(self, index: int, output) -> list[TokenLogprob] | None:
        """Record one output of choice `index`; returns its logprobs (OpenAI shape) if requested."""
        state = self.states[index]
        state.text.append(output.text_delta)
        logprobs = None
        if output.logprobs is not None:
            logprobs = chat_logprobs(self.service.token_texts, output.logprobs)
            state.logprobs += logprobs
        if output.finished:
            state.finish_reason, state.output_tokens = output.finish_reason, output.num_output_tokens
        return logprobs

    def usage(self) -> Usage:
        completion_tokens = sum(s.output_tokens for s in self.states)
        return Usage(prompt_tokens=self.prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=self.prompt_tokens + completion_tokens)

    def response(self) -> ChatCompletionResponse:
        choices = [ChatChoice(index=i, message=AssistantMessage(content="".join(s.text)),
                              logprobs=ChoiceLogprobs(content=s.logprobs) if self.request.logprobs else None,
                              finish_reason=s.finish_reason)
                   for i, s in enumerate(self.states)]
        return ChatCompletionResponse(id=self.id, created=self.created, model=self.request.model, choices=choices,
                                      usage=self.usage())

    async def events(self, run: GenerationRun) -> AsyncIterator[str]:
        include_usage = bool(self.request.stream_options and self.request.stream_options.include_usage)
        for index in range(len(self.states)):
            yield event(self._chunk(index, {"role": "assistant", "content": ""}, None, None, include_usage))
        async for index, output in run:
            logprobs = self.add(index, output)
            if output.text_delta or logprobs:
                yield event(self._chunk(index, {"content": output.text_delta}, logprobs, None, include_usage))
            if output.finished:
                yield event(self._chunk(index, {}, None, output.finish_reason, include_usage))
        if include_usage:
            yield event({"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                         "model": self.request.model, "choices": [], "usage": self.usage().model_dump()})

    def _chunk(self, index: int, delta: dict, logprobs: list[TokenLogprob] | None, finish_reason: str | None,
               include_usage: bool) -> dict:
        choice = {"index": index, "delta": delta, "finish_reason": finish_reason,
                  "logprobs": None if logprobs is None else {"content": [p.model_dump() for p in logprobs]}}
        chunk = {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                 "model": self.request.model, "choices": [choice]}
        if include_usage:
            chunk["usage"] = None
        return chunk
