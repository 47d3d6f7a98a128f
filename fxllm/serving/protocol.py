"""Request and response bodies of the OpenAI API, as pydantic models (the server's OpenAPI schema is built from them).

Field names, types and defaults follow the OpenAI API reference (completions, chat completions, models, errors).
The schema states types only: a value of the right type that the engine refuses (a negative temperature, a prompt
longer than the context) is answered 400 with the engine's own one-line message, a value of the wrong type 400 too
(naming the field, as OpenAI and vLLM answer it; FastAPI's default would be 422).
Unknown request fields are ignored (as vLLM does); fields of the reference, and vLLM extensions, that fxllm does not
implement are accepted at their defaults and refused (400, naming the field) otherwise. Extensions (as vLLM spells
them): `top_k` (0 or -1: no limit), `min_p`, `repetition_penalty`, `min_tokens`, `stop_token_ids`,
`allowed_token_ids`, `include_stop_str_in_output`, `bad_words`, `skip_special_tokens`, `ignore_eos`, the structured
outputs `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` and `structured_outputs` (as OpenAI's
`response_format`, on both endpoints as vLLM takes it) and chat's `chat_template_kwargs`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field


class _Request(BaseModel):
    # strict: `true` is not the integer 1 nor "yes" a boolean (an integer is still a number); a wrong type is a 400
    model_config = ConfigDict(extra="ignore", strict=True)


class _FailFast:
    """`_FailFast[T]`: a list of T whose validation stops at its first bad item. A 4 MiB body holds a million items:
    an error for each (per member of a union: `prompt` has three list members) took pydantic and FastAPI ~20 s on
    the event loop, stalling every stream, and ~600 MB to report; the client only needs the first."""

    def __class_getitem__(cls, item):
        return Annotated[list[item], Field(fail_fast=True)]


class StreamOptions(_Request):
    include_usage: Optional[bool] = False  # a last chunk with `usage` (and no choices) before [DONE]
    continuous_usage_stats: Optional[bool] = Field(False, description="vLLM extension, not supported: false")


class _VllmExtensions(_Request):
    """vLLM's extensions that fxllm does not implement, declared (any type) so that a value other than their default
    is refused naming the field (400; sampling.check_supported) instead of being ignored as unknown fields are: a
    client asking for beam search must not get a sampled text as if it had been applied."""

    use_beam_search: Optional[Any] = Field(None, description="vLLM extension, not supported: false")
    guided_whitespace_pattern: Optional[Any] = Field(None, description="vLLM extension, not supported")


class _SamplingFields(_VllmExtensions):
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
    stop: Optional[Union[str, _FailFast[str]]] = None
    seed: Optional[int] = Field(None, description="choice i of a request samples with seed + i")
    frequency_penalty: Optional[float] = Field(0.0, description="-2 to 2: minus this times the token's count so far")
    presence_penalty: Optional[float] = Field(0.0, description="-2 to 2: minus this for a token already generated")
    # values checked by SamplingParams after the entry count: a type error for each of a million entries is slow
    logit_bias: Optional[dict[str, Any]] = Field(None, description="token id (a string) → bias in [-100, 100] added "
                                                                   "to its logit (at most 1024 entries)")
    min_p: Optional[float] = Field(None, description="vLLM extension: drop tokens less likely than min_p times the "
                                                     "most likely one (0: off)")
    repetition_penalty: Optional[float] = Field(None, description="vLLM extension: 0.01 to 100, 1 off; divides the "
                                                                  "positive logits of prompt and output tokens, "
                                                                  "multiplies the negative ones")
    min_tokens: Optional[int] = Field(None, description="vLLM extension: no EOS or stop token before this many tokens")
    stop_token_ids: Optional[_FailFast[int]] = Field(None, description="vLLM extension: token ids that end the "
                                                                       "output (at most 65,536)")
    allowed_token_ids: Optional[_FailFast[int]] = Field(None, description="vLLM extension: the only token ids that "
                                                                          "may be sampled (at most 65,536)")
    include_stop_str_in_output: Optional[bool] = Field(None, description="vLLM extension: the text ends after the "
                                                                         "stop string instead of before it")
    bad_words: Optional[_FailFast[str]] = Field(None, description="vLLM extension: words that may not be generated "
                                                                  "(at most 256, of at most 256 characters)")
    skip_special_tokens: Optional[bool] = Field(None, description="vLLM extension: false keeps special tokens' text "
                                                                  "in the output")
    # structured outputs (at most one of these): OpenAI's response_format, vLLM's guided_* and structured_outputs
    response_format: Optional[dict] = Field(None, description="{'type': 'text'}, {'type': 'json_object'} or "
                                                              "{'type': 'json_schema', 'json_schema': {'name': ..., "
                                                              "'schema': {...}}}")
    guided_json: Optional[Union[dict, str]] = Field(None, description="vLLM extension: a JSON schema the output "
                                                                      "follows")
    guided_regex: Optional[str] = Field(None, description="vLLM extension: a regular expression the output matches")
    guided_choice: Optional[_FailFast[str]] = Field(None, description="vLLM extension: the output is one of these")
    guided_grammar: Optional[str] = Field(None, description="vLLM extension: a Lark or GBNF grammar of the output")
    structured_outputs: Optional[dict] = Field(None, description="vLLM extension: one of json, regex, choice, "
                                                                 "grammar, json_object")
    user: Optional[str] = None


class CompletionRequest(_SamplingFields):
    prompt: Union[str, _FailFast[str], _FailFast[int], _FailFast[_FailFast[int]]]
    max_tokens: Optional[int] = 16
    logprobs: Optional[int] = Field(None, description="the logprobs of the N most likely tokens at each position")
    echo: Optional[bool] = False
    best_of: Optional[int] = Field(None, description="not supported: must be absent or equal to n")
    suffix: Optional[str] = Field(None, description="not supported")


class ContentPart(_Request):
    """A part of a message's content. Only `text` parts are served; a part of another type (`image_url`,
    `input_audio`, `file`) is refused naming its type (400), which the schema alone would answer as "content should
    be a valid string"."""

    type: str = Field(description="only 'text' is supported")
    text: Optional[str] = Field(None, description="required in a 'text' part")


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[str, _FailFast[ContentPart]]] = None
    name: Optional[str] = None
    # a conversation's history as the chat template reads it (tools themselves are not supported: see sampling.py)
    tool_calls: Optional[_FailFast[dict]] = Field(None, description="an assistant message's tool calls, as sent")
    tool_call_id: Optional[str] = Field(None, description="the call a tool message answers")


class ChatCompletionRequest(_SamplingFields):
    messages: _FailFast[ChatMessage]
    max_tokens: Optional[int] = Field(None, description="deprecated alias of max_completion_tokens")
    max_completion_tokens: Optional[int] = Field(None, description="default: what the context leaves")
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = None
    tools: Optional[_FailFast[dict]] = Field(None, description="not supported")
    tool_choice: Optional[Union[str, dict]] = Field(None, description="not supported")
    # the reference's deprecated forms of tools and tool_choice, and audio output: declared so that they are refused
    # (sampling.check_supported) rather than ignored, which would answer free text as if they had been applied
    functions: Optional[_FailFast[dict]] = Field(None, description="deprecated form of tools: not supported")
    function_call: Optional[Union[str, dict]] = Field(None, description="deprecated form of tool_choice: not "
                                                                        "supported")
    modalities: Optional[_FailFast[str]] = Field(None, description="only ['text']")
    audio: Optional[dict] = Field(None, description="audio output: not supported")
    chat_template_kwargs: Optional[dict] = Field(None, description="extension (vLLM's): more variables for the chat "
                                                                   "template, e.g. {'enable_thinking': false}")


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
