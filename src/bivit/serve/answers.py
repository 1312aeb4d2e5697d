"""Writing an answer to its client: made in pieces as it is sent, and what it holds released once it is written or
its client is gone.

An answer made whole was a file of every copy of every item (safetensors' writer cloning each copy's rows),
then copied twice more (by h11, then into the socket's write buffer) and kept while the client did not read:
four clients that asked for ~210 MB answers (200 copies of one image) and read nothing took a server from 280
MB to 2.9 GB. Made in pieces (`bivit.core.records.file_pieces`: the header, then each tensor's bytes; copies of an
item read from its one tensor), each sent when the previous one has left the write buffer, an answer costs its
embeddings and about one piece. A JSON answer (`?format=json`, ~20 bytes a value) was one `json.dumps` call of
12 s under the interpreter lock for 145 MB; it is made a few rows at a time (`bivit.serve.protocol.json_chunks`).
Pieces are made on a worker thread. A client that reads nothing is cut off by the server's write timeout
(`bivit.serve.transport`); its answer stops being made.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Callable, Iterator, Optional, Union

from starlette.responses import Response

PIECE = 256 * 2**10

# Where the request frame keeps the server's own `receive` (the endpoint's is wrapped by the middleware, and
# cannot see a disconnect without waiting for one).
CLIENT_RECEIVE = "bivit.client_receive"


class Answer(Response):
    """An answer of `content` (bytes, sent in `PIECE`s, or an iterator of pieces made on a worker thread, of
    `length` bytes when known); `release` runs once it is written or abandoned (what it held against
    `--max-answers-mb`)."""

    def __init__(self, content: Union[bytes, Iterator[bytes]], media_type: str, status_code: int = 200,
                 release: Optional[Callable[[], None]] = None, length: Optional[int] = None):
        self.status_code, self.media_type, self.background = status_code, media_type, None
        self._content, self._release = content, release or (lambda: None)
        if isinstance(content, bytes):
            length = len(content)
        self.init_headers(None if length is None else {"content-length": str(length)})

    async def __call__(self, scope, receive, send) -> None:
        gone = asyncio.Event()

        async def watch() -> None:  # the client's disconnect (or the write timeout's abort) stops the answer
            client = scope.get(CLIENT_RECEIVE, receive)
            with contextlib.suppress(Exception):
                while (await client())["type"] != "http.disconnect":
                    pass
            gone.set()

        watcher = asyncio.ensure_future(watch())
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for piece in self._pieces():
                if gone.is_set():
                    return
                await send({"type": "http.response.body", "body": piece, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            watcher.cancel()
            self._release()

    async def _pieces(self):
        if isinstance(self._content, bytes):
            for start in range(0, len(self._content), PIECE):
                yield self._content[start:start + PIECE]
            return
        loop = asyncio.get_running_loop()
        while (piece := await loop.run_in_executor(None, next, self._content, None)) is not None:
            yield piece
