"""`bivit encode-dataset` / `open_dataset`: offline encoding that is resumable, crash-safe and partition-invariant.

Everything runs on real files (Pillow images, PyAV videos, a corrupt/empty/mislabelled file), the tiny demo model,
a real local Ray (one instance for the module) and real SIGKILLs of a real subprocess. Bitwise claims use
torch.equal against `Encoder.encode` on each file alone.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

import bivit
from bivit import BivitError, EncoderSpec
from bivit.base.fileio import TMP_PREFIX, sha256_file
from bivit.dataset import ERRORS, HEADER, MANIFEST, encode_dataset, open_dataset
from bivit.dataset.pipeline import encode_prepared
from bivit.dataset.sources import list_sources
from bivit.dataset.writer import DatasetWriter
from support import launch
from support.media import make_image, make_video

IMAGE_SIZES = [(28, 28), (56, 28), (56, 56), (84, 56), (112, 112), (140, 84), (28, 84), (196, 112)]


# ----------------------------------------------------------------------------------------------------------------
# Fixtures: one folder of real media, one reference encoding of it, one local Ray for the module


@pytest.fixture(scope="module")
def media(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("media")
    (d / "sub" / "deeper").mkdir(parents=True)
    for i, (w, h) in enumerate(IMAGE_SIZES):
        make_image(d / f"img{i}.png", (w, h), seed=i)
    make_image(d / "photo.jpg", (84, 56), seed=99)
    # Same bytes under other names: stored once.
    shutil.copy(d / "img2.png", d / "sub" / "copy_of_img2.png")
    shutil.copy(d / "img4.png", d / "sub" / "deeper" / "img4_again.png")
    # Failures: recorded, never fatal.
    (d / "empty.png").write_bytes(b"")
    (d / "text.png").write_text("not an image\n")
    (d / "truncated.png").write_bytes((d / "img5.png").read_bytes()[:80])
    # Videos: 20 frames at 4 fps sample 10 frames -> chunks of 4, 4, 2; a GIF is a video too (bivit.media.video's rule).
    make_video(d / "clip.mp4", frames=20, fps=4, size=(56, 56))
    make_video(d / "sub" / "anim.gif", frames=3, fps=2, size=(28, 28))
    # Not inputs: unknown extension, hidden file, hidden folder.
    (d / "notes.txt").write_text("ignored")
    make_image(d / ".hidden.png", (28, 28), seed=7)
    (d / ".cache").mkdir()
    make_image(d / ".cache" / "x.png", (28, 28), seed=8)
    return d


GOOD = sorted([f"img{i}.png" for i in range(len(IMAGE_SIZES))] + ["photo.jpg", "sub/copy_of_img2.png",
              "sub/deeper/img4_again.png", "clip.mp4", "sub/anim.gif"])
BAD = {"empty.png": "file is empty", "text.png": "not an image format", "truncated.png": "truncated"}


@pytest.fixture(scope="module")
def encoder():
    return bivit.load_encoder()


@pytest.fixture(scope="module")
def reference(media, tmp_path_factory) -> Path:
    """The dataset encoded once with the local engine and default settings."""
    out = tmp_path_factory.mktemp("ref") / "out"
    s = encode_dataset(media, out, progress=False)
    assert (s.encoded, s.deduplicated, s.failed, s.skipped) == (len(GOOD) - 2, 2, 3, 0)
    return out


@pytest.fixture(scope="module")
def ray_local():
    ray = pytest.importorskip("ray")
    import logging

    ray.init(num_cpus=4, include_dashboard=False, object_store_memory=128 * 2**20, logging_level=logging.WARNING)
    yield ray
    ray.shutdown()


def assert_same_tensors(a: Path, b: Path) -> None:
    da, db = open_dataset(a), open_dataset(b)
    assert sorted(da.sources) == sorted(db.sources) == GOOD
    for rec in da:
        other = db[rec.source]
        assert (other.sha256, other.tokens, other.grid_thw, other.timestamps) == \
            (rec.sha256, rec.tokens, rec.grid_thw, rec.timestamps)
        assert torch.equal(da.tensor(rec), db.tensor(other)), rec.source
    assert {e.source for e in da.errors} == {e.source for e in db.errors} == set(BAD)


def shards_in(d: Path) -> set[str]:
    return {p.name for p in d.glob("shard-*.safetensors")}


def manifest_lines(d: Path) -> list[dict]:
    if not (d / MANIFEST).exists():
        return []
    return [json.loads(line) for line in (d / MANIFEST).read_text().splitlines()]


def assert_consistent(d: Path) -> None:
    """What any reader may rely on at any instant: whole lines, each pointing at a complete, durable shard."""
    data = (d / MANIFEST).read_bytes() if (d / MANIFEST).exists() else b""
    assert data == b"" or data.endswith(b"\n")
    for row in manifest_lines(d):
        with safe_open(str(d / row["shard"]), framework="pt") as f:
            assert f.get_tensor(row["tensor"]).shape[0] == row["tokens"]


# ----------------------------------------------------------------------------------------------------------------
# Sources


def test_directory_listing_is_recursive_sorted_and_skips_the_output(media):
    out = media / "encoded"  # an output folder inside SRC is never read as input
    out.mkdir()
    make_image(out / "stale.png", (28, 28))
    try:
        got = list_sources(media, exclude=out)
    finally:
        shutil.rmtree(out)
    assert [s.source for s in got] == sorted(GOOD + list(BAD))
    kinds = {s.source: s.kind for s in got}
    assert kinds["clip.mp4"] == kinds["sub/anim.gif"] == "video" and kinds["photo.jpg"] == "image"


def test_manifest_listing_plain_and_jsonl(media, tmp_path):
    m = tmp_path / "list.jsonl"
    rel = os.path.relpath(media / "img1.png", tmp_path)
    m.write_text(f"# comment\n\n{rel}\n" + json.dumps({"path": str(media / "clip.mp4"), "label": 3}) + "\n"
                 + f"{rel}\n")  # a repeated line is listed once
    got = list_sources(m)
    assert [(s.source, s.kind) for s in got] == [(rel, "image"), (str(media / "clip.mp4"), "video")]
    assert got[0].path.resolve() == (media / "img1.png").resolve()
    m.write_text('{"file": "a.png"}\n')
    with pytest.raises(BivitError, match=r"list.jsonl:1: .*'path'"):
        list_sources(m)
    with pytest.raises(BivitError, match="no such file"):
        list_sources(tmp_path / "missing")


# ----------------------------------------------------------------------------------------------------------------
# What gets written


def test_output_matches_encoding_each_file_alone(reference, media, encoder):
    ds = open_dataset(reference)
    assert len(ds) == len(GOOD)
    for rec in ds:
        alone = encoder.encode([media / rec.source])[0]
        got = ds.tensor(rec.source)
        assert got.dtype == torch.bfloat16 and got.shape == (rec.tokens, encoder.config.text_hidden_size)
        assert torch.equal(got, alone), rec.source
    clip = ds["clip.mp4"]
    chunks = encoder.encode_video(media / "clip.mp4")
    assert clip.kind == "video" and clip.grid_thw == [list(c.grid_thw) for c in chunks]
    assert [c.grid_thw[0] for c in chunks] == [4, 4, 2]
    assert clip.timestamps == [c.timestamp for c in chunks]
    assert all(torch.equal(a, c.embedding) for a, c in zip(ds.chunks("clip.mp4"), chunks))
    assert ds["sub/anim.gif"].kind == "video" and ds["sub/anim.gif"].grid_thw == [[3, 2, 2]]


def test_identical_files_are_stored_once(reference):
    ds = open_dataset(reference)
    rows = manifest_lines(reference)
    assert len(rows) == len(GOOD)
    distinct = {r["sha256"] for r in rows}
    stored = []
    for name in shards_in(reference):
        with safe_open(str(reference / name), framework="pt") as f:
            stored += list(f.keys())
    assert sorted(stored) == sorted(distinct) and len(distinct) == len(GOOD) - 2
    a, b = ds["img2.png"], ds["sub/copy_of_img2.png"]
    assert (a.shard, a.tensor, a.sha256) == (b.shard, b.tensor, b.sha256)
    assert {r.source for r in ds.by_hash(a.sha256)} == {"img2.png", "sub/copy_of_img2.png"}


def test_errors_are_recorded_not_fatal(reference):
    rows = [json.loads(line) for line in (reference / ERRORS).read_text().splitlines()]
    assert {r["source"]: r["error"] for r in rows}.keys() == BAD.keys()
    for r in rows:
        assert r["error"].startswith(r["source"] + ": ") and BAD[r["source"]] in r["error"]
        assert "\n" not in r["error"]
    assert {e.source for e in open_dataset(reference).errors} == set(BAD)


def test_load_embeddings_of_a_folder_shows_its_failed_inputs(reference, media):
    """As in a `bivit encode` file, a failed input is a record with its error and no embedding: after the encoded
    inputs, in the order they failed."""
    items = bivit.load_embeddings(reference)
    ok = [r for r in items if r.ok]
    assert [r.source for r in ok] == open_dataset(reference).sources and len(items) == len(ok) + len(BAD)
    failed = items[len(ok):]
    assert sorted(r.source for r in failed) == sorted(BAD)
    for r in failed:
        assert not r.ok and r.embedding is None and r.chunks == [] and r.tensor is None and r.tokens == 0
        assert BAD[r.source] in r.error and not r.error.startswith(r.source) and r.kind == "image"
        assert items.get(r.source) is r and r.fingerprint == items.fingerprint
    assert [r.seq for r in failed] == sorted(r.seq for r in failed)
    assert items.get("text.png").sha256 == sha256_file(media / "text.png")


def test_ray_engine_refuses_another_device_before_any_work(media, tmp_path):
    pytest.importorskip("ray")
    with pytest.raises(BivitError, match="--device cuda: the Ray engine's workers encode on CPU; use --engine local"):
        encode_dataset(media, tmp_path / "out", engine="ray", device="cuda", progress=False)
    assert not (tmp_path / "out").exists()


def test_header(reference, encoder):
    h = json.loads((reference / HEADER).read_text())
    assert h["fingerprint"] == encoder.fingerprint and h["model_name"] == "demo" and h["is_demo"]
    assert (h["dtype"], h["projector_dtype"], h["output_dtype"]) == ("bfloat16",) * 3
    assert h["bivit_version"] == bivit.__version__ and h["batch_invariant"] is True
    assert h["text_hidden_size"] == encoder.config.text_hidden_size


def test_open_dataset_api(reference):
    ds = open_dataset(reference)
    assert [r.source for r in ds] == ds.sources and len(ds.records) == len(ds)
    rec = ds["img3.png"]
    assert ds.get("img3.png") == rec and ds.get("nope.png") is None and "img3.png" in ds
    with pytest.raises(KeyError, match="nope.png"):
        ds["nope.png"]
    t, a = ds.tensor("img3.png"), ds.numpy(rec)
    # bfloat16 has no numpy dtype: numpy() gives float32, which holds every bfloat16 exactly.
    assert t.dtype == torch.bfloat16 and a.dtype == np.float32 and torch.equal(torch.from_numpy(a), t.float())
    assert ds.by_hash("0" * 64) == [] and ds.dtype == torch.bfloat16
    assert sum(c.shape[0] for c in ds.chunks("clip.mp4")) == ds["clip.mp4"].tokens
    with pytest.raises(BivitError, match="not an encoded dataset"):
        open_dataset(reference.parent)
    assert getattr(bivit, "open_dataset", open_dataset) is open_dataset  # the package re-exports it


def test_float32_output_reads_as_float32(media, tmp_path, reference):
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(media / "img4.png", src / "img4.png")
    encode_dataset(src, tmp_path / "out", output_dtype="float32", progress=False)
    ds = open_dataset(tmp_path / "out")
    assert ds.numpy("img4.png").dtype == np.float32 and ds.tensor("img4.png").dtype == torch.float32
    # Same tower/projector, only the output cast differs.
    assert torch.equal(ds.tensor("img4.png"), open_dataset(reference).tensor("img4.png").float())


# ----------------------------------------------------------------------------------------------------------------
# Partition invariance: however the work is cut, every item gets the same bits


def test_batch_patches_and_shard_size_do_not_change_results(media, reference, tmp_path):
    # max_batch_patches=1: every image and video chunk in its own pass; tiny shards: one shard per item.
    s = encode_dataset(media, tmp_path / "out", max_batch_patches=1, shard_mb=1e-6, progress=False)
    assert s.encoded == len(GOOD) - 2
    assert len(shards_in(tmp_path / "out")) == len(GOOD) - 2
    assert_same_tensors(reference, tmp_path / "out")


@pytest.mark.parametrize("workers,batch_patches", [(1, 16384), (3, 28)])
def test_ray_engine_matches_local(media, reference, tmp_path, ray_local, workers, batch_patches):
    s = encode_dataset(media, tmp_path / "out", engine="ray", workers=workers, max_batch_patches=batch_patches,
                       progress=False)
    assert (s.encoded, s.deduplicated, s.failed) == (len(GOOD) - 2, 2, 3)
    assert_same_tensors(reference, tmp_path / "out")


def test_idle_ray_workers_change_nothing(media, reference, tmp_path, ray_local):
    """More workers than items: two of three actors never get a row (vLLM's idle-rank dtype hazard). Ray's
    warning that the pool will not use all its actors stays out of the output, as every Ray warning."""
    src = tmp_path / "one"
    src.mkdir()
    shutil.copy(media / "img3.png", src / "img3.png")
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        s = encode_dataset(src, tmp_path / "out", engine="ray", workers=3, progress=False)
    assert s.encoded == 1
    assert [str(w.message) for w in said if "ray" in w.filename] == []
    got = open_dataset(tmp_path / "out").tensor("img3.png")
    assert got.dtype == torch.bfloat16 and torch.equal(got, open_dataset(reference).tensor("img3.png"))


def test_encoder_stage_with_empty_batch_keeps_schema_and_dtype(media, encoder):
    """The actor's code path, called directly: zero rows in, zero rows out, same schema as a full batch."""
    pa = pytest.importorskip("pyarrow")
    from bivit.dataset.ray_engine import ENCODED_SCHEMA, PREPARED_SCHEMA, EncodeActor, decode_encoded, prepare_rows

    actor = EncodeActor(EncoderSpec(dtype="bfloat16"),
                        encoder.fingerprint, encoder.bits, threads=torch.get_num_threads())
    empty = actor(prepare_rows(pa.table({"sha256": [], "kind": [], "path": [], "name": []},
                                        schema=pa.schema([(n, pa.string()) for n in ("sha256", "kind", "path", "name")]))))
    assert empty.num_rows == 0 and empty.schema == ENCODED_SCHEMA
    assert encode_prepared(encoder, []) == []
    path = media / "img1.png"
    rows = prepare_rows(pa.table({"sha256": [sha256_file(path)], "kind": ["image"], "path": [str(path)],
                                  "name": ["img1.png"]}))
    assert rows.schema == PREPARED_SCHEMA
    full = actor(rows)
    assert full.schema == ENCODED_SCHEMA
    e = decode_encoded(full.to_pylist()[0])
    assert e.embedding.dtype == torch.bfloat16 and torch.equal(e.embedding, encoder.encode([path])[0])
    with pytest.raises(BivitError, match="fingerprint"):
        EncodeActor(EncoderSpec(dtype="bfloat16"), "f" * 64,
                    encoder.bits, 1)
    # A worker whose kernels compute another class of bits than the driver's (another CPU kind with
    # BIVIT_ARITH=native, a node without a C compiler) is refused, naming both classes.
    other = f"native/gemm-bfloat16=amx/{encoder.bits}"
    with pytest.raises(BivitError, match=f"computes bits {encoder.bits}, the driver {other}"):
        EncodeActor(EncoderSpec(dtype="bfloat16"), encoder.fingerprint,
                    other, 1)


# ----------------------------------------------------------------------------------------------------------------
# Resume and crash safety


def test_rerun_skips_and_picks_up_changes(media, tmp_path, encoder):
    src = tmp_path / "src"
    shutil.copytree(media, src)
    out = tmp_path / "out"
    encode_dataset(src, out, progress=False)
    shards = shards_in(out)
    again = encode_dataset(src, out, progress=False)
    # Failed inputs are retried (and fail again); nothing else is read or encoded.
    assert (again.encoded, again.skipped, again.deduplicated, again.failed) == (0, len(GOOD), 0, 3)
    assert shards_in(out) == shards and len(manifest_lines(out)) == len(GOOD)
    assert len((out / ERRORS).read_text().splitlines()) == 3  # one line per failing source, not one per run

    os.utime(src / "img0.png")  # touched, same bytes: rehashed, skipped
    make_image(src / "img1.png", (56, 56), seed=1234)  # new content under an old name: re-encoded
    shutil.copy(src / "img5.png", src / "new_copy.png")  # a new name for stored bytes: one line, no encode
    (src / "text.png").unlink()
    make_image(src / "text.png", (28, 56), seed=5)  # a fixed input: encoded, its error is dropped
    s = encode_dataset(src, out, progress=False)
    assert (s.encoded, s.deduplicated, s.failed, s.skipped) == (2, 1, 2, len(GOOD) - 1)
    ds = open_dataset(out)
    assert len(ds) == len(GOOD) + 2 and {e.source for e in ds.errors} == {"empty.png", "truncated.png"}
    for name in ("img1.png", "new_copy.png", "text.png", "img0.png"):
        assert torch.equal(ds.tensor(name), encoder.encode([src / name])[0]), name
    assert ds["new_copy.png"].tensor == ds["img5.png"].tensor


def test_a_deleted_bad_file_leaves_no_error_behind(media, tmp_path):
    """A dataset's error records are facts about files still in its source: once the bad file is deleted, a
    rerun exits 0 and neither errors.jsonl, `open_dataset().errors` nor `load_embeddings` lists it."""
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    for name in ("img0.png", "photo.jpg", "text.png"):
        shutil.copy(media / name, src / name)

    def run():
        return subprocess.run([sys.executable, "-m", "bivit", "encode-dataset", str(src), "--out", str(out),
                               "--no-progress"], capture_output=True, text=True, timeout=300)

    r = run()
    assert r.returncode == 1 and "1 input failed" in r.stderr, r.stderr
    assert [x.source for x in bivit.load_embeddings(out)] == ["img0.png", "photo.jpg", "text.png"]
    (src / "text.png").unlink()
    r = run()
    assert r.returncode == 0, r.stderr
    assert (out / ERRORS).read_text() == "" and open_dataset(out).errors == []
    assert [x.source for x in bivit.load_embeddings(out)] == ["img0.png", "photo.jpg"]


def _run_cli_until(src: Path, out: Path, pause: str, ready, timeout: float = 60.0,
                   options: tuple = ("--shard-mb", "0.000001")) -> None:
    """Run the real CLI in a subprocess, wait until `ready(out)` holds while it sits at a pause point, kill -9."""
    log_path = out.parent / "cli.log"
    log = open(log_path, "wb")
    proc = subprocess.Popen([sys.executable, launch.__file__, "pause", pause if ":" in pause else f"{pause}:120",
                             "encode-dataset", str(src), "--out", str(out), *options, "--no-progress"],
                            stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + timeout
        while not (out.is_dir() and ready(out)):
            assert proc.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, "the subprocess never reached the pause point"
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
        log.close()
    assert proc.returncode == -signal.SIGKILL


def _unreferenced_shards(out: Path) -> set[str]:
    return shards_in(out) - {r["shard"] for r in manifest_lines(out)}


@pytest.mark.parametrize("pause,ready", [
    # Killed with a shard half-way (written to its temp name, not yet renamed).
    ("before_rename", lambda d: any(p.name.startswith(TMP_PREFIX + "shard-") for p in d.iterdir())),
    # Killed between the shard's rename and its manifest lines: a complete shard nobody references.
    ("after_rename", lambda d: bool(shards_in(d)) and bool(_unreferenced_shards(d))),
    # Killed a few shards in, between two of them (paused after the third shard's manifest lines).
    ("after_commit:120:2", lambda d: (d / MANIFEST).exists() and (d / MANIFEST).read_bytes().count(b"\n") >= 3),
])
def test_sigkill_then_resume_is_bit_identical(media, reference, tmp_path, pause, ready):
    out = tmp_path / "out"
    _run_cli_until(media, out, pause, ready)
    assert_consistent(out)
    before = open_dataset(out)  # a reader sees only whole, durable items
    assert len(before) < len(GOOD)
    from bivit.dataset.journal import JOURNAL, read_entries

    # What the journal holds beyond the committed lines is committed first, and skipped too.
    journaled = {r.source for lines, _ in read_entries(out / JOURNAL) for r in lines} - set(before.sources)
    s = encode_dataset(media, out, progress=False)
    assert s.skipped == len(before) + len(journaled)
    assert not [p for p in out.iterdir() if p.name.startswith(TMP_PREFIX)]
    assert not _unreferenced_shards(out)
    assert sorted(r["source"] for r in manifest_lines(out)) == GOOD  # every source exactly once
    assert_consistent(out)
    assert_same_tensors(reference, out)


def test_sigkill_below_one_shard_keeps_progress(tmp_path):
    """With the default --shard-mb (256), eight SIGKILLs of a 10 s job each left no manifest: every resume redid
    everything. Each input the writer takes is now in the folder's journal before the next is taken: killed
    once the journal holds 5 of 12 inputs (paused there, so no timing decides it), the folder lists nothing yet
    (the control: no shard was committed, only the journal holds them), and the resume commits those 5 before
    it plans and encodes only the other 7 (a journal cut short in its 5th entry: the 4 before it). Every tensor
    is bit-identical to an uninterrupted run's."""
    from bivit.dataset.journal import JOURNAL, read_entries

    src = tmp_path / "src"
    src.mkdir()
    for i in range(12):
        make_image(src / f"{i:02d}.png", (28 * (1 + i % 3), 56), seed=200 + i)
    ref = tmp_path / "ref"
    encode_dataset(src, ref, progress=False)
    out = tmp_path / "out"
    _run_cli_until(src, out, "journaled:600:5", lambda d: len(list(read_entries(d / JOURNAL))) >= 5, options=())
    assert len(list(read_entries(out / JOURNAL))) == 5
    assert len(open_dataset(out)) == 0 and not shards_in(out)  # the control: nothing committed but the journal
    cut = tmp_path / "cut"  # killed in the middle of its 5th entry: the 4 before it are kept
    shutil.copytree(out, cut)
    with open(cut / JOURNAL, "r+b") as f:
        f.truncate((cut / JOURNAL).stat().st_size - 100)
    for folder, kept in ((out, 5), (cut, 4)):
        journaled = {r.source for lines, _ in read_entries(folder / JOURNAL) for r in lines}
        s = encode_dataset(src, folder, progress=False)
        assert (s.skipped, s.encoded, len(journaled)) == (kept, 12 - kept, kept)
        assert s.tokens == sum(r.tokens for r in open_dataset(ref) if r.source not in journaled)  # this run's own
        assert not (folder / JOURNAL).exists()
        done, want = open_dataset(folder), open_dataset(ref)
        assert sorted(done.sources) == sorted(want.sources) == sorted(p.name for p in src.iterdir())
        for rec in want:
            assert torch.equal(done.tensor(rec.source), want.tensor(rec)), rec.source


def test_a_version_1_folder_is_continued_in_its_version(media, reference, tmp_path, caplog):
    """A folder written before lines and header carried checksums (format_version 1) is read unverified, said
    once per file, and a job continues it in version 1 (its new lines sealed all the same) rather than refusing
    it as another encoder's; the control: the same folder as written (version 2) is refused once a line is
    altered, and this one is not."""
    from bivit.dataset.format import HEADER_KEY, LINE_KEY

    out = tmp_path / "out"
    shutil.copytree(reference, out)
    header = json.loads((out / HEADER).read_text())
    (out / HEADER).write_text(json.dumps({**{k: v for k, v in header.items() if k != HEADER_KEY},
                                          "format_version": 1}))
    lines = [{k: v for k, v in row.items() if k != LINE_KEY} for row in manifest_lines(out)]
    victim = next(r for r in lines if r["source"] == "img1.png")
    lines.remove(victim)
    (out / MANIFEST).write_text("".join(json.dumps(r) + "\n" for r in lines))
    with caplog.at_level("WARNING", logger="bivit.records"):
        s = encode_dataset(media, out, progress=False)
    assert (s.encoded, s.skipped) == (1, len(GOOD) - 1)
    assert json.loads((out / HEADER).read_text())["format_version"] == 1
    assert LINE_KEY in json.loads((out / MANIFEST).read_text().splitlines()[-1])
    assert [r.getMessage() for r in caplog.records if "unverified" in r.getMessage()].count(
        f"{out / MANIFEST}: written without checksums ({LINE_KEY}, before bivit wrote them): read unverified") == 1
    assert_same_tensors(reference, out)
    for folder, refused in ((out, False), (tmp_path / "v2", True)):
        if refused:
            shutil.copytree(reference, folder)
        altered = [json.loads(x) for x in (folder / MANIFEST).read_text().splitlines()]
        altered[0]["source"] = "other.png"
        (folder / MANIFEST).write_text("".join(json.dumps(r) + "\n" for r in altered))
        if refused:
            with pytest.raises(bivit.errors.FormatError, match="not matching its checksum"):
                open_dataset(folder)
        else:
            assert "other.png" in open_dataset(folder).sources


def test_cut_off_manifest_line_is_ignored_then_repaired(media, reference, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(reference, out)
    rows = manifest_lines(out)
    # The state a kill in the middle of an append leaves: the last line cut short, no newline.
    cut = (out / MANIFEST).read_text().splitlines(keepends=True)
    (out / MANIFEST).write_text("".join(cut[:-1]) + cut[-1][:40])
    assert len(open_dataset(out)) == len(GOOD) - 1
    s = encode_dataset(media, out, progress=False)
    assert s.skipped == len(GOOD) - 1 and s.encoded + s.deduplicated == 1
    assert (out / MANIFEST).read_bytes().endswith(b"\n") and len(manifest_lines(out)) == len(rows)
    assert_same_tensors(reference, out)


# ----------------------------------------------------------------------------------------------------------------
# Refusals


def test_refuses_a_folder_of_another_encoder(media, reference, tmp_path, kimi_ckpt):
    out = tmp_path / "out"
    shutil.copytree(reference, out)
    with pytest.raises(BivitError, match=r"dtype 'bfloat16' there vs 'float32' now"):
        encode_dataset(media, out, dtype="float32", progress=False)
    with pytest.raises(BivitError, match="fingerprint"):
        encode_dataset(media, out, model=str(kimi_ckpt), progress=False)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "x.bin").write_bytes(b"1")
    with pytest.raises(BivitError, match="not empty and has no dataset.json"):
        encode_dataset(media, tmp_path / "other", progress=False)
    assert manifest_lines(out) == manifest_lines(reference)


def test_one_writer_at_a_time(reference, tmp_path):
    header = json.loads((reference / HEADER).read_text())
    with DatasetWriter(tmp_path / "out", header):
        with pytest.raises(BivitError, match="another bivit encode-dataset is writing"):
            DatasetWriter(tmp_path / "out", header)
    DatasetWriter(tmp_path / "out", header).close()  # released


def test_cli_prints_a_summary_or_one_line_error(media, tmp_path):
    from typer.testing import CliRunner

    from bivit.cli import app

    r = CliRunner().invoke(app, ["encode-dataset", str(media), "--out", str(tmp_path / "out"), "--no-progress"])
    assert r.exit_code == 1, r.output  # inputs failed
    assert f"encoded {len(GOOD) - 2}, skipped 0, deduplicated 2, failed 3" in r.output
    r = CliRunner().invoke(app, ["encode-dataset", str(media), "--out", str(tmp_path / "out"), "--no-progress",
                                 "--allow-failures"])
    assert r.exit_code == 0, r.output
    assert f"encoded 0, skipped {len(GOOD)}, deduplicated 0, failed 3" in r.output  # the failures are retried
    r = CliRunner().invoke(app, ["encode-dataset", str(media), "--out", str(tmp_path / "out"), "--dtype", "int8"])
    assert r.exit_code == 2 and r.output.strip().count("\n") == 0 and r.output.startswith("bivit: error: --dtype")
    assert "Traceback" not in r.output


# ----------------------------------------------------------------------------------------------------------------
# Hostile and careless inputs: nothing hangs, nothing is silently lost or silently stale


def run_cli(*args, timeout: float = 120, **kw):
    return subprocess.run([sys.executable, "-m", "bivit", "encode-dataset", *map(str, args), "--no-progress"],
                          capture_output=True, text=True, timeout=timeout, **kw)


def test_replaced_bytes_fail_visibly_and_hide_the_stale_embedding(tmp_path):
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    make_image(src / "a.png", (56, 28), seed=1)
    make_image(src / "b.png", (28, 28), seed=2)
    good = (src / "a.png").read_bytes()
    encode_dataset(src, out, progress=False)
    before = open_dataset(out).tensor("a.png")
    (src / "a.png").write_bytes(b"garbage, not an image")
    s = encode_dataset(src, out, progress=False)
    assert s.failed == 1
    rows = [json.loads(line) for line in (out / ERRORS).read_text().splitlines()]
    assert [r["source"] for r in rows] == ["a.png"] and rows[0]["error"].startswith("a.png: ")
    ds = open_dataset(out)
    assert [e.source for e in ds.errors] == ["a.png"] and "a.png" not in ds and ds.sources == ["b.png"]
    with pytest.raises(KeyError):
        ds.tensor("a.png")  # the old embedding is not the file's bytes any more
    (src / "a.png").write_bytes(good)
    s = encode_dataset(src, out, progress=False)
    assert (s.failed, s.encoded, s.deduplicated) == (0, 0, 1)  # its bytes are still stored
    ds = open_dataset(out)
    assert ds.errors == [] and torch.equal(ds.tensor("a.png"), before)


def test_unreadable_folder_is_recorded_until_it_can_be_listed(tmp_path):
    from support.users import ordinary

    src, out = tmp_path / "src", tmp_path / "out"
    (src / "locked").mkdir(parents=True)
    make_image(src / "a.png", (28, 28), seed=1)
    make_image(src / "locked" / "b.png", (28, 28), seed=2)
    (src / "locked").chmod(0)
    try:
        r = run_cli(src, "--out", out, preexec_fn=ordinary)
    finally:
        (src / "locked").chmod(0o755)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    ds = open_dataset(out)
    assert ds.sources == ["a.png"] and [e.source for e in ds.errors] == ["locked/"]
    assert "cannot list the folder" in ds.errors[0].error and "ermission denied" in ds.errors[0].error
    r = run_cli(src, "--out", out, preexec_fn=ordinary)
    assert r.returncode == 0, r.stderr
    ds = open_dataset(out)
    assert sorted(ds.sources) == ["a.png", "locked/b.png"] and ds.errors == []


def test_fifo_and_links_to_devices_are_refused_without_hanging(tmp_path):
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    make_image(src / "a.png", (28, 28), seed=1)
    os.mkfifo(src / "pipe.png")
    (src / "zero.png").symlink_to("/dev/zero")
    (src / "folder.png").mkdir()  # a folder named like an image is a folder: listed into, not read
    r = run_cli(src, "--out", out, timeout=60)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    errors = {e.source: e.error for e in open_dataset(out).errors}
    assert errors.keys() == {"pipe.png", "zero.png"}
    assert "a FIFO" in errors["pipe.png"] and "not followed" in errors["zero.png"]  # a link out of SRC
    r = run_cli(src, "--out", tmp_path / "out1", "--follow-symlinks", timeout=60)  # followed: a device, refused
    followed = {e.source: e.error for e in open_dataset(tmp_path / "out1").errors}
    assert r.returncode == 1 and "a character device" in followed["zero.png"]
    manifest = tmp_path / "list.txt"
    manifest.write_text(f"{src / 'pipe.png'}\n{src / 'zero.png'}\n/dev/null\n{src / 'a.png'}\n")
    r = run_cli(manifest, "--out", tmp_path / "out2", timeout=60)
    assert r.returncode == 1, r.stderr
    ds = open_dataset(tmp_path / "out2")
    assert len(ds) == 1 and len(ds.errors) == 3 and all("not a regular file" in e.error for e in ds.errors)


def test_each_source_with_the_same_bad_bytes_is_named_in_its_own_error(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in ("first.png", "second.png"):
        (src / name).write_bytes(b"the same garbage")
    encode_dataset(src, tmp_path / "out", progress=False)
    errors = {e.source: e.error for e in open_dataset(tmp_path / "out").errors}
    assert errors["first.png"].startswith("first.png: ") and errors["second.png"].startswith("second.png: ")
    assert "first.png" not in errors["second.png"]


def test_manifest_names_are_read_as_normalised(tmp_path):
    make_image(tmp_path / "a.png", (28, 28), seed=1)
    manifest = tmp_path / "list.txt"
    manifest.write_text("nosuchdir/../a.png\na.png\n")
    s = encode_dataset(manifest, tmp_path / "out", progress=False)
    assert (s.encoded, s.failed) == (1, 0)
    assert open_dataset(tmp_path / "out").sources == ["a.png"]


# ------------------------------------------------------------------------------ model preprocessing and alpha
def _transparent_png(path: Path, w: int = 50, h: int = 40) -> Path:
    from PIL import Image

    rgba = np.random.default_rng(w * h).integers(0, 256, (h, w, 4), np.uint8)
    Image.fromarray(rgba, "RGBA").save(path)
    return path


@pytest.mark.parametrize("engine", ["local", "ray"])
def test_dataset_follows_the_models_preprocessing_and_alpha(tmp_path, k3_ckpt, engine, request):
    if engine == "ray":
        request.getfixturevalue("ray_local")
    src = tmp_path / "src"
    src.mkdir()
    _transparent_png(src / "t.png")
    make_image(src / "odd.png", (333, 517), seed=3)
    make_video(src / "clip.mp4", frames=8, fps=4, size=(56, 56))
    out = tmp_path / "out"
    s = encode_dataset(src, out, model=str(k3_ckpt), dtype="float32", alpha="white", engine=engine, progress=False)
    assert (s.encoded, s.failed) == (2, 1)  # K3's processor takes images only: the video is an error
    enc = bivit.load_encoder(k3_ckpt, dtype="float32", alpha="white")
    ds = open_dataset(out)
    for name in ("t.png", "odd.png"):
        assert torch.equal(ds.tensor(name), enc.encode([src / name])[0]), name
    assert ds["odd.png"].tokens == enc.image_token_count(333, 517)
    assert [e.source for e in ds.errors] == ["clip.mp4"] and "accepts images only" in ds.errors[0].error
    header = json.loads((out / HEADER).read_text())
    assert header["alpha"] == "white" and header["processing"]["processor"] == "kimi_k3"
    if engine == "local":  # resuming with another alpha would mix two preprocessings: refused
        with pytest.raises(BivitError, match="alpha"):
            encode_dataset(src, out, model=str(k3_ckpt), dtype="float32", progress=False)
