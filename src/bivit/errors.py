"""bivit's exceptions: every user mistake surfaces as one of these, with a message naming the file, key or reason."""


class BivitError(Exception):
    """Base class of every error bivit raises on purpose."""


class ConfigError(BivitError):
    """A config.json (or an option) holds a value bivit cannot honour; the message names the key."""


class CheckpointError(BivitError):
    """Weights are missing, malformed, mis-shaped or non-finite; the message names the key and the file."""


class MediaError(BivitError):
    """An image or video cannot be decoded or is outside the limits; the message names the input and the reason."""
