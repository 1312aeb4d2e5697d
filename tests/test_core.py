"""The core path every front end uses: any mix of inputs -> one result per input (`Encoder.encode_items`,
`encode_stream`), the one packing rule, `describe`, and the deprecated spellings of the budget.

Embeddings are compared bit for bit with the lower-level path (`encode_batch` of one input's preprocessed
items); the invariance claim (shared passes change nothing) has its control: under a GEMM whose reduction
order depends on the row count, default mode differs where invariant mode does not.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import av
import pytest
import torch
from PIL import Image
from safetensors import safe_open

import bivit
import bivit.core.packing
from bivit.core.items import ItemResult, Prepared, VideoFrames, pixels_sha256
from bivit.core.packing import pack
from bivit.media.pixels import MediaBatch
from bivit.media.video import preprocess_video, sample_frame_indices
from support.controls import row_count_dependent_gemms
from support.media import make_video, random_image


@pytest.fixture(scope="module")
def enc():
    return bivit.load_encoder()  # demo model, bf16, batch-invariant


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    d = tmp_path_factory.mktemp("core")
    Image.fromarray(random_image(60, 90, 1)).save(d / "a.png")
    Image.fromarray(random_image(150, 100, 2)).save(d / "b.jpg", quality=95)
    (d / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\nbroken")
    video = make_video(d / "clip.mp4", frames=22, fps=8, size=(84, 56),
                       content=lambda i, size: random_image(size[1], size[0], i))
    return {"png": d / "a.png", "jpg": d / "b.jpg", "corrupt": d / "corrupt.png", "missing": d / "missing.png",
            "video": video}


def _alone(enc, src) -> torch.Tensor:
    """One input through the lower-level path: its preprocessed items, one `encode_batch` call, joined."""
    is_video = isinstance(src, Path) and src.suffix == ".mp4"
    batch = preprocess_video(src, processing=enc.processing) if is_video else enc.preprocess([src])
    return torch.cat(enc.encode_batch(batch))


def _decoded_frames(path) -> VideoFrames:
    """The frames bivit samples from `path`, decoded here with PyAV (RGB24, as bivit decodes them)."""
    with av.open(str(path)) as c:
        stream = c.streams.video[0]
        fps = float(stream.average_rate)
        frames = [f.to_ndarray(format="rgb24") for f in c.decode(stream)]
    indices = sample_frame_indices(len(frames), fps)
    return VideoFrames([frames[i] for i in indices], fps, indices, name="decoded")


def test_any_mix_of_inputs_gives_one_result_each(enc, media):
    rgba = Image.fromarray(random_image(40, 70, 3)).convert("RGBA")
    arr = random_image(33, 47, 4)
    jpg_bytes = media["jpg"].read_bytes()
    frames = _decoded_frames(media["video"])
    inputs = [media["png"], media["video"], jpg_bytes, rgba, media["corrupt"], arr, frames, media["missing"]]
    results = enc.encode_items(inputs)
    assert len(results) == len(inputs) and all(isinstance(r, ItemResult) for r in results)
    assert [r.kind for r in results] == ["image", "video", "image", "image", "image", "image", "video", "image"]
    for i in (4, 7):  # a bad input is its own result, never an exception
        assert isinstance(results[i].error, bivit.MediaError) and results[i].embedding is None
        assert str(inputs[i]) in str(results[i].error) and results[i].source == str(inputs[i])
    good = [r for i, r in enumerate(results) if i not in (4, 7)]
    assert all(r.ok and r.embedding.dtype == torch.bfloat16 for r in good)
    # Same bits as each input alone through the lower-level path (shared passes change nothing).
    for i in (0, 1, 2, 3, 5):
        assert torch.equal(results[i].embedding, _alone(enc, inputs[i])), i
    # A video decoded by the caller is chunked and timestamped as the file is: the same bits.
    assert torch.equal(results[6].embedding, results[1].embedding)
    assert results[6].timestamps == results[1].timestamps and results[6].grid_thw == results[1].grid_thw
    # Per chunk: grid, timestamps, placeholders; a video's chunks in time order, joined.
    chunks = enc.encode_video(media["video"])
    assert results[1].grid_thw == [list(c.grid_thw) for c in chunks]
    assert results[1].timestamps == [c.timestamp for c in chunks]
    assert all(torch.equal(a, c.embedding) for a, c in zip(results[1].chunks, chunks))
    assert results[1].chunk_tokens == [c.token_count for c in chunks] and len(chunks) == 2
    for r, ph in zip(good[:3], enc.placeholders(inputs[:4])):
        assert r.placeholders == ph and sum(p.tokens for p in ph) == r.tokens
    # Content hash: the bytes' sha256 for paths and bytes; for decoded images, of their pixels.
    assert results[0].sha256 == hashlib.sha256(media["png"].read_bytes()).hexdigest()
    assert results[1].sha256 == hashlib.sha256(media["video"].read_bytes()).hexdigest()
    assert results[2].sha256 == hashlib.sha256(jpg_bytes).hexdigest()
    assert results[5].sha256 == pixels_sha256(Image.fromarray(arr)) != pixels_sha256(random_image(33, 47, 5))
    assert results[3].sha256 == pixels_sha256(rgba) != pixels_sha256(rgba.convert("RGB"))
    with pytest.raises(bivit.MediaError, match="corrupt.png"):
        enc.encode_items(inputs[3:5], raise_errors=True)


def test_pixels_hash_sees_palettes():
    a = Image.new("P", (4, 4), 1)
    b = a.copy()
    a.putpalette([0, 0, 0, 255, 0, 0])
    b.putpalette([0, 0, 0, 0, 255, 0])
    assert pixels_sha256(a) != pixels_sha256(b) and pixels_sha256(a) == pixels_sha256(a.copy())


def test_sharing_passes_changes_no_bits_and_the_control_shows_it_could():
    images = [random_image(h, w, 7) for h, w in [(28, 28), (28, 56), (84, 28), (56, 56), (112, 84)]]
    for invariant in (True, False):
        e = bivit.load_encoder(dtype="float32", batch_invariant=invariant)
        with row_count_dependent_gemms():
            together = e.encode_items(images)
            alone = [_alone(e, img) for img in images]
        same = all(torch.equal(r.embedding, a) for r, a in zip(together, alone))
        assert same == invariant


def _images(sides):
    return [random_image(h, h, i) for i, h in enumerate(sides)]


def test_stream_cuts_passes_by_the_rule_and_streams(enc, monkeypatch):
    # 28 -> 4 patches, 56 -> 16, 112 -> 64. Budget 20: [4, 16] | [64] (larger than the budget: alone) | [16, 4].
    images = _images([28, 56, 112, 56, 28])
    passes, pulled, first_at = [], [], []
    forward = enc.forward
    monkeypatch.setattr(enc, "forward", lambda batch: passes.append(batch.patch_counts) or forward(batch))

    def prepared():
        for img in images:
            pulled.append(img)
            yield enc.prepare(img)

    monkeypatch.setattr(enc, "max_batch_patches", 20)
    results = []
    for r in enc.encode_stream(prepared()):
        first_at.append(len(pulled))
        results.append(r)
    counts = [4, 16, 64, 16, 4]
    assert passes == [[4, 16], [64], [16, 4]] == [[counts[i] for i in p] for p in pack(counts, 20)]
    # Results come out in order as soon as their pass ran: the first two before the last inputs were prepared.
    assert first_at == [3, 3, 4, 5, 5]
    assert all(torch.equal(r.embedding, _alone(enc, img)) for r, img in zip(results, images))


def _passes_of_both_users(enc, monkeypatch, images, budget):
    """The passes `encode_stream` and the service's batching worker run for the same queue of items (patch
    counts per pass) and the embeddings each gives."""
    from bivit.serve.batcher import Batcher
    from bivit.serve.metrics import Metrics

    monkeypatch.setattr(enc, "max_batch_patches", budget)
    passes = {"stream": [], "service": []}
    user = "stream"
    forward = enc.forward
    monkeypatch.setattr(enc, "forward", lambda batch: passes[user].append(batch.patch_counts) or forward(batch))
    stream = [r.embedding for r in enc.encode_stream(enc.prepare(img) for img in images)]
    user = "service"
    batcher = Batcher(enc, max_wait_s=0.0, metrics=Metrics())
    # Every item is queued before the worker starts: where a batch ends is then decided by the rule alone.
    futures = [batcher.submit(enc.prepare(img).batch) for img in images]
    batcher.start()
    batcher.stop()
    return passes, stream, [f.result(timeout=60) for f in futures]


def test_stream_and_service_fill_passes_by_one_rule(enc, monkeypatch):
    images = _images([28, 56, 112, 56, 28, 28, 56, 28])  # 4, 16, 64, 16, 4, 4, 16, 4 patches
    counts = [4, 16, 64, 16, 4, 4, 16, 4]
    passes, stream, service = _passes_of_both_users(enc, monkeypatch, images, 20)
    assert passes["stream"] == passes["service"] == [[counts[i] for i in p] for p in pack(counts, 20)]
    assert len(passes["stream"]) == 5
    assert all(torch.equal(a, b) for a, b in zip(stream, service))
    # Control: both users ask `Pass.fits` and nothing else; change the rule and both follow it.
    monkeypatch.setattr(bivit.core.packing.Pass, "fits", lambda self, patches: not self.items)
    passes, _, _ = _passes_of_both_users(enc, monkeypatch, images, 20)
    assert passes["stream"] == passes["service"] == [[n] for n in counts]


def test_encode_prepares_inputs_as_passes_fill(enc, monkeypatch):
    """`encode` of many inputs holds about one pass of pixels: an input is prepared only when the pass being
    filled has room for it (memory does not grow with the number of inputs)."""
    images = _images([56] * 12)  # 16 patches each: budget 32 -> passes of two
    prepare, forward = enc.prepare, enc.forward
    prepared, at_pass = [], []
    monkeypatch.setattr(enc, "max_batch_patches", 32)
    monkeypatch.setattr(enc, "prepare", lambda src, **kw: prepared.append(src) or prepare(src, **kw))
    monkeypatch.setattr(enc, "forward", lambda batch: at_pass.append(len(prepared)) or forward(batch))
    out = enc.encode(images)
    # Each pass runs once the next input (which did not fit) is prepared: never more than one input ahead.
    assert at_pass == [3, 5, 7, 9, 11, 12]
    assert all(torch.equal(e, _alone(enc, img)) for e, img in zip(out, images))
    with pytest.raises(bivit.MediaError):  # raise_errors: the first bad input raises as soon as it is read
        enc.encode([images[0], b"not an image"])


def test_a_failing_pass_fails_only_its_item(enc):
    good = [enc.prepare(img) for img in _images([28, 56])]
    # An odd grid width cannot go through the 2x2 merger: the model raises for it, in any pass.
    bad = Prepared("bad", "image", grid_thw=[[1, 2, 3]],
                   batch=MediaBatch(good[1].batch.pixel_values[:6], torch.tensor([[1, 2, 3]])))
    results = list(enc.encode_stream([good[0], bad, good[1]]))
    assert isinstance(results[1].error, RuntimeError)
    assert results[1].error is not None and results[1].embedding is None
    assert all(torch.equal(results[i].embedding, _alone(enc, img)) for i, img in ((0, _images([28])[0]),
                                                                                  (2, _images([28, 56])[1])))


def test_describe(enc):
    d = enc.describe()
    assert (d["model"], d["demo"], d["fingerprint"]) == ("demo", True, enc.fingerprint)
    assert (d["dtype"], d["projector_dtype"], d["output_dtype"]) == ("bfloat16",) * 3
    assert d["batch_invariant"] is True and d["alpha"] == "model" and d["processing"] == enc.processing.to_dict()
    assert d["kernels"]["gemm"] == [f"bfloat16: {bivit.ops.gemm_kernel(torch.bfloat16).describe()}"]
    assert d["kernels"]["attention"].startswith("bivit compiled (")
    proof = d["kernels"]["proof"]  # the load-time proof: every op proven on this machine, nothing refused
    assert proof["checks"] and all(c["invariant"] for c in proof["checks"]) and proof["refused"] == []
    json.dumps(d)


def test_one_budget_one_name_one_default(enc):
    """The patch budget has one name and one default, the library's included (no unbounded pass), and the old
    spellings are gone rather than converted."""
    from bivit.core.packing import MAX_BATCH_PATCHES
    from bivit.serve.settings import ServerSettings

    assert enc.max_batch_patches == MAX_BATCH_PATCHES == 16384
    with pytest.raises(bivit.ConfigError, match="max_batch_tokens"):
        bivit.load_encoder(max_batch_tokens=64)
    with pytest.raises(TypeError):
        ServerSettings(max_batch_patches=7)  # the service cuts passes by its encoder's budget
    batch = enc.preprocess(_images([28, 56]))
    with pytest.raises(TypeError):
        enc.encode_batch(batch, max_batch_tokens=4)


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "bivit.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=300)


def test_cli_budget_option_and_the_file_it_writes(media, tmp_path):
    out = tmp_path / "e.safetensors"
    r = _cli("encode", media["png"], "--out", out, "--max-batch-patches", "64")
    assert r.returncode == 0, r.stderr
    with safe_open(str(out), "pt") as f:
        meta = json.loads(f.metadata()["encoder"])
        items = json.loads(f.metadata()["items"])
        assert torch.equal(f.get_tensor("0"), _alone(bivit.load_encoder(), media["png"]))
    # The file names the encoder as `describe` does (its fallbacks are those of the process that wrote it), and
    # each item's kind and content hash.
    d = bivit.load_encoder().describe()
    kernels = lambda about: {k: v for k, v in about["kernels"].items() if k != "fallbacks"}  # noqa: E731
    assert kernels(meta) == kernels(d) and {k: meta[k] for k in d if k != "kernels"} == {
        k: v for k, v in d.items() if k != "kernels"}
    assert items[0]["sha256"] == hashlib.sha256(media["png"].read_bytes()).hexdigest()
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.png").write_bytes(media["png"].read_bytes())
    r = _cli("encode-dataset", src, "--out", tmp_path / "ds", "--max-batch-patches", "20", "--no-progress")
    assert r.returncode == 0, r.stderr
    header = json.loads((tmp_path / "ds" / "dataset.json").read_text())
    assert header["fingerprint"] == d["fingerprint"] and kernels(header) == kernels(d)
    for cmd, arg, dest in (("encode", media["png"], out), ("encode-dataset", src, tmp_path / "ds2")):
        r = _cli(cmd, arg, "--out", dest, "--max-batch-patches", "0")
        assert r.returncode == 2 and r.stderr == "bivit: error: --max-batch-patches 0: expected a whole number >= 1\n"
    for old in ("--max-batch-tokens", "--batch-tokens", "--batch-patches"):  # the old spellings are gone
        r = _cli("encode", media["png"], "--out", out, old, "64")
        assert r.returncode == 2 and "No such option" in r.stderr
