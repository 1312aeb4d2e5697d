"""The FastAPI app of the encoder service: routes, auth, request ids, the request log, lifecycle.

`POST /v1/encode` (see `bivit.serve.protocol` for the wire format and `bivit.serve.serving` for what happens
to a request), `POST /v1/weights` (a safetensors body replacing every weight; refused while no API key is
set unless explicitly allowed), `GET /health` (liveness, no auth), `GET /ready`, `GET /v1/info` (the encoder's
`describe()`), `GET /metrics`. Auth guards every route but /health, with a constant-time compare.
`bivit.serve.transport.run` serves the app with uvicorn.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import re
import time
import uuid
from typing import Callable, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..core.encoder import Encoder
from ..errors import ErrorKind, RequestError
from .answers import CLIENT_RECEIVE, Answer
from .bodies import content_type
from .logs import log
from .protocol import SAFETENSORS_MEDIA_TYPE, answer, error_body, failed_answer
from .serving import Service
from .settings import ServerSettings


ROUTES = "POST /v1/encode, POST /v1/weights, GET /health, GET /ready, GET /v1/info, GET /metrics"
_PATHS = frozenset(route.split()[1] for route in ROUTES.split(", "))

# What a client may choose as its request id: it is echoed in a header and written to the log.
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:+=/-]{1,128}")


def _request_id(sent: Optional[str]) -> str:
    """The client's X-Request-ID when it is short and plain, else a fresh one (never echo arbitrary bytes)."""
    return sent if sent and _REQUEST_ID.fullmatch(sent) else uuid.uuid4().hex


def _bearer_ok(header: Optional[str], key: str) -> bool:
    if not header or not header.lower().startswith("bearer "):
        return False
    return hmac.compare_digest(header[7:].strip().encode(), key.encode())


def _names(info: dict) -> dict:
    """What /ready and the start-up log line say about the encoder: its model, fingerprint and output dtype."""
    return {"model": info["model"], "fingerprint": info["fingerprint"], "dtype": info["output_dtype"]}


def create_app(encoder: Encoder, settings: Optional[ServerSettings] = None, *,
               held: Optional[Callable[[], bool]] = None) -> FastAPI:
    """The service around a loaded Encoder. The app starts its worker on startup and drains it on shutdown.
    `held`: the batching worker's (`bivit.serve.batcher.Batcher`)."""
    settings = settings or ServerSettings()
    svc = Service(encoder, settings, held=held)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        svc.start()
        log.info("ready", extra={"fields": {**_names(svc.info), "max_batch_patches": svc.encoder.max_batch_patches,
                                            "max_queue": settings.max_queue,
                                            "cache_mb": settings.cache_mb if svc.cache.max_bytes else 0}})
        try:
            yield
        finally:
            # uvicorn calls this only after in-flight requests finished (graceful shutdown), so the queue is
            # normally empty; stop() still finishes anything queued before the worker ends.
            await asyncio.get_running_loop().run_in_executor(None, svc.stop)
            log.info("stopped")

    app = FastAPI(title="bivit encoder", version="1", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.service = svc

    @app.exception_handler(RequestError)
    async def _http_error(request: Request, exc: RequestError) -> JSONResponse:
        svc.metrics.errors.labels(exc.kind).inc()
        request.state.error = exc.message
        return JSONResponse(error_body(exc.kind, exc.message), exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _routing_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # The router's own answers (no such route, a method the route does not take) in the service's one shape.
        # The app raises no HTTPException of its own and reads every body itself: the router's 404 and 405 are
        # the only ones; anything else would be a bug, answered as one.
        said = {ErrorKind.NOT_FOUND: f"no route {request.url.path}; the service answers {ROUTES}",
                ErrorKind.METHOD_NOT_ALLOWED: f"{request.method} is not allowed on {request.url.path}"}
        kind = next((k for k in said if k.status == exc.status_code), ErrorKind.INTERNAL)
        message = said.get(kind, f"HTTP {exc.status_code}: {exc.detail}")
        svc.metrics.errors.labels(kind).inc()
        request.state.error = message
        return JSONResponse(error_body(kind, message), kind.status, headers=getattr(exc, "headers", None))

    @app.middleware("http")
    async def _frame(request: Request, call_next):
        # Request id, auth, structured request log. Auth guards every route except /health.
        rid = _request_id(request.headers.get("x-request-id"))
        request.scope[CLIENT_RECEIVE] = request.receive
        request.state.items = 0
        request.state.failed = 0
        request.state.error = None
        t0 = time.perf_counter()
        if "content-length" in request.headers and "transfer-encoding" in request.headers:
            # Which one frames the body is where a proxy and this server can disagree (request smuggling): refused,
            # and the connection closed after the answer, so nothing behind it on the connection is read
            # (RFC 9112, section 6.1).
            svc.metrics.errors.labels(ErrorKind.BAD_REQUEST).inc()
            request.state.error = "both Content-Length and Transfer-Encoding"
            response: Response = JSONResponse(
                error_body(ErrorKind.BAD_REQUEST, "a request may not carry both Content-Length and Transfer-Encoding"),
                ErrorKind.BAD_REQUEST.status,
                headers={"Connection": "close"})
        elif settings.api_key and request.url.path != "/health" and \
                not _bearer_ok(request.headers.get("authorization"), settings.api_key):
            svc.metrics.errors.labels(ErrorKind.AUTH).inc()
            request.state.error = "missing or wrong API key"
            response = JSONResponse(error_body(ErrorKind.AUTH, "missing or wrong API key "
                                               "(send 'Authorization: Bearer <key>')"), ErrorKind.AUTH.status,
                                    headers={"WWW-Authenticate": "Bearer"})
        else:
            try:
                response = await call_next(request)
            except Exception:  # noqa: BLE001 - a bug must still produce a 500 and a log line
                log.exception("unhandled error", extra={"fields": {"id": rid}})
                svc.metrics.errors.labels(ErrorKind.INTERNAL).inc()
                response = JSONResponse(error_body(ErrorKind.INTERNAL, "internal server error"),
                                        ErrorKind.INTERNAL.status)
            finally:
                svc.bodies.release(request)
        latency = time.perf_counter() - t0
        response.headers["X-Request-ID"] = rid
        if request.url.path == "/v1/encode":
            svc.metrics.latency.observe(latency)
        # Every route, as bivit_errors_total counts every refusal: 4 unauthenticated calls were 4 auth errors and
        # one 401 request (only /v1/encode was counted). A path that is no route is "other" (bounded labels).
        route = request.url.path if request.url.path in _PATHS else "other"
        svc.metrics.requests.labels(route, str(response.status_code)).inc()
        if request.url.path not in ("/health", "/metrics", "/ready") or response.status_code >= 400:
            fields = {"id": rid, "method": request.method, "path": request.url.path,
                      "status": response.status_code, "items": request.state.items,
                      "failed": request.state.failed, "latency_ms": round(latency * 1000, 3)}
            if request.state.error:
                fields["error"] = request.state.error
            log.info("request", extra={"fields": fields})
        return response

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        ok = svc.batcher.alive and not svc.draining
        body = {"ready": ok, "worker_alive": svc.batcher.alive, "draining": svc.draining, **_names(svc.info)}
        return JSONResponse(body, 200 if ok else 503)

    @app.get("/v1/info")
    async def encoder_info() -> dict:
        """The encoder's description (`Encoder.describe`: model, dtypes, fingerprint, preprocessing, kernels)."""
        return svc.info

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(svc.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/encode")
    async def encode(request: Request) -> Response:
        fmt = request.query_params.get("format", "safetensors")
        if fmt not in ("safetensors", "json"):
            raise ErrorKind.BAD_REQUEST.error(f"format must be 'safetensors' or 'json', got {fmt!r}")
        ctype = content_type(request)  # 415 before reading a byte of the body
        body = await svc.bodies.read(request)
        items = await svc.bodies.parse_items(ctype, request, body)
        if not items:
            raise ErrorKind.BAD_REQUEST.error("no items: send at least one 'file' part or JSON item")
        request.state.items = len(items)
        results, info, release = await _unless_disconnected(request, svc.encode_request(items, fmt == "json"))
        try:
            return await _answer(svc, request, results, info, fmt, release)
        except BaseException:
            release()
            raise

    @app.post("/v1/weights")
    async def weights(request: Request) -> JSONResponse:
        if not settings.api_key and not settings.allow_weight_updates_without_key:
            raise ErrorKind.FORBIDDEN.error("weight updates need an API key: start the server with --api-key "
                               "(or --allow-weight-updates-without-key on a trusted machine)")
        content_type(request, ("application/octet-stream", SAFETENSORS_MEDIA_TYPE),
                     "send the weights as a safetensors file, application/octet-stream")
        if svc.weights.busy.locked():  # one weights body at a time: each may be gigabytes (on disk)
            raise ErrorKind.BUSY.error("a weight update is in progress; retry later",
                                       {"Retry-After": str(settings.retry_after_s)})
        async with svc.weights.busy:
            async with svc.bodies.spooled(request, svc.weights.limit_mb, "--max-weights-mb") as path:
                return JSONResponse(await svc.weights.update(path))

    return app


async def _answer(svc: Service, request: Request, results: list, info: dict, fmt: str, release) -> Response:
    """The answer to an encoded request (`release`: what lets go of its bytes held against --max-answers-mb,
    once it is written)."""
    failed = [r for r in results if r.error is not None]
    request.state.failed = len(failed)
    for r in failed:
        svc.metrics.errors.labels(r.error_kind or ErrorKind.INTERNAL).inc()
    for r in results:
        svc.metrics.items.labels("error" if r.error else ("cached" if r.cached else "encoded")).inc()
    if len(failed) == len(results):
        # Nothing to return: a client error unless the server itself broke.
        status = max((r.error_kind or ErrorKind.INTERNAL).status for r in failed)  # 500 if the server broke
        request.state.error = failed[0].error
        body = await asyncio.get_running_loop().run_in_executor(None, failed_answer, info, results)
        return Answer(body, "application/json", status, release)
    # Made as it is sent (`bivit.serve.answers`); the file's header (every record) off the event loop.
    length, pieces = await asyncio.get_running_loop().run_in_executor(None, answer, info, results, fmt == "json")
    return Answer(pieces, "application/json" if fmt == "json" else SAFETENSORS_MEDIA_TYPE, release=release,
                  length=length)


async def _unless_disconnected(request: Request, work):
    """`await work`, cancelled when the client hangs up meanwhile (the body is read: the next message the server
    has for this request is its disconnect): its queued decodes and forward passes are dropped (a decode
    already running stops at its item's end), and the request is logged as 499."""
    task = asyncio.ensure_future(work)
    receive = request.scope.get(CLIENT_RECEIVE)

    async def hung_up() -> None:
        if receive is None:
            await asyncio.Event().wait()
        while (await receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(hung_up())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watch.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        raise ErrorKind.CLIENT_CLOSED.error("the client closed the connection before the answer")
    return task.result()
