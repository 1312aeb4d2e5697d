"""Image preprocessing against the formulas of Moonshot's processor (docs/model.md, "Images")."""

import io
import math

import numpy as np
import pytest
import torch
from PIL import Image

import bivit
from bivit.media.decode import open_image
from bivit.media.grids import image_token_count, navit_size
from bivit.media.pixels import frames_to_item, preprocess_images

SPEC_TABLE = [  # (w, h) -> (grid h, grid w, tokens), docs/model.md "Images"
    ((224, 224), (16, 16, 64)), ((448, 448), (32, 32, 256)), ((640, 480), (36, 46, 414)),
    ((1024, 1024), (74, 74, 1369)), ((1280, 720), (52, 92, 1196)), ((1920, 1080), (78, 138, 2691)),
    ((2048, 2048), (130, 130, 4225)), ((3840, 2160), (98, 172, 4214)),
]


def reference_size(w, h, limit=16384):
    """The formula as docs/model.md writes it, independently of bivit's code."""
    s1 = math.sqrt(limit / (max(1, w // 14) * max(1, h // 14)))
    scale = min(1.0, s1, 512 * 14 / w, 512 * 14 / h)
    return min(max(1, int(w * scale)), 7168), min(max(1, int(h * scale)), 7168)


@pytest.mark.parametrize("size,expected", SPEC_TABLE)
def test_token_counts_from_the_spec_table(size, expected):
    w, h = size
    assert image_token_count(w, h) == expected[2]
    assert navit_size(w, h) == reference_size(w, h)


@pytest.mark.parametrize("size,expected", SPEC_TABLE[:3] + SPEC_TABLE[4:5])
def test_real_preprocessing_gives_the_grid(size, expected):
    w, h = size
    batch = preprocess_images([np.zeros((h, w, 3), np.uint8)])
    assert batch.grid_thw.tolist() == [[1, expected[0], expected[1]]]
    assert batch.pixel_values.shape == (expected[0] * expected[1], 3, 14, 14)
    assert batch.pixel_values.dtype == torch.float32 and batch.grid_thw.dtype == torch.int64
    assert batch.token_counts == [expected[2]]


def test_never_upscales_and_respects_side_limit():
    assert navit_size(10, 10) == (10, 10)
    assert navit_size(100000, 20)[0] <= 512 * 14


def test_padding_is_minus_one_and_patch_order_is_row_major():
    # 30x20 image (w x h): pads to 56 x 28 -> grid 2 x 4. Pixel (y, x) encodes its own coordinates.
    arr = np.zeros((20, 30, 3), np.uint8)
    for y in range(20):
        for x in range(30):
            arr[y, x] = (x * 8 % 256, y * 12 % 256, 200)
    batch = preprocess_images([arr])
    assert batch.grid_thw.tolist() == [[1, 2, 4]]
    px = batch.pixel_values
    norm = lambda v: np.float32((np.float64(np.float32(v / 255.0)) - 0.5) / 0.5)
    for patch in range(8):
        r, c = divmod(patch, 4)  # row-major
        for dy, dx in [(0, 0), (5, 9), (13, 13)]:
            y, x = r * 14 + dy, c * 14 + dx
            for ch in range(3):
                want = norm(arr[y, x, ch]) if (y < 20 and x < 30) else np.float32(-1.0)
                assert px[patch, ch, dy, dx].item() == want


def test_normalisation_is_bit_exact_with_reference_arithmetic():
    values = np.arange(256, dtype=np.uint8)
    arr = np.broadcast_to(values[None, :, None], (28, 256, 3)).copy()[:, :252]
    px = preprocess_images([arr]).pixel_values
    x = (values.astype(np.float64) / 255.0).astype(np.float32)
    ref = ((x.astype(np.float64) - 0.5) * 2.0).astype(np.float32)
    got = px[0, 0, 0, :14].numpy()
    assert np.array_equal(got, ref[:14])


def test_bicubic_resize_is_pil(tmp_path):
    img = Image.fromarray(np.random.default_rng(0).integers(0, 256, (900, 8000, 3), dtype=np.uint8))
    w, h = navit_size(*img.size)
    assert (w, h) != img.size
    pixels, (t, gh, gw) = frames_to_item([img])
    resized = np.asarray(img.resize((w, h), Image.Resampling.BICUBIC))
    padded = np.zeros((gh * 14, gw * 14, 3), np.uint8)
    padded[:h, :w] = resized
    assert (gh * 14 - h) < 28 and (gw * 14 - w) < 28
    ref = ((padded.astype(np.float64) / 255.0).astype(np.float32).astype(np.float64) - 0.5) / 0.5
    ref = ref.astype(np.float32).reshape(gh, 14, gw, 14, 3).transpose(0, 2, 4, 1, 3).reshape(-1, 3, 14, 14)
    assert torch.equal(pixels, torch.from_numpy(np.ascontiguousarray(ref)))


def test_input_kinds_agree(tmp_path):
    arr = np.random.default_rng(1).integers(0, 256, (50, 70, 3), dtype=np.uint8)
    path = tmp_path / "x.png"
    Image.fromarray(arr).save(path)
    variants = [arr, Image.fromarray(arr), str(path), path, path.read_bytes()]
    batches = [preprocess_images([v]) for v in variants]
    assert all(torch.equal(b.pixel_values, batches[0].pixel_values) for b in batches)


def test_alpha_is_dropped_not_composited_and_grey_is_rgb():
    rgba = np.zeros((28, 28, 4), np.uint8)
    rgba[..., :3] = 200
    rgba[..., 3] = 0  # fully transparent: compositing on white/black would change the colour
    a = preprocess_images([Image.fromarray(rgba, "RGBA")]).pixel_values
    b = preprocess_images([np.full((28, 28, 3), 200, np.uint8)]).pixel_values
    assert torch.equal(a, b)
    grey = preprocess_images([Image.fromarray(np.full((28, 28), 200, np.uint8), "L")]).pixel_values
    assert torch.equal(grey, b)


def _png_bytes(arr):
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


@pytest.mark.parametrize("make,reason", [
    (lambda p: p.write_bytes(b""), "empty"),
    (lambda p: p.write_bytes(b"this is not an image at all"), "not an image"),
    (lambda p: p.write_bytes(_png_bytes(np.random.default_rng(0).integers(0, 256, (64, 64, 3), np.uint8))[:3000]),
     "corrupt or truncated"),
    (lambda p: None, "no such file"),
])
def test_bad_inputs_raise_media_error_naming_the_file(tmp_path, make, reason):
    path = tmp_path / "bad.png"
    make(path)
    with pytest.raises(bivit.MediaError, match=reason) as info:
        open_image(path)
    assert str(path) in str(info.value)


def test_decompression_bomb_is_refused_before_decoding(tmp_path):
    path = tmp_path / "bomb.png"
    Image.new("1", (20000, 12000)).save(path)  # 240 MP in a few kB
    assert path.stat().st_size < 1_000_000
    with pytest.raises(bivit.MediaError, match="decompression bomb"):
        open_image(path)
    with pytest.raises(bivit.MediaError, match="exceeds the limit"):
        open_image(np.zeros((100, 100, 3), np.uint8), max_pixels=5000)


@pytest.mark.parametrize("bad", [np.zeros((10, 10), np.uint8), np.zeros((10, 10, 3), np.float32),
                                 np.zeros((0, 10, 3), np.uint8), 12345])
def test_bad_arrays_and_types(bad):
    with pytest.raises(bivit.MediaError):
        open_image(bad)


def test_encoder_preprocess_returns_media_batch():
    enc = bivit.load_encoder()
    batch = enc.preprocess([np.zeros((28, 28, 3), np.uint8), np.zeros((56, 84, 3), np.uint8)])
    assert isinstance(batch, bivit.MediaBatch)
    assert batch.grid_thw.tolist() == [[1, 2, 2], [1, 4, 6]]
    out = enc.encode([np.zeros((28, 28, 3), np.uint8), np.zeros((56, 84, 3), np.uint8)])
    assert [tuple(o.shape) for o in out] == [(1, 128), (6, 128)]


def test_media_error_carries_the_name_the_caller_gave():
    with pytest.raises(bivit.MediaError) as e:
        preprocess_images([b"not an image"], names=["upload.png"])
    assert e.value.source == "upload.png" and str(e.value).startswith("upload.png: ")
    assert e.value.reason == "not an image format bivit reads (PNG, JPEG, WEBP, BMP, TIFF, GIF)"
    with pytest.raises(bivit.MediaError) as e:
        open_image(b"")
    assert e.value.source == "<0 bytes>"


def test_something_that_is_not_a_file_is_named_for_what_it_is(tmp_path):
    import os

    os.mkfifo(tmp_path / "pipe.png")
    for path, kind in ((tmp_path, "a directory"), ("/dev/null", "a character device"),
                       (tmp_path / "pipe.png", "a FIFO")):  # the FIFO would block a plain open()
        with pytest.raises(bivit.MediaError, match=f"not a regular file but {kind}"):
            open_image(path)
    with pytest.raises(bivit.MediaError, match="no such file"):
        open_image(tmp_path / "missing.png")
