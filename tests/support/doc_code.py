"""The guides' code, as the tests run it: docs/encode-once.md (the default `guide`) and docs/rl.md (`RL_GUIDE`).

Each runnable block is the ```python block after a `<!-- doc-code: NAME -->` line. A test runs the blocks in
the guide's order in one namespace, with only what is the reader's own substituted: the checkpoint path, the
encoder-cache folder, the server's address and the folder a trained model is saved to (each must occur, so a
guide that drops one fails here).
"""

from __future__ import annotations

import re
from pathlib import Path

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "encode-once.md"
RL_GUIDE = GUIDE.with_name("rl.md")
CKPT, EC_DIR, URL, OUT = "/ckpt/Kimi-K2.6", "/shared/ec", "http://127.0.0.1:8000", "/ckpt/Kimi-K2.6-grpo"
_BLOCK = re.compile(r"<!-- doc-code: ([\w-]+) -->\n```python\n(.*?)\n```", re.S)


def blocks(guide: Path = GUIDE) -> dict[str, str]:
    found = _BLOCK.findall(guide.read_text())
    assert len({name for name, _ in found}) == len(found), "a doc-code name used twice"
    return dict(found)


LITERALS = {"ckpt": CKPT, "ec_dir": EC_DIR, "url": URL, "out": OUT}


def block(name: str, guide: Path = GUIDE, **values) -> str:
    """Block `name` with the reader's values put in where the block has them: ckpt=, ec_dir=, url=, out=."""
    code = blocks(guide)[name]
    for key, value in values.items():
        code = code.replace(f'"{LITERALS[key]}"', repr(None if value is None else str(value)))
    return code


def line(prefix: str, **values: str) -> str:
    """The guide's command line starting with `prefix`, with the reader's values put in (ckpt=, ec_dir=)."""
    (found,) = [ln for ln in GUIDE.read_text().splitlines() if ln.startswith(prefix)]
    for key, literal in {"ckpt": CKPT, "ec_dir": EC_DIR}.items():
        if key in values:
            assert literal in found, f"{GUIDE.name}: {prefix!r} no longer has {literal!r}"
            found = found.replace(literal, str(values[key]))
    return found


def run(names, namespace: dict, *, guide: Path = GUIDE, engine=None, **values) -> dict:
    """Run blocks in order in `namespace` (kept between calls) and return it. With `engine`, the blocks'
    `llm = LLM(...)` is answered by `engine(...)` (the same arguments) instead of starting a vLLM engine."""
    unused = {k for k in values if all(f'"{LITERALS[k]}"' not in blocks(guide)[n] for n in names)}
    assert not unused, f"{guide.name} {list(names)} no longer have {[LITERALS[k] for k in unused]}"
    for name in names:
        code = block(name, guide, **values)
        if engine is not None and "LLM(" in code:
            assert code.count("llm = LLM(") == code.count("LLM(") == 1, f"{guide.name} [{name}]: one LLM(...)"
            code = code.replace("llm = LLM(", "llm = __engine__(")
            namespace["__engine__"] = engine
        exec(compile(code, f"{guide.name}[{name}]", "exec"), namespace)
    return namespace


def fenced() -> list[tuple[str, str]]:
    """The guide's fenced blocks: (info string, body), in order."""
    out, info, body = [], None, []
    for ln in GUIDE.read_text().splitlines():
        if ln.startswith("```"):
            if info is None:
                info, body = ln[3:].strip(), []
            else:
                out.append((info, "\n".join(body)))
                info = None
        elif info is not None:
            body.append(ln)
    return out


def server_options() -> set[str]:
    """Every `--option` the guide's vLLM server commands pass."""
    commands = [b for info, b in fenced() if not info and "vllm.entrypoints.openai.api_server" in b]
    assert commands, f"{GUIDE.name}: no vLLM server command"
    return {o for c in commands for o in re.findall(r"(?<![\w-])--[a-z][a-z-]*", c)}


def write_inputs(directory: Path) -> None:
    """The reader's files the guide names, in `directory` (the tests run the guide there)."""
    from .media import make_video, png_bytes

    (Path(directory) / "cat.png").write_bytes(png_bytes(140, 112, 31))
    make_video(Path(directory) / "clip.mp4", frames=8, fps=2, size=(84, 56))
