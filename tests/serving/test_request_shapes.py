"""Request shapes a client gets wrong, or that the schema alone would answer unclearly: each is one OpenAI error with
a message that names what to fix (and the right status), and the app serves the next request. The app runs in this
process (httpx's ASGI transport) under a served name with a slash, as Hugging Face names have."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

import fxllm
from fxllm.runtime.async_engine import AsyncEngine
from fxllm.serving.app import create_app
from fxllm.serving.service import OpenAIService, ServingConfig

NAME = "org/tiny-v1"
OK = {"model": NAME, "prompt": "x", "max_tokens": 2}


@pytest.fixture
def loaded(serve_artifact):
    return fxllm.load(serve_artifact, threads=1)


def ask(engine, requests: list[dict], max_queue: int | None = None) -> list[httpx.Response]:
    """Serve `engine` as NAME and send the requests (httpx.Client.request keyword arguments) one after another; a
    last valid completion must succeed (the app keeps serving after every error)."""

    async def main() -> list[httpx.Response]:
        service = OpenAIService(AsyncEngine(engine), ServingConfig((NAME,), max_queue))
        transport = httpx.ASGITransport(app=create_app(lambda: service))
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as client:
                responses = [await client.request(**request) for request in requests]
                assert (await client.post("/v1/completions", json=OK)).status_code == 200
        finally:
            await service.engine.shutdown(drain_timeout=0)
        return responses

    return asyncio.run(main())


def error_of(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert "\n" not in body["error"]["message"] and "Traceback" not in body["error"]["message"]
    return body["error"]


def test_a_served_name_with_a_slash_is_retrieved(loaded):
    """GET /v1/models/{model} takes the slash of `org/name` (openai's `models.retrieve("org/name")`): the card, and
    an unknown name of that shape is the model's 404, not a missing route."""
    found, unknown, slashed, listed = ask(loaded, [{"method": "GET", "url": f"/v1/models/{NAME}"},
                                                   {"method": "GET", "url": "/v1/models/org/other"},
                                                   {"method": "GET", "url": f"/v1/models/{NAME}/"},
                                                   {"method": "GET", "url": "/v1/models/"}])
    assert found.status_code == 200 and found.json()["id"] == NAME, found.text
    assert unknown.status_code == 404 and error_of(unknown)["code"] == "model_not_found", unknown.text
    # a trailing slash is ignored, not redirected (Starlette's 307 had an empty body and echoed the Host header)
    assert slashed.status_code == 200 and slashed.json()["id"] == NAME, slashed.text
    assert listed.status_code == 200 and [card["id"] for card in listed.json()["data"]] == [NAME], listed.text


def test_a_trailing_slash_is_the_route_and_errors_repeat_little_of_the_request(loaded):
    """POST /v1/completions/ is the route itself; a 60,000-character path and a 4,000-digit max_tokens are refused
    with messages that repeat a bounded part of them."""
    huge = int("9" * 4000)
    slashed, path, digits = ask(loaded, [
        {"method": "POST", "url": "/v1/completions/", "json": OK},
        {"method": "GET", "url": "/" + "p" * 60_000},
        {"method": "POST", "url": "/v1/completions", "json": {**OK, "max_tokens": huge}}])
    assert slashed.status_code == 200 and slashed.json()["object"] == "text_completion", slashed.text
    assert path.status_code == 404 and len(error_of(path)["message"]) < 200, path.text[:300]
    assert digits.status_code == 400 and error_of(digits)["param"] == "max_tokens", digits.text[:300]
    assert len(error_of(digits)["message"]) < 300, digits.text[:400]


@pytest.mark.parametrize("content, content_type, status, says", [
    (b'{"model": "org/tiny-v1", "prompt": "x"}', "application/x-www-form-urlencoded", 415,  # `curl -d` without -H
     "'Content-Type: application/json'; this one came as 'application/x-www-form-urlencoded'"),
    (b'{"model": "org/tiny-v1", "prompt": "x"}', "text/plain", 415, "came as 'text/plain'"),
    (b'{"model": "org/tiny-v1", "prompt": "x"}', None, 415, "came without a Content-Type"),  # FastAPI's CSRF guard
    (b"[1, 2]", "application/json", 400, "the request body must be a JSON object, not an array"),
    (b"null", "application/json", 400, "the request body must be a JSON object, not null"),
    (b'"x"', "application/json", 400, "the request body must be a JSON object, not a string"),
    (b'{"model": "org/tiny-v1", "prompt": "\xff"}', "application/json", 400, "not UTF-8 text (byte 36)"),
    (b'{"model": "org/tiny-v1", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "application/json", 400,
     "nests arrays or objects too deeply"),
    (b'{"model": "org/tiny-v1", "prompt": "x", "seed": ' + b"9" * 5000 + b"}", "application/json", 400,
     "cannot be read as JSON: Exceeds the limit"),
    (b'{"model": "org/tiny-v1", "prompt": "x\ny"}', "application/json", 400,  # a raw newline inside a string
     "the request body is not valid JSON: Invalid control character at character 37"),
    (b"{model: 1}", "application/json", 400, "Expecting property name enclosed in double quotes at character 1"),
])
def test_a_body_that_is_not_a_json_object_says_why(loaded, content, content_type, status, says):
    headers = {"Content-Type": content_type} if content_type else {}
    (response,) = ask(loaded, [{"method": "POST", "url": "/v1/completions", "content": content, "headers": headers}])
    assert response.status_code == status, response.text
    assert says in error_of(response)["message"], response.text


def test_a_refusal_names_what_the_client_asked_too_much_or_the_wrong_thing_of(loaded):
    """Seven prompts on a server that runs six at once are too many prompts, not too large an n; a tool_choice
    without tools is the tool_choice's fault; a token id of 1.5 "should be a valid integer", not "a valid string"
    (the first member of the prompt's union); a lone surrogate in a chat message is named where the
    client wrote it, not at its position in the rendered template."""
    capacity = loaded.max_batch
    chat = {"model": NAME, "messages": [{"role": "user", "content": "hi"}]}
    prompts, n, tool_choice, token, surrogate = ask(loaded, [
        {"method": "POST", "url": "/v1/completions", "json": {**OK, "prompt": ["x"] * (capacity + 1)}},
        {"method": "POST", "url": "/v1/completions", "json": {**OK, "n": capacity + 1}},
        {"method": "POST", "url": "/v1/chat/completions", "json": {**chat, "tool_choice": {"type": "function"}}},
        {"method": "POST", "url": "/v1/completions", "json": {**OK, "prompt": [1.5]}},
        {"method": "POST", "url": "/v1/chat/completions", "headers": {"Content-Type": "application/json"},
         "content": '{"model": "%s", "messages": [{"role": "user", "content": "hi \\ud800"}]}' % NAME},
    ], max_queue=0)
    assert (prompts.status_code, error_of(prompts)["param"]) == (400, "prompt"), prompts.text
    assert (n.status_code, error_of(n)["param"]) == (400, "n"), n.text
    assert (tool_choice.status_code, error_of(tool_choice)["param"]) == (400, "tool_choice"), tool_choice.text
    assert (token.status_code, error_of(token)["param"]) == (400, "prompt.0"), token.text
    assert "Input should be a valid integer" in error_of(token)["message"], token.text
    error = error_of(surrogate)
    assert (surrogate.status_code, error["param"]) == (400, "messages"), surrogate.text
    assert error["message"] == "messages.0.content is not valid Unicode: a lone surrogate '\\ud800' at character 3"


@pytest.mark.parametrize("parts, status, param, says", [
    ([{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "http://x/a.png"}}], 400,
     "messages.0.content.1.type", "content part of type 'image_url'; this server takes text only"),
    ([{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}], 400, "messages.0.content.0.type",
     "'input_audio'"),
    ([{"type": "text"}], 400, "messages.0.content.0.text", "missing required parameter 'messages.0.content.0.text'"),
    ([{"type": "text", "text": 5}], 400, "messages.0.content.0.text", "Input should be a valid string"),
])
def test_a_content_part_is_refused_by_what_is_wrong_with_it(loaded, parts, status, param, says):
    """Not "content should be a valid string" (the schema's first union member) for a list of parts: the part at
    fault, by its type or its field."""
    (response,) = ask(loaded, [{"method": "POST", "url": "/v1/chat/completions",
                                "json": {"model": NAME, "messages": [{"role": "user", "content": parts}]}}])
    error = error_of(response)
    assert (response.status_code, error["param"]) == (status, param), response.text
    assert says in error["message"], response.text


def test_a_prompt_of_a_list_too_long_for_the_context_is_named(loaded):
    """The engine's refusal of one prompt of several says which one it was."""
    (response,) = ask(loaded, [{"method": "POST", "url": "/v1/completions",
                                "json": {**OK, "prompt": ["a short one", "hello " * loaded.max_context]}}])
    error = error_of(response)
    assert (response.status_code, error["param"]) == (400, "prompt"), response.text
    assert error["message"].startswith("prompt[1]: the prompt is "), error["message"]


@pytest.mark.parametrize("prompt", [["a", ""], [[1, 2], []]])
def test_an_empty_prompt_of_a_list_is_named(loaded, prompt):
    (response,) = ask(loaded, [{"method": "POST", "url": "/v1/completions", "json": {**OK, "prompt": prompt}}])
    assert response.status_code == 400 and error_of(response)["message"] == "prompt[1] is empty (no tokens)", \
        response.text


SHOWS_TOOLS = ("{% for m in messages %}{{ m.role }}: {{ m.content }}{% for call in m.tool_calls or [] %} -> "
               "{{ call.function.name }}({{ call.function.arguments }}){% endfor %}"
               "{% if m.tool_call_id %} [answers {{ m.tool_call_id }}]{% endif %}\n{% endfor %}assistant:")


def test_tool_calls_in_the_history_reach_the_template(loaded):
    """An agent's conversation replayed: the assistant's tool call and the id a tool result answers are given to the
    chat template as sent (as the tokenizer renders the same conversation), not dropped as unknown fields."""
    loaded.tokenizer.chat_template = SHOWS_TOOLS
    conversation = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_7", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_7", "content": "18 C, sunny"},
    ]
    expected = loaded.tokenizer.apply_chat_template(conversation, add_generation_prompt=True)
    assert "weather(" in expected and "answers call_7" in expected
    (response,) = ask(loaded, [{"method": "POST", "url": "/v1/chat/completions",
                                "json": {"model": NAME, "messages": conversation, "max_tokens": 1}}])
    assert response.status_code == 200, response.text
    prompt_tokens = len(loaded.tokenizer.encode(expected, add_special_tokens=False))
    assert response.json()["usage"]["prompt_tokens"] == prompt_tokens


def test_chat_template_kwargs_reach_the_template(loaded):
    """vLLM's `chat_template_kwargs` (`enable_thinking` and the like) are variables of the template, not an ignored
    field; names the renderer sets itself, and a template of the client's own, are refused naming the field."""
    loaded.tokenizer.chat_template = ("{% if not enable_thinking %}/no_think {% endif %}{% for m in messages %}"
                                      "{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:")
    messages = [{"role": "user", "content": "Hi"}]
    chat = {"model": NAME, "messages": messages, "max_tokens": 1}
    thinking, refused, picked = ask(loaded, [
        {"method": "POST", "url": "/v1/chat/completions",
         "json": {**chat, "chat_template_kwargs": {"enable_thinking": True}}},
        {"method": "POST", "url": "/v1/chat/completions", "json": {**chat, "chat_template_kwargs": {"messages": []}}},
        {"method": "POST", "url": "/v1/chat/completions",
         "json": {**chat, "chat_template_kwargs": {"chat_template": "{{ 7 * 7 }}"}}}])
    expected = loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=True)
    assert not expected.startswith("/no_think")
    assert thinking.status_code == 200, thinking.text
    assert thinking.json()["usage"]["prompt_tokens"] == len(loaded.tokenizer.encode(expected, add_special_tokens=False))
    for response, name in ((refused, "messages"), (picked, "chat_template")):
        error = error_of(response)
        assert (response.status_code, error["param"]) == (400, "chat_template_kwargs"), response.text
        assert error["message"] == f"chat_template_kwargs cannot set {name}"


def test_a_value_nested_too_deeply_for_the_template_is_a_400_naming_its_field(loaded):
    """600 levels of lists in a tool call or a template variable: the rebuild before rendering recursed into Python's
    recursion limit (a 500 naming RecursionError); now a 400 naming where the value was."""
    deep = 1
    for _ in range(600):
        deep = [deep]
    messages = [{"role": "user", "content": "Hi"}]
    in_call, in_kwargs = ask(loaded, [
        {"method": "POST", "url": "/v1/chat/completions",
         "json": {"model": NAME, "max_tokens": 1,
                  "messages": [*messages, {"role": "assistant", "content": "a", "tool_calls": [{"x": deep}]}]}},
        {"method": "POST", "url": "/v1/chat/completions",
         "json": {"model": NAME, "max_tokens": 1, "messages": messages, "chat_template_kwargs": {"x": deep}}}])
    for response, param in ((in_call, "messages"), (in_kwargs, "chat_template_kwargs")):
        error = error_of(response)
        assert (response.status_code, error["param"]) == (400, param), response.text
        assert error["message"] == "a chat message or template variable nests lists or objects more than 100 " \
                                   "levels deep"


@pytest.mark.parametrize("field, value, default", [
    ("use_beam_search", True, False), ("guided_whitespace_pattern", " ", None),
])
def test_a_vllm_extension_fxllm_lacks_is_refused_unless_at_its_default(loaded, field, value, default):
    """A vLLM client's `use_beam_search` (or guided_whitespace_pattern) is not silently ignored: a 400 naming it, on
    both endpoints; its default (or null) changes nothing and is accepted."""
    chat = {"model": NAME, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    refused = ask(loaded, [{"method": "POST", "url": "/v1/completions", "json": {**OK, field: value}},
                           {"method": "POST", "url": "/v1/chat/completions", "json": {**chat, field: value}},
                           {"method": "POST", "url": "/v1/completions", "json": {**OK, field: default}}])
    for response in refused[:2]:
        error = error_of(response)
        assert (response.status_code, error["param"]) == (400, field), response.text
        assert error["message"] == f"{field} (a vLLM extension) is not supported by fxllm"
    assert refused[2].status_code == 200, refused[2].text


@pytest.mark.parametrize("field, value, param, says, default", [
    ("functions", [{"name": "get_weather", "parameters": {"type": "object"}}], "functions",
     "functions (the deprecated form of tools) is not supported by fxllm's server", []),
    ("function_call", {"name": "get_weather"}, "function_call",
     "function_call (the deprecated form of tools) is not supported by fxllm's server", "none"),
    ("function_call", "auto", "function_call",
     "function_call (the deprecated form of tools) is not supported by fxllm's server", None),
    ("modalities", ["text", "audio"], "modalities", "modalities other than ['text'] are not supported by fxllm",
     ["text"]),
    ("audio", {"voice": "alloy", "format": "wav"}, "audio", "audio output is not supported by fxllm", None),
])
def test_a_deprecated_or_audio_field_is_refused_like_tools(loaded, field, value, param, says, default):
    """The reference's deprecated `functions` / `function_call` (what older clients send instead of tools) and
    audio output were ignored as unknown fields: a client asking for a function call got free text as if it had
    been applied (while `tools` is refused). Now a 400 naming the field; its default (or null) is accepted."""
    chat = {"model": NAME, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    refused, accepted = ask(loaded, [{"method": "POST", "url": "/v1/chat/completions", "json": {**chat, field: value}},
                                     {"method": "POST", "url": "/v1/chat/completions",
                                      "json": {**chat, field: default}}])
    error = error_of(refused)
    assert (refused.status_code, error["param"], error["message"]) == (400, param, says), refused.text
    assert accepted.status_code == 200, accepted.text


@pytest.mark.parametrize("route, body", [("/v1/completions", OK),
                                         ("/v1/chat/completions", {"model": NAME, "max_tokens": 2,
                                                                   "messages": [{"role": "user", "content": "x"}]})])
def test_continuous_usage_stats_is_refused_unless_false(loaded, route, body):
    """vLLM's stream_options.continuous_usage_stats (usage in every chunk) was ignored: each chunk then carried
    `usage: null` where the client expects counts. Now a 400 naming it, as vLLM's other extensions; false is fine."""
    streamed = {**body, "stream": True}
    refused, accepted = ask(loaded, [
        {"method": "POST", "url": route,
         "json": {**streamed, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}},
        {"method": "POST", "url": route, "json": {**streamed, "stream_options": {"continuous_usage_stats": False}}}])
    error = error_of(refused)
    assert (refused.status_code, error["param"]) == (400, "stream_options.continuous_usage_stats"), refused.text
    assert error["message"] == "stream_options.continuous_usage_stats (a vLLM extension) is not supported by fxllm"
    assert accepted.status_code == 200 and accepted.text.endswith("data: [DONE]\n\n"), accepted.text


def test_a_conversation_too_long_for_the_context_names_messages(loaded):
    """The engine refuses the rendered conversation as its `prompt`; a chat request has no such field, so the
    error's param is `messages` (what the client has to shorten)."""
    chat = {"model": NAME, "messages": [{"role": "user", "content": "hello " * 300}]}
    (response,) = ask(loaded, [{"method": "POST", "url": "/v1/chat/completions", "json": chat}])
    error = error_of(response)
    assert (response.status_code, error["param"]) == (400, "messages"), response.text
    assert "context is 256 tokens" in error["message"]


@pytest.mark.parametrize("route, body, param", [
    ("/v1/completions", {"model": NAME, "prompt": [True] * 100_000}, "prompt.0"),
    ("/v1/completions", {"model": NAME, "prompt": [[1, 2]] * 10 + [[True]] * 100_000}, "prompt.10.0"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "stop": [1] * 100_000}, "stop.0"),
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "wizard"}] * 100_000}, "messages.0.role"),
])
def test_a_long_list_of_wrong_types_is_one_error(loaded, route, body, param):
    """Validation stops at a list's first bad item: pydantic made an error for every item (three per item of a
    prompt, one for each member of its union), 2 million for a 4 MiB body, which took ~20 s on the event loop (every
    stream stalled) and ~600 MB. Counted here by the problems the message reports, not by time."""
    (response,) = ask(loaded, [{"method": "POST", "url": route, "json": body}])
    error = error_of(response)
    assert (response.status_code, error["param"]) == (400, param), response.text
    more = error["message"].partition(" (and ")[2].split(" ")[0]
    assert int(more or 0) <= 3, error["message"]


@pytest.mark.parametrize("stop, message", [
    ([f"s{i}" for i in range(330_000)], "stop holds more than 16 strings"),
    (["ok", "y" * 2000], "stop[1] has 2,000 characters; at most 1,024"),
])
def test_stop_strings_are_bounded(loaded, stop, message):
    """Every stop string is searched for after every token of every choice, on the step loop all requests share: a
    request of 330,000 stop strings (a 3 MB body) made a 10-token request beside it take 6.5 s instead of 0.4."""
    (response,) = ask(loaded, [{"method": "POST", "url": "/v1/completions",
                                "json": {"model": NAME, "prompt": "x", "max_tokens": 1, "stop": stop}}])
    error = error_of(response)
    assert (response.status_code, error["param"], error["message"]) == (400, "stop", message), response.text


def test_a_full_server_refuses_before_tokenizing(loaded):
    """While every admission slot is taken, a request is 429 before its prompt is tokenized or its template rendered
    (a large prompt costs seconds of CPU, which an overloaded server should not spend on a request it refuses);
    once a slot frees, the same requests are served."""

    async def main() -> tuple[list[int], int, int]:
        service = OpenAIService(AsyncEngine(loaded), ServingConfig((NAME,), max_queue=1))
        prepared = []
        for name in ("encode", "encode_chat"):
            def counted(*args, _real=getattr(service, name), **kwargs):
                prepared.append(name)
                return _real(*args, **kwargs)
            setattr(service, name, counted)
        transport = httpx.ASGITransport(app=create_app(lambda: service))
        chat = {"model": NAME, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as client:
                service.admit(service.capacity)  # as if that many requests were running or queued
                refused = [await client.post(url, json=body) for url, body in
                           (("/v1/completions", OK), ("/v1/chat/completions", chat))]
                prepared_while_full = len(prepared)
                service.release(service.capacity)
                served = [await client.post(url, json=body) for url, body in
                          (("/v1/completions", OK), ("/v1/chat/completions", chat))]
        finally:
            await service.engine.shutdown(drain_timeout=0)
        return [r.status_code for r in refused + served], prepared_while_full, len(prepared)

    statuses, prepared_while_full, prepared = asyncio.run(main())
    assert statuses == [429, 429, 200, 200]
    assert (prepared_while_full, prepared) == (0, 2)


def test_max_tokens_0_with_echo_scores_the_prompt(loaded):
    """The legacy API's way to score a prompt (lm-evaluation-harness' log-likelihoods): the prompt's text and
    logprobs, nothing generated, finish_reason "length" and no completion tokens; the same prompt logprobs as with a
    generated token. Without echo it is a 400 naming max_tokens."""
    score = {"model": NAME, "prompt": "The cat sat on the mat", "echo": True, "logprobs": 1}
    scored, streamed, generated, refused = ask(loaded, [
        {"method": "POST", "url": "/v1/completions", "json": {**score, "max_tokens": 0}},
        {"method": "POST", "url": "/v1/completions", "json": {**score, "max_tokens": 0, "stream": True}},
        {"method": "POST", "url": "/v1/completions", "json": {**score, "max_tokens": 1, "temperature": 0}},
        {"method": "POST", "url": "/v1/completions", "json": {**OK, "max_tokens": 0}},
    ])
    choice, usage = scored.json()["choices"][0], scored.json()["usage"]
    assert (choice["text"], choice["finish_reason"]) == (score["prompt"], "length"), scored.text
    assert usage["completion_tokens"] == 0 and len(choice["logprobs"]["tokens"]) == usage["prompt_tokens"]
    assert choice["logprobs"]["token_logprobs"][0] is None
    with_token = generated.json()["choices"][0]["logprobs"]
    prompt_part = {key: values[:usage["prompt_tokens"]] for key, values in with_token.items()}
    assert choice["logprobs"] == prompt_part
    chunks = [json.loads(line[len("data: "):]) for line in streamed.text.splitlines()
              if line.startswith("data: {")]
    assert "".join(chunk["choices"][0]["text"] for chunk in chunks if chunk["choices"]) == score["prompt"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert (refused.status_code, error_of(refused)["param"]) == (400, "max_tokens"), refused.text
