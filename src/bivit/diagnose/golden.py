"""Golden rows: fixed inputs whose encoded rows' SHA-256 are committed (bivit/diagnose/golden.json), per model and
dtype, for bivit-arith/1. Any machine that computes bivit-arith/1 reproduces them bit for bit; `bivit doctor --prove`
checks the demo model's on the user's machine, the test suite checks every kernel a machine runs against them.

The inputs are made from integers alone (numpy's PCG64: the same on every platform): five images of mixed sizes
(one as small as a patch grid allows, others with hundreds of patches, so attention sees more than 16 keys and
more than a 128-key chunk) and a video given as decoded frames (`VideoFrames`: no container, no YUV conversion,
so nothing outside bivit's arithmetic decides its pixels). Images go through bivit's preprocessing (Pillow's
resize, exact integer arithmetic) like any image.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from ..core.items import VideoFrames

GOLDEN_FILE = Path(__file__).resolve().parent / "golden.json"

IMAGE_SIZES = ((300, 40), (224, 224), (448, 336), (90, 250), (28, 28))  # (width, height)
VIDEO = (6, 96, 64, 10.0)  # frames, width, height, fps


def pixels(height: int, width: int, seed: int) -> np.ndarray:
    """Smooth gradients plus noise (a picture, not white noise, so resizing and patches see structure)."""
    g = np.random.Generator(np.random.PCG64(seed))
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([(x * 255) // max(width - 1, 1), (y * 255) // max(height - 1, 1), ((x + y) * 127) // max(
        width + height - 2, 1)], axis=-1)
    noise = g.integers(-24, 25, size=(height, width, 3))
    return np.clip(base + noise, 0, 255).astype(np.uint8)


def inputs() -> dict[str, object]:
    """name -> input (a PIL image or a VideoFrames), in a fixed order."""
    out: dict[str, object] = {}
    for i, (w, h) in enumerate(IMAGE_SIZES):
        out[f"image {w}x{h}"] = Image.fromarray(pixels(h, w, i))
    frames, w, h, fps = VIDEO
    out[f"video {frames}x{w}x{h}"] = VideoFrames([pixels(h, w, 100 + f) for f in range(frames)], fps,
                                                  name="golden video")
    return out


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def rows(encoder) -> dict[str, str]:
    """SHA-256 of each golden input's rows under `encoder` (each input encoded alone)."""
    return {name: digest(encoder.encode([x])[0]) for name, x in inputs().items()}


def committed() -> dict:
    """{class: {model: {dtype: {input: sha256}}}} from bivit/diagnose/golden.json."""
    return json.loads(GOLDEN_FILE.read_text())


@dataclass(frozen=True)
class Check:
    """The golden rows of one model and dtype on this machine against the committed ones."""

    bits: str
    model: str
    dtype: str
    differ: tuple[str, ...]  # inputs whose rows are not the committed bits
    total: int
    committed: bool          # hashes are committed for this class, model and dtype

    @property
    def match(self) -> bool:
        return self.committed and not self.differ

    def line(self) -> str:
        head = f"bits {self.bits}: "
        if not self.committed:
            return head + f"no committed rows for {self.model} at {self.dtype} (a class of this machine only)"
        if self.match:
            return head + f"match ({self.total} inputs, {self.model} at {self.dtype})"
        return head + f"MISMATCH in {len(self.differ)} of {self.total} inputs ({', '.join(self.differ)}; " \
                      f"{self.model} at {self.dtype})"


def check(encoder, model: str = "demo") -> Check:
    """Encode the golden inputs with `encoder` and compare with the committed rows of `model` (a key of
    golden.json) at its dtype, for its class of bits."""
    dtype = str(encoder.dtype).removeprefix("torch.")
    want = committed().get(encoder.bits, {}).get(model, {}).get(dtype)
    got = rows(encoder)
    if want is None:
        return Check(encoder.bits, model, dtype, (), len(got), False)
    return Check(encoder.bits, model, dtype, tuple(k for k in got if got[k] != want.get(k)), len(got), True)
