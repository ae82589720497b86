"""The FastAPI app: OpenAI-compatible routes over one ModelBackend and one GenerationQueue.

Routes: GET /health, GET /v1/models, GET /v1/models/{id}, POST /v1/chat/completions,
POST /v1/completions, GET /metrics. A generation request is parsed and checked here (body.py,
plan.py: 400/404 before it queues), then becomes a Job whose choices the worker generates one
after the other; the handler relays the worker's events as one JSON body or as server-sent
events. A client that goes away cancels its job: a waiting job leaves the queue,
a running one stops between tokens (Starlette cancels a stream on disconnect; a watcher task
also polls for it every ``POLL_S``, which is what a non-streamed request relies on).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response, StreamingResponse

from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect

from moespec.errors import MoespecError
from moespec.serve.backend import ChoiceSpec, ModelBackend
from moespec.serve.body import parse_body
from moespec.serve.errors import ApiError
from moespec.serve.metrics import ServerMetrics
from moespec.serve.plan import Limits, chat_choices, completion_choices
from moespec.serve.queue import GenerationQueue, Job, QueueClosed, QueueFull
from moespec.serve.responses import DONE, ResponseFormat, sse
from moespec.serve.schemas import ChatCompletionRequest, CompletionRequest, SamplingFields
from moespec.serve.security import Gate

POLL_S = 0.1  # how often a waiting non-streamed request checks that its client is still there
_ENDPOINTS = ("/health", "/metrics", "/v1/models", "/v1/chat/completions", "/v1/completions")


def _endpoint(path: str) -> str:
    if path in _ENDPOINTS:
        return path
    return "/v1/models/{id}" if path.startswith("/v1/models/") else "other"


@dataclass(frozen=True)
class ServeSettings:
    """Server behaviour (the `moespec serve` options).

    Attributes:
        api_key: Bearer key clients must send (None: no key; only allowed on loopback).
        max_queue: most requests waiting while one generates (past it: 429).
        max_body_bytes: largest request body (past it: 413).
        default_max_tokens: new tokens when a request names no max_tokens.
        default_seed: sampling seed when a request names none.
        max_n: most choices one request may ask for (``n``; past it: 400).
        cors_origins: origins a browser page may call from (CORS; empty: none).
    """

    api_key: str | None = None
    max_queue: int = 16
    max_body_bytes: int = 1 << 20
    default_max_tokens: int = 256
    default_seed: int = 0
    max_n: int = 8
    cors_origins: tuple[str, ...] = ()


class _Counted:
    """ASGI middleware counting responses per endpoint and status code."""

    def __init__(self, app, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        endpoint = _endpoint(scope["path"])
        started = False

        async def counted(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                self.metrics.requests.labels(endpoint, str(message["status"])).inc()
            await send(message)

        try:
            await self.app(scope, receive, counted)
        except Exception:
            # An unhandled error becomes Starlette's 500 outside this middleware: count it here.
            if not started:
                self.metrics.requests.labels(endpoint, "500").inc()
            raise


def create_app(backend: ModelBackend, settings: ServeSettings, metrics: ServerMetrics | None = None,
               queue: GenerationQueue | None = None) -> FastAPI:
    """The ASGI app serving ``backend``; ``app.state`` holds backend, queue, metrics and settings.

    The caller owns the model; ``app.state.queue.close()`` stops the worker.
    """
    metrics = metrics or ServerMetrics()
    queue = queue or GenerationQueue(settings.max_queue, on_change=metrics.set_queue)
    metrics.observe_cache(backend.engine.om.cache)
    app = FastAPI(title="moespec", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.backend, app.state.queue, app.state.metrics, app.state.settings = backend, queue, metrics, settings
    app.add_middleware(Gate, api_key=settings.api_key, max_body_bytes=settings.max_body_bytes)
    app.add_middleware(_Counted, metrics=metrics)
    if settings.cors_origins:
        # Outermost: a browser's preflight (OPTIONS, no credentials) is answered before the key check.
        # Any request header: the openai SDKs send their own (X-Stainless-*, OpenAI-Organization, ...).
        app.add_middleware(CORSMiddleware, allow_origins=list(settings.cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=["*"], max_age=600)
    _add_error_handlers(app)
    service = _Service(backend, queue, metrics, settings)
    limits = Limits(settings.max_n, settings.default_max_tokens, settings.default_seed)
    started = int(time.time())

    def model_card() -> dict:
        return {"id": backend.name, "object": "model", "created": started, "owned_by": "moespec"}

    @app.get("/health")
    async def health() -> dict:
        running, waiting = queue.counts()
        return {"status": "ok", "model": backend.name, "running": running, "waiting": waiting}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        _check_model(backend, model_id)
        return model_card()

    @app.get("/metrics")
    async def prometheus() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = parse_body(await request.body(), ChatCompletionRequest)
        _check_model(backend, body.model)
        # Off the event loop: rendering, and compiling a grammar the first time (llguidance: ms to ~1 s).
        specs = await asyncio.to_thread(chat_choices, body, backend, limits)
        return await service.respond(request, body, specs, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = parse_body(await request.body(), CompletionRequest)
        _check_model(backend, body.model)
        specs = await asyncio.to_thread(completion_choices, body, backend, limits)
        return await service.respond(request, body, specs, chat=False)

    return app


def _check_model(backend: ModelBackend, name: str) -> None:
    if name != backend.name:
        raise ApiError(404, f"the model {name!r} does not exist; this server serves {backend.name!r}",
                       param="model", code="model_not_found")


@dataclass(frozen=True)
class _Service:
    """What a generation request needs: the model, the queue, the metrics and the settings."""

    backend: ModelBackend
    queue: GenerationQueue
    metrics: ServerMetrics
    settings: ServeSettings

    def _work(self, specs: list[ChoiceSpec]):
        def work(job: Job) -> None:  # on the worker thread
            outs = self.backend.generate(job, specs)
            job.emit("done", outs)
            self.metrics.observe_generation(job, outs)
            self.metrics.observe_cache(self.backend.engine.om.cache)

        return work

    async def respond(self, request: Request, body: SamplingFields, specs: list[ChoiceSpec], chat: bool) -> Response:
        """Queue the generation of ``specs`` and answer it (JSON, or SSE when ``body.stream``).

        Raises:
            ApiError: 429 when the queue is full (with Retry-After); 503 when the server shuts down.
        """
        job = Job(work=self._work(specs), loop=asyncio.get_running_loop())
        try:
            self.queue.submit(job)
        except QueueFull as full:
            self.metrics.rejected.inc()
            raise ApiError(429, f"the server is busy: {full.waiting} requests wait for the model "
                                f"(--max-queue {self.settings.max_queue}); retry after {full.retry_after_s} s",
                           code="queue_full", headers={"Retry-After": str(full.retry_after_s)}) from None
        except QueueClosed:
            raise ApiError(503, "the server is shutting down", code="shutting_down") from None
        fmt = ResponseFormat(self.backend.name, chat, self.backend.token_text, body.choices())
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(_stream(request, job, self.queue, fmt, include_usage, len(specs)),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        watcher = asyncio.create_task(_watch(request, job, self.queue))
        try:
            while True:
                kind, payload = await job.events.get()
                if kind == "done":
                    if job.closed:
                        raise ApiError(503, "the server shut down before the answer was complete",
                                       code="shutting_down")
                    return JSONResponse(fmt.full(payload))
                if kind == "error":
                    if isinstance(payload, MoespecError):  # a fault while generating (a disk read), not the request's
                        raise ApiError(500, f"generation failed: {payload.message}") from payload
                    raise payload
                if kind == "gone":
                    return Response(status_code=499)  # nobody reads it
        except asyncio.CancelledError:
            self.queue.cancel(job)
            raise
        finally:
            watcher.cancel()


async def _watch(request: Request, job: Job, queue: GenerationQueue) -> None:
    """Cancel ``job`` when its client disconnects (checked every POLL_S; one cheap task per request).

    Why a task and not a timeout on each event: the consumer then awaits its events plainly, so a
    streamed token costs the event loop one wake-up and no timer.
    """
    while not job.cancelled.is_set():
        await asyncio.sleep(POLL_S)
        if await request.is_disconnected():
            queue.cancel(job)
            job.emit("gone", None)
            return


async def _stream(request: Request, job: Job, queue: GenerationQueue, fmt: ResponseFormat, include_usage: bool,
                  choices: int):
    finished = False
    watcher = asyncio.create_task(_watch(request, job, queue))
    try:
        first = fmt.first(range(choices))
        if first:
            yield first
        while True:
            events = [await job.events.get()]
            while not job.events.empty():  # a slow reader gets what piled up in one write
                events.append(job.events.get_nowait())
            out = []
            for kind, payload in events:
                if kind == "delta":
                    out.append(fmt.piece(payload))
                    continue
                if kind == "choice":
                    if not job.closed:
                        out.append(fmt.last(payload))
                    continue
                if kind == "gone":
                    return
                if kind == "done" and not job.closed:
                    if include_usage:
                        out.append(fmt.usage_chunk(payload))
                elif kind == "done":
                    out.append(sse(ApiError(503, "the server shut down before the answer was complete",
                                            code="shutting_down").body()))
                else:
                    err = payload if isinstance(payload, ApiError) else ApiError(500, f"generation failed: {payload}")
                    out.append(sse(err.body()))
                finished = True
                out.append(DONE)
                break
            yield "".join(out)
            if finished:
                return
    finally:
        watcher.cancel()
        if not finished:
            # Why here: Starlette cancels this generator when the client disconnects mid-stream.
            queue.cancel(job)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> Response:
        return exc.response()

    @app.exception_handler(MoespecError)
    async def moespec_error(request: Request, exc: MoespecError) -> Response:
        return ApiError(400, exc.message).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        return ApiError(exc.status_code, str(exc.detail)).response()

    @app.exception_handler(ClientDisconnect)
    async def gone(request: Request, exc: ClientDisconnect) -> Response:
        return Response(status_code=499)  # the client left while sending its body: nobody reads this

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception) -> Response:
        return ApiError(500, f"internal error: {type(exc).__name__}: {exc}").response()
