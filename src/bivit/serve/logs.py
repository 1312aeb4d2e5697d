"""The service's log: one JSON object per line, for its request log and uvicorn's own messages."""

from __future__ import annotations

import json
import logging
import sys
import time
import traceback

from ..media.names import SHOWN_CHARS, shown

log = logging.getLogger("bivit.server")


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
    log.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = True
