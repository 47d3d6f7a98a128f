"""Errors as the OpenAI API returns them: `{"error": {"message", "type", "param", "code"}}` with a fitting status.

| status | when |
| --- | --- |
| 400 | not JSON, or JSON that cannot be read (not UTF-8, nested too deeply) |
| 400 | a value the engine refuses (its GenerationError's message; `param` of an InvalidArgumentError) |
| 400 | an unsupported field, `n` out of range, more choices than the server admits at once |
| 400 | a JSON body that does not fit the schema (not an object, wrong types, missing fields): OpenAI's and vLLM's |
|     | status for these, not FastAPI's 422, so an OpenAI client raises its BadRequestError |
| 401 | a missing or wrong API key |
| 404 | an unknown model or route |
| 405 | a wrong method |
| 408 | a body that does not arrive within the body timeout (a Content-Length the client does not send) |
| 413 | a body over the size limit |
| 415 | a body sent without a JSON Content-Type (none, or e.g. `curl -d`'s form encoding), or compressed |
| 429 | the request queue is full (retry later) |
| 500 | a model call failed, or a bug: a one-line message, never a traceback (the server log has it) |
| 503 | the server is shutting down |

`install_error_handlers(app)` maps every exception an app raises to such a body, so no client ever sees a stack
trace and the server keeps serving.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from fxllm.errors import FxllmError

logger = logging.getLogger("fxllm.serving")
_UNION_TAG = re.compile(r"^(str|int|float|bool|dict|list|none)$|^[a-z_-]+\[.*\]$")  # pydantic's union members in a loc

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
               405: "invalid_request_error", 408: "invalid_request_error", 413: "invalid_request_error",
               415: "invalid_request_error", 429: "rate_limit_error",
               500: "server_error", 503: "service_unavailable"}


class APIError(Exception):
    """An error answered with the OpenAI error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)

    def response(self, headers: Mapping[str, str] | None = None) -> JSONResponse:
        """The JSON response, with `headers` besides (and Retry-After on a 429 or 503)."""
        headers = {**(headers or {}), **({"Retry-After": "1"} if self.status in (429, 503) else {})}
        return JSONResponse(self.body(), status_code=self.status, headers=headers or None)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    """The OpenAI error body; a lone surrogate echoed from the request (`\ud800` in its JSON) is written escaped, so
    the body always encodes as UTF-8."""
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"), "param": param,
                      "code": code}}


def bad_request(exc: FxllmError, fields: Mapping[str, str] | None = None) -> APIError:
    """An engine refusal (GenerationError / InvalidArgumentError: one line) as a 400. `fields`: the request's own
    name of an engine argument where they differ (chat's max_completion_tokens is the engine's max_tokens), used as
    the error's param and in its message."""
    message, param = str(exc), getattr(exc, "param", None)
    if fields and param in fields:
        message, param = message.replace(param, fields[param]), fields[param]
    return APIError(400, message, param=param)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(FxllmError, _fxllm_error)
    app.add_exception_handler(Exception, _internal_error)


async def _api_error(request: Request, exc: APIError) -> JSONResponse:
    return exc.response()


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        context = first.get("ctx") or {}
        reason = str(context.get("error") or first.get("msg", "invalid JSON")).removesuffix(" at")
        where = [part for part in first.get("loc", ()) if isinstance(part, int)]
        at = f" at character {where[0]}" if where else ""
        return APIError(400, _one_line(f"the request body is not valid JSON: {reason}{at}")).response()
    if first.get("type") == "model_attributes_type" and not _location(first):
        return not_an_object(request.headers.get("content-type"), first.get("input")).response()
    reported = _most_specific(errors)
    param = ".".join(_location(reported)) or None
    message = reported.get("msg", "invalid request")
    if reported.get("type") == "missing":
        message = f"missing required parameter '{param}'" if param else "the request has no body (a JSON object)"
    elif param:
        message = f"invalid value for '{param}': {message}"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    return APIError(400, _one_line(message), param=param).response()


def _location(error: Mapping) -> list[str]:
    """Where in the body an error is, without pydantic's union members (`prompt.list[int].0` is `prompt.0`)."""
    return [str(part) for part in error.get("loc", ()) if part != "body" and not _UNION_TAG.match(str(part))]


def _most_specific(errors: list[Mapping]) -> Mapping:
    """The error reaching deepest into the body, and of those one whose expected type is the value's kind (then the
    first): where a field takes several types, the members the value's type does not fit fail at the field itself
    ("`content` should be a valid string" for a list of parts), while the member it fits fails at the element at
    fault, which is what the client has to fix; `prompt: [1.5]` fails as a string and as an integer at `prompt.0`,
    and a number was meant as a token id, not as text."""
    return max(errors, key=lambda error: (len(_location(error)), _expects_its_kind(error)))


_KINDS = ((bool, ("bool",)), ((int, float), ("int", "float")), (str, ("string",)), (list, ("list",)),
          (dict, ("dict", "model")))


def _expects_its_kind(error: Mapping) -> bool:
    """Whether a pydantic error's type (`int_type`, `string_too_long`, ...) is about the JSON kind of its input."""
    value = error.get("input")
    prefixes = next((names for kinds, names in _KINDS if isinstance(value, kinds)), ())
    return str(error.get("type", "")).startswith(prefixes)


_JSON_TYPES = ((type(None), "null"), (bool, "a boolean"), (int, "a number"), (float, "a number"), (str, "a string"),
               (list, "an array"))


def not_an_object(content_type: str | None, body) -> APIError:
    """A body that is not a JSON object: bytes FastAPI did not parse because the Content-Type is not JSON (415: `curl
    -d` sends form encoding; a body without a Content-Type is not parsed either, FastAPI's guard against cross-site
    requests), or JSON of another type (400)."""
    if isinstance(body, (bytes, bytearray)):
        came = f"came as '{shown(content_type)}'" if content_type else "came without a Content-Type"
        return APIError(415, f"the request body must be JSON sent with 'Content-Type: application/json'; this one "
                             f"{came}")
    kind = next((name for kind, name in _JSON_TYPES if isinstance(body, kind)), type(body).__name__)
    return APIError(400, f"the request body must be a JSON object, not {kind}")


def not_accepting() -> APIError:
    """503 for a request that arrives once the server is shutting down (fxllm serve's service, the Ray ingress)."""
    return APIError(503, "the server is shutting down and accepts no new requests")


MAX_SHOWN = 100  # characters of a request's header that an error repeats


def shown(header: str) -> str:
    """A request header's value as an error repeats it: one line, at most MAX_SHOWN characters."""
    return _one_line(header)[:MAX_SHOWN]


def unreadable_body(cause: BaseException) -> str:
    """Why FastAPI could not read a body as JSON (`cause`: what its parsing raised), in one line: not UTF-8, nested
    past Python's recursion limit, an integer too long for int()."""
    if isinstance(cause, UnicodeDecodeError):
        return f"the request body is not UTF-8 text (byte {cause.start})"
    if isinstance(cause, RecursionError):
        return "the request body nests arrays or objects too deeply to be read"
    return f"the request body cannot be read as JSON: {_one_line(str(cause).split(';')[0])}"


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    status = exc.status_code
    message = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
    if status == 404:
        message = f"no route {request.method} {shown(request.url.path)}"
    elif status == 405:
        message = f"method {request.method} is not allowed on {shown(request.url.path)}"
    elif status == 400 and isinstance(exc.__cause__, (ValueError, RecursionError)):  # FastAPI's body parsing
        message = unreadable_body(exc.__cause__)
    elif not message:
        message = HTTPStatus(status).phrase
    code = {408: "request_timeout", 413: "request_too_large"}.get(status)
    response = APIError(status, _one_line(message), code=code).response()
    for name, value in (exc.headers or {}).items():
        response.headers[name] = value
    return response


async def _fxllm_error(request: Request, exc: FxllmError) -> JSONResponse:
    return bad_request(exc).response()


async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    logger.error("internal error on %s %s", request.method, request.url.path, exc_info=exc)
    return internal_error(exc).response()


def as_api_error(exc: Exception) -> APIError:
    """Any exception as the APIError the handlers answer it with (a bug is logged here, with its traceback)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, FxllmError):
        return bad_request(exc)
    logger.error("internal error", exc_info=exc)
    return internal_error(exc)


def internal_error(exc: Exception) -> APIError:
    """A bug (any exception that is not an APIError or FxllmError) as a 500 with a one-line message."""
    return APIError(500, f"internal server error: {type(exc).__name__} (details are in the server log)")


def _one_line(message: str) -> str:
    return " ".join(str(message).split())
