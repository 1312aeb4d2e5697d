"""The one table of error kinds (`bivit.errors.ErrorKind`), walked: every kind is reached from a real input
(a real `bivit serve` process on loopback, the real `bivit encode` and `bivit encode-dataset` commands), and what
the answer, the record, the CLI line and the dataset's errors.jsonl say is what the table says; statuses are
distinct where a client acts on them; each exception class has one kind; no kind is spelled outside the table.
"""

from __future__ import annotations

import base64
import json
import re
import resource
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Callable

import httpx
import pytest

import bivit
from bivit.errors import (BadItem, BivitError, CheckpointError, ConfigError, EncodeFailed, ErrorKind, FormatError,
                          MediaError, RequestError)

from support.media import png_bytes
from support.server import ServerProcess

pytest.importorskip("fastapi")

KEY = "table-key"
SRC = Path(bivit.__file__).parent
# Answers: one 364x336 image (156 tokens, bf16, 128 wide: ~41 KB) fits --max-response-mb, two in flight do not fit
# --max-answers-mb; a 448x448 one (256 tokens, ~66 KB) does not fit alone.
ANSWER_MB, ANSWERS_MB = "0.05", "0.06"


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    srv = ServerProcess(["--max-body-mb", "1", "--max-queue", "2", "--body-timeout-s", "1", "--request-timeout-s",
                         "10", "--max-response-mb", ANSWER_MB, "--max-answers-mb", ANSWERS_MB, "--cache-mb", "0",
                         "--max-wait-ms", "10"], tmp_path_factory.mktemp("keyed"), api_key=KEY, holdable=True)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def keyless(tmp_path_factory):
    srv = ServerProcess(["--cache-mb", "0"], tmp_path_factory.mktemp("keyless"))
    yield srv
    srv.stop()


class Env:
    """What a trigger may use: the two servers (started when first asked for) and a scratch folder."""

    def __init__(self, request: pytest.FixtureRequest, tmp_path: Path):
        self.request, self.tmp = request, tmp_path

    @property
    def keyed(self) -> ServerProcess:
        return self.request.getfixturevalue("keyed")

    @property
    def keyless(self) -> ServerProcess:
        return self.request.getfixturevalue("keyless")


def refused(r: httpx.Response, kind: ErrorKind) -> dict:
    """The answer is the table's: its status and `{"error": {"kind"}}`; -> its JSON."""
    assert (r.status_code, r.json()["error"]["kind"]) == (kind.status, kind.value), r.text[:500]
    return r.json()


def encode(srv: ServerProcess, parts: list[tuple[str, bytes]], **kw) -> httpx.Response:
    return httpx.post(f"{srv.url}/v1/encode", headers=srv.headers, timeout=60,
                      files=[("file", (name, data, "application/octet-stream")) for name, data in parts], **kw)


def raw(srv: ServerProcess, head: bytes, body: bytes = b"") -> bytes:
    """A request written on a socket by hand -> everything the server answers before it closes."""
    with socket.create_connection(("127.0.0.1", srv.port), timeout=60) as s:
        s.sendall(head + body)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out


def cli(*args, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bivit", *map(str, args)], capture_output=True, text=True,
                          timeout=300, **kw)


def item_everywhere(env: Env, kind: ErrorKind, name: str, data: bytes) -> None:
    """An item of `kind` through every front end the table says meets it: the service answers the table's status
    with the kind in the item's record; `bivit encode` says it skipped the item and files the kind in the record;
    `bivit encode-dataset` keeps the kind in errors.jsonl."""
    body = refused(encode(env.keyed, [(name, data)]), kind)
    assert body["items"][0]["error_kind"] == kind.value and body["items"][0]["error"].startswith(name)
    (env.tmp / "in").mkdir()
    (env.tmp / "in" / name).write_bytes(data)
    (env.tmp / "in" / "good.png").write_bytes(png_bytes(56, 56, 1))
    r = cli("encode", env.tmp / "in" / name, env.tmp / "in" / "good.png", "--out", env.tmp / "e.safetensors")
    assert r.returncode == 1 and f"bivit: skipped: {env.tmp / 'in' / name}: " in r.stderr, r.stderr[-2000:]
    recs = bivit.load_embeddings(env.tmp / "e.safetensors")
    assert recs[0].error_kind == kind and recs[1].error_kind is None and recs[1].ok
    r = cli("encode-dataset", env.tmp / "in", "--out", env.tmp / "ds", "--no-progress")
    assert r.returncode == 1, r.stderr[-2000:]
    rows = [json.loads(line) for line in (env.tmp / "ds" / "errors.jsonl").read_text().splitlines()]
    assert [(row["source"], row["error_kind"]) for row in rows] == [(name, kind.value)]
    [err] = bivit.open_dataset(env.tmp / "ds").errors
    assert err.error_kind == kind and err.error.startswith(f"{name}: ")


# ------------------------------------------------------------------------------------------- the triggers

TRIGGERS: dict[ErrorKind, Callable[[Env], None]] = {}


def trigger(kind: ErrorKind):
    def register(fn: Callable[[Env], None]) -> Callable[[Env], None]:
        TRIGGERS[kind] = fn
        return fn
    return register


@trigger(ErrorKind.MEDIA)
def _(env: Env) -> None:
    item_everywhere(env, ErrorKind.MEDIA, "broken.png", png_bytes(56, 56, 2)[:60])  # a truncated PNG


@trigger(ErrorKind.BAD_ITEM)
def _(env: Env) -> None:
    body = refused(httpx.post(f"{env.keyed.url}/v1/encode", json={"items": [{"data": "!", "name": "b64"}]},
                              headers=env.keyed.headers, timeout=60), ErrorKind.BAD_ITEM)
    assert body["items"][0]["error_kind"] == "bad_item" and "base64" in body["items"][0]["error"]


@trigger(ErrorKind.INVALID)
def _(env: Env) -> None:
    # A name bivit will not store (over 4096 bytes; the path need not exist: it is refused before it is read),
    # next to a good input: refused alone, said skipped, filed with its kind.
    good = env.tmp / "good.png"
    good.write_bytes(png_bytes(28, 28, 3))
    long = Path("d/.." * 1100 + "/x.png")
    r = cli("encode", long, good, "--out", env.tmp / "e.safetensors")
    assert r.returncode == 1 and f"bivit: skipped: " in r.stderr, r.stderr[-2000:]
    recs = bivit.load_embeddings(env.tmp / "e.safetensors")
    assert [r.error_kind for r in recs] == [ErrorKind.INVALID, None] and "4096" in recs[0].error


@trigger(ErrorKind.INTERNAL)
def _(env: Env) -> None:
    # The server's own failure: its address space limited (like a machine out of memory), a request it cannot
    # serve is answered 500 "internal", never blamed on the client.
    srv = env.keyless
    big = png_bytes(1792, 1792, 4)
    assert encode(srv, [("warm.png", big)]).status_code == 200  # threads and arenas exist before the limit
    with open(f"/proc/{srv.proc.pid}/status") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    resource.prlimit(srv.proc.pid, resource.RLIMIT_AS, (vm + 32 * 2**20, resource.RLIM_INFINITY))
    try:
        refused(encode(srv, [("big.png", png_bytes(1792, 1792, 5))]), ErrorKind.INTERNAL)
    finally:
        resource.prlimit(srv.proc.pid, resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))


@trigger(ErrorKind.BAD_REQUEST)
def _(env: Env) -> None:
    refused(httpx.post(f"{env.keyed.url}/v1/encode", content=b"{", timeout=30,
                       headers={**env.keyed.headers, "Content-Type": "application/json"}), ErrorKind.BAD_REQUEST)


@trigger(ErrorKind.AUTH)
def _(env: Env) -> None:
    refused(httpx.post(f"{env.keyed.url}/v1/encode", files=[("file", ("a.png", png_bytes(28, 28, 6)))],
                       timeout=30), ErrorKind.AUTH)


@trigger(ErrorKind.FORBIDDEN)
def _(env: Env) -> None:
    refused(httpx.post(f"{env.keyless.url}/v1/weights", content=b"x", timeout=30,
                       headers={"Content-Type": "application/octet-stream"}), ErrorKind.FORBIDDEN)


@trigger(ErrorKind.NOT_FOUND)
def _(env: Env) -> None:
    refused(httpx.get(f"{env.keyed.url}/v1/nope", headers=env.keyed.headers, timeout=30), ErrorKind.NOT_FOUND)


@trigger(ErrorKind.METHOD_NOT_ALLOWED)
def _(env: Env) -> None:
    refused(httpx.get(f"{env.keyed.url}/v1/encode", headers=env.keyed.headers, timeout=30),
            ErrorKind.METHOD_NOT_ALLOWED)


@trigger(ErrorKind.BODY_TIMEOUT)
def _(env: Env) -> None:
    # Headers announce 100 bytes that never come (--body-timeout-s 1).
    out = raw(env.keyed, b"POST /v1/encode HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode()
              + b"\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n")
    assert out.startswith(b"HTTP/1.1 %d " % ErrorKind.BODY_TIMEOUT.status) and b'"body_timeout"' in out, out[:300]


@trigger(ErrorKind.TOO_LARGE)
def _(env: Env) -> None:
    refused(encode(env.keyed, [("big.png", bytes(1_200_000))]), ErrorKind.TOO_LARGE)  # --max-body-mb 1


@trigger(ErrorKind.TOO_MANY_ITEMS)
def _(env: Env) -> None:
    refused(encode(env.keyed, [(f"{i}.png", png_bytes(28, 28, 10 + i)) for i in range(3)]),  # --max-queue 2
            ErrorKind.TOO_MANY_ITEMS)


@trigger(ErrorKind.RESPONSE_TOO_LARGE)
def _(env: Env) -> None:
    refused(encode(env.keyed, [("wide.png", png_bytes(448, 448, 13))]), ErrorKind.RESPONSE_TOO_LARGE)


@trigger(ErrorKind.UNSUPPORTED_MEDIA_TYPE)
def _(env: Env) -> None:
    refused(httpx.post(f"{env.keyed.url}/v1/encode", content=png_bytes(28, 28, 14), timeout=30,
                       headers={**env.keyed.headers, "Content-Type": "image/png"}), ErrorKind.UNSUPPORTED_MEDIA_TYPE)


@trigger(ErrorKind.BAD_WEIGHTS)
def _(env: Env) -> None:
    refused(httpx.post(f"{env.keyed.url}/v1/weights", content=b"not safetensors", timeout=30,
                       headers={**env.keyed.headers, "Content-Type": "application/octet-stream"}),
            ErrorKind.BAD_WEIGHTS)


def _while_held(srv: ServerProcess, first: list[tuple[str, bytes]], then: Callable[[], None]) -> httpx.Response:
    """`first` sent and admitted while no forward pass can run; `then()`; the first request's answer once passes
    run again."""
    out: list = []
    sender = threading.Thread(target=lambda: out.append(encode(srv, first)))
    with srv.held():
        sender.start()
        srv.wait_for_metric("bivit_inflight_items", lambda v: v == len(first))
        then()
    sender.join(60)
    return out[0]


@trigger(ErrorKind.QUEUE_FULL)
def _(env: Env) -> None:
    srv = env.keyed

    def second() -> None:
        r = encode(srv, [("c.png", png_bytes(56, 56, 17))])
        refused(r, ErrorKind.QUEUE_FULL)
        assert int(r.headers["retry-after"]) >= 1

    first = _while_held(srv, [("a.png", png_bytes(56, 56, 15)), ("b.png", png_bytes(56, 56, 16))], second)
    assert first.status_code == 200, first.text[:300]  # --max-queue 2: two in flight


@trigger(ErrorKind.BUSY)
def _(env: Env) -> None:
    srv = env.keyed

    def second() -> None:  # its answer would fit alone, not beside the first's: --max-answers-mb
        r = encode(srv, [("d.png", png_bytes(364, 336, 19))])
        refused(r, ErrorKind.BUSY)
        assert int(r.headers["retry-after"]) >= 1

    first = _while_held(srv, [("c.png", png_bytes(364, 336, 18))], second)
    assert first.status_code == 200, first.text[:300]


@trigger(ErrorKind.TIMEOUT)
def _(env: Env) -> None:
    srv = env.keyed
    with srv.held():  # no pass runs: the request outlives --request-timeout-s
        refused(encode(srv, [("late.png", png_bytes(28, 28, 20))]), ErrorKind.TIMEOUT)


@trigger(ErrorKind.CLIENT_CLOSED)
def _(env: Env) -> None:
    srv = env.keyed
    name = f'bivit_errors_total{{kind="{ErrorKind.CLIENT_CLOSED.value}"}}'
    before = srv.metrics().get(name, 0.0)
    body = json.dumps({"items": [{"name": "gone.png", "data": base64.b64encode(png_bytes(56, 56, 21)).decode()}]})
    body = body.encode()
    with srv.held():
        with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as s:
            s.sendall(b"POST /v1/encode HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode()
                      + b"\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
            srv.wait_for_metric("bivit_queue_depth", lambda v: v == 1)
        srv.wait_for_metric(name, lambda v: v == before + 1)  # counted under its kind, while no pass can run


def _file_limited(srv: ServerProcess, post: Callable[[], httpx.Response]) -> httpx.Response:
    """`post()` while the server may write no file past 1 MiB beyond its log (like a full disk)."""
    limit = srv.log_path.stat().st_size + 2**20
    resource.prlimit(srv.proc.pid, resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
    try:
        return post()
    finally:
        resource.prlimit(srv.proc.pid, resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))


@trigger(ErrorKind.INSUFFICIENT_STORAGE)
def _(env: Env) -> None:
    # A weights body is spooled to a file, and so is an upload's part past 1 MiB: a full disk is the server's
    # state, not the client's mistake (the upload was answered 400 "malformed multipart body" before).
    weights = _file_limited(env.keyed, lambda: httpx.post(
        f"{env.keyed.url}/v1/weights", content=bytes(4 * 2**20), timeout=60,
        headers={**env.keyed.headers, "Content-Type": "application/octet-stream"}))
    refused(weights, ErrorKind.INSUFFICIENT_STORAGE)
    upload = _file_limited(env.keyless, lambda: encode(env.keyless, [("big.png", bytes(4 * 2**20))]))
    refused(upload, ErrorKind.INSUFFICIENT_STORAGE)


# ------------------------------------------------------------------------------------------------ the walk

def test_every_kind_has_a_trigger():
    assert set(TRIGGERS) == set(ErrorKind)


@pytest.mark.parametrize("kind", list(ErrorKind), ids=lambda k: k.value)
def test_every_kind_is_reachable(kind, request, tmp_path):
    TRIGGERS[kind](Env(request, tmp_path))


def test_statuses_are_distinct_where_a_client_acts_on_them():
    by_status: dict[int, set] = {}
    for k in ErrorKind:
        by_status.setdefault(k.status, set()).add(k)
    # Shared only where a client does the same thing whichever it is: send less (413); read the records, or
    # fix the weights (422: every item failed; on /v1/weights, the update refused).
    shared = {413: {ErrorKind.TOO_LARGE, ErrorKind.TOO_MANY_ITEMS, ErrorKind.RESPONSE_TOO_LARGE},
              422: {ErrorKind.BAD_ITEM, ErrorKind.MEDIA, ErrorKind.INVALID, ErrorKind.BAD_WEIGHTS}}
    assert {s: ks for s, ks in by_status.items() if len(ks) > 1} == shared
    # Retry later (429, 503), the client's mistake (4xx) and the server's (5xx) never share a status.
    assert {k for k in ErrorKind if k.status in (429, 503)} == {ErrorKind.QUEUE_FULL, ErrorKind.BUSY}
    assert ErrorKind.INTERNAL.status >= 500 and ErrorKind.INSUFFICIENT_STORAGE.status >= 500
    assert all(400 <= k.status < 500 for k in ErrorKind if k.item and k is not ErrorKind.INTERNAL)


def test_each_exception_class_has_one_kind():
    items = [k for k in ErrorKind if k.item]
    assert len({k.exception for k in items}) == len(items)  # one class, one kind
    for k in items:
        assert ErrorKind.of(k.exception(f"{k.value}")) is k
    for error in (ConfigError("c"), CheckpointError("w"), FormatError("f"), BivitError("b")):
        assert ErrorKind.of(error) is ErrorKind.INVALID
    assert ErrorKind.of(MediaError("m", "x")) is ErrorKind.MEDIA and ErrorKind.of(BadItem("b")) is ErrorKind.BAD_ITEM
    assert ErrorKind.of(EncodeFailed("e")) is ErrorKind.of(RuntimeError("a bug")) is ErrorKind.INTERNAL
    for k in ErrorKind:
        if not k.item:
            assert ErrorKind.of(k.error("m")) is k and k.error("m").status == k.status
            assert isinstance(k.error("m"), RequestError)


def test_no_kind_is_spelled_outside_the_table():
    """A kind's wire name as a string literal anywhere in bivit but the table is a second copy of it ('media'
    as a default input name, `x or 'media'`, is a name, not a kind)."""
    spelled = re.compile(r"""(?<!or )["'](%s)["']""" % "|".join(k.value for k in ErrorKind))
    hits = [f"{p.relative_to(SRC)}:{i}: {line.strip()}" for p in sorted(SRC.rglob("*.py")) if p.name != "errors.py"
            for i, line in enumerate(p.read_text().splitlines(), 1) if spelled.search(line)]
    assert hits == []
