"""The FastAPI app of the encoder service: routes, auth, request ids, the request log, lifecycle.

`POST /v1/encode` (see `bivit.serve.protocol` for the wire format and `bivit.serve.serving` for what happens
to a request), `POST /v1/weights` (a safetensors body replacing every weight; refused while no API key is
set unless explicitly allowed), `GET /health` (liveness, no auth), `GET /ready`, `GET /v1/info` (the encoder's
`describe()`), `GET /metrics`. Auth guards every route but /health, with a constant-time compare. `run` serves
an app with uvicorn (what `bivit serve` calls).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hmac
import json
import logging
import os
import re
import resource
import sys
import time
import traceback
import uuid
from http import HTTPStatus
from typing import Optional

import h11
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol  # private: pinned and checked (UVICORN_TESTED)

from ..encoder import Encoder
from ..names import SHOWN_CHARS, shown
from .answers import CLIENT_RECEIVE, Answer
from ..errors import ErrorKind, RequestError
from .protocol import SAFETENSORS_MEDIA_TYPE, answer, error_body, failed_answer
from .bodies import content_type
from .serving import Service, log
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


class JsonFormatter(logging.Formatter):
    """One JSON object per line: machine-readable logs for the request log and uvicorn's own messages."""

    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
               "level": record.levelname.lower(), "logger": record.name, "msg": record.getMessage()}
        out.update(getattr(record, "fields", {}))
        # What a line quotes (an upload's name, an error naming it) is cut: a 60 MB name was a 60 MB line.
        out = {k: shown(v) if isinstance(v, str) and len(v) > SHOWN_CHARS else v for k, v in out.items()}
        if record.exc_info:
            out["exc"] = "".join(traceback.format_exception(*record.exc_info))
        return json.dumps(out, default=str)


def configure_logging(level: str = "info") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # `bivit` CLI quiets the library logger; the service's own logs (one line per request) must still show.
    logging.getLogger("bivit.server").setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = True


def _names(info: dict) -> dict:
    """What /ready and the start-up log line say about the encoder: its model, fingerprint and output dtype."""
    return {"model": info["model"], "fingerprint": info["fingerprint"], "dtype": info["output_dtype"]}


def create_app(encoder: Encoder, settings: Optional[ServerSettings] = None) -> FastAPI:
    """The service around a loaded Encoder. The app starts its worker on startup and drains it on shutdown."""
    settings = settings or ServerSettings()
    svc = Service(encoder, settings)

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
        if svc.updating.locked():  # one weights body at a time: each may be gigabytes (on disk)
            raise ErrorKind.BUSY.error("a weight update is in progress; retry later",
                                       {"Retry-After": str(settings.retry_after_s)})
        async with svc.updating:
            async with svc.bodies.spooled(request, svc.weights_limit_mb, "--max-weights-mb") as path:
                return JSONResponse(await svc.update_weights(path))

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


def run(encoder: Encoder, settings: ServerSettings, *, host: str, port: int, log_level: str) -> None:
    """Serve until SIGTERM/SIGINT; accepted requests get their answers first (bounded graceful shutdown)."""
    if host not in ("127.0.0.1", "localhost", "::1") and not settings.api_key:
        log.warning("serving on a non-loopback interface without --api-key", extra={"fields": {"host": host}})
    limit = max_connections()
    config = uvicorn.Config(create_app(encoder, settings), host=host, port=port, log_config=None,
                            access_log=False, log_level=log_level.lower(), backlog=accept_burst(limit),
                            http=_protocol(settings.header_timeout_s, settings.write_timeout_s, limit),
                            timeout_graceful_shutdown=int(settings.request_timeout_s + settings.body_timeout_s) + 10)
    uvicorn.Server(config).run()


def max_connections() -> int:
    """Open connections the service keeps: half of the file descriptors it has left (RLIMIT_NOFILE less those
    open now: the model's files, pipes, threads), the rest left for what requests open. Past it asyncio's
    accept() fails with EMFILE: a traceback logged per attempt (167 MB of log in 40 s with 1100 slow
    connections at `ulimit -n 1024`) and probes 8 s late."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 65536
    try:
        open_now = len(os.listdir("/proc/self/fd"))
    except OSError:  # no /proc: count nothing as open
        open_now = 0
    return max(16, (soft - open_now) // 2)


def accept_burst(limit: int) -> int:
    """The listen backlog, which is also how many connections asyncio accepts in one go before any of them is
    seen by the protocol (its accept loop runs `backlog` times per wake-up). uvicorn's 2048 let a burst of
    connections take every descriptor before the oldest silent one could be closed to make room; an eighth of
    the connection limit keeps a burst within the half of the descriptors left free."""
    return max(8, min(2048, limit // 8))


# The uvicorn minor `_protocol` was read against (pyproject.toml pins it). uvicorn's public settings have no
# timeout for headers that trickle in nor for a client that stops reading, so `_protocol` subclasses its private
# H11Protocol and relies on its internals (`connections`, `cycle.response_complete`, `loop`, `transport`, `client`,
# and when it calls `data_received`, `pause_writing`, `resume_writing`): a new minor may rename any of them and
# silently lose the limits. To move the pin: re-read uvicorn/protocols/http/h11_impl.py, run
# tests/test_server_limits.py, then change this and pyproject.toml together.
UVICORN_TESTED = "0.55"

# What a connection whose request was answered before its body was read (a refusal: 401, 413, 415, 503, ...) may
# still send before it is closed. Closing at once, with unread bytes, sends a TCP reset that can reach the client
# before it has read the answer; reading to the end let an unauthenticated client stream 19 GB into a 401. So the
# answer is followed by a FIN, and at most LINGER_BYTES more are read and dropped, for at most LINGER_S.
LINGER_BYTES = 1 << 20
LINGER_S = 2.0

# The answer to a connection over the limit when no connection is still sending its headers.
_BUSY = json.dumps(error_body(ErrorKind.BUSY, "server busy: too many open connections; retry later")).encode()
_BUSY_RESPONSE = (f"HTTP/1.1 {ErrorKind.BUSY.status} {HTTPStatus(ErrorKind.BUSY.status).phrase}\r\n".encode()
                  + b"Content-Type: application/json\r\nRetry-After: 1\r\n"
                  b"Connection: close\r\nContent-Length: " + str(len(_BUSY)).encode() + b"\r\n\r\n" + _BUSY)


def _protocol(seconds: float, write_seconds: float, limit: int) -> type:
    """uvicorn's h11 protocol, closing a connection whose request headers take longer than `seconds` or whose
    client reads nothing of its answer for `write_seconds`, and keeping at most `limit` connections open.

    uvicorn times out idle kept-alive connections but not a request whose headers trickle in (one byte a
    second holds a connection and a buffer forever). The timer starts with the connection or with the first
    bytes of the next request on a kept-alive one, and stops when the headers are complete. A connection past
    `limit` closes the connection that has been sending its headers longest (a slow client makes room for a
    new one, a probe included); if none is, the new one is answered 503 and closed.

    A request answered before its body was read (every refusal) has its connection closed after the answer: at
    most LINGER_BYTES more of the body are read and dropped, for at most LINGER_S (uvicorn read and dropped it to
    its end: 19 GB chunked into a 401 in 10 s).

    Nor does uvicorn time out a client that stops reading: its answer waits in memory for as long as it keeps
    the connection (four such clients held 2.4 GB, for good). The write timer starts when the socket's write
    buffer fills (asyncio's `pause_writing`) and stops when it drains (`resume_writing`); if it runs out, the
    connection is aborted and what was buffered for it is dropped.
    """
    waiting: "collections.OrderedDict[H11Protocol, None]" = collections.OrderedDict()  # headers not complete

    class Protocol(H11Protocol):
        _header_timer: Optional[asyncio.TimerHandle] = None
        _write_timer: Optional[asyncio.TimerHandle] = None
        _linger: Optional[asyncio.TimerHandle] = None  # set while a refused body is dropped before the close
        _dropped = 0

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > limit:
                if not waiting:
                    transport.write(_BUSY_RESPONSE)
                    transport.close()
                    return
                oldest = next(iter(waiting))
                log.info("connection closed: the oldest still sending its headers, to keep at most "
                         f"{limit} connections", extra={"fields": {"client": oldest.client}})
                oldest._disarm()
                oldest.transport.close()
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self._linger is not None:  # the rest of a refused body: counted, never parsed
                self._dropped += len(data)
                if self._dropped > LINGER_BYTES:
                    self._close_lingering()
                return
            if self.cycle is None or self.cycle.response_complete:  # these bytes start a request
                self._arm()
            super().data_received(data)
            if self.cycle is not None and not self.cycle.response_complete:  # its headers are complete
                self._disarm()

        def on_response_complete(self) -> None:
            if self.conn.their_state is not h11.SEND_BODY or self.transport.is_closing():
                super().on_response_complete()
                return
            self.server_state.total_requests += 1
            self.flow.resume_reading()  # reading stopped while the body waited for the app: drop it now
            self.transport.write_eof()  # after the answer: the client sees the end at once
            self._linger = self.loop.call_later(LINGER_S, self._close_lingering)

        def _close_lingering(self) -> None:
            if self._linger is not None:
                self._linger.cancel()
            log.info("connection closed: its request was answered before its body was read",
                     extra={"fields": {"client": self.client, "dropped_bytes": self._dropped}})
            self.transport.close()

        def connection_lost(self, exc: Optional[Exception]) -> None:
            if self._linger is not None:
                self._linger.cancel()
            self._disarm()
            if self._write_timer is not None:
                self._write_timer.cancel()
            super().connection_lost(exc)

        def pause_writing(self) -> None:
            super().pause_writing()
            if self._write_timer is None:
                self._write_timer = self.loop.call_later(write_seconds, self._write_expired)

        def resume_writing(self) -> None:
            if self._write_timer is not None:
                self._write_timer.cancel()
                self._write_timer = None
            super().resume_writing()

        def _write_expired(self) -> None:
            self._write_timer = None
            log.info("connection closed: its client read nothing of its answer within --write-timeout-s",
                     extra={"fields": {"client": self.client, "write_timeout_s": write_seconds}})
            self.transport.abort()

        def _arm(self) -> None:
            if self._header_timer is None:
                self._header_timer = self.loop.call_later(seconds, self._expire)
                waiting[self] = None

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None
            waiting.pop(self, None)

        def _expire(self) -> None:
            self._header_timer = None
            waiting.pop(self, None)
            log.info("connection closed: request headers not received within --header-timeout-s",
                     extra={"fields": {"client": self.client, "header_timeout_s": seconds}})
            self.transport.close()

    return Protocol
