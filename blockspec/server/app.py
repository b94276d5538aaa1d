"""The FastAPI application: error format, API-key check, lifespan of the engine thread."""
from __future__ import annotations

import hmac
import json
import logging
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Optional, Union

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from blockspec.engine.engine import Engine
from blockspec.server.args import ServerSettings
from blockspec.server.engine_loop import EngineLoop
from blockspec.server.metrics import ServerMetrics
from blockspec.server.state import APIError, ClientGone, ServerState

logger = logging.getLogger(__name__)
# NOTE: a refused body up to this size (or 4x --max-request-bytes) is read before its 413 (BodyLimitMiddleware)
MIN_DRAIN_BYTES = 64 * 1024 * 1024
OPEN_PATHS = ("/health", "/metrics")


class ApiKeyMiddleware:
    """Plain ASGI (not BaseHTTPMiddleware) so streaming and disconnect detection pass through untouched."""

    def __init__(self, app: ASGIApp, api_key: str, metrics: ServerMetrics) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] == "OPTIONS" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        supplied = dict(scope["headers"]).get(b"authorization", b"")
        if not hmac.compare_digest(supplied, self.expected):
            error = APIError(
                401,
                "authorization: missing or wrong API key (send 'Authorization: Bearer KEY')",
                "authorization",
                "authentication_error",
            )
            self.metrics.http_errors.labels(status="401").inc()
            await JSONResponse(error.body(), status_code=401)(scope, receive, send)
            return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """413 for a body over `limit` bytes: up front from Content-Length, else as the bytes arrive.

    Not FastAPI's `max_body_size`: when Content-Length is over its limit it swaps whatever response the app sends
    for a plain-text "Content Too Large", so no exception handler can give it the OpenAI error shape.

    NOTE: the rest of a refused body, up to `drain_bytes` in all, is read and dropped before the 413 is sent. The
    connection closes after a 413 (h11: the body was not read), and closing a socket with unread bytes sends a reset
    that a client still writing its body sees instead of the 413. A body declared or sent beyond `drain_bytes` gets its
    413 at once, and such a client may still see the reset (the bytes are not worth reading)."""

    def __init__(self, app: ASGIApp, limit: int, metrics: ServerMetrics, drain_bytes: int) -> None:
        self.app = app
        self.limit = limit
        self.metrics = metrics
        self.drain_bytes = drain_bytes

    def error(self) -> APIError:
        return APIError(
            413, f"body: larger than the server's limit of {self.limit} bytes (--max-request-bytes)", "body"
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > self.limit:
            self.metrics.http_errors.labels(status="413").inc()
            if int(declared) <= self.drain_bytes:
                await self._drain(receive, 0)
            await JSONResponse(self.error().body(), status_code=413)(scope, receive, send)
            return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    if message.get("more_body", False):
                        await self._drain(receive, received)
                    # NOTE: FastAPI re-raises an HTTPException met while reading the body; http_error answers it.
                    raise HTTPException(413, self.error().message)
            return message

        await self.app(scope, limited_receive, send)

    async def _drain(self, receive: Receive, received: int) -> None:
        """Reads and drops the rest of the body while it stays within `drain_bytes` (`received` bytes read so far)."""
        while received <= self.drain_bytes:
            message = await receive()
            if message["type"] != "http.request":
                return
            received += len(message.get("body", b""))
            if not message.get("more_body", False):
                return


def _loc_to_param(loc: tuple[Any, ...]) -> str:
    parts = [str(p) for p in loc if p != "body"]
    return ".".join(parts) if parts else "body"


def _validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    # NOTE: a union reports one error per member; a ValueError raised by our own validators is the one that matters.
    chosen = next((e for e in errors if e.get("type") == "value_error"), errors[0] if errors else None)
    first: dict[str, Any] = dict(chosen) if chosen else {"loc": ("body",), "msg": "invalid request", "type": ""}
    if first.get("type") == "json_invalid":
        return APIError(400, f"body: malformed JSON ({first.get('ctx', {}).get('error', first['msg'])})", "body")
    # NOTE: union fields name the failing member type in loc (e.g. "str", "list[int]"), after the field's own name.
    loc = tuple(
        p for i, p in enumerate(first.get("loc", ("body",)))
        if i < 2 or not (isinstance(p, str) and ("[" in p or p in ("str", "int", "float", "bool", "dict")))
    )
    param = _loc_to_param(loc)
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    return APIError(400, f"{param}: {message}", param)


def create_app(engine: Union[Engine, EngineLoop], settings: Optional[ServerSettings] = None) -> FastAPI:
    """`engine`: an Engine (in-process mode: its core runs on a thread of this process, for tests and notebooks) or
    an EngineLoop whose engine process is launched already (`blockspec serve`)."""
    settings = settings or ServerSettings()
    loop = engine if isinstance(engine, EngineLoop) else EngineLoop(engine)
    loop.max_queued_requests = settings.max_queued_requests
    state = ServerState.build(loop, settings)
    metrics = state.metrics
    metrics.set_startup(state.info.startup.get("seconds", {}))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.loop.start()
        try:
            yield
        finally:
            await state.loop.stop()
            state.tokenize_pool.shutdown(wait=False, cancel_futures=True)
            if state.encoder is not None:
                state.encoder.close()

    app = FastAPI(title="blockspec", lifespan=lifespan)
    app.state.blockspec = state

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        metrics.http_errors.labels(status=str(exc.status)).inc()
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return await api_error(request, _validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        param = "body" if exc.status_code == 413 else None
        return await api_error(request, APIError(exc.status_code, str(exc.detail), param))

    @app.exception_handler(ClientGone)
    async def client_gone(request: Request, exc: ClientGone) -> Response:
        return Response(status_code=499)

    @app.exception_handler(json.JSONDecodeError)
    async def json_error(request: Request, exc: json.JSONDecodeError) -> JSONResponse:
        return await api_error(request, APIError(400, f"body: malformed JSON ({exc})", "body"))

    from blockspec.server.native_api import router as native_router
    from blockspec.server.openai_api import router as openai_router

    app.include_router(openai_router)
    app.include_router(native_router)
    app.add_middleware(BodyLimitMiddleware, limit=settings.max_request_bytes, metrics=metrics,
                       drain_bytes=max(4 * settings.max_request_bytes, MIN_DRAIN_BYTES))
    if settings.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=settings.api_key, metrics=metrics)
    return app
