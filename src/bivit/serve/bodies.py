"""Reading a request's body within the service's limits, and splitting it into items (multipart `file` parts or
JSON base64 items, `bivit.serve.protocol`): before any of it is decoded."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Optional

from fastapi import Request
from starlette.requests import ClientDisconnect

from .protocol import RequestError, UploadItem, parse_json_request, too_many_items
from .metrics import Metrics
from .settings import ServerSettings

ENCODE_MEDIA_TYPES = ("multipart/form-data", "application/json")
ENCODE_HINT = "send multipart/form-data with 'file' parts or application/json {\"items\": [{\"data\": <base64>}]}"


def content_type(request: Request, accepted: tuple[str, ...] = ENCODE_MEDIA_TYPES, hint: str = ENCODE_HINT) -> str:
    """The request's media type if the route accepts it, else RequestError 415 (before reading the body)."""
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype not in accepted:
        raise RequestError(415, "unsupported_media_type", f"Content-Type {ctype or '(none)'!r} is not accepted; {hint}")
    return ctype


# How long the rest of a refused body is read and dropped before the answer (see `_discard_body`).
DISCARD_S = 5.0


class BodyReader:
    """Reads bodies under one app's `ServerSettings` (body size and time limits, items per request), and the
    bytes of encode bodies held at once over all requests (`max_bodies_mb`: uploads that send 63 of 64 MB and
    stall held +2.3 GB at 32 of them)."""

    def __init__(self, settings: ServerSettings, metrics: Optional[Metrics] = None):
        self.settings = settings
        self.metrics = metrics
        self.held = 0  # bytes of encode bodies received and not yet released; event loop only

    def _hold(self, request: Request, n: int) -> None:
        self.held += n
        request.state.body_bytes = getattr(request.state, "body_bytes", 0) + n
        if self.metrics is not None:
            self.metrics.body_bytes.set(self.held)

    def release(self, request: Request) -> None:
        """The request is answered: its body no longer counts (called by the request frame, always)."""
        self._hold(request, -getattr(request.state, "body_bytes", 0))

    async def read(self, request: Request, limit_mb: Optional[float] = None, option: str = "--max-body-mb") -> bytes:
        """The whole body, at most `limit_mb` (default --max-body-mb; 413 above) and within --body-timeout-s (408).
        An encode body (the default limit) also counts against `max_bodies_mb` as it arrives: 503 beyond."""
        counted = limit_mb is None
        limit_mb = self.settings.max_body_mb if limit_mb is None else limit_mb
        limit = self.settings.mb(limit_mb)
        declared = request.headers.get("content-length")
        if declared is not None:
            try:
                n = int(declared)
            except ValueError:
                raise RequestError(400, "bad_request", f"invalid Content-Length {declared!r}") from None
            if n > limit:
                await self._discard_body(request, n)
                raise RequestError(413, "too_large", f"request body of {n} bytes exceeds {option} "
                                   f"{limit_mb:g} ({limit} bytes)")
        try:
            return await asyncio.wait_for(self._read(request, limit, f"{option} {limit_mb:g}", counted),
                                          self.settings.body_timeout_s)
        except asyncio.TimeoutError:
            # A client sending slower than this holds a connection and a buffer: drop it (408 closes it).
            raise RequestError(408, "body_timeout", f"request body not received within --body-timeout-s "
                               f"{self.settings.body_timeout_s:g}", {"Connection": "close"}) from None

    async def _read(self, request: Request, limit: int, option: str, counted: bool) -> bytes:
        chunks, size = [], 0
        all_bodies = self.settings.mb(self.settings.max_bodies_mb)
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:  # a chunked or lying body: stop at the limit, never hold more than it
                    await self._discard_body(request, limit)
                    raise RequestError(413, "too_large", f"request body exceeds {option} ({limit} bytes)")
                if counted:
                    if self.held + len(chunk) > all_bodies:
                        await self._discard_body(request, limit)
                        raise RequestError(503, "busy", f"server busy: {self.held} bytes of request bodies held, "
                                           f"max_bodies_mb {self.settings.max_bodies_mb:g}; retry later",
                                           {"Retry-After": str(self.settings.retry_after_s), "Connection": "close"})
                    self._hold(request, len(chunk))
                chunks.append(chunk)
        except ClientDisconnect:
            raise RequestError(400, "bad_request", "client disconnected while sending the body") from None
        return b"".join(chunks)

    async def _discard_body(self, request: Request, up_to: int) -> None:
        # Read and drop (a bounded amount of) the rest of the body before answering 413: closing a socket with
        # unread data sends a TCP reset, and the client would see "connection reset" instead of the 413.
        # A client that sent `Expect: 100-continue` has not sent the body; reading would invite it to.
        if "100-continue" in request.headers.get("expect", "").lower():
            return
        budget = min(up_to, self.settings.mb(self.settings.max_body_mb) + 64 * 2**20)

        async def drain() -> None:
            seen = 0
            async for chunk in request.stream():
                seen += len(chunk)
                if seen > budget:
                    return

        with contextlib.suppress(Exception):  # a client that stalls is not waited for past 5 s either
            await asyncio.wait_for(drain(), DISCARD_S)

    async def parse_items(self, ctype: str, request: Request, body: bytes) -> list[UploadItem]:
        """The items of a body of media type `ctype` (as `content_type` returned it), parsed on a worker thread:
        the parsers' work grows with what the body holds (5M empty multipart parts, 300,000 JSON objects), and
        the event loop answers every other connection meanwhile."""
        loop = asyncio.get_running_loop()
        if ctype == "multipart/form-data":
            scope = request.scope
            return await loop.run_in_executor(None, lambda: asyncio.run(self._parse_multipart(scope, body)))
        return await loop.run_in_executor(None, parse_json_request, body, self.settings.max_queue)

    async def _parse_multipart(self, scope: dict, body: bytes) -> list[UploadItem]:
        """Runs in its own event loop on a worker thread (`parse_items`)."""
        sent = False

        async def replay() -> dict:  # feed the already-bounded body to Starlette's multipart parser
            nonlocal sent
            if sent:
                return {"type": "http.disconnect"}
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        max_items = self.settings.max_queue
        try:
            form = await Request(scope, replay).form(max_files=max_items, max_fields=max_items)
        except Exception as e:  # noqa: BLE001 - malformed multipart in any of the parser's ways
            reason = str(getattr(e, "detail", None) or e)
            if reason.startswith(("Too many files", "Too many fields")):
                raise too_many_items("more", max_items) from None
            raise RequestError(400, "bad_request", f"malformed multipart body: {reason}") from None
        items = []
        try:
            for key, value in form.multi_items():
                if key != "file":
                    raise RequestError(400, "bad_request", f"unexpected form field {key!r}; send each image or "
                                       "video as a file part named 'file'")
                if isinstance(value, str):
                    raise RequestError(400, "bad_request",
                                       "form field 'file' must be a file part (curl -F file=@path)")
                data = await value.read()
                name = value.filename or f"item{len(items)}"
                items.append(UploadItem(name, data, (value.content_type or "").lower().startswith("video/")))
        finally:
            await form.close()
        return items
