"""Chat templates rendered without transformers, with the same semantics as its `apply_chat_template`.

A template is untrusted code from the model's author: it runs in jinja2's ImmutableSandboxedEnvironment (templates
cannot mutate their inputs or reach Python internals) within a time and size budget (runtime/template_budget.py),
with `trim_blocks` and `lstrip_blocks` on, the loop-controls extension (`{% break %}`, `{% continue %}`), and the
names templates written for transformers expect: `raise_exception(message)`, `strftime_now(format)`, a `tojson`
filter that does not HTML-escape, `dict(...)`, and a `namespace(...)` that refuses underscore-prefixed attributes.
`{% generation %}` blocks (assistant-mask markers) render their body unchanged. The template sees `messages`, `tools`,
`documents`, `add_generation_prompt`, the tokenizer's named special tokens (`bos_token`, `eos_token`, ...) and any extra
keyword arguments, which take precedence over the special tokens. Inputs are rebuilt from plain JSON types before the
template sees them.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
import numpy as np

from fxllm.errors import GenerationError
from fxllm.runtime.template_budget import BudgetedSandbox, RenderTimeout, render_within
from fxllm.runtime.template_sizes import check_size, json_size, text_size

RENDER_SECONDS = 5.0  # a chat template renders in milliseconds; one still running after this never ends usefully
# Older names for a message's reasoning; templates read `reasoning_content`, gpt-oss templates read `thinking`.
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


# Levels of lists and objects in a message or template variable: a tool's JSON schema nests a dozen; the rebuild and a
# template's walk recurse once a level, and Python's recursion limit (1,000 frames) must never be what ends them.
MAX_NESTING = 100
RENDERER_VARIABLES = ("messages", "tools", "documents", "add_generation_prompt")  # what render_chat sets itself


def render_chat(template: str, messages: Any, *, add_generation_prompt: bool = True, tools: list | None = None,
                documents: list | None = None, special_tokens: Mapping[str, str] | None = None,
                variables: Mapping[str, Any] | None = None) -> str:
    """The conversation rendered as the prompt text. `messages`: a list of dicts (or dataclasses / pydantic models)
    with at least `role` and `content`; `variables` are further template variables (any name but
    RENDERER_VARIABLES), over `special_tokens` (bos_token, ...), which they may override. A template error, a
    `raise_exception` call or a malformed conversation is a GenerationError with a one-line message."""
    compiled = compile_template(template)
    conversation = _conversation(messages)
    for name, items in (("tools", tools), ("documents", documents)):
        if items is not None and not (isinstance(items, list) and all(isinstance(item, Mapping) for item in items)):
            raise GenerationError(f"chat {name} must be a list of JSON objects")
    variables = {**(special_tokens or {}), **(variables or {})}
    taken = sorted(set(variables) & set(RENDERER_VARIABLES))
    if taken:
        raise GenerationError(f"a chat template variable cannot be called {', '.join(taken)}: the renderer sets it")
    inputs = {"tools": plain_json(tools), "documents": plain_json(documents), **plain_json(variables)}
    try:
        return render_within(compiled, RENDER_SECONDS, messages=conversation,
                             add_generation_prompt=add_generation_prompt, **inputs)
    except RenderTimeout as exc:
        raise GenerationError(f"{exc} over a conversation of {len(conversation):,} messages (a template loop without "
                              "end, or an enormous conversation); nothing was generated") from None
    except TemplateRaised as exc:
        raise GenerationError(f"the chat template refused the conversation: {_one_line(exc)}") from exc
    except jinja2.TemplateError as exc:  # an undefined value, a sandbox violation
        raise GenerationError(f"the chat template failed: {_one_line(exc)}") from exc
    except Exception as exc:  # any other template bug: still only this request fails
        raise GenerationError(f"the chat template failed: {type(exc).__name__}: {_one_line(exc)}") from exc


@lru_cache(maxsize=16)
def compile_template(template: str) -> jinja2.Template:
    """The template compiled in the sandbox (cached: servers render the same template for every request)."""
    environment = BudgetedSandbox(trim_blocks=True, lstrip_blocks=True,
                                  extensions=[jinja2.ext.loopcontrols, _GenerationBlock])
    environment.filters["tojson"] = _tojson
    environment.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_TemplateDict(),
                               namespace=_TemplateNamespace)
    try:
        return environment.from_string(template)
    except jinja2.TemplateSyntaxError as exc:
        raise GenerationError(f"the model's chat template does not parse: {_one_line(exc)} (line {exc.lineno})") \
            from exc


def _conversation(messages: Any) -> list[dict[str, Any]]:
    """Plain message dicts; keys whose value is None are dropped (templates test for a missing key, not None)."""
    messages = getattr(messages, "messages", messages)
    if not isinstance(messages, (list, tuple)) or not messages:
        raise GenerationError("a chat needs a non-empty list of messages")
    conversation = []
    for message in plain_json(list(messages)):
        if not isinstance(message, dict):
            raise GenerationError(f"each chat message must be an object with 'role' and 'content', got {message!r}")
        message = {key: value for key, value in message.items() if value is not None}
        reasoning = next((message[key] for key in REASONING_FIELDS if key in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        conversation.append(message)
    return conversation


def plain_json(value: Any, depth: int = 0) -> Any:
    """Rebuild a value from exact JSON types, so the template only ever sees objects without dangerous methods.
    A value with no JSON form (bytes, a set, a path, any other object), or lists and objects nested more than
    MAX_NESTING deep, is a GenerationError: rendered as a placeholder it would reach the model as text the caller
    never wrote, and a deeper value would end the rebuild (or the template's walk) in Python's recursion limit."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if depth >= MAX_NESTING and not isinstance(value, (str, int, float, np.generic)):  # a container of any kind
        raise GenerationError(f"a chat message or template variable nests lists or objects more than {MAX_NESTING} "
                              "levels deep")
    depth += 1
    if isinstance(value, str):  # subclasses (enums, numpy strings) may carry methods: back to the base type
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {plain_json(key, depth): plain_json(item, depth) for key, item in value.items()}
    if isinstance(value, list):
        return [plain_json(item, depth) for item in value]
    if isinstance(value, tuple):
        return tuple(plain_json(item, depth) for item in value)
    if isinstance(value, np.generic):  # np.bool_(False) must not become a truthy placeholder
        return plain_json(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {field.name: plain_json(getattr(value, field.name), depth) for field in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):  # pydantic models, e.g. the openai client's messages
        return plain_json(value.model_dump(), depth)
    hint = "; decode bytes to text first" if isinstance(value, (bytes, bytearray, memoryview)) else ""
    raise GenerationError(f"a chat message or template variable holds a {type(value).__name__} value, which has no "
                          f"JSON form: give text, numbers, lists or objects{hint}")


ERROR_CHARACTERS = 2000  # of an error's message kept in a GenerationError (a template may raise a huge one)


def _one_line(exc: BaseException) -> str:
    return " ".join(str(getattr(exc, "message", None) or exc)[:ERROR_CHARACTERS].split())


class TemplateRaised(jinja2.TemplateError):
    """The template itself refused its input, through `raise_exception(message)`."""


def _raise_exception(message: str):
    check_size(text_size(message), "raise_exception")  # its text is built for the error message
    raise TemplateRaised(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    # jinja2's own tojson HTML-escapes (<, >, &, '), which would change the prompt text.
    check_size(json_size(value, indent=indent, separators=separators, ensure_ascii=ensure_ascii), "'tojson'")
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:  # noqa: A002 - the name templates call it with
    if isinstance(format, str):  # a directive writes at most a few dozen characters ('%c': 24)
        check_size(len(format) + 64 * format.count("%"), "strftime_now")
    return datetime.now().strftime(format)


class _TemplateDict:
    """`dict(...)` for templates, without exposing the dict type itself (and with it type-level attributes)."""

    def __call__(self, *args, **kwargs) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """jinja2's namespace, refusing underscore-prefixed attributes (a route to CPython internals)."""

    def __init__(*args, **kwargs):  # jinja2's signature trick: `namespace(self=...)` must still work
        self, args = args[0], args[1:]
        attributes = dict(*args, **kwargs)
        for name in attributes:
            _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attributes)

    def __setitem__(self, name, value) -> None:
        _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template cannot set the attribute {name!r} on a namespace")


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; here it renders as is."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller) -> str:
        return caller()
