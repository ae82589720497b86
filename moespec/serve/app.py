"""The FastAPI app: OpenAI-compatible routes over one ModelBackend and one GenerationQueue.

Routes: GET /health, GET /v1/models, POST /v1/chat/completions, POST /v1/completions,
GET /metrics. A generation request is parsed and checked here (400/404 before it queues),
then becomes a Job; the handler relays the worker's events as one JSON body or as
server-sent events. A client that goes away cancels its job: a waiting job leaves the queue,
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

from moespec.config import SamplingConfig
from moespec.errors import MoespecError
from moespec.serve.backend import GenerationRequest, ModelBackend
from moespec.serve.errors import ApiError
from moespec.serve.metrics import ServerMetrics
from moespec.serve.queue import GenerationQueue, Job, QueueFull
from moespec.serve.responses import DONE, ResponseFormat, sse
from moespec.serve.schemas import ChatCompletionRequest, CompletionRequest, SamplingFields, parse_body
from moespec.serve.security import Gate

POLL_S = 0.1  # how often a waiting non-streamed request checks that its client is still there
_ENDPOINTS = ("/health", "/metrics", "/v1/models", "/v1/chat/completions", "/v1/completions")


@dataclass(frozen=True)
class ServeSettings:
    """Server behaviour (the `moespec serve` options).

    Attributes:
        api_key: Bearer key clients must send (None: no key; only allowed on loopback).
        max_queue: most requests waiting while one generates (past it: 429).
        max_body_bytes: largest request body (past it: 413).
        default_max_tokens: new tokens when a request names no max_tokens.
        default_seed: sampling seed when a request names none.
    """

    api_key: str | None = None
    max_queue: int = 16
    max_body_bytes: int = 1 << 20
    default_max_tokens: int = 256
    default_seed: int = 0


class _Counted:
    """ASGI middleware counting responses per endpoint and status code."""

    def __init__(self, app, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        endpoint = scope["path"] if scope["path"] in _ENDPOINTS else "other"

        async def counted(message):
            if message["type"] == "http.response.start":
                self.metrics.requests.labels(endpoint, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counted)


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
    _add_error_handlers(app)
    service = _Service(backend, queue, metrics, settings)
    started = int(time.time())

    @app.get("/health")
    async def health() -> dict:
        running, waiting = queue.counts()
        return {"status": "ok", "model": backend.name, "running": running, "waiting": waiting}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": backend.name, "object": "model", "created": started,
                                            "owned_by": "moespec"}]}

    @app.get("/metrics")
    async def prometheus() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = parse_body(await request.body(), ChatCompletionRequest)
        _check_model(backend, body.model)
        ids = backend.chat_ids(body.rendered_messages())
        return await service.respond(request, body, ids, "messages", chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = parse_body(await request.body(), CompletionRequest)
        _check_model(backend, body.model)
        ids = backend.text_ids(body.prompt)
        return await service.respond(request, body, ids, "prompt", chat=False)

    return app


def _check_model(backend: ModelBackend, name: str) -> None:
    if name != backend.name:
        raise ApiError(404, f"the model {name!r} does not exist; this server serves {backend.name!r}",
                       param="model", code="model_not_found")


def _sampling(body: SamplingFields, settings: ServeSettings) -> SamplingConfig:
    return SamplingConfig(
        max_new_tokens=body.token_limit() or settings.default_max_tokens,
        temperature=0.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        seed=settings.default_seed if body.seed is None else body.seed,
    )


@dataclass(frozen=True)
class _Service:
    """What a generation request needs: the model, the queue, the metrics and the settings."""

    backend: ModelBackend
    queue: GenerationQueue
    metrics: ServerMetrics
    settings: ServeSettings

    def _work(self, gen: GenerationRequest):
        def work(job: Job) -> None:  # on the worker thread
            out = self.backend.generate(job, gen)
            job.emit("done", out)
            self.metrics.observe_generation(job, out)
            self.metrics.observe_cache(self.backend.engine.om.cache)

        return work

    async def respond(self, request: Request, body: SamplingFields, ids: list[int], param: str,
                      chat: bool) -> Response:
        """Queue the generation of ``ids`` and answer it (JSON, or SSE when ``body.stream``).

        Raises:
            ApiError: 400 when the prompt does not fit (``param`` names the field), 429 when the
                queue is full (with Retry-After).
        """
        self.backend.check(ids, param)
        gen = GenerationRequest(ids, _sampling(body, self.settings), body.stop_strings())
        job = Job(work=self._work(gen), loop=asyncio.get_running_loop())
        try:
            self.queue.submit(job)
        except QueueFull as full:
            self.metrics.rejected.inc()
            raise ApiError(429, f"the server is busy: {full.waiting} requests wait for the model "
                                f"(--max-queue {self.settings.max_queue}); retry after {full.retry_after_s} s",
                           code="queue_full", headers={"Retry-After": str(full.retry_after_s)}) from None
        fmt = ResponseFormat(self.backend.name, chat)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(_stream(request, job, self.queue, fmt, include_usage),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        watcher = asyncio.create_task(_watch(request, job, self.queue))
        try:
            while True:
                kind, payload = await job.events.get()
                if kind == "done":
                    return JSONResponse(fmt.full(payload))
                if kind == "error":
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


async def _stream(request: Request, job: Job, queue: GenerationQueue, fmt: ResponseFormat, include_usage: bool):
    finished = False
    watcher = asyncio.create_task(_watch(request, job, queue))
    try:
        first = fmt.first()
        if first:
            yield first
        while True:
            events = [await job.events.get()]
            while not job.events.empty():  # a slow reader gets what piled up in one write
                events.append(job.events.get_nowait())
            out = []
            for kind, payload in events:
                if kind == "text":
                    out.append(fmt.piece(payload))
                    continue
                if kind == "gone":
                    return
                if kind == "done":
                    out.append(fmt.last(payload))
                    if include_usage:
                        out.append(fmt.usage_chunk(payload))
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

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception) -> Response:
        return ApiError(500, f"internal error: {type(exc).__name__}: {exc}").response()
