"""Video input: sampling, chunking, timestamps, decoding and limits against the reference's rules
(docs/model.md, "Video").

Every video here is a real file written by PyAV (tests/support/media.py) whose frames carry their own index, so
the tests check *which* frames were sampled. Expected indices come from a literal transcription of the
reference formula below and, for the cases that matter, from hand-computed constants.
"""

from __future__ import annotations

import math
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import pytest
import torch

import bivit
from bivit import MediaError
from bivit.errors import ConfigError
from bivit.media.grids import image_token_count, padded_grid
from bivit.media.kinds import is_video_path
from bivit.media.pixels import frames_to_item
from bivit.media.video import (VideoChunk, chunk_timestamp, preprocess_video, probe_video, sample_frame_indices,
                               video_chunks)
from support import reference
from support.media import (
    frame_pattern,
    make_audio_only,
    make_image,
    make_video,
    make_zero_frame_video,
    overstate_avi_frame_count,
    read_frame_index,
)

NTSC = Fraction(30000, 1001)


def reference_indices(num_frames: int, fps: float, sample_fps: float = 2.0) -> list[int]:
    """The reference's sampling, transcribed literally."""
    sample_fps = min(sample_fps, fps)
    n = max(round(num_frames * sample_fps / fps), 1)
    return np.linspace(0, num_frames - 1, n).round().astype(int).tolist()


def reference_timestamp(frame_index: int, fps: float) -> str:
    return reference.timestamp(frame_index / fps)


def decode_all(path) -> list:
    """Every frame of a video as PIL RGB, decoded the plain way (independent of bivit.media.video)."""
    with av.open(str(path)) as c:
        return [f.to_image().convert("RGB") for f in c.decode(video=0)]


def unpatchify(pixels: torch.Tensor, grid) -> np.ndarray:
    """Inverse of the patchify in frames_to_item: `[t*h*w, 3, 14, 14]` -> uint8 frames `[t, 14h, 14w, 3]`."""
    t, h, w = (int(v) for v in grid)
    x = pixels.reshape(t, h, w, 3, 14, 14).permute(0, 1, 4, 2, 5, 3).reshape(t, h * 14, w * 14, 3)
    return ((x.double() * 0.5 + 0.5) * 255).round().clamp(0, 255).to(torch.uint8).numpy()


def sampled_frame_ids(batch) -> list[int]:
    """The frame indices a batch's frames show (84x56 frames are a whole number of 28-px units: no resize/pad)."""
    ids = []
    for i in range(len(batch)):
        item = batch.item(i)
        ids += [read_frame_index(f) for f in unpatchify(item.pixel_values, item.grid_thw[0].tolist())]
    return ids


@pytest.fixture(scope="module")
def vids(tmp_path_factory):
    d = tmp_path_factory.mktemp("videos")
    return d


# ------------------------------------------------------------------------------------------- sampling
@pytest.mark.parametrize("num_frames,fps", [
    (23, 10.0), (300, 30.0), (301, 30.0), (7, 1.0), (1, 1.0), (5, 0.5), (150, float(NTSC)), (1799, float(NTSC)),
    (108_000, 30.0), (1_000_000, 59.94), (10, 2.0), (11, 2.5), (5, 4.0), (7, 4.0), (3, 4.0), (1, 4.0),
    (2, 100.0), (61, 24.0), (100, 1000 / 41),
])
def test_sample_frame_indices_match_reference_formula(num_frames, fps):
    got = sample_frame_indices(num_frames, fps)
    assert got == reference_indices(num_frames, fps)
    assert got[0] == 0 and got == sorted(set(got))
    assert got[-1] == num_frames - 1 or got == [0]  # one sample is frame 0, not the last
    assert all(isinstance(i, int) for i in got)


def test_sample_frame_indices_hand_computed():
    # 23 frames at 10 fps: n = round(4.6) = 5, linspace = [0, 5.5, 11, 16.5, 22]; half to even: 5.5->6, 16.5->16.
    assert sample_frame_indices(23, 10) == [0, 6, 11, 16, 22]
    # n itself rounds half to even: 5*2/4 = 2.5 -> 2, 7*2/4 = 3.5 -> 4, 3*2/4 = 1.5 -> 2, 1*2/4 = 0.5 -> 0 -> 1.
    assert sample_frame_indices(5, 4) == [0, 4]
    assert sample_frame_indices(7, 4) == [0, 2, 4, 6]
    assert sample_frame_indices(3, 4) == [0, 2]
    assert sample_frame_indices(1, 4) == [0]
    # fps below 2: every frame is sampled.
    assert sample_frame_indices(7, 1) == list(range(7))
    assert sample_frame_indices(5, 0.5) == list(range(5))
    # NTSC: 150 frames at 29.97 fps = 5.005 s -> round(10.01) = 10 frames.
    assert len(sample_frame_indices(150, NTSC)) == 10
    # One hour at 30 fps: 7200 frames, 1800 chunks.
    one_hour = sample_frame_indices(108_000, 30)
    assert len(one_hour) == 7200 and math.ceil(len(one_hour) / 4) == 1800
    # Other sampling rates follow the same formula.
    assert sample_frame_indices(31, 10, sample_fps=1.0) == reference_indices(31, 10, 1.0) == [0, 15, 30]


@pytest.mark.parametrize("num_frames,fps", [(0, 10.0), (-3, 10.0), (10, 0.0), (10, float("nan")), (10, -1.0)])
def test_sample_frame_indices_rejects_impossible_videos(num_frames, fps):
    with pytest.raises(MediaError):
        sample_frame_indices(num_frames, fps)


@pytest.mark.parametrize("sample_fps", [0, -2.0, float("inf"), float("nan")])
def test_sample_frame_indices_rejects_bad_sample_fps(sample_fps):
    with pytest.raises(ConfigError, match="sample_fps"):
        sample_frame_indices(10, 10, sample_fps=sample_fps)


# ------------------------------------------------------------------------------------------ timestamps
def test_chunk_timestamp_truncates_like_the_reference():
    assert chunk_timestamp(23, 10) == "00:00:02.299"  # 2.3 s is 2.2999999999999998 in binary
    assert chunk_timestamp(0, 30) == "00:00:00.000"
    assert chunk_timestamp(15, 30) == "00:00:00.500"
    assert chunk_timestamp(189, 30) == "00:00:06.299"
    assert chunk_timestamp(1001, NTSC) == "00:00:33.400"
    assert chunk_timestamp(3723 * 30 + 15, 30) == "01:02:03.500"  # past one hour
    assert chunk_timestamp(36_000 * 24 - 1, 24) == "09:59:59.958"
    # The reference's %H wraps at 24 h (gmtime of a day); matched, not fixed.
    assert chunk_timestamp(25 * 3600, 1) == "01:00:00.000"


@pytest.mark.parametrize("index,fps", [(23, 10.0), (7, 3.0), (1001, float(NTSC)), (12345, 59.94), (999_999, 30.0),
                                       (5, 0.5), (17, 24.0), (1, 1000 / 41)])
def test_chunk_timestamp_matches_reference_transcription(index, fps):
    assert chunk_timestamp(index, fps) == reference_timestamp(index, fps)


# ---------------------------------------------------------------------------------- decoding: content
@pytest.mark.parametrize("ext", [".mp4", ".webm", ".mkv", ".gif", ".avi", ".mov"])
def test_right_frames_are_sampled_in_every_container(vids, ext):
    path = make_video(vids / f"n23{ext}", frames=23, fps=10)
    batch = preprocess_video(path)
    assert sampled_frame_ids(batch) == [0, 6, 11, 16, 22]
    assert batch.grid_thw.tolist() == [[4, 4, 6], [1, 4, 6]]
    assert batch.timestamps == ["00:00:00.000", "00:00:02.200"]
    assert batch.sources == [f"{path}#chunk0", f"{path}#chunk1"]
    info = probe_video(path)
    assert (info.num_frames, info.fps, info.width, info.height) == (23, 10.0, 84, 56)
    # WebM/Matroska store no frame count: it is counted by decoding.
    assert info.frame_count_from == ("decoding" if ext in (".webm", ".mkv") else "container")


@pytest.mark.parametrize("frames,fps,ext", [
    (6, 1, ".mp4"),          # fps < 2: every frame, chunks [4, 2]
    (5, 0.5, ".mkv"),        # very low fps, counted by decoding
    (150, NTSC, ".mp4"),     # 29.97 fps
    (5, 4, ".mp4"),          # n = round(2.5) = 2 (half to even)
    (7, 4, ".webm"),         # n = round(3.5) = 4
    (1, 25, ".mp4"),         # a single frame
    (61, 24, ".mkv"),
])
def test_sampled_frames_match_formula(vids, frames, fps, ext):
    path = make_video(vids / f"f{frames}_{float(fps):g}{ext}", frames=frames, fps=fps)
    expected = reference_indices(frames, float(fps))
    batch = preprocess_video(path)
    assert sampled_frame_ids(batch) == expected
    assert len(batch) == math.ceil(len(expected) / 4)
    assert [t for t, _, _ in batch.grid_thw.tolist()] == [min(4, len(expected) - 4 * c) for c in range(len(batch))]
    assert batch.timestamps == [reference_timestamp(expected[4 * c], float(fps)) for c in range(len(batch))]


def test_ten_seconds_at_30fps(vids):
    path = make_video(vids / "ten.mp4", frames=300, fps=30)
    batch = preprocess_video(path)
    expected = sample_frame_indices(300, 30)
    assert len(expected) == 20 and sampled_frame_ids(batch) == expected
    assert batch.grid_thw[:, 0].tolist() == [4] * 5
    # Chunk 3 starts at frame 189 = 6.3 s, which the reference truncates to .299.
    assert batch.timestamps == ["00:00:00.000", "00:00:02.100", "00:00:04.200", "00:00:06.299", "00:00:08.400"]


def timed_mkv(path: Path, times_ms: list[int], rate: int) -> Path:
    """An MKV (MPEG-4 part 2, 84x56) whose frame i shows its index and is stamped `times_ms[i]` ms, declaring
    `rate` fps: the rate is nominal (Matroska's default duration), the timestamps are the frames' own."""
    with av.open(str(path), "w", format="matroska") as out:
        stream = out.add_stream("mpeg4", rate=rate)
        stream.width, stream.height, stream.pix_fmt = 84, 56, "yuv420p"
        stream.codec_context.time_base = Fraction(1, 1000)
        for i, t in enumerate(times_ms):
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(frame_pattern(i, (84, 56))), format="rgb24")
            frame.pts, frame.time_base = t, Fraction(1, 1000)
            out.mux(stream.encode(frame))
        out.mux(stream.encode(None))
    return path


def test_a_variable_rate_video_is_sampled_by_its_frames_timestamps(vids):
    """40 frames stamped 0-18019 ms, irregularly, in an MKV declaring 1000 fps: sampled by the declared rate it
    was one frame of the 18 s (0.04 s at 1000 fps), while the truncation check measured 18 s. The rate is now the
    frames' average by their timestamps, 39 / 18.019 s, as the reference samples by the average rate: 37 frames,
    10 chunks up to 00:00:18. Control: the same 40 frames 1 ms apart declare their rate truly: one frame."""
    rng = np.random.default_rng(0)
    times = [0, *sorted(rng.choice(np.arange(1, 18019), 38, replace=False).tolist()), 18019]
    info = probe_video(timed_mkv(vids / "vfr.mkv", times, 1000))
    assert info.num_frames == 40 and info.fps == 39 / 18.019
    batch = preprocess_video(vids / "vfr.mkv")
    expected = reference_indices(40, 39 / 18.019)
    assert len(expected) == 37 and sampled_frame_ids(batch) == expected
    assert batch.timestamps == [reference_timestamp(expected[4 * c], 39 / 18.019) for c in range(10)]
    assert batch.timestamps[-1].startswith("00:00:18")
    steady = probe_video(timed_mkv(vids / "steady.mkv", list(range(40)), 1000))
    assert steady.fps == 1000.0 and len(preprocess_video(vids / "steady.mkv")) == 1
    assert probe_video(timed_mkv(vids / "ten.mkv", [100 * i for i in range(40)], 10)).fps == 10.0


def test_a_variable_rate_video_is_held_to_max_frames_by_its_timestamps(vids):
    """Sampled by its timestamps' rate, a variable-rate video is held to max_frames by the frames that rate
    samples (37), not by the one frame its declared 1000 fps would give."""
    path = timed_mkv(vids / "long.mkv", [463 * i for i in range(40)], 1000)
    assert probe_video(path, max_frames=40).num_frames == 40
    with pytest.raises(MediaError, match=r"gives 37 frames \(18.5 s of video\), more than max_frames=30"):
        probe_video(path, max_frames=30)


# ------------------------------------------------------------------- chunks are frames_to_item exactly
@pytest.mark.parametrize("ext,frames,fps,size", [
    (".mp4", 23, 10, (84, 56)),
    (".webm", 31, 10, (100, 70)),   # not a multiple of 28: padded
    (".gif", 9, 2, (60, 40)),
    (".mkv", 17, 4, (640, 360)),
])
def test_chunks_equal_frames_to_item_of_the_decoded_frames(vids, ext, frames, fps, size):
    path = make_video(vids / f"eq{frames}{ext}", frames=frames, fps=fps, size=size,
                      content=lambda i, s: np.random.default_rng(i).integers(0, 256, (s[1], s[0], 3), dtype=np.uint8))
    decoded = decode_all(path)
    assert len(decoded) == frames
    indices = sample_frame_indices(frames, fps)
    batch = preprocess_video(path)
    assert len(batch) == math.ceil(len(indices) / 4)
    for c in range(len(batch)):
        pixels, grid = frames_to_item([decoded[i] for i in indices[4 * c : 4 * c + 4]], patch_limit=4096)
        item = batch.item(c)
        assert item.grid_thw[0].tolist() == list(grid)
        assert torch.equal(item.pixel_values, pixels)
    assert batch.grid_thw[-1, 0].item() == len(indices) - 4 * (len(batch) - 1)  # last chunk may be shorter
    assert batch.pixel_values.dtype == torch.float32 and batch.grid_thw.dtype == torch.int64


def test_1080p_frames_get_48x86_patches():
    assert padded_grid(1920, 1080, 4096) == (48, 86)
    assert image_token_count(1920, 1080, 4096) == 1032  # per chunk, as docs/model.md "Video" says
    assert padded_grid(1920, 1080) == (78, 138)  # the image budget, for contrast


def test_real_1080p_video_chunk(vids):
    path = make_video(vids / "hd.mp4", frames=4, fps=2, size=(1920, 1080),
                      content=lambda i, s: np.random.default_rng(i).integers(0, 256, (s[1], s[0], 3), dtype=np.uint8))
    batch = preprocess_video(path)
    assert batch.grid_thw.tolist() == [[4, 48, 86]] and batch.token_counts == [1032]
    pixels, _ = frames_to_item(decode_all(path), patch_limit=4096)
    assert torch.equal(batch.pixel_values, pixels)


def test_bytes_input_equals_path_input(vids):
    path = make_video(vids / "bytes.webm", frames=13, fps=5)
    a, b = preprocess_video(path), preprocess_video(path.read_bytes())
    assert torch.equal(a.pixel_values, b.pixel_values) and torch.equal(a.grid_thw, b.grid_thw)
    assert a.timestamps == b.timestamps
    assert b.sources[0].startswith("<video ") and b.sources[0].endswith("#chunk0")


def test_options_change_sampling_chunking_and_budget(vids):
    path = make_video(vids / "opts.mp4", frames=31, fps=10, size=(168, 112))
    batch = preprocess_video(path, sample_fps=1.0, chunk_size=2, patch_limit=24)
    # 168x112 is 12x8 = 96 patches; a budget of 24 halves each side to 84x56, which needs no padding.
    assert batch.grid_thw.tolist() == [[2, 4, 6], [1, 4, 6]] == [[2, *padded_grid(168, 112, 24)], [1, 4, 6]]
    assert sampled_frame_ids(batch) == [0, 15, 30]  # sampled at 1 fps, in chunks of 2
    assert batch.timestamps == ["00:00:00.000", "00:00:03.000"]


def test_container_that_overstates_its_frame_count(vids):
    # The avi headers claim 22 frames; the stream holds 20: within the slack of a header off by a frame or two,
    # the decoder's count wins: resample with 20.
    path = overstate_avi_frame_count(make_video(vids / "liar.avi", frames=20, fps=10), 22)
    with av.open(str(path)) as c:
        assert c.streams.video[0].frames == 22
    batch = preprocess_video(path)
    assert sampled_frame_ids(batch) == sample_frame_indices(20, 10) == [0, 6, 13, 19]
    # A third of the declared frames missing is not a header slip: the video is truncated (or damaged).
    path = overstate_avi_frame_count(make_video(vids / "short.avi", frames=20, fps=10), 30)
    with pytest.raises(MediaError, match=r"truncated or damaged: the container declares 30 frames \(3\.00 s\), "
                                         r"its frames cover 2\.00 s"):
        preprocess_video(path)


def test_is_video_path():
    for name in ["a.mp4", "b.MP4", "c.webm", "d.mkv", "e.mov", "f.avi", "g.gif", "h.m4v", Path("x/y.Mp4")]:
        assert is_video_path(name), name
    for name in ["a.png", "b.jpg", "c", "d.mp4.txt", "mp4", Path("dir/.mp4x")]:
        assert not is_video_path(name), name


def test_single_frame_gif_is_a_one_frame_video(vids):
    path = make_video(vids / "one.gif", frames=1, fps=10)
    batch = preprocess_video(path)
    assert batch.grid_thw.tolist() == [[1, 4, 6]] and batch.timestamps == ["00:00:00.000"]
    assert sampled_frame_ids(batch) == [0]


def test_video_chunks_pairs_items_with_embeddings(vids):
    batch = preprocess_video(make_video(vids / "pair.mp4", frames=23, fps=10))
    embs = [torch.full((n, 3), float(i)) for i, n in enumerate(batch.token_counts)]
    chunks = video_chunks(batch, embs)
    assert [c.index for c in chunks] == [0, 1]
    assert [c.grid_thw for c in chunks] == [(4, 4, 6), (1, 4, 6)]
    assert [c.timestamp for c in chunks] == batch.timestamps
    assert all(c.embedding is e for c, e in zip(chunks, embs)) and chunks[0].token_count == 6
    with pytest.raises(ValueError):
        video_chunks(batch, embs[:1])


# --------------------------------------------------------------------------------------------- errors
def _corrupt_inputs(d: Path) -> dict[str, Path]:
    good = make_video(d / "good.mp4", frames=30, fps=10, size=(160, 120),
                      content=lambda i, s: np.random.default_rng(i).integers(0, 256, (s[1], s[0], 3), dtype=np.uint8))
    data = good.read_bytes()
    out = {"random": d / "random.mp4"}
    out["random"].write_bytes(np.random.default_rng(0).integers(0, 256, 5000, dtype=np.uint8).tobytes())
    out["truncated"] = d / "truncated.mp4"
    out["truncated"].write_bytes(data[: len(data) // 2])
    fast = make_video(d / "faststart.mp4", frames=30, fps=10, size=(160, 120),
                      content=lambda i, s: np.random.default_rng(i).integers(0, 256, (s[1], s[0], 3), dtype=np.uint8),
                      container_options={"movflags": "faststart"})
    out["truncated_faststart"] = d / "truncated_faststart.mp4"
    out["truncated_faststart"].write_bytes(fast.read_bytes()[: fast.stat().st_size // 2])
    out["empty"] = d / "empty.mp4"
    out["empty"].write_bytes(b"")
    out["text"] = d / "notes.mp4"
    out["text"].write_text("this is not a video\n" * 50)
    out["png_renamed"] = d / "picture.mp4"
    out["png_renamed"].write_bytes(make_image(d / "picture.png").read_bytes())
    out["zero_frames_mkv"] = make_zero_frame_video(d / "zero.mkv")
    out["zero_frames_webm"] = make_zero_frame_video(d / "zero.webm")
    out["audio_only"] = make_audio_only(d / "audio.mp4")
    out["missing"] = d / "does_not_exist.mp4"
    out["directory"] = d / "a_directory.mp4"
    out["directory"].mkdir()
    return out


@pytest.fixture(scope="module")
def bad(vids):
    return _corrupt_inputs(vids)


@pytest.mark.parametrize("kind,reason", [
    ("random", "corrupt or unsupported"), ("truncated", "corrupt or unsupported"),
    ("truncated_faststart", "corrupt or unsupported"), ("empty", "empty"), ("text", "corrupt or unsupported"),
    ("png_renamed", "still image"), ("zero_frames_mkv", "no frames"), ("zero_frames_webm", "no frames"),
    ("audio_only", "no video stream"), ("missing", "no such file"), ("directory", "not a regular file"),
])
def test_unusable_inputs_raise_media_error_naming_the_file(bad, kind, reason):
    path = bad[kind]
    with pytest.raises(MediaError) as info:
        preprocess_video(path)
    assert str(path) in str(info.value) and reason in str(info.value)
    assert isinstance(info.value, bivit.BivitError)


def test_empty_bytes_and_wrong_types():
    with pytest.raises(MediaError, match="empty"):
        preprocess_video(b"")
    with pytest.raises(MediaError, match="unsupported video input"):
        preprocess_video(12345)
    with pytest.raises(MediaError, match="corrupt or unsupported"):
        preprocess_video(b"\x00\x01not a video" * 100)
    with pytest.raises(MediaError, match="no such file"):
        probe_video("/nonexistent/clip.webm")
    with pytest.raises(ConfigError, match="max_frames"):
        probe_video(b"x", max_frames=-1)


@pytest.mark.parametrize("seed", range(6))
def test_damaged_video_never_leaks_a_raw_exception(vids, seed):
    """Bytes overwritten in the middle of a real mp4: either it still decodes or MediaError, nothing else."""
    good = make_video(vids / f"dmg_src{seed}.mp4", frames=20, fps=10, size=(112, 84),
                      content=lambda i, s: np.random.default_rng(i).integers(0, 256, (s[1], s[0], 3), dtype=np.uint8))
    data = bytearray(good.read_bytes())
    rng = np.random.default_rng(seed)
    for _ in range(4):
        at = int(rng.integers(len(data) // 8, len(data)))
        data[at : at + 64] = rng.integers(0, 256, len(data[at : at + 64]), dtype=np.uint8).tobytes()
    path = vids / f"dmg{seed}.mp4"
    path.write_bytes(bytes(data))
    try:
        batch = preprocess_video(path)
    except MediaError as e:
        assert str(path) in str(e)
    else:
        assert len(batch) >= 1 and batch.timestamps is not None


# --------------------------------------------------------------------------------------------- limits
def test_max_frames(vids):
    path = make_video(vids / "lim.mp4", frames=23, fps=10)  # samples 5 frames
    assert len(preprocess_video(path, max_frames=5)) == 2
    with pytest.raises(MediaError, match=r"max_frames=4") as info:
        preprocess_video(path, max_frames=4)
    assert str(path) in str(info.value)
    assert len(preprocess_video(path, max_frames=None)) == 2


def test_max_frames_stops_counting_early(vids):
    # A 10 s WebM has no frame count; counting stops at the first frame that breaks the limit (frame 23:
    # round(23 * 2 / 10) = 5 > 4), long before the end, and says "at least".
    path = make_video(vids / "long.webm", frames=100, fps=10)
    with pytest.raises(MediaError, match=r"gives at least 5 frames \(2\.3 s of video\), more than max_frames=4"):
        preprocess_video(path, max_frames=4)


def test_max_duration(vids):
    path = make_video(vids / "dur.mp4", frames=23, fps=10)  # 2.3 s
    assert len(preprocess_video(path, max_duration_s=2.3)) == 2
    with pytest.raises(MediaError, match=r"lasts 2\.3 s .* more than max_duration_s=2"):
        preprocess_video(path, max_duration_s=2.0)
    # Without a container frame count, a clearly too long video is refused from its metadata, before decoding.
    webm = make_video(vids / "dur.webm", frames=100, fps=10)
    with pytest.raises(MediaError, match="by its metadata"):
        preprocess_video(webm, max_duration_s=3)
    # Within the metadata slack, counting catches it.
    with pytest.raises(MediaError, match=r"lasts at least 9\.1 s"):
        preprocess_video(webm, max_duration_s=9.05)


def test_max_frame_pixels(vids):
    path = make_video(vids / "px.mp4", frames=3, fps=10)  # 84 x 56 = 4704 pixels
    assert len(preprocess_video(path, max_frame_pixels=4704)) == 1
    with pytest.raises(MediaError, match=r"84x56 = 4704 pixels exceeds max_frame_pixels=4703"):
        preprocess_video(path, max_frame_pixels=4703)


@pytest.mark.parametrize("option,value", [
    ("sample_fps", 0), ("chunk_size", 0), ("chunk_size", 2.5), ("patch_limit", -1), ("max_frames", 0),
    ("max_duration_s", float("nan")), ("max_frame_pixels", 0), ("chunk_size", True),
    ("chunk_size", 4.0), ("max_frames", 8.0),  # integral floats: refused, not a TypeError later
])
def test_bad_options_raise_config_error(vids, option, value):
    path = make_video(vids / "cfg.mp4", frames=3, fps=10)
    with pytest.raises(ConfigError, match=option):
        preprocess_video(path, **{option: value})


def test_default_limits():
    import bivit.media.video as v

    assert (v.MAX_FRAMES, v.MAX_DURATION_S, v.MAX_FRAME_PIXELS) == (1024, 14400.0, 7680 * 4320)
    # 1024 sampled frames at 2 fps is 512 s: the frame cap is what binds first for ordinary video.
    assert len(sample_frame_indices(512 * 30, 30)) == 1024
    assert len(sample_frame_indices(512 * 30 + 8, 30)) == 1025


# ----------------------------------------------------------------------------- encoding (model level)
def _noise(i, size):
    return np.random.default_rng(1000 + i).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)


@pytest.fixture(scope="module")
def demo():
    return bivit.load_encoder()  # tiny seeded demo model, bf16, batch-invariant


def test_video_chunks_are_batch_invariant(vids, demo):
    """A chunk's embedding is the same bits alone, next to the video's other chunks, next to images and other
    videos in one call, and however max_batch_patches splits the work."""
    video = make_video(vids / "inv.mp4", frames=7, fps=1, size=(140, 112), content=_noise)  # chunks t = 4, 3
    other = make_video(vids / "inv2.webm", frames=9, fps=2, size=(84, 56), content=_noise)   # chunks t = 4, 4, 1
    image = make_image(vids / "inv.png", size=(100, 60), seed=3)
    chunks = demo.encode_video(video)
    batch = preprocess_video(video)
    assert [c.grid_thw for c in chunks] == [(4, 8, 10), (3, 8, 10)]
    assert [c.timestamp for c in chunks] == batch.timestamps == ["00:00:00.000", "00:00:04.000"]
    assert [c.index for c in chunks] == [0, 1] and isinstance(chunks[0], VideoChunk)
    alone = [demo.encode_batch(batch.item(i))[0] for i in range(len(batch))]
    mixed = demo.encode([image, video, other, video])
    assert len(mixed) == 4
    for c, a in zip(chunks, alone):
        assert c.embedding.shape == (20, demo.config.text_hidden_size) and torch.equal(c.embedding, a)
    whole = torch.cat([c.embedding for c in chunks])
    assert torch.equal(mixed[1], whole) and torch.equal(mixed[3], whole)
    split = bivit.load_encoder(max_batch_patches=200)  # 320 patches per 4-frame chunk: every chunk alone
    assert torch.equal(split.encode([other, video])[1], whole)


@pytest.fixture(scope="module")
def hf_fp32(kimi_hf_ckpt):
    from support.checkpoints import load_hf

    return load_hf(kimi_hf_ckpt, torch.float32)


@pytest.mark.parametrize("t", [1, 2, 3, 4])
def test_fp32_parity_with_hf_port_per_chunk_length(vids, kimi_hf_ckpt, hf_fp32, t):
    """Each chunk (t frames, h x w patches) against the transformers port, fp32, one chunk per call.

    The port's get_video_features splits its output by t*h*w/4 and raises for t > 1 (docs/model.md, "Known
    defects"), so the tower's pooled output and the projector are called directly, as docs/model.md prescribes.
    """
    enc = bivit.load_encoder(kimi_hf_ckpt, dtype="float32")
    # fps 1 samples every frame: 4 + t frames give chunks of 4 and t frames; 140x112 is an 8x10 grid, which
    # interpolates the 8x8 position table.
    path = make_video(vids / f"parity{t}.mp4", frames=4 + t, fps=1, size=(140, 112), content=_noise)
    batch = preprocess_video(path)
    assert batch.grid_thw.tolist() == [[4, 8, 10], [t, 8, 10]]
    ours = [c.embedding for c in enc.encode_video(path)]
    for i in range(len(batch)):
        item = batch.item(i)
        with torch.no_grad():
            pooled = hf_fp32.vision_tower(item.pixel_values, grid_thw=item.grid_thw).pooler_output
            ref = hf_fp32.mm_projector(pooled).squeeze(1)
        assert ours[i].shape == ref.shape == (20, enc.config.text_hidden_size)
        assert ours[i].dtype == torch.float32
        err = float((ours[i] - ref).abs().max() / ref.abs().max())
        assert err <= 1e-4, (t, i, err)
        if t > 1 and i == 1:
            # The temporal term is live: the same frames in reverse order give a clearly different chunk.
            rev = item.pixel_values.reshape(t, -1, 3, 14, 14).flip(0).reshape(-1, 3, 14, 14)
            assert float((enc.encode_pixels(rev, item.grid_thw)[0] - ref).abs().max() / ref.abs().max()) > 1e-2


def test_media_error_names_video_bytes_as_the_caller_says():
    with pytest.raises(MediaError) as e:
        preprocess_video(b"\x1a\x45\xdf\xa3 not really matroska", name="clip.webm")
    assert e.value.source == "clip.webm" and str(e.value).startswith("clip.webm: ")
