"""bivit's exceptions and its one table of error kinds.

Every user mistake surfaces as one of these exceptions, with a message naming the file, key or reason. Each
failure a front end reports has a kind (`ErrorKind`): its name on the wire (the service's `error_kind` and
`{"error": {"kind"}}`, a dataset's errors.jsonl) and its HTTP status. The table below is the only place a
kind is spelled; every site names a member.
"""

from __future__ import annotations

import enum
from typing import Optional


class BivitError(Exception):
    """Base class of every error bivit raises on purpose."""


class ConfigError(BivitError):
    """A config.json (or an option) holds a value bivit cannot honour; the message names the key."""


class CheckpointError(BivitError):
    """Weights are missing, malformed, mis-shaped or non-finite; the message names the key and the file."""


class FormatError(BivitError):
    """A file that is not a bivit embedding file, or one of a format version this bivit does not read."""


class MediaError(BivitError):
    """An image or video cannot be decoded or is outside the limits; the message names the input and the reason.

    `source` is the input's name as the message spells it (a path, an upload's name, `<N bytes>`) when known, so
    a caller can report it without parsing the message; `reason` is the message without that name.
    """

    def __init__(self, message: str, source: Optional[str] = None):
        super().__init__(message)
        self.source = source

    @property
    def reason(self) -> str:
        msg = str(self)
        if self.source is not None and msg.startswith(f"{self.source}: "):
            return msg[len(self.source) + 2:]
        return msg

    def about(self, name: str) -> str:
        """The message for a report already keyed by input `name`: the reason alone when the error is about
        that input, else the whole message (which names the file at fault, e.g. one frame of a video)."""
        return self.reason if self.source == name else str(self)


class InvarianceError(BivitError):
    """Invariant mode cannot keep its promise on this machine (no proven path for an op, or proofs disagree)."""


class BadItem(BivitError):
    """An uploaded item that could not even be extracted from its request (bad base64, a name too long)."""


class EncodeFailed(BivitError):
    """A forward pass that raised something other than a BivitError: bivit's fault, not the input's."""


class RequestError(BivitError):
    """A request the service refuses, whole: its `kind` (a request-level `ErrorKind`, which gives the HTTP
    `status`), the message, extra response `headers`."""

    def __init__(self, kind: "ErrorKind", message: str, headers: Optional[dict[str, str]] = None):
        super().__init__(message)
        self.kind, self.message, self.headers = kind, message, headers or {}

    @property
    def status(self) -> int:
        return self.kind.status


class ErrorKind(str, enum.Enum):
    """The kinds of failure bivit reports, each with what every front end says about it.

    value      its name on the wire: a record's `error_kind`, an error answer's `error.kind`, the metrics label
    status     the HTTP status of an answer that fails for this reason alone
    exception  the exception class that carries it (request-level kinds: `RequestError`, which names its kind)

    A str: a record's `error_kind` compares equal to its wire name (`r.error_kind == "media"`).
    """

    # One item of a request (or of `bivit encode`, or of a dataset job) failed; the others are answered.
    BAD_ITEM = ("bad_item", 422, BadItem)
    MEDIA = ("media", 422, MediaError)
    INVALID = ("invalid", 422, BivitError)
    INTERNAL = ("internal", 500, EncodeFailed)
    # The request as a whole is refused (`RequestError`).
    BAD_REQUEST = ("bad_request", 400, RequestError)
    AUTH = ("auth", 401, RequestError)
    FORBIDDEN = ("forbidden", 403, RequestError)
    NOT_FOUND = ("not_found", 404, RequestError)
    METHOD_NOT_ALLOWED = ("method_not_allowed", 405, RequestError)
    BODY_TIMEOUT = ("body_timeout", 408, RequestError)
    TOO_LARGE = ("too_large", 413, RequestError)
    TOO_MANY_ITEMS = ("too_many_items", 413, RequestError)
    RESPONSE_TOO_LARGE = ("response_too_large", 413, RequestError)
    UNSUPPORTED_MEDIA_TYPE = ("unsupported_media_type", 415, RequestError)
    BAD_WEIGHTS = ("bad_weights", 422, RequestError)
    QUEUE_FULL = ("queue_full", 429, RequestError)
    CLIENT_CLOSED = ("client_closed", 499, RequestError)
    BUSY = ("busy", 503, RequestError)
    TIMEOUT = ("timeout", 504, RequestError)
    INSUFFICIENT_STORAGE = ("insufficient_storage", 507, RequestError)

    def __new__(cls, value: str, status: int, exception: type):
        obj = str.__new__(cls, value)
        obj._value_ = value
        obj.status, obj.exception = status, exception
        return obj

    def __str__(self) -> str:
        return self.value

    @property
    def item(self) -> bool:
        """A kind one item of many can have (the others answered), not a refusal of the whole request."""
        return self.exception is not RequestError

    def error(self, message: str, headers: Optional[dict[str, str]] = None) -> RequestError:
        """The `RequestError` refusing a request for this (request-level) reason."""
        assert not self.item, f"{self.value} is an item's kind"
        return RequestError(self, message, headers)

    @classmethod
    def of(cls, error: BaseException) -> "ErrorKind":
        """The kind of an exception: a RequestError's own; else the kind of the nearest class in its MRO that
        the table names (a ConfigError or CheckpointError is INVALID, as any BivitError); an exception that is
        not bivit's is INTERNAL (a bug)."""
        if isinstance(error, RequestError):
            return error.kind
        for klass in type(error).__mro__:
            kind = _BY_EXCEPTION.get(klass)
            if kind is not None:
                return kind
        return cls.INTERNAL

    @classmethod
    def read(cls, value: object) -> Optional["ErrorKind"]:
        """A kind as a file or an answer spells it; None for none, or one this bivit does not know (a newer
        writer's)."""
        try:
            return None if value is None else cls(value)
        except ValueError:
            return None


_BY_EXCEPTION = {k.exception: k for k in ErrorKind if k.item}
