"""One embedding file format, one reader: `bivit encode`'s file, the service's `?format=safetensors` answer and
a dataset job's shards (and folder) open with `bivit.load_embeddings` and give the same records and bit-identical
embeddings for the same input. Everything real: `bivit` processes, a `bivit serve` process on loopback, a
`bivit encode-dataset` job, Pillow images and PyAV videos. Files of older bivit versions still open, and files of
other formats fail naming what they are."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import save_file

import bivit
from bivit.core import records
from bivit.errors import FormatError
from support.media import make_image, make_video

INPUTS = ("a.png", "clip.mp4", "b.jpg")
# Every record key but the tensor's name in its file (writers name tensors their own way), so a new field is
# compared across writers the day it is added to RECORD_KEYS.
COMPARED = tuple(k for k in records.RECORD_KEYS if k != "tensor") + ("model", "fingerprint", "dtype")


def cli(*args, cwd=None):
    r = subprocess.run([sys.executable, "-m", "bivit.cli", *map(str, args)], capture_output=True, text=True,
                       cwd=cwd, timeout=600)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stdout + r.stderr
    return r


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("inputs")
    make_image(d / "a.png", (84, 56), seed=1)
    make_video(d / "clip.mp4", frames=20, fps=4, size=(56, 56))  # 10 frames sampled: chunks of 4, 4, 2
    make_image(d / "b.jpg", (112, 84), seed=2)
    return d


@pytest.fixture(scope="module")
def written(folder, tmp_path_factory) -> dict:
    """The same three inputs through the three writers, in float32."""
    out = tmp_path_factory.mktemp("out")
    cli("encode", *INPUTS, "--out", out / "encode.safetensors", "--dtype", "float32", cwd=folder)
    cli("encode-dataset", folder, "--out", out / "ds", "--dtype", "float32", "--no-progress")
    pytest.importorskip("fastapi")
    from support.server import ServerProcess

    with ServerProcess(["--dtype", "float32"], out) as srv:
        files = [("file", (name, (folder / name).read_bytes(), "application/octet-stream")) for name in INPUTS]
        r = httpx.post(f"{srv.url}/v1/encode", files=files, timeout=300)
        assert r.status_code == 200, r.text
    (out / "answer.safetensors").write_bytes(r.content)
    shards = sorted((out / "ds").glob("shard-*.safetensors"))
    assert len(shards) == 1
    return {"encode": out / "encode.safetensors", "answer": out / "answer.safetensors", "folder": out / "ds",
            "shard": shards[0]}


def test_every_writer_gives_the_same_records_and_bits(written, folder):
    opened = {name: bivit.load_embeddings(path) for name, path in written.items()}
    for name, items in opened.items():
        assert items.format == "bivit.embeddings/2" or name == "folder", name
        assert sorted(items.sources) == sorted(INPUTS), name
    assert opened["encode"].sources == opened["answer"].sources == list(INPUTS)  # input order
    ref = {r.source: r for r in opened["encode"]}
    assert ref["clip.mp4"].kind == "video" and len(ref["clip.mp4"].timestamps) == 3
    assert ref["a.png"].fingerprint == bivit.load_encoder(dtype="float32").fingerprint and ref["a.png"].dtype == "float32"
    for name, items in opened.items():
        for r in items:
            want = ref[r.source]
            assert {k: getattr(r, k) for k in COMPARED} == {k: getattr(want, k) for k in COMPARED}, (name, r.source)
            assert torch.equal(r.embedding, want.embedding), (name, r.source)
            assert [c.shape[0] for c in r.chunks] == r.chunk_tokens and sum(r.chunk_tokens) == r.tokens
    assert opened["answer"][0].cached is False  # the service's own key, kept as such
    assert opened["folder"][0].shard == written["shard"].name  # the dataset's


def test_open_dataset_is_the_same_records(written):
    ds = bivit.open_dataset(written["folder"])
    view = ds.embeddings()
    assert [r.source for r in ds] == view.sources
    for rec, r in zip(ds, view):
        assert torch.equal(ds.tensor(rec), r.embedding) and rec.placeholders == r.placeholders
        assert (rec.sha256, rec.grid_thw, rec.timestamps) == (r.sha256, r.grid_thw, r.timestamps)


# ------------------------------------------------------------------------------------- older files and others

def _old_encode_file(path: Path, tensors: dict, items: list[dict]) -> None:
    """What `bivit encode` wrote before bivit.embeddings/1: everything under one "bivit" JSON key."""
    meta = {"format": "bivit.encode/1", "model": "demo", "demo": True, "dtype": "float32",
            "projector_dtype": "float32", "output_dtype": "float32", "batch_invariant": True, "alpha": "model",
            "processing": {}, "items": items}
    save_file(tensors, str(path), metadata={"bivit": json.dumps(meta)})


def test_old_formats_still_open(written, tmp_path):
    new = bivit.load_embeddings(written["encode"])
    a, clip = new[0], new[1]
    old_items = [{"key": "0", "source": "a.png", "tokens": a.tokens, "grid_thw": a.grid_thw,
                  "chunk_tokens": a.chunk_tokens, "placeholders": a.placeholders},
                 {"key": "1", "source": "clip.mp4", "tokens": clip.tokens, "grid_thw": clip.grid_thw,
                  "chunk_tokens": clip.chunk_tokens, "timestamps": clip.timestamps,
                  "placeholders": clip.placeholders}]
    _old_encode_file(tmp_path / "old.safetensors", {"0": a.embedding, "1": clip.embedding}, old_items)
    old = bivit.load_embeddings(tmp_path / "old.safetensors")
    assert old.format == "bivit.encode/1" and old.encoder["output_dtype"] == "float32"
    assert [r.kind for r in old] == ["image", "video"] and old[1].timestamps == clip.timestamps
    assert torch.equal(old[0].embedding, a.embedding) and torch.equal(old[1].embedding, clip.embedding)
    # The service's answers before: format/model/fingerprint/dtype keys and items named by "name".
    meta = {"format": "bivit.response/1", "model": "demo", "fingerprint": a.fingerprint, "dtype": "float32",
            "items": json.dumps([{"index": 0, "name": "a.png", "kind": "image", "sha256": a.sha256, "tensor": "0",
                                  "tokens": a.tokens, "grid_thw": a.grid_thw, "timestamps": None,
                                  "placeholders": a.placeholders, "cached": False, "error": None,
                                  "error_kind": None}])}
    save_file({"0": a.embedding}, str(tmp_path / "answer1.safetensors"), metadata=meta)
    (r,) = bivit.load_embeddings(tmp_path / "answer1.safetensors")
    assert (r.source, r.sha256, r.fingerprint, r.dtype, r.chunk_tokens) == (
        "a.png", a.sha256, a.fingerprint, "float32", a.chunk_tokens)
    assert torch.equal(r.embedding, a.embedding) and r.cached is False


def test_an_older_dataset_folder_and_its_shard_still_open(written, tmp_path):
    """Folders written before manifest lines had placeholders and shards had records: the folder opens (no
    placeholders), and a shard opens through its folder's manifest."""
    import shutil

    old = tmp_path / "old-ds"
    shutil.copytree(written["folder"], old)
    lines = [json.loads(x) for x in (old / "manifest.jsonl").read_text().splitlines()]
    (old / "manifest.jsonl").write_text("".join(json.dumps({k: v for k, v in line.items()
                                                             if k not in ("placeholders", "chunk_tokens",
                                                                          "line_sha256")}) + "\n"
                                                for line in lines))
    header = json.loads((old / "dataset.json").read_text())  # version 1: before the checksums
    (old / "dataset.json").write_text(json.dumps({**{k: v for k, v in header.items() if k != "header_sha256"},
                                                  "format_version": 1}))
    shard = old / written["shard"].name
    from safetensors.torch import load_file

    tensors = load_file(str(shard))
    save_file(tensors, str(shard), metadata={"format": "bivit-encoded-dataset", "fingerprint": "x"})
    for opened in (bivit.load_embeddings(old), bivit.load_embeddings(shard)):
        new = {r.source: r for r in bivit.load_embeddings(written["folder"])}
        assert sorted(opened.sources) == sorted(new)
        for r in opened:
            assert r.placeholders == [] and r.chunk_tokens == new[r.source].chunk_tokens
            assert torch.equal(r.embedding, new[r.source].embedding)
    alone = tmp_path / "alone.safetensors"
    shutil.copy(shard, alone)
    with pytest.raises(FormatError, match="older bivit.*open it inside that folder"):
        bivit.load_embeddings(alone)


def test_other_files_fail_naming_what_they_are(tmp_path):
    newer = tmp_path / "newer.safetensors"
    save_file({"0": torch.zeros(1, 2)}, str(newer), metadata={"format": "bivit.embeddings/3", "encoder": "{}",
                                                               "items": "[]"})
    with pytest.raises(FormatError, match=r"format 'bivit.embeddings/3', which this bivit does not read "
                                                  r"\(it reads bivit.embeddings/2, bivit.embeddings/1, bivit.encode/1, "
                                                  r"bivit.response/1\)"):
        bivit.load_embeddings(newer)
    plain = tmp_path / "weights.safetensors"
    save_file({"w": torch.zeros(2)}, str(plain))
    with pytest.raises(FormatError, match="not a bivit embedding file"):
        bivit.load_embeddings(plain)
    text = tmp_path / "notes.safetensors"
    text.write_text("hello, this is not a safetensors file at all\n")
    with pytest.raises(FormatError, match="not a safetensors file"):
        bivit.load_embeddings(text)
    with pytest.raises(bivit.BivitError, match="does not exist"):
        bivit.load_embeddings(tmp_path / "missing.safetensors")


def test_media_given_as_an_embedding_file_is_named_for_what_it_is(tmp_path):
    """An image or video passed to `load_embeddings` is said to be one (bivit's own sniffing, `bivit.media.kinds`),
    whatever its name, not read as a safetensors header of absurd length."""
    make_image(tmp_path / "a.png", (28, 28), seed=1)
    make_image(tmp_path / "b.jpg", (28, 28), seed=2)
    (tmp_path / "c.safetensors").write_bytes((tmp_path / "b.jpg").read_bytes())
    make_video(tmp_path / "d.mp4", frames=4, fps=4, size=(28, 28))
    for name, what in (("a.png", "a PNG image"), ("b.jpg", "a JPEG image"), ("c.safetensors", "a JPEG image"),
                       ("d.mp4", "a video")):
        with pytest.raises(FormatError) as e:
            bivit.load_embeddings(tmp_path / name)
        assert str(e.value) == f"{tmp_path / name}: {what}, not an embedding file (encode it first: bivit encode " \
                               f"{tmp_path / name})"


# ------------------------------------------------------------------------------ rows that prove they are the rows

def _flip_tensor_bits(path: Path, every: int = 1024) -> None:
    """One bit flipped per `every` bytes of a safetensors file's tensor data (its header kept)."""
    data = bytearray(path.read_bytes())
    start = 8 + int.from_bytes(data[:8], "little")
    for at in range(start, len(data), every):
        data[at] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("writer", ["encode", "answer", "folder"])
def test_a_damaged_file_is_refused_naming_file_and_tensor(written, tmp_path, writer):
    """One bit flipped per KB of a dataset shard's tensor data: `load_embeddings` and `open_dataset` returned 8 of
    8 embeddings wrong (one with NaN), silently. Every record now holds its tensor's sha256 (`tensor_sha256`) and
    every reader checks it: the first damaged tensor is a FormatError naming the file and the tensor. The
    control: the same files undamaged read back equal."""
    import shutil

    src = written[writer]
    copy = tmp_path / src.name
    (shutil.copytree if src.is_dir() else shutil.copy)(src, copy)
    damaged = next(copy.glob("shard-*.safetensors")) if copy.is_dir() else copy
    readers = [lambda: [r.embedding for r in bivit.load_embeddings(copy)]]
    if writer == "answer":  # the client reads an answer from memory
        readers.append(lambda: records.from_bytes(damaged.read_bytes(), str(damaged)))
    if writer == "folder":
        readers += [lambda: [bivit.open_dataset(copy).tensor(r) for r in bivit.open_dataset(copy)],
                    lambda: [r.embedding for r in bivit.load_embeddings(damaged)]]
    for read in readers:
        read()  # undamaged: read back, and checked
    _flip_tensor_bits(damaged)
    for read in readers:
        with pytest.raises(FormatError, match=rf"{damaged.name}: tensor '\w+' of '[\w.]+': its bytes do not "
                                                      "match the checksum its record holds"):
            read()


def test_files_without_checksums_still_open_said_once(written, tmp_path, caplog):
    """Files written before records held `tensor_sha256` (and before the metadata's checksum: format
    `bivit.embeddings/1`) open as before; that their records and embeddings are read unverified is said once
    per file."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(str(written["encode"]), "pt") as f:
        meta = f.metadata()
    items = [{k: v for k, v in item.items() if k != "tensor_sha256"} for item in json.loads(meta["items"])]
    old = tmp_path / "old.safetensors"
    save_file(load_file(str(written["encode"])), str(old),
              metadata={"format": records.FORMAT_1, "encoder": meta["encoder"], "items": json.dumps(items)})
    with caplog.at_level("WARNING", logger="bivit.records"):
        opened = bivit.load_embeddings(old)
        new = bivit.load_embeddings(written["encode"])
        for r, want in zip(opened, new):
            assert r.tensor_sha256 is None and torch.equal(r.embedding, want.embedding)
    said = [rec.getMessage() for rec in caplog.records if "unverified" in rec.getMessage()]
    assert said == [f"{old}: format bivit.embeddings/1 (before metadata checksums): its records are read unverified",
                    f"{old}: its records hold no tensor checksums (a file of an older bivit format): its embeddings "
                    "are read unverified"]


def test_a_header_of_empty_arrays_is_refused_before_it_is_built(tmp_path):
    """A crafted embedding file whose header held 40 MB of `[]` took `load_embeddings` to 1.13 GB (the 256 MB
    header cap allowed ~7 GB). JSON read from outside is counted first (elements of every kind): here 15 MB of
    `[],` (5 million lists, ~450 MB if built) is refused before anything is built."""
    bomb = tmp_path / "bomb.safetensors"
    header = b'{"__metadata__": {"format": "bivit.embeddings/1"}, "x": [' + b"[]," * 5_000_000 + b"[]]}"
    bomb.write_bytes(len(header).to_bytes(8, "little") + header)
    code = ("import resource, sys, bivit\n"
            "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
            "try:\n    bivit.load_embeddings(sys.argv[1])\nexcept bivit.BivitError as e:\n    print(e)\n"
            "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)")
    r = subprocess.run([sys.executable, "-c", code, str(bomb)], capture_output=True, text=True, timeout=300)
    message, grew_kb = r.stdout.splitlines()
    assert message == f"{bomb}: not a safetensors file (unreadable header)", r.stdout + r.stderr
    print(f"\nheader of 5,000,000 empty arrays: peak RSS +{int(grew_kb) / 1024:.0f} MB")
    assert int(grew_kb) < 100 * 1024  # the 15 MB header and one chunk of counting


# ------------------------------------------------------------------------------ records that prove themselves

@pytest.fixture(scope="module")
def small(tmp_path_factory) -> Path:
    """A real `bivit encode` file of the shipped sample (108 rows on the demo model) and a 3-chunk video."""
    d = tmp_path_factory.mktemp("small")
    make_video(d / "clip.mp4", frames=20, fps=4, size=(28, 28))
    sample = Path(__file__).parents[1] / "examples" / "sample.png"
    cli("encode", sample, "clip.mp4", "--out", d / "e.safetensors", "--dtype", "float32", cwd=d)
    return d / "e.safetensors"


def _identical(opened, want) -> bool:
    return opened.encoder == want.encoder and len(opened) == len(want) and all(
        r.to_json() == w.to_json() and torch.equal(r.embedding, w.embedding) for r, w in zip(opened, want))


def _flip_each_header_byte(path: Path, tmp_path: Path, disk: bool = True) -> dict:
    """One bit flipped at each byte of a file's header (its length, the metadata, the tensors' entries), read
    back from memory (the client's reader) and from disk (`disk`): outcome -> count."""
    data = path.read_bytes()
    want = bivit.load_embeddings(path)
    out: dict = {}
    flipped = tmp_path / "flipped.safetensors"
    for at in range(8 + int.from_bytes(data[:8], "little")):
        body = bytearray(data)
        body[at] ^= 1 << (at % 8)
        flipped.write_bytes(body)
        readers = (lambda: records.from_bytes(bytes(body), "answer"), lambda: bivit.load_embeddings(flipped))
        for read in readers[:1 + disk]:
            try:
                outcome = "identical" if _identical(read(), want) else "another record"
            except bivit.BivitError as e:
                outcome = type(e).__name__
            out[outcome] = out.get(outcome, 0) + 1
    return out


def _resealed(src: Path, dst: Path, edit=None, fmt: str = records.FORMAT) -> Path:
    """`src` written again with its records edited by `edit` (or not), its checksum made for what it now holds
    (a writer that wrote them so), in format `fmt` (`bivit.embeddings/1`: no checksum, as before them)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    from bivit.core.integrity import CHECKSUM_KEY, metadata_sha256

    with safe_open(str(src), "pt") as f:
        meta = f.metadata()
    items = json.loads(meta["items"])
    meta = {"format": fmt, "encoder": meta["encoder"],
            "items": json.dumps(edit(items) if edit else items, ensure_ascii=False)}
    if fmt == records.FORMAT:
        meta[CHECKSUM_KEY] = metadata_sha256(meta)
    save_file(load_file(str(src)), str(dst), metadata=meta)
    return dst


def test_one_bit_flipped_anywhere_in_the_header_is_refused_or_changes_nothing(small, tmp_path):
    """Flipping one bit at each of the 588 bytes of an encode file's `items`: 223 flips read silently as another
    record (placeholders, sha256, source, grid_thw, tokens, kind "hmage"), 2 a raw RuntimeError. The metadata
    now holds its checksum (format, encoder, records), which every reader checks: each flip at every byte of the
    header is a FormatError or reads the identical records and bits. The control: the same flips on the file
    written as a `bivit.embeddings/1` one (no checksum, read unverified) do give other records."""
    outcomes = _flip_each_header_byte(small, tmp_path)
    print(f"\none bit flipped at each header byte, read from memory and disk: {outcomes}")
    assert set(outcomes) <= {"FormatError", "identical"} and outcomes.get("FormatError", 0) > 2000, outcomes
    old = _flip_each_header_byte(_resealed(small, tmp_path / "v1.safetensors", fmt=records.FORMAT_1), tmp_path,
                                 disk=False)
    assert old.get("another record", 0) > 100, old  # the control: the flips do change records unchecked


def test_the_checksum_cannot_be_dropped_to_pass_as_an_older_file(small, tmp_path):
    """The key `tensor_sha256` flipped to `uensor_sha256` and one bit of the tensor flipped read a wrong
    embedding back with a false "an older bivit" line. Now the records' checksum no longer matches; dropping
    the checksum too leaves a current-format file without one (refused: the format, which the checksum
    covers, is what says a file may lack it); in an older-format file a record without its tensor's checksum
    beside records with one is refused too."""
    data = small.read_bytes()
    start = 8 + int.from_bytes(data[:8], "little")
    downgraded = bytearray(data.replace(b'\\"tensor_sha256\\"', b'\\"uensor_sha256\\"', 1))
    downgraded[start + 4] ^= 0x10
    (tmp_path / "a.safetensors").write_bytes(downgraded)
    with pytest.raises(FormatError, match="does not match the checksum it holds"):
        bivit.load_embeddings(tmp_path / "a.safetensors")
    stripped = _resealed(small, tmp_path / "b.safetensors")
    from bivit.core.integrity import CHECKSUM_KEY

    raw = stripped.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    del header["__metadata__"][CHECKSUM_KEY]
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    stripped.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n:])
    with pytest.raises(FormatError, match=f"{stripped}: format 'bivit.embeddings/2' without its "
                                                  f"'{CHECKSUM_KEY}'"):
        bivit.load_embeddings(stripped)

    def rename(items):
        items[0]["uensor_sha256"] = items[0].pop("tensor_sha256")
        return items

    old = _resealed(small, tmp_path / "c.safetensors", rename, fmt=records.FORMAT_1)
    with pytest.raises(FormatError, match="names tensor '0' without its 'tensor_sha256'"):
        bivit.load_embeddings(old)
    # The checksum is what docs/formats.md says, computed without bivit.
    import hashlib

    from safetensors import safe_open

    with safe_open(str(small), "pt") as f:
        meta = f.metadata()
    recipe = json.dumps([meta["format"], meta["encoder"], meta["items"]], ensure_ascii=False)
    assert hashlib.sha256(recipe.encode()).hexdigest() == meta[CHECKSUM_KEY]
    # The control: the same file, resealed unchanged, reads back identical (in both formats).
    assert _identical(bivit.load_embeddings(_resealed(small, tmp_path / "d.safetensors")),
                      bivit.load_embeddings(small))
    assert _identical(bivit.load_embeddings(_resealed(small, tmp_path / "e.safetensors", fmt=records.FORMAT_1)),
                      bivit.load_embeddings(small))


def _set(index: int, **values):
    def edit(items):
        items[index].update(values)
        return items
    return edit


@pytest.mark.parametrize("case,edit,field", [
    ("two chunks of a one-chunk grid", _set(0, chunk_tokens=[100, 8]), "chunk_tokens"),
    ("chunks not adding up to its rows", _set(0, chunk_tokens=[50, 50]), "chunk_tokens"),
    ("a grid of 1e18", _set(0, grid_thw=[[1e18] * 3]), "grid_thw"),
    ("an integer grid past any model's", _set(0, grid_thw=[[1, 10**18, 10**18]]), "grid_thw"),
    ("placeholder of 5 rows", lambda items: [{**items[0], "placeholders": [{**items[0]["placeholders"][0],
                                                                          "tokens": 5}]}, items[1]], "placeholders"),
    ("a 1x2x2 grid for 108 rows", _set(0, grid_thw=[[1, 2, 2]]), "chunk_tokens"),
    ("kind hmage", _set(0, kind="hmage"), "kind"),
    ("tokens against its chunks", _set(0, tokens=100), "tokens"),
    ("an image of two frames", _set(0, grid_thw=[[2, 18, 24]]), "grid_thw"),
    ("a video chunk without its timestamp", _set(1, timestamps=["00:00:00.000"]), "timestamps"),
    ("a failed item naming a tensor", _set(1, error="x: broken"), "error"),
])
def test_a_record_that_contradicts_itself_is_refused_naming_file_and_field(small, tmp_path, case, edit, field):
    """Records contradicting themselves were read: chunk_tokens [100, 8] of a one-chunk grid gave 2 chunks,
    [50, 50] of 108 rows torch's RuntimeError, grid [[1e18]*3] a TypeError; placeholder tokens 5 of 108 rows, a
    grid of 1 row for 108 and kind "hmage" were accepted. Written by a writer that sealed them (their checksum
    matches), each is now a FormatError naming the file, the record and the field. The control: the sample's
    record holds 108 rows in one 18x24 chunk, and the file resealed unchanged reads back."""
    want = bivit.load_embeddings(small)
    assert (want[0].tokens, want[0].grid_thw, want[0].chunk_tokens) == (108, [[1, 18, 24]], [108])
    bad = _resealed(small, tmp_path / "bad.safetensors", edit)
    with pytest.raises(FormatError) as e:
        [r.embedding for r in bivit.load_embeddings(bad)]
    assert str(e.value).startswith(f"{bad}: record ") and f": {field!r} " in str(e.value), str(e.value)
    assert _identical(bivit.load_embeddings(_resealed(small, tmp_path / "good.safetensors")), want)


def test_a_record_at_odds_with_its_tensor_is_refused(small, tmp_path):
    """A record consistent with itself (grid, chunks, tokens, placeholders of one row) but not with its tensor
    of 108 rows: FormatError naming the file and the tensor when the embedding is read."""
    one = _set(0, grid_thw=[[1, 2, 2]], chunk_tokens=[1], tokens=1, sizes=[None])
    bad = _resealed(small, tmp_path / "bad.safetensors",
                    lambda items: [{**(r := one(items)[0]), "placeholders": [{**r["placeholders"][0], "tokens": 1}]},
                                   items[1]])
    opened = bivit.load_embeddings(bad)
    with pytest.raises(FormatError, match=rf"{bad}: tensor '0' of '.*sample.png': a tensor of shape "
                                                  r"\[108, 128\], its record says 1 rows"):
        opened[0].embedding  # noqa: B018 - reads it
    assert torch.equal(opened[1].embedding, bivit.load_embeddings(small)[1].embedding)  # the control
