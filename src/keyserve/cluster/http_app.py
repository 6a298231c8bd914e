"""The FastAPI app: OpenAI routes, health, Prometheus metrics, auth and error envelopes.

The same app runs under Ray Serve (``serve_app.build_app``) and plain uvicorn (tests, laptops).
A client that goes away aborts its request: while streaming, Starlette cancels the body
iterator; before that (queueing, prefill, non-streaming), a watcher on ``http.disconnect``
cancels the handler (Ray Serve cancels it itself). Either way the engine request is aborted,
its KV blocks freed, and the request counted as aborted, not as an error (``disconnects``).
With an API key, the docs and the OpenAPI schema need it too; /health and /metrics stay open.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import Awaitable
from typing import Any, TypeVar

import anyio
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from keyserve.cluster import openapi_doc
from keyserve.cluster.disconnects import DisconnectGuard
from keyserve.cluster.errors import APIError, bad_request
from keyserve.cluster.json_body import parse_json, read_body
from keyserve.cluster.metrics import CONTENT_TYPE
from keyserve.cluster.openai_protocol import ChatCompletionRequest, CompletionRequest, ModelCard
from keyserve.cluster.openai_serving import Kind, OpenAIServing

log = logging.getLogger(__name__)
T = TypeVar("T")
CLIENT_CLOSED = 499  # nginx's "client closed request": nobody reads it, the logs do


class _Disconnected(Exception):
    pass


def create_app(serving: OpenAIServing) -> FastAPI:
    app = FastAPI(title="keyserve", description="OpenAI-compatible LLM server",
                  docs_url=None, redoc_url=None, openapi_url=None)  # served below, behind the key
    app.state.serving = serving
    _install_error_handlers(app, serving)
    if serving.metrics is not None:
        app.add_middleware(DisconnectGuard, on_abort=serving.metrics.observe_aborted)
    else:
        app.add_middleware(DisconnectGuard, on_abort=lambda: None)
    auth = [Depends(_api_key_checker(serving.config.api_key))]
    v1 = APIRouter(prefix="/v1", dependencies=auth)

    @v1.get("/models")
    async def models() -> dict:
        return serving.models()

    @v1.get("/models/{model_id:path}", response_model=ModelCard)
    async def model(model_id: str) -> dict:
        """One model (``client.models.retrieve``); an unknown id is a 404 envelope."""
        return serving.model(model_id)

    @v1.post("/completions")
    async def completions(request: Request) -> Response:
        return await _generate(serving, request, "completions")

    @v1.post("/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _generate(serving, request, "chat")

    app.include_router(v1)
    openapi_doc.install(app, {"/v1/completions": CompletionRequest,
                              "/v1/chat/completions": ChatCompletionRequest})
    _install_docs(app, auth if serving.config.api_key is not None else [])

    @app.api_route("/health", methods=["GET", "HEAD"])  # HEAD: what load balancers often probe with
    async def health() -> Response:
        engine = serving.engine
        if engine.is_ready:
            return JSONResponse({"status": "ok"})
        state = "loading" if engine.is_alive else f"dead: {engine.dead_reason}"
        return JSONResponse({"status": state}, status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        if serving.metrics is None:
            return Response(b"", media_type=CONTENT_TYPE)
        return Response(serving.metrics.render(), media_type=CONTENT_TYPE)

    return app


def _install_docs(app: FastAPI, auth: list) -> None:
    """/openapi.json, /docs and /redoc, behind the API key when there is one."""

    def schema_url(request: Request) -> str:
        return request.scope.get("root_path", "").rstrip("/") + "/openapi.json"

    @app.get("/openapi.json", include_in_schema=False, dependencies=auth)
    async def openapi_json() -> JSONResponse:
        return JSONResponse(app.openapi())

    @app.get("/docs", include_in_schema=False, dependencies=auth)
    async def docs(request: Request) -> HTMLResponse:
        return get_swagger_ui_html(openapi_url=schema_url(request), title=f"{app.title} - docs")

    @app.get("/redoc", include_in_schema=False, dependencies=auth)
    async def redoc(request: Request) -> HTMLResponse:
        return get_redoc_html(openapi_url=schema_url(request), title=f"{app.title} - ReDoc")


async def _generate(serving: OpenAIServing, request: Request, kind: Kind) -> Response:
    raw = await read_body(request, serving.config.max_request_bytes)
    body = await parse_json(raw)
    try:
        result = await _until_disconnect(request, serving.handle(kind, body, checked=True))
    except _Disconnected:
        return Response(status_code=CLIENT_CLOSED)
    if isinstance(result, dict):
        return JSONResponse(result)
    return _EventStream(result, media_type="text/event-stream",
                        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


class _EventStream(StreamingResponse):
    """Closes its iterator however streaming ends (a failed send on a closed connection
    included), so the request's finally blocks run now and abort it."""

    async def stream_response(self, send: Any) -> None:
        try:
            await super().stream_response(send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()  # type: ignore[attr-defined]


async def _until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Run ``work``; cancel it (aborting its engine requests) if the client disconnects."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # the server cancelled us (Ray Serve on disconnect)
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    try:
        await task
    except BaseException:  # noqa: BLE001 — the client is gone; nothing to report to
        pass
    raise _Disconnected


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
        await asyncio.sleep(0.05)  # a stray body message: keep listening without spinning


def _api_key_checker(api_key: str | None):
    async def check(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if not header:
            raise APIError(401, "missing API key: send `Authorization: Bearer <key>`",
                           code="invalid_api_key")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError(401, "incorrect API key", code="invalid_api_key")

    return check


def _install_error_handlers(app: FastAPI, serving: OpenAIServing) -> None:
    def envelope(err: APIError) -> JSONResponse:
        if serving.metrics is not None:
            serving.metrics.observe_rejected(err.status)
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return envelope(exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return envelope(APIError(exc.status_code, str(exc.detail), kind, code=code,
                                 headers=dict(exc.headers or {})))

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(x) for x in first.get("loc", []) if x not in ("body", "query", "path")]
        return envelope(bad_request(str(first.get("msg", exc)), loc[0] if loc else None))

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return envelope(APIError(500, f"internal server error: {type(exc).__name__}", "server_error",
                                 code="internal_error"))
