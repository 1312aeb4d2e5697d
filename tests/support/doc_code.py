"""docs/encode-once.md's code, as the tests run it.

Each runnable block is the ```python block after a `<!-- doc-code: NAME -->` line. A test runs the blocks in
the guide's order in one namespace, with only what is the reader's own substituted: the checkpoint path, the
encoder-cache folder and the server's address (each must occur, so a guide that drops one fails here).
"""

from __future__ import annotations

import re
from pathlib import Path

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "encode-once.md"
CKPT, EC_DIR, URL = "/ckpt/Kimi-K2.6", "/shared/ec", "http://127.0.0.1:8000"
_BLOCK = re.compile(r"<!-- doc-code: ([\w-]+) -->\n```python\n(.*?)\n```", re.S)


def blocks() -> dict[str, str]:
    found = _BLOCK.findall(GUIDE.read_text())
    assert len({name for name, _ in found}) == len(found), "a doc-code name used twice"
    return dict(found)


def block(name: str, **values: str) -> str:
    """Block `name` with the reader's values put in: ckpt=, ec_dir=, url= (each must be in the block)."""
    code = blocks()[name]
    for key, literal in {"ckpt": CKPT, "ec_dir": EC_DIR, "url": URL}.items():
        if key in values:
            assert f'"{literal}"' in code, f"{GUIDE.name} [{name}] no longer has {literal!r}"
            code = code.replace(f'"{literal}"', repr(None if values[key] is None else str(values[key])))
    return code


def line(prefix: str, **values: str) -> str:
    """The guide's command line starting with `prefix`, with the reader's values put in (ckpt=, ec_dir=)."""
    (found,) = [ln for ln in GUIDE.read_text().splitlines() if ln.startswith(prefix)]
    for key, literal in {"ckpt": CKPT, "ec_dir": EC_DIR}.items():
        if key in values:
            assert literal in found, f"{GUIDE.name}: {prefix!r} no longer has {literal!r}"
            found = found.replace(literal, str(values[key]))
    return found


def run(names, namespace: dict, **values) -> dict:
    """Run blocks in order in `namespace` (kept between calls) and return it."""
    for name in names:
        exec(compile(block(name, **values), f"{GUIDE.name}[{name}]", "exec"), namespace)
    return namespace


def write_inputs(directory: Path) -> None:
    """The reader's files the guide names, in `directory` (the tests run the guide there)."""
    from .media import make_video, png_bytes

    (Path(directory) / "cat.png").write_bytes(png_bytes(140, 112, 31))
    make_video(Path(directory) / "clip.mp4", frames=8, fps=2, size=(84, 56))
