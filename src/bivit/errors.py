"""bivit's exceptions: every user mistake surfaces as one of these, with a message naming the file, key or reason."""

from __future__ import annotations

from typing import Optional


class BivitError(Exception):
    """Base class of every error bivit raises on purpose."""


class ConfigError(BivitError):
    """A config.json (or an option) holds a value bivit cannot honour; the message names the key."""


class CheckpointError(BivitError):
    """Weights are missing, malformed, mis-shaped or non-finite; the message names the key and the file."""


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
