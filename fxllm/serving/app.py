"""The FastAPI app of the OpenAI-compatible server. Routes get the served model from an injected provider, so
whoever serves — `fxllm serve` (server.py: an OpenAIService on its own engine), or the Ray Serve ingress (an
object with the same methods that forwards to engine replicas, fxllm/serving/ray/) — passes `lambda: served` and
reuses every route, error mapping and guard.

    app = create_app(lambda: service, api_key="secret")

The served object has `model_names`, `check_model(name)`, `card(name)`, `health()`, `async render_metrics()`,
`async completion(request)` and `async chat_completion(request)` (a response model or a streaming response). A
non-streamed request whose client disconnects is cancelled, which aborts its engine requests.

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /v1/models/{model}, GET /health,
GET /metrics; HEAD on any route is answered as GET without the body. /v1/ routes need the API key when one is set;
/health and /metrics do not. CORS headers are sent only for the origins given (none by default).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from fxllm import __version__
from fxllm.serving.errors import install_error_handlers
from fxllm.serving.middleware import (APIKeyGuard, BodyReadTimeout, BodySizeLimit, BugGuard, HeadAsGet,
                                      IdentityEncodingOnly, OpenAICORS, TrailingSlashIgnored, check_api_key)
from fxllm.serving.protocol import (ChatCompletionRequest, ChatCompletionResponse, CompletionRequest,
                                    CompletionResponse, ErrorResponse, Health, ModelCard, ModelList)

MAX_BODY_BYTES = 4 * 1024 * 1024
BODY_TIMEOUT = 30.0  # seconds a request's body may take to arrive

_ERRORS = {status: {"model": ErrorResponse} for status in (400, 401, 404, 408, 413, 415, 429, 500, 503)}
# One server-sent event (OpenAPI before 3.2: the `schema` of an event stream describes each event).
_EVENT = {"type": "object", "required": ["data"],
          "properties": {"data": {"type": "string", "description": "a chunk as JSON (the response object with text or "
                                  "delta pieces), an error body as JSON, or [DONE] last"},
                         "event": {"type": "string"}}}
_STREAMED = {200: {"content": {"text/event-stream": {"schema": _EVENT}},
                   "description": "the response, or its chunks as server-sent events with stream=true"}}


def create_app(get_service: Callable[[], object], api_key: str | None = None,
               max_body_bytes: int = MAX_BODY_BYTES, body_timeout: float = BODY_TIMEOUT,
               allowed_origins: Sequence[str] = ()) -> FastAPI:
    """The app. `get_service()` is called on every request; `api_key` guards the /v1/ routes; a body must be at most
    `max_body_bytes` long (413) and arrive within `body_timeout` seconds of the request (408); browsers on
    `allowed_origins` (`*`: any) may call it (CORS; none by default). An api_key no client can send (surrounding
    whitespace) is a one-line FxllmError."""
    if api_key is not None:
        check_api_key(api_key)
    app = FastAPI(title="fxllm", version=__version__, description="OpenAI-compatible API of an fxllm artifact",
                  redirect_slashes=False)
    install_error_handlers(app)
    app.add_middleware(BodyReadTimeout, seconds=body_timeout)
    app.add_middleware(BodySizeLimit, max_bytes=max_body_bytes)
    app.add_middleware(IdentityEncodingOnly)
    if api_key is not None:
        app.add_middleware(APIKeyGuard, api_key=api_key)
    app.add_middleware(BugGuard)  # the outermost of the guards, so that it sees what the others raise
    app.add_middleware(HeadAsGet)  # outside BugGuard, so that its 500 to a HEAD has no body either
    app.add_middleware(TrailingSlashIgnored)  # before the API-key guard reads the path
    if allowed_origins:  # outermost: a preflight carries no API key, and every answer, errors too, needs the headers
        app.add_middleware(OpenAICORS, allow_origins=list(allowed_origins), allow_methods=["GET", "HEAD", "POST"],
                           allow_headers=["*"])

    def service():
        return get_service()

    @app.post("/v1/completions", response_model=CompletionResponse, responses={**_ERRORS, **_STREAMED})
    async def completions(request: CompletionRequest, raw: Request, served=Depends(service)):
        return await until_disconnected(raw, served.completion(request))

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses={**_ERRORS, **_STREAMED})
    async def chat_completions(request: ChatCompletionRequest, raw: Request, served=Depends(service)):
        return await until_disconnected(raw, served.chat_completion(request))

    @app.get("/v1/models", response_model=ModelList, responses=_ERRORS)
    async def list_models(served=Depends(service)) -> ModelList:
        return ModelList(data=[await served.card(name) for name in served.model_names])

    # `:path`: a served name may hold slashes (`--served-model-name org/model`, as Hugging Face names are)
    @app.get("/v1/models/{model:path}", response_model=ModelCard, responses=_ERRORS)
    async def get_model(model: str, served=Depends(service)):
        served.check_model(model)
        return await served.card(model)

    @app.get("/health", response_model=Health, responses={503: {"model": Health}})
    async def health(served=Depends(service)):
        status = await served.health()
        return JSONResponse({"status": status}, status_code=200 if status == "ok" else 503)

    @app.get("/metrics", response_class=Response,
             responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}},
                              "description": "Prometheus text format"}})
    async def metrics(served=Depends(service)) -> Response:
        body, content_type = await served.render_metrics()
        return Response(body, media_type=content_type)

    return app


async def until_disconnected(request: Request, work: Awaitable):
    """The result of `work`, unless the client disconnects first: then `work` is cancelled (a non-streamed
    generation's engine requests are aborted at once) and nobody reads the empty answer. A streaming response is
    returned as soon as its run has started; from then on it watches the connection itself."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task.done() and not task.cancelled():
        return task.result()
    return Response(status_code=499)  # the client has gone (nginx's "client closed request")


async def _disconnect(request: Request) -> None:
    """Returns once the client has disconnected (the body has been read by then: only a disconnect can come)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
