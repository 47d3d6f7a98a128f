"""OpenAI request fields → the engine's SamplingParams, one per choice. Values are checked by SamplingParams and the
engine core themselves (their one-line messages become 400s); this module checks only what exists over HTTP alone
(`n`, the fields fxllm does not implement).

Seeds: choice i of a request samples with `seed + i`, so the n choices differ from each other and the same request
with the same seed gives the same choices again. Without a seed every choice samples from fresh entropy.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fxllm.errors import GenerationError
from fxllm.runtime.checks import short, token_id_text
from fxllm.runtime.request import ADJUSTMENT_FIELDS, MAX_LOGIT_BIAS, SamplingParams
from fxllm.serving.errors import APIError, bad_request
from fxllm.serving.protocol import ChatCompletionRequest, CompletionRequest
from fxllm.serving.service import MAX_CHOICES


# vLLM's extensions fxllm does not implement (protocol._VllmExtensions) → the values that change nothing (besides
# null); any other value is refused.
VLLM_DEFAULTS = {"use_beam_search": (False,), "guided_whitespace_pattern": ()}
# where a request may ask for a structure (at most one of them): OpenAI's field, then vLLM's
STRUCTURED_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                     "structured_outputs")
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def check_supported(request: CompletionRequest | ChatCompletionRequest) -> None:
    """Refuse (400, naming the field) the reference's fields (deprecated ones too: `functions`) and vLLM's extensions
    that fxllm does not implement, unless at their defaults, and `stream_options` without `stream` (as OpenAI does)."""
    for name, defaults in VLLM_DEFAULTS.items():
        value = getattr(request, name)
        if value is not None and not any(_same_json(value, d) for d in defaults):
            raise APIError(400, f"{name} (a vLLM extension) is not supported by fxllm", param=name)
    if request.stream_options is not None and not request.stream:
        raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options")
    if request.stream_options is not None and request.stream_options.continuous_usage_stats:
        # chunks would carry `usage: null` where the client expects counts
        raise APIError(400, "stream_options.continuous_usage_stats (a vLLM extension) is not supported by fxllm",
                       param="stream_options.continuous_usage_stats")
    if isinstance(request, CompletionRequest):
        if request.suffix:
            raise APIError(400, "suffix is not supported by fxllm", param="suffix")
        if request.best_of is not None and request.best_of != (request.n or 1):
            raise APIError(400, "best_of is not supported by fxllm; leave it unset (or equal to n)", param="best_of")
        return
    if request.tools:
        raise APIError(400, "tools are not supported by fxllm's server", param="tools")
    if request.tool_choice not in (None, "none"):
        raise APIError(400, "tool_choice is not supported by fxllm's server (it serves no tools); leave it unset or "
                            "'none'", param="tool_choice")
    if request.functions or request.function_call not in (None, "none"):
        param = "functions" if request.functions else "function_call"
        raise APIError(400, f"{param} (the deprecated form of tools) is not supported by fxllm's server", param=param)
    if request.modalities not in (None, [], ["text"]):
        raise APIError(400, "modalities other than ['text'] are not supported by fxllm", param="modalities")
    if request.audio is not None:
        raise APIError(400, "audio output is not supported by fxllm", param="audio")


def _same_json(a, b) -> bool:
    """Equal as JSON values: 0 and 0.0 alike, but `true` is not 1."""
    return a == b and isinstance(a, bool) == isinstance(b, bool)


def choices_per_prompt(n: int | None) -> int:
    n = 1 if n is None else n
    if not 1 <= n <= MAX_CHOICES:
        raise APIError(400, f"n must be between 1 and {MAX_CHOICES}, got {n}", param="n")
    return n


def sampling_params(request: CompletionRequest | ChatCompletionRequest, n: int, max_tokens: int,
                    logprobs: int | None = None, prompt_logprobs: int | None = None,
                    fields: Mapping[str, str] | None = None) -> list[SamplingParams]:
    """The n choices' SamplingParams for one prompt (a refusal names the request's `fields`, as bad_request)."""
    top_k = 0 if request.top_k in (None, -1) else request.top_k
    stop = () if request.stop is None else request.stop
    adjustments = {name: value for name in ADJUSTMENT_FIELDS if (value := getattr(request, name)) is not None}
    adjustments["structured_outputs"], _ = structure(request)
    try:
        adjustments["logit_bias"] = _logit_bias(request.logit_bias)  # its keys are strings in JSON
        first = SamplingParams(temperature=1.0 if request.temperature is None else request.temperature,
                               top_k=top_k, top_p=1.0 if request.top_p is None else request.top_p,
                               seed=request.seed, max_tokens=max_tokens, stop=stop, logprobs=logprobs,
                               prompt_logprobs=prompt_logprobs, **adjustments)
        return [first] + [first.with_seed(None if request.seed is None else request.seed + i) for i in range(1, n)]
    except GenerationError as exc:
        raise bad_request(exc, fields) from None


def field_names(request: CompletionRequest | ChatCompletionRequest,
                fields: Mapping[str, str] | None = None) -> Mapping[str, str] | None:
    """`fields` (the request's own names of engine arguments, for bad_request) with the structured-output field the
    request used, if any, as the name of the engine's `structured_outputs`."""
    _, field = structure(request)
    return fields if field is None else {**(fields or {}), "structured_outputs": field}


def structure(request: CompletionRequest | ChatCompletionRequest) -> tuple[dict | None, str | None]:
    """The structure the request asks for, as StructuredOutputsParams' fields (checked there), and the request field
    it came from; (None, None) for free text. Two fields asking for one are a 400."""
    given = [name for name in STRUCTURED_FIELDS if getattr(request, name) is not None
             and not (name == "response_format" and request.response_format.get("type") == "text")]
    if len(given) > 1:
        raise APIError(400, f"{given[0]} and {given[1]} both ask for a structured output; give one", param=given[1])
    if not given:
        return None, None
    name = given[0]
    value = getattr(request, name)
    if name in GUIDED:
        return {GUIDED[name]: value}, name
    if name == "structured_outputs":
        return value, name
    kind = value.get("type")
    if kind == "json_object":
        return {"json_object": True}, name
    if kind == "json_schema":
        schema = value.get("json_schema")
        if not isinstance(schema, dict) or not isinstance(schema.get("schema"), dict):
            raise APIError(400, "response_format of type json_schema needs json_schema.schema, a JSON schema object",
                           param="response_format")
        return {"json": schema["schema"]}, name
    raise APIError(400, f"response_format.type must be text, json_object or json_schema, got {short(kind)}",
                   param="response_format")


def _logit_bias(bias: dict[str, Any] | None) -> dict[int, Any]:
    """The request's {"token id": bias} with int keys (the values are checked by SamplingParams)."""
    if not bias:
        return {}
    if len(bias) > MAX_LOGIT_BIAS:
        raise APIError(400, f"logit_bias holds {len(bias):,} entries; at most {MAX_LOGIT_BIAS}", param="logit_bias")
    ids = {key: token_id_text(key) for key in bias}
    bad = next((key for key, token in ids.items() if token is None), None)
    if bad is not None:
        raise APIError(400, f"logit_bias keys must be token ids (non-negative integers, as strings), got {short(bad)}",
                       param="logit_bias")
    return {ids[key]: value for key, value in bias.items()}


def max_new_tokens(requested: int | None, prompt_length: int, max_sequence_tokens: int) -> int:
    """The request's max_tokens, or what one sequence's room (the context, or a smaller KV pool) leaves after the
    prompt (at least 1, so that a prompt with no room gets the engine's own message)."""
    return max(max_sequence_tokens - prompt_length, 1) if requested is None else requested
