"""Request and response bodies of the OpenAI API, as pydantic models (the server's OpenAPI schema is built from them).

Field names, types and defaults follow the OpenAI API reference (completions, chat completions, models, errors).
The schema states types only: a value of the right type that the engine refuses (a negative temperature, a prompt
longer than the context) is answered 400 with the engine's own one-line message, a value of the wrong type 422.
Unknown request fields are ignored (as vLLM does); fields of the reference that fxllm does not implement are
accepted at their defaults and refused (400, naming the field) otherwise. Extensions (as vLLM spells them): `top_k`
(0 or -1: no limit) and `ignore_eos`.
"""

from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field


class _Request(BaseModel):
    # strict: `true` is not the integer 1 nor "yes" a boolean (an integer is still a number); a wrong type is a 422
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Request):
    include_usage: Optional[bool] = False  # a last chunk with `usage` (and no choices) before [DONE]


class _SamplingFields(_Request):
    """What both endpoints take."""

    model: str
    temperature: Optional[float] = 1.0
    top_p: Optional[float] = 1.0
    top_k: Optional[int] = Field(None, description="extension: sample from the K most likely tokens (0 or -1: all)")
    ignore_eos: Optional[bool] = Field(False, description="extension: do not stop at the model's end-of-sequence "
                                                          "tokens (benchmarks)")
    n: Optional[int] = 1
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[int] = Field(None, description="choice i of a request samples with seed + i")
    frequency_penalty: Optional[float] = Field(0.0, description="not supported: must be 0")
    presence_penalty: Optional[float] = Field(0.0, description="not supported: must be 0")
    logit_bias: Optional[dict[str, float]] = Field(None, description="not supported: must be empty")
    user: Optional[str] = None


class CompletionRequest(_SamplingFields):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = 16
    logprobs: Optional[int] = Field(None, description="the logprobs of the N most likely tokens at each position")
    echo: Optional[bool] = False
    best_of: Optional[int] = Field(None, description="not supported: must be absent or equal to n")
    suffix: Optional[str] = Field(None, description="not supported")


class TextContentPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[str, list[TextContentPart]]] = None
    name: Optional[str] = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_tokens: Optional[int] = Field(None, description="deprecated alias of max_completion_tokens")
    max_completion_tokens: Optional[int] = Field(None, description="default: what the context leaves")
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = None
    tools: Optional[list[dict]] = Field(None, description="not supported")
    tool_choice: Optional[Union[str, dict]] = Field(None, description="not supported")
    response_format: Optional[dict] = Field(None, description="only {'type': 'text'}")


# -- responses --------------------------------------------------------------------------------------------------------


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = []
    token_logprobs: list[Optional[float]] = []
    tokens: list[str] = []
    top_logprobs: list[Optional[dict[str, float]]] = []


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[Literal["stop", "length"]] = None  # null in stream chunks before the last


class _Response(BaseModel):
    id: str
    created: int
    model: str
    system_fingerprint: Optional[str] = None
    usage: Optional[Usage] = None


class CompletionResponse(_Response):
    """A completion, and also each chunk of a streamed one (the reference uses the same object for both)."""

    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChoiceLogprobs(BaseModel):
    content: Optional[list[TokenLogprob]] = None
    refusal: Optional[list[TokenLogprob]] = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: Optional[str] = None
    refusal: Optional[str] = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: Optional[ChoiceLogprobs] = None
    finish_reason: Literal["stop", "length"]


class ChatCompletionResponse(_Response):
    """A chat completion (streamed: `chat.completion.chunk` objects with `delta`s, built in chat.py)."""

    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "fxllm"
    max_model_len: Optional[int] = Field(None, description="extension: the longest sequence served, in tokens "
                                                           "(the context, or a smaller KV pool's room)")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class Health(BaseModel):
    status: Literal["ok", "shutting down", "unavailable"]  # unavailable: no engine replica answers (Ray Serve)


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
