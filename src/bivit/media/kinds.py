"""What an input is, image or video: the one rule every path through bivit applies (encoding a path, a
service upload, a dataset listing). Imports nothing heavy, so `bivit.serve.client` and the service's protocol use it
without loading PyAV or torch.

A name decides first: a video extension (`.gif` included, even with a single frame: how a path is encoded
never depends on its content) or an image extension; an unknown extension is a video when the bytes start like
a video container.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Union

# Names that are images when a folder is listed.
IMAGE_EXTENSIONS = frozenset({".png", ".jpg", ".jpeg", ".webp", ".bmp", ".tif", ".tiff"})
VIDEO_EXTENSIONS = frozenset({
    ".mp4", ".m4v", ".mov", ".qt", ".webm", ".mkv", ".mk3d", ".avi", ".gif", ".apng", ".mpg", ".mpeg", ".m2v",
    ".ts", ".m2ts", ".mts", ".wmv", ".asf", ".flv", ".3gp", ".3g2", ".ogv", ".mxf", ".vob", ".y4m", ".hevc",
    ".h264", ".h265", ".264", ".265", ".ivf", ".dv", ".nut",
})


def is_video_path(path: Union[str, os.PathLike]) -> bool:
    """True when the extension names a video container (case-insensitive); `.gif` always counts as video."""
    return Path(os.fspath(path)).suffix.lower() in VIDEO_EXTENSIONS


# ISO BMFF brands that are still images (an `ftyp` box does not by itself mean video).
_STILL_IMAGE_BRANDS = {b"avif", b"avis", b"heic", b"heix", b"heim", b"heis", b"hevc", b"hevx", b"mif1", b"msf1"}


def looks_like_video(data: bytes) -> bool:
    """True when the bytes start like a video container (decided from the bytes alone, so it is cache-safe)."""
    if len(data) >= 12 and data[4:8] == b"ftyp":
        return data[8:12] not in _STILL_IMAGE_BRANDS
    return (data[:4] == b"\x1a\x45\xdf\xa3"  # Matroska / WebM
            or (data[:4] == b"RIFF" and data[8:12] == b"AVI ")
            or data[:3] == b"FLV"
            or data[:4] == b"\x00\x00\x01\xba"  # MPEG program stream
            or (len(data) > 376 and data[0] == data[188] == data[376] == 0x47))  # MPEG transport stream


def media_kind(name: Union[str, os.PathLike], data: Optional[bytes] = None) -> Optional[str]:
    """"video", "image" or None (unknown): the one rule for what an input is.

    By extension first (`is_video_path`: how `Encoder.encode` treats a path, `.gif` included); an unknown
    extension is a video when `data` starts like a video container, else unknown.
    """
    if is_video_path(name):
        return "video"
    if Path(os.fspath(name)).suffix.lower() in IMAGE_EXTENSIONS:
        return "image"
    if data is not None and looks_like_video(data):
        return "video"
    return None


# Leading bytes of the image formats bivit reads (a GIF is a video to bivit: `is_video_path`).
_IMAGE_MAGIC = ((b"\x89PNG\r\n\x1a\n", "PNG"), (b"\xff\xd8\xff", "JPEG"), (b"GIF87a", "GIF"), (b"GIF89a", "GIF"),
                (b"BM", "BMP"), (b"II*\x00", "TIFF"), (b"MM\x00*", "TIFF"))
SNIFF_BYTES = 512  # enough for every signature above and `looks_like_video`


def sniff(data: bytes) -> Optional[str]:
    """What media the first bytes of a file are, in words ("a PNG image", "a video"), or None: for messages
    about a file given where it does not belong (an image passed as an embedding file)."""
    for magic, name in _IMAGE_MAGIC:
        if data.startswith(magic):
            return f"a {name} image"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "a WebP image"
    if len(data) >= 12 and data[4:8] == b"ftyp" and data[8:12] in _STILL_IMAGE_BRANDS:
        return "an HEIF/AVIF image"
    return "a video" if looks_like_video(data) else None
