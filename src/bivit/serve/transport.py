"""The service's transport: uvicorn serving the app (`run`), with the limits uvicorn's public settings lack on a
connection: how many are open, how long a request's headers and an answer's reading may take, and what is read of
a body answered before it was read (`_protocol`).
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import resource
from http import HTTPStatus
from typing import Callable, Optional

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol  # private: pinned and checked (UVICORN_TESTED)

from ..core.encoder import Encoder
from ..errors import ErrorKind
from .logs import log
from .protocol import error_body
from .routes import create_app
from .settings import ServerSettings


def run(encoder: Encoder, settings: ServerSettings, *, host: str, port: int, log_level: str,
        held: Optional[Callable[[], bool]] = None) -> None:
    """Serve until SIGTERM/SIGINT; accepted requests get their answers first (bounded graceful shutdown).
    `held`: the batching worker's (`bivit.serve.batcher.Batcher`)."""
    if host not in ("127.0.0.1", "localhost", "::1") and not settings.api_key:
        log.warning("serving on a non-loopback interface without --api-key", extra={"fields": {"host": host}})
    limit = max_connections()
    config = uvicorn.Config(create_app(encoder, settings, held=held), host=host, port=port, log_config=None,
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
