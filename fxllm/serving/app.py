"""The FastAPI app of the OpenAI-compatible server. Routes get the served model from an injected provider, so
whoever owns the engine — `fxllm serve` (server.py), or a Ray Serve deployment using this app as its ingress (one
service per replica) — passes `lambda: its_service` and reuses every route, error mapping and guard.

    app = create_app(lambda: service, api_key="secret")

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /v1/models/{model}, GET /health,
GET /metrics. /v1/ routes need the API key when one is set; /health and /metrics do not.
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi import Depends, FastAPI
from fastapi.responses import JSONResponse, Response

from fxllm import __version__
from fxllm.serving.chat import create_chat_completion
from fxllm.serving.completions import create_completion
from fxllm.serving.errors import install_error_handlers
from fxllm.serving.middleware import APIKeyGuard, BodySizeLimit
from fxllm.serving.protocol import (ChatCompletionRequest, ChatCompletionResponse, CompletionRequest,
                                    CompletionResponse, ErrorResponse, Health, ModelCard, ModelList)
from fxllm.serving.service import OpenAIService

MAX_BODY_BYTES = 4 * 1024 * 1024

_ERRORS = {status: {"model": ErrorResponse} for status in (400, 401, 404, 413, 422, 429, 500, 503)}
# One server-sent event (OpenAPI before 3.2: the `schema` of an event stream describes each event).
_EVENT = {"type": "object", "required": ["data"],
          "properties": {"data": {"type": "string", "description": "a chunk as JSON (the response object with text or "
                                  "delta pieces), an error body as JSON, or [DONE] last"},
                         "event": {"type": "string"}}}
_STREAMED = {200: {"content": {"text/event-stream": {"schema": _EVENT}},
                   "description": "the response, or its chunks as server-sent events with stream=true"}}


def create_app(get_service: Callable[[], OpenAIService], api_key: str | None = None,
               max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    """The app. `get_service()` is called on every request; `api_key` guards the /v1/ routes."""
    app = FastAPI(title="fxllm", version=__version__, description="OpenAI-compatible API of an fxllm artifact")
    install_error_handlers(app)
    app.add_middleware(BodySizeLimit, max_bytes=max_body_bytes)
    if api_key is not None:
        app.add_middleware(APIKeyGuard, api_key=api_key)

    def service() -> OpenAIService:
        return get_service()

    @app.post("/v1/completions", response_model=CompletionResponse, responses={**_ERRORS, **_STREAMED})
    async def completions(request: CompletionRequest, served: OpenAIService = Depends(service)):
        return await create_completion(served, request)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses={**_ERRORS, **_STREAMED})
    async def chat_completions(request: ChatCompletionRequest, served: OpenAIService = Depends(service)):
        return await create_chat_completion(served, request)

    @app.get("/v1/models", response_model=ModelList, responses=_ERRORS)
    async def list_models(served: OpenAIService = Depends(service)) -> ModelList:
        return ModelList(data=[_card(served, name) for name in served.config.model_names])

    @app.get("/v1/models/{model}", response_model=ModelCard, responses=_ERRORS)
    async def get_model(model: str, served: OpenAIService = Depends(service)) -> ModelCard:
        served.check_model(model)
        return _card(served, model)

    @app.get("/health", response_model=Health, responses={503: {"model": Health}})
    async def health(served: OpenAIService = Depends(service)):
        status = served.health()
        return JSONResponse({"status": status}, status_code=200 if status == "ok" else 503)

    @app.get("/metrics", response_class=Response,
             responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}},
                              "description": "Prometheus text format"}})
    async def metrics(served: OpenAIService = Depends(service)) -> Response:
        body, content_type = served.metrics.render()
        return Response(body, media_type=content_type)

    return app


def _card(service: OpenAIService, name: str) -> ModelCard:
    return ModelCard(id=name, created=service.created, max_model_len=service.max_context)
