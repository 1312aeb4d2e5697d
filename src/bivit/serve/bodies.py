"""Reading a request's body within the service's limits, and splitting it into items (multipart `file` parts or
JSON base64 items, `bivit.serve.protocol`): before any of it is decoded."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import tempfile
import urllib.parse
from typing import AsyncIterator, Optional

from fastapi import Request
from starlette.formparsers import MultiPartParser
from starlette.requests import ClientDisconnect

from ..errors import ErrorKind
from .protocol import UploadItem, parse_json_request, too_many_items, upload_name
from .metrics import Metrics
from .settings import ServerSettings

ENCODE_MEDIA_TYPES = ("multipart/form-data", "application/json")
ENCODE_HINT = "send multipart/form-data with 'file' parts or application/json {\"items\": [{\"data\": <base64>}]}"


def content_type(request: Request, accepted: tuple[str, ...] = ENCODE_MEDIA_TYPES, hint: str = ENCODE_HINT) -> str:
    """The request's media type if the route accepts it, else RequestError 415 (before reading the body)."""
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype not in accepted:
        raise ErrorKind.UNSUPPORTED_MEDIA_TYPE.error(f"Content-Type {ctype or '(none)'!r} is not accepted; {hint}")
    return ctype


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

    async def read(self, request: Request) -> bytearray:
        """An encode body: at most --max-body-mb (413 above), within --body-timeout-s (408), counted against
        `max_bodies_mb` as it arrives (503 beyond). Gathered in one growing buffer (chunks joined at the end held
        the body twice)."""
        body = bytearray()
        async for chunk in self._chunks(request, self.settings.max_body_mb, "--max-body-mb", counted=True):
            body += chunk
        return body

    @contextlib.asynccontextmanager
    async def spooled(self, request: Request, limit_mb: float, option: str) -> AsyncIterator[str]:
        """A body streamed to a temporary file (at most `limit_mb`, 413 above; within --body-timeout-s, 408),
        its path while the block runs: what it holds in memory is one chunk at a time (an 800 MiB weights body
        held whole took +2.4 GB, and was never given back)."""
        fd, path = tempfile.mkstemp(prefix="bivit-body-")
        try:
            with os.fdopen(fd, "wb") as f:
                async for chunk in self._chunks(request, limit_mb, option, counted=False):
                    try:
                        f.write(chunk)
                    except OSError as e:  # a full disk is the server's state, not the request's fault
                        raise ErrorKind.INSUFFICIENT_STORAGE.error(f"cannot hold the body in "
                                           f"{tempfile.gettempdir()} ({e.strerror or e})") from None
            yield path
        finally:
            os.unlink(path)

    async def _chunks(self, request: Request, limit_mb: float, option: str, counted: bool) -> AsyncIterator[bytes]:
        """The body's chunks, at most `limit_mb` (413 above) and within --body-timeout-s (408); `counted`: each
        counts against `max_bodies_mb` as it arrives (503 beyond), until the request is answered."""
        limit = self.settings.mb(limit_mb)
        declared = request.headers.get("content-length")
        if declared is not None:
            try:
                n = int(declared)
            except ValueError:
                raise ErrorKind.BAD_REQUEST.error(f"invalid Content-Length {declared!r}") from None
            if n > limit:
                raise ErrorKind.TOO_LARGE.error(f"request body of {n} bytes exceeds {option} "
                                   f"{limit_mb:g} ({limit} bytes)")
        deadline = asyncio.get_running_loop().time() + self.settings.body_timeout_s
        all_bodies = self.settings.mb(self.settings.max_bodies_mb)
        stream = request.stream().__aiter__()
        size = 0
        while True:
            try:
                async with asyncio.timeout_at(deadline):
                    chunk = await stream.__anext__()
            except StopAsyncIteration:
                return
            except TimeoutError:
                # A client sending slower than this holds a connection and a buffer: drop it (408 closes it).
                raise ErrorKind.BODY_TIMEOUT.error(f"request body not received within --body-timeout-s "
                                   f"{self.settings.body_timeout_s:g}", {"Connection": "close"}) from None
            except ClientDisconnect:
                raise ErrorKind.BAD_REQUEST.error("client disconnected while sending the body") from None
            size += len(chunk)
            if size > limit:  # a chunked or lying body: stop at the limit, never hold more than it
                raise ErrorKind.TOO_LARGE.error(f"request body exceeds {option} {limit_mb:g} ({limit} bytes)")
            if counted:
                if self.held + len(chunk) > all_bodies:
                    raise ErrorKind.BUSY.error(f"server busy: {self.held} bytes of request bodies held, "
                                       f"max_bodies_mb {self.settings.max_bodies_mb:g}; retry later",
                                       {"Retry-After": str(self.settings.retry_after_s)})
                self._hold(request, len(chunk))
            yield chunk

    async def parse_items(self, ctype: str, request: Request, body: bytearray) -> list[UploadItem]:
        """The items of a body of media type `ctype` (as `content_type` returned it), parsed on a worker thread:
        the parsers' work grows with what the body holds (5M empty multipart parts, 300,000 JSON objects), and
        the event loop answers every other connection meanwhile."""
        loop = asyncio.get_running_loop()
        if ctype == "multipart/form-data":
            scope = request.scope
            return await loop.run_in_executor(None, lambda: asyncio.run(self._parse_multipart(scope, body)))
        return await loop.run_in_executor(None, parse_json_request, body, self.settings.max_queue)

    async def _parse_multipart(self, scope: dict, body: bytearray) -> list[UploadItem]:
        """Runs in its own event loop on a worker thread (`parse_items`)."""
        sent = False

        async def replay() -> dict:  # feed the already-bounded body to Starlette's multipart parser
            nonlocal sent
            if sent:
                return {"type": "http.disconnect"}
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        max_items = self.settings.max_queue
        request = Request(scope, replay)
        try:
            form = await _Parser(request.headers, request.stream(), max_files=max_items, max_fields=max_items).parse()
        except OSError as e:  # a part past 1 MiB is spooled to a file: a full disk is the server's state (507)
            raise ErrorKind.INSUFFICIENT_STORAGE.error(f"cannot hold the upload's parts in "
                                                       f"{tempfile.gettempdir()} ({e.strerror or e})") from None
        except (MemoryError, RuntimeError):  # no memory, or no thread for the parser's file writes: 500, not 400
            raise
        except Exception as e:  # noqa: BLE001 - malformed multipart in any of the parser's ways
            reason = str(getattr(e, "message", None) or e)
            if reason.startswith(("Too many files", "Too many fields")):
                raise too_many_items("more", max_items) from None
            raise ErrorKind.BAD_REQUEST.error(f"malformed multipart body: {reason}") from None
        items = []
        try:
            for key, value in form.multi_items():
                if key != "file":
                    raise ErrorKind.BAD_REQUEST.error(f"unexpected form field {key!r}; send each image or "
                                       "video as a file part named 'file'")
                if isinstance(value, str):
                    raise ErrorKind.BAD_REQUEST.error("form field 'file' must be a file part (curl -F file=@path)")
                name, refused = upload_name(value.filename, len(items))
                data = None if refused else await value.read()
                items.append(UploadItem(name, data, (value.content_type or "").lower().startswith("video/"),
                                        error=refused))
        finally:
            await form.close()
        return items


# A part's plain `filename=` parameter; when a part has only RFC 5987's `filename*=`, `_Parser` adds one.
_FILENAME = re.compile(rb";\s*filename\s*=", re.I)
_FILENAME_STAR = re.compile(rb";\s*filename\*\s*=\s*(\"[^\"]*\"|[^;]*)", re.I)


class _Parser(MultiPartParser):
    """Starlette's multipart parser, which also takes a part's file name from RFC 5987's `filename*=` when the
    part has no plain `filename=`. RFC 7578 forbids that syntax in forms and python-multipart ignores it, so such
    a part was a text field and refused with a misleading 400; clients still send it for non-ASCII names
    (urllib3 1.x)."""

    def on_headers_finished(self) -> None:
        part = self._current_part
        disposition = part.content_disposition or b""
        star = _FILENAME_STAR.search(disposition)
        if star and not _FILENAME.search(disposition):
            value = star.group(1).strip().strip(b'"').decode("latin-1")
            charset, _, rest = value.partition("'")
            _, _, encoded = rest.partition("'")
            try:
                name = urllib.parse.unquote(encoded, encoding=charset or "utf-8", errors="strict")
            except (LookupError, UnicodeDecodeError):
                name = urllib.parse.unquote(encoded, encoding="latin-1")
            # As a quoted string the parser unquotes, in the bytes it decodes names from (UTF-8 by default).
            quoted = name.replace("\\", "\\\\").replace('"', '\\"').encode("utf-8", "surrogatepass")
            part.content_disposition = disposition + b'; filename="' + quoted + b'"'
        super().on_headers_finished()
