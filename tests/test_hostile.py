"""Hostile media and files against the library, the CLI, the dataset job and a real `bivit serve` process: no
file read that was not given, no socket opened, memory bounded in bytes, clear errors (a 4xx, one CLI line).

Each attack here worked against bivit before the limits it tests existed. Where a property is about what the
process does (a socket, the memory it takes), a child process shows it: seccomp kills the child on the first
`socket()`, and the child's own peak RSS (`VmHWM` after resetting it) is measured around one call.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import platform
import resource
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image
from safetensors.torch import save_file

import bivit
from bivit.base.fileio import MAX_JSON_DEPTH
from bivit.checkpoint.config import ModelConfig, load_config
from bivit.checkpoint.preprocess_config import load_processing
from bivit.checkpoint.state_dict import (INDEX, load_state_dict, moonshot_config_dict, random_state_dict,
                                         transformers_config_dict)
from bivit.errors import CheckpointError, ConfigError, MediaError
from bivit.media.decode import MAX_IMAGE_SIDE
from bivit.media.decode import MAX_IMAGE_BYTES, load_image
from bivit.media.pixels import preprocess_images
from bivit.media.video import preprocess_video
from support.media import blank_png, make_video, png_bytes

REPO = Path(__file__).resolve().parents[1]
DEEP = b"[" * 200_000


def run_python(code: str, *args: str, cwd=None, preexec_fn=None, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True,
                          cwd=cwd, env=env, preexec_fn=preexec_fn, timeout=timeout)


def run_cli(*args, cwd=None, preexec_fn=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bivit", *map(str, args)], capture_output=True, text=True, cwd=cwd,
                          preexec_fn=preexec_fn, timeout=300)


def one_error_line(r: subprocess.CompletedProcess, code: int = 2) -> str:
    assert r.returncode == code and "Traceback" not in r.stderr, r.stderr[-3000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("bivit: error: ")]
    assert len(lines) == 1, r.stderr[-3000:]
    return lines[0]


@pytest.fixture(scope="module")
def secret(tmp_path_factory):
    """A folder holding `private/secret_clip.mp4` and `private/secret.png`: files nobody uploads."""
    d = tmp_path_factory.mktemp("host")
    (d / "private").mkdir()
    make_video(d / "private" / "secret_clip.mp4", frames=8, fps=10)
    Image.fromarray(np.full((56, 56, 3), 200, np.uint8)).save(d / "private" / "secret.png")
    return d


def ffconcat(path: str) -> bytes:
    return f"ffconcat version 1.0\nfile {path}\n".encode()


# ------------------------------------------------------------------------------ media cannot reach the host

def test_ffconcat_script_reads_no_file_and_is_no_existence_oracle(secret, monkeypatch, tmp_path):
    """An ffconcat upload named the server's files (relative to its working directory): decoded, and a missing
    one failed differently. Now the concat demuxer never opens: the same refusal whatever the script names."""
    monkeypatch.chdir(secret)
    scripts = {"clip": ffconcat("private/secret_clip.mp4"), "still": ffconcat("private/secret.png"),
               "absolute": ffconcat(str(secret / "private" / "secret_clip.mp4")),
               "missing": ffconcat("private/missing.mp4")}
    reasons = set()
    for what, data in scripts.items():
        path = tmp_path / f"{what}.mp4"
        path.write_bytes(data)
        for src in (data, path):
            with pytest.raises(MediaError) as info:
                preprocess_video(src, name="upload.mp4")
            reasons.add(info.value.reason)
    assert len(reasons) == 1, reasons  # present, missing, absolute: indistinguishable
    assert "not a video container bivit reads" in reasons.pop()


def test_playlists_and_manifests_fetch_nothing(secret, tmp_path):
    """An HLS playlist given as a `.m3u8` path made FFmpeg read the local file it lists."""
    target = secret / "private" / "secret_clip.mp4"
    hls = f"#EXTM3U\n#EXT-X-TARGETDURATION:10\n#EXTINF:10,\n{target}\n#EXT-X-ENDLIST\n".encode()
    dash = (f'<?xml version="1.0"?><MPD xmlns="urn:mpeg:dash:schema:mpd:2011" type="static" '
            f'mediaPresentationDuration="PT1S"><Period><AdaptationSet mimeType="video/mp4"><Representation id="1" '
            f'bandwidth="1"><BaseURL>{target}</BaseURL></Representation></AdaptationSet></Period></MPD>').encode()
    for data, name in ((hls, "list.m3u8"), (dash, "manifest.mpd")):
        (tmp_path / name).write_bytes(data)
        for src in (data, tmp_path / name):
            with pytest.raises(MediaError, match="not a video container bivit reads|corrupt or unsupported"):
                preprocess_video(src)


def test_a_path_is_opened_as_a_file_never_parsed_as_a_url(secret, monkeypatch):
    """`concat:secret_clip.mp4` is a file name here (an unusable one); FFmpeg given the name would read
    secret_clip.mp4 through its concat protocol."""
    monkeypatch.chdir(secret / "private")
    Path("concat:secret_clip.mp4").write_bytes(b"not a video" * 10)
    with pytest.raises(MediaError, match="corrupt or unsupported"):
        preprocess_video("concat:secret_clip.mp4")


SECCOMP_CHILD = """
    import ctypes, platform, struct, sys
    from bivit.errors import MediaError
    from bivit.media.video import preprocess_video

    # seccomp: the first socket() kills the process with SIGSYS (no_new_privs first, so no privilege is needed).
    nr = {"x86_64": 41, "aarch64": 198}[platform.machine()]
    code = [(0x20, 0, 0, 0), (0x15, 0, 1, nr), (0x06, 0, 0, 0x80000000), (0x06, 0, 0, 0x7FFF0000)]
    prog = ctypes.create_string_buffer(b"".join(struct.pack("HBBI", *c) for c in code))
    fprog = struct.pack("HxxxxxxQ", len(code), ctypes.addressof(prog))
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.prctl(38, 1, 0, 0, 0) == 0  # PR_SET_NO_NEW_PRIVS
    assert libc.prctl(22, 2, ctypes.c_char_p(fprog), 0, 0) == 0, ctypes.get_errno()  # SECCOMP_MODE_FILTER
    sdp = open(sys.argv[1], "rb").read()
    for src in (sdp, sys.argv[1]):
        try:
            preprocess_video(src)
        except MediaError as e:
            print(e.reason)
"""


@pytest.mark.skipif(platform.machine() not in ("x86_64", "aarch64"), reason="seccomp filter written for x86_64/arm64")
def test_sdp_upload_opens_no_socket(tmp_path):
    """SDP text made FFmpeg bind the UDP ports it names (127.0.0.1:5004, 0.0.0.0:5005) and wait for packets."""
    sdp = tmp_path / "stream.mp4"
    sdp.write_bytes(b"v=0\no=- 0 0 IN IP4 127.0.0.1\ns=x\nc=IN IP4 127.0.0.1\nt=0 0\n"
                    b"m=video 5004 RTP/AVP 96\na=rtpmap:96 H264/90000\n")
    r = run_python(SECCOMP_CHILD, str(sdp))
    assert r.returncode != -signal.SIGSYS, "the decoder called socket()"
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.count("not a video container bivit reads") == 2, r.stdout


def test_seccomp_control_kills_a_child_that_opens_a_socket():
    """The filter of the SDP test does kill on socket(): the test can fail."""
    r = run_python(SECCOMP_CHILD.replace("sdp = open(", "import socket; socket.socket(); sdp = open("), "/dev/null")
    assert r.returncode == -signal.SIGSYS


def test_image_formats_outside_the_list_are_refused(tmp_path):
    """Pillow reads ~40 formats, EPS through Ghostscript (a subprocess) among them; bivit opens its six."""
    rgb = Image.fromarray(np.full((28, 28, 3), 100, np.uint8))
    for fmt in ("EPS", "TGA", "PPM", "ICO"):
        buf = io.BytesIO()
        rgb.save(buf, format=fmt)
        with pytest.raises(MediaError, match=r"not an image format bivit reads \(PNG, JPEG, WEBP, BMP, TIFF, GIF\)"):
            preprocess_images([buf.getvalue()])


# ---------------------------------------------------------------------------------------- memory, in bytes

MEASURE_CHILD = """
    import ctypes, json, os, sys
    from bivit.errors import MediaError
    from bivit.media.decode import image_header
    from bivit.media.pixels import preprocess_images
    from bivit.checkpoint.preprocess_config import PROCESSING_PRESETS

    def status(key):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))

    preprocess_images([])  # imports and first-call setup, before any fork
    for case in json.loads(sys.argv[1]):  # each in a fresh fork: its peak is its own
        data = open(case["path"], "rb").read()
        proc = PROCESSING_PRESETS[case["preset"]].replace(**case.get("replace", {}))
        pid = os.fork()
        if pid == 0:
            try:
                estimate = image_header(data, proc).work_bytes
            except MediaError:
                estimate = None
            ctypes.CDLL(None).malloc_trim(0)  # free heap memory already resident would hide a reuse of it
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset VmHWM to the current RSS
            before = status("VmRSS:")
            try:
                preprocess_images([data], processing=proc, alpha=case.get("alpha", "model"))
                error = None
            except MediaError as e:
                error = str(e)
            print(json.dumps({"name": case["name"], "peak": status("VmHWM:") - before, "estimate": estimate,
                              "error": error}), flush=True)
            os._exit(0)
        os.waitpid(pid, 0)
"""


def measure(cases: list[dict]) -> dict[str, dict]:
    r = run_python(MEASURE_CHILD, json.dumps(cases))
    assert r.returncode == 0, r.stderr[-3000:]
    return {m["name"]: m for m in map(json.loads, r.stdout.splitlines())}


def test_one_pixel_thin_pngs_are_refused_before_they_take_memory(tmp_path):
    """117 KB of PNG, 1x60,000,000 pixels (under the 200 MP limit), took a server from 0.3 to 3.4 GB; a 39 KB one of
    40,000,000x1 (under MAX_IMAGE_BYTES too: estimated 1.6 GB) peaked at +1.4 GB in the request (resize weights
    and, tall, a pointer per row). A side over MAX_IMAGE_SIDE is refused from the header now. Control: a side of
    MAX_IMAGE_SIDE is admitted and decoded, and its peak is small."""
    sizes = {"tall": (1, 60_000_000, 0), "wide": (40_000_000, 1, 0), "wide rgb": (40_000_000, 1, 2),
             "longest": (MAX_IMAGE_SIDE, 1, 0), "longest tall": (1, MAX_IMAGE_SIDE, 2),
             "one more": (MAX_IMAGE_SIDE + 1, 1, 0)}
    cases = []
    for name, (w, h, color) in sizes.items():
        path = tmp_path / f"{name}.png"
        path.write_bytes(blank_png(w, h, color))
        cases.append({"name": name, "path": str(path), "preset": "kimi-k2.6"})
    assert (tmp_path / "wide.png").stat().st_size < 40_000
    m = measure(cases)
    print({name: (round(r["peak"] / 2**20), r["error"]) for name, r in m.items()})
    for name in ("tall", "wide", "wide rgb", "one more"):
        w, h, _ = sizes[name]
        assert m[name]["error"].endswith(f"{w}x{h}: a side of {max(w, h)} pixels exceeds the limit of "
                                         f"{MAX_IMAGE_SIDE}"), m[name]
        assert m[name]["estimate"] is None and m[name]["peak"] < 8 * 2**20, m[name]
    for name in ("longest", "longest tall"):
        assert m[name]["error"] is None and m[name]["peak"] < 64 * 2**20, m[name]


def _write_cases(d: Path) -> list[dict]:
    rng = np.random.default_rng(0)
    rgb = Image.fromarray(rng.integers(0, 256, (2000, 3000, 3), dtype=np.uint8))
    rgba = Image.fromarray(rng.integers(0, 256, (2000, 3000, 4), dtype=np.uint8), "RGBA")
    files = {"png": (rgb, {"compress_level": 1}), "rgba.png": (rgba, {"compress_level": 1}),
             "progressive.jpg": (rgb, {"progressive": True, "quality": 90}), "jpg": (rgb, {"quality": 90}),
             "webp": (rgb, {"lossless": True, "method": 0}), "gif": (rgb.convert("P"), {}),
             "strip.tif": (rgb, {"compression": "tiff_deflate", "tiffinfo": {278: 2000}}), "bmp": (rgb, {}),
             "l.png": (rgb.convert("L"), {"compress_level": 1})}
    cases = []
    for name, (img, kw) in files.items():
        path = d / f"case.{name}"
        img.save(path, **kw)
        cases.append({"name": name, "path": str(path), "preset": "kimi-k2.6"})
        # A small patch budget: the decode, not normalisation at the model's budget, dominates the peak.
        cases.append({"name": f"{name} small", "path": str(path), "preset": "kimi-k2.6",
                      "replace": {"in_patch_limit": 256}})
    for name, (w, h) in {"tall": (1, MAX_IMAGE_SIDE), "wide": (MAX_IMAGE_SIDE, 1)}.items():
        path = d / f"{name}.png"
        path.write_bytes(blank_png(w, h, 2))
        cases.append({"name": name, "path": str(path), "preset": "kimi-k2.6"})
    rgba_path = str(d / "case.rgba.png")
    cases += [{"name": "rgba white", "path": rgba_path, "preset": "kimi-k2.6", "alpha": "white"},
              {"name": "rgba k3", "path": rgba_path, "preset": "kimi-k3"},
              {"name": "rgba k3 before_resize", "path": rgba_path, "preset": "kimi-k3",
               "replace": {"transparent_bg_fill_stage": "before_resize"}}]
    return cases


def test_peak_memory_of_an_admitted_image_stays_under_its_estimate(tmp_path):
    """The bound is real: for every format, mode, aspect ratio and preprocessing path, the child's measured peak
    RSS while decoding and preprocessing stays under the estimate the limit is checked against."""
    results = measure(_write_cases(tmp_path))
    assert len(results) == 23
    for name, m in results.items():
        assert m["error"] is None, m
        assert m["peak"] <= m["estimate"] <= MAX_IMAGE_BYTES, m
    # The estimate is an upper bound, not a wild one (measured: 0.5-0.9 of it on an AVX-512 EPYC).
    assert min(m["peak"] / m["estimate"] for m in results.values()) > 0.25, results


def test_images_above_pillows_own_limit_decode_under_bivits(tmp_path, monkeypatch):
    """Pillow checks its bomb limit again while decoding TIFF and GIF: a 196 MP deflate TIFF (under bivit's 200 MP)
    raised DecompressionBombError through the CLI and the service. Shown small: Pillow's limit lowered."""
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    arr = np.random.default_rng(0).integers(0, 256, (100, 120, 3), dtype=np.uint8)
    for fmt, kw in (("TIFF", {"compression": "tiff_deflate"}), ("GIF", {}), ("PNG", {})):
        buf = io.BytesIO()
        Image.fromarray(arr).save(buf, format=fmt, **kw)
        assert load_image(buf.getvalue()).size == (120, 100)
        assert len(preprocess_images([buf.getvalue()])) == 1
    assert Image.MAX_IMAGE_PIXELS == 1000  # Pillow's setting is the user's again
    with pytest.raises(MediaError, match="exceeds the limit of 5000"):
        load_image(buf.getvalue(), max_pixels=5000)


def test_out_of_memory_while_decoding_is_a_media_error(tmp_path):
    """MemoryError inside a decoder (here: an address-space limit) names the input, like any other failure."""
    path = tmp_path / "big.png"
    path.write_bytes(blank_png(8000, 8000, 2))  # 64 MP: 256 MB decoded, within bivit's limits
    r = run_python("""
        import resource, sys
        from bivit.errors import MediaError
        from bivit.media.pixels import preprocess_images
        data = open(sys.argv[1], "rb").read()
        with open("/proc/self/status") as f:
            vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
        resource.setrlimit(resource.RLIMIT_AS, (vm + 128 * 2**20, resource.RLIM_INFINITY))
        try:
            preprocess_images([data], names=["big.png"])
        except MediaError as e:
            print("MediaError", e)
    """, str(path))
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert r.stdout.startswith("MediaError big.png: not enough memory"), r.stdout


# -------------------------------------------------------------------------------------------- truncation

def test_truncated_videos_are_refused(tmp_path):
    """A WebM cut at half its size decoded cleanly to half its frames and was encoded (docs promised an error)."""
    full = make_video(tmp_path / "full.webm", frames=40, fps=10)
    assert len(preprocess_video(full)) == 2  # 8 sampled frames, 2 chunks
    data = full.read_bytes()
    cut = tmp_path / "cut.webm"
    cut.write_bytes(data[: len(data) // 2])
    for src in (cut, cut.read_bytes()):
        with pytest.raises(MediaError, match=r"truncated or damaged: the container declares 4\.00 s, its frames "
                                             r"cover 1\.\d\d s"):
            preprocess_video(src)
    noise = lambda i, size: np.random.default_rng(i).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    avi = make_video(tmp_path / "full.avi", frames=40, fps=10, content=noise)  # frames are most of the bytes
    (tmp_path / "cut.avi").write_bytes(avi.read_bytes()[: avi.stat().st_size // 2])
    with pytest.raises(MediaError, match="truncated or damaged: the container declares 40 frames"):
        preprocess_video(tmp_path / "cut.avi")


# ------------------------------------------------------------------------------------- configs and JSON

def _hf_checkpoint(d: Path, **vision: object) -> Path:
    cfg = ModelConfig(pos_emb_height=8, pos_emb_width=8, hidden_size=32, num_layers=1, num_heads=2,
                      intermediate_size=64, text_hidden_size=32)
    config = transformers_config_dict(cfg)
    for key, value in vision.items():
        node = config["vision_config"]
        *parents, last = key.split(".")
        for p in parents:
            node = node[p]
        node[last] = value
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(config))
    return d


@pytest.mark.parametrize("theta", [0, -10000.0, 1e-300, 1.0])
def test_rope_theta_out_of_range_names_the_key(tmp_path, theta):
    """A HF-layout rope theta of 0, negative or 1e-300 was accepted and every output was NaN."""
    d = _hf_checkpoint(tmp_path / "ckpt", **{"rope_parameters.rope_theta": theta})
    with pytest.raises(ConfigError, match=r"'vision_config\.rope_parameters\.rope_theta' = .*RoPE base"):
        load_config(d)


@pytest.mark.parametrize("key,value", [("init_pos_emb_time", 300_000), ("init_pos_emb_time", 2_000_000_000),
                                       ("patch_size", 100_000), ("init_pos_emb_height", 1 << 20),
                                       ("text_hidden_size", 1 << 30)])
def test_absurd_config_sizes_are_refused_naming_the_key(tmp_path, key, value):
    """`init_pos_emb_time` 300,000 was missing from the memory estimate (1154 MB for a 40-frame video instead of
    312 MB); 2e9 failed the first video with "Unable to allocate 7.45 GiB", the skip line naming no file. Every
    size key now has a bound and counts in the model's size, checked when config.json is read."""
    from bivit.checkpoint.state_dict import moonshot_config_dict

    config = moonshot_config_dict(ModelConfig(pos_emb_height=8, pos_emb_width=8, hidden_size=32, num_layers=1,
                                              num_heads=2, intermediate_size=64, text_hidden_size=32))
    config["vision_config"][key] = value
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=rf"config key '{key}' = {value}: more than \d+"):
        load_config(tmp_path)
    assert ModelConfig(pos_emb_time=4096).parameter_estimate - ModelConfig(pos_emb_time=4).parameter_estimate \
        == 4092 * 1152  # the temporal table of every frame the config declares, in the model's size


def test_float_config_values_in_range_or_refused():
    for key, value in (("norm_eps", 1e-300), ("norm_eps", 0.0), ("projector_ln_eps", 2.0), ("rope_theta", 1e39)):
        with pytest.raises(ConfigError, match=key):
            ModelConfig(**{key: value})
    ModelConfig(norm_eps=1e-6, projector_ln_eps=1e-5, rope_theta=10000.0)  # Kimi's own values pass
    from bivit.checkpoint.preprocess_config import ProcessorConfig

    for std in ((1e-300,) * 3, (-0.5, 0.5, 0.5)):
        with pytest.raises(ConfigError, match="image_std"):
            ProcessorConfig(image_std=std)


def test_nested_json_in_checkpoint_files_is_one_clear_error(tmp_path, kimi_ckpt):
    """200k nested `[` in config.json (and the other JSON files) raised RecursionError: a traceback."""
    bad = tmp_path / "cfg"
    bad.mkdir()
    (bad / "config.json").write_bytes(DEEP)
    with pytest.raises(ConfigError, match=rf"config.json: not valid JSON \(nested 200000 levels deep, more than the "
                                          rf"{MAX_JSON_DEPTH} bivit reads\)"):
        load_config(bad)
    (bad / "preprocessor_config.json").write_bytes(DEEP)
    with pytest.raises(ConfigError, match="preprocessor_config.json: not valid JSON"):
        load_processing(bad, ModelConfig())
    ckpt = tmp_path / "indexed"
    ckpt.mkdir()
    for f in kimi_ckpt.iterdir():
        (ckpt / f.name).symlink_to(f)
    (ckpt / INDEX).write_bytes(DEEP)
    with pytest.raises(CheckpointError, match="unreadable index .*nested 200000 levels"):
        load_state_dict(ckpt, load_config(ckpt))
    # The CLI: one line, exit 2.
    line = one_error_line(run_cli("encode", "--model", bad, tmp_path / "nothing.png", "--out", tmp_path / "o.st"))
    assert "nested 200000 levels deep" in line


def test_oversized_json_file_is_not_read(tmp_path):
    d = tmp_path / "big"
    d.mkdir()
    with open(d / "config.json", "wb") as f:
        f.truncate(100 * 2**20)  # sparse: 100 MB of nothing
    with pytest.raises(ConfigError, match="larger than the 67108864 bytes bivit reads"):
        load_config(d)


def _two_shard_checkpoint(d: Path) -> tuple[Path, ModelConfig, dict]:
    cfg = ModelConfig(pos_emb_height=8, pos_emb_width=8, hidden_size=32, num_layers=1, num_heads=2,
                      intermediate_size=64, text_hidden_size=32)
    d.mkdir()
    (d / "config.json").write_text(json.dumps(moonshot_config_dict(cfg)))
    state = random_state_dict(cfg)
    return d, cfg, state


def test_duplicate_tensors_across_index_less_shards_are_refused_naming_both(tmp_path):
    d, cfg, state = _two_shard_checkpoint(tmp_path / "ckpt")
    save_file(state, str(d / "a.safetensors"))
    key = next(iter(state))
    save_file({key: state[key] * 2}, str(d / "b.safetensors"))  # last one would have won
    with pytest.raises(CheckpointError, match=rf"{key!r} is in two shards, a.safetensors and b.safetensors"):
        load_state_dict(d, cfg)


def test_duplicate_weight_map_keys_are_refused(tmp_path):
    d, cfg, state = _two_shard_checkpoint(tmp_path / "ckpt")
    keys = list(state)
    save_file({k: state[k] for k in keys[:3]}, str(d / "s1.safetensors"))
    save_file({k: state[k] for k in keys[3:]}, str(d / "s2.safetensors"))
    entries = [f'"{k}": "s1.safetensors"' for k in keys[:3]] + [f'"{k}": "s2.safetensors"' for k in keys[3:]]
    entries.append(f'"{keys[0]}": "s2.safetensors"')  # the same key again, another shard
    (d / INDEX).write_text('{"metadata": {}, "weight_map": {%s}}' % ", ".join(entries))
    with pytest.raises(CheckpointError, match=rf"key {keys[0]!r} appears more than once"):
        load_state_dict(d, cfg)


# ----------------------------------------------------------------------------------------- the service

@pytest.fixture(scope="module")
def server(secret):
    from support.server import ServerProcess

    pytest.importorskip("fastapi")
    cwd = os.getcwd()
    os.chdir(secret)  # the server's working directory holds private/: what a relative ffconcat path reaches
    try:
        srv = ServerProcess(["--cache-mb", "0", "--request-timeout-s", "60"], secret)
    finally:
        os.chdir(cwd)
    yield srv
    srv.stop()


def test_service_never_decodes_a_file_it_was_not_given(server, secret):
    """Multipart and JSON, as a video and as an image (which used to bypass the still-image refusal): 422, the
    same reason whether the named file exists or not, and no embedding."""
    scripts = [ffconcat("private/secret_clip.mp4"), ffconcat("private/secret.png"),
               ffconcat("private/missing.mp4")]
    reasons = set()
    for data in scripts:
        r = httpx.post(f"{server.url}/v1/encode", timeout=60,
                       files=[("file", ("u.mp4", data, "video/mp4")), ("file", ("u.png", data, "image/png"))])
        items = r.json()["items"]
        assert r.status_code == 422 and all(i["tensor"] is None for i in items), r.text[:500]
        reasons |= {i["error"] for i in items}
        body = {"items": [{"name": "u.mp4", "data": base64.b64encode(data).decode(), "kind": "video"}]}
        r = httpx.post(f"{server.url}/v1/encode", json=body, timeout=60)
        assert r.status_code == 422, r.text[:500]
        reasons.add(r.json()["items"][0]["error"])
    assert reasons == {"u.mp4: not a video container bivit reads (FFmpeg demuxers "
                       + ", ".join(bivit.media.container.VIDEO_DEMUXERS) + ")",
                       "u.png: not an image format bivit reads (PNG, JPEG, WEBP, BMP, TIFF, GIF)"}, reasons


def test_deeply_nested_json_body_is_400(server):
    r = httpx.post(f"{server.url}/v1/encode", content=b'{"items": ' + DEEP, timeout=60,
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text[:300]
    assert "nested 200001 levels deep" in r.json()["error"]["message"]
    r = httpx.post(f"{server.url}/v1/encode", timeout=60,
                   files=[("file", ("ok.png", png_bytes(56, 56, 1), "image/png"))])
    assert r.status_code == 200


def test_image_decoding_stops_at_its_deadline():
    """Only videos honoured the request deadline: an image nobody waits for any more was decoded anyway."""
    import time

    png = png_bytes(300, 200, 3)
    with pytest.raises(MediaError, match="decoding stopped at its deadline"):
        preprocess_images([png], names=["late.png"], deadline=time.monotonic() - 1)
    assert len(preprocess_images([png], deadline=time.monotonic() + 600)) == 1


def test_a_heavy_image_never_holds_the_thread_a_small_one_needs():
    """Two 803 KB 14000x14000 PNGs made small requests sent a second later answer 504. Heavy images (by their
    header) now decode in a pool of their own. Shown without timing: the heavy pool is held busy (standing in for
    a long decode) while a heavy item waits in it; a small request completes meanwhile, the heavy one only after
    the pool is free (the control: a busy pool does hold back what is queued in it)."""
    from bivit.media.decode import image_work_bytes
    from bivit.serve.protocol import UploadItem
    from bivit.serve.admission import item_cost
    from bivit.serve.serving import Service
    from bivit.serve.settings import ServerSettings

    svc = Service(bivit.load_encoder(), ServerSettings(cache_mb=0, preprocess_threads=1))
    svc.admission.heavy_bytes = image_work_bytes(112, 112, "RGB", svc.encoder.processing)  # small limits in tests
    heavy, small = UploadItem("heavy.png", png_bytes(300, 300, 1)), UploadItem("small.png", png_bytes(56, 56, 2))
    assert item_cost(heavy, svc.encoder.processing).work > svc.admission.heavy_bytes \
        >= item_cost(small, svc.encoder.processing).work
    busy_pool_scenario(svc, "heavy_pool", first=small, held=heavy)


def busy_pool_scenario(svc, pool: str, first, held) -> None:
    """`svc`'s pool `pool` is held busy by another request while `held` waits in it: `first` completes meanwhile,
    `held` only once the pool is free (the control: a busy pool does hold back what is queued in it)."""
    svc.start()
    busy = threading.Event()
    try:
        blocker = getattr(svc.admission, pool).submit("another request", busy.wait)

        async def scenario() -> None:
            held_task = asyncio.ensure_future(svc.encode_request([held]))
            results, _, release = await asyncio.wait_for(svc.encode_request([first]), 120)
            release()
            assert results[0].embedding is not None and results[0].error is None
            await asyncio.sleep(0)
            assert not held_task.done()  # still queued behind the busy pool
            busy.set()
            results, _, release = await asyncio.wait_for(held_task, 120)
            release()
            assert results[0].embedding is not None and results[0].error is None

        asyncio.run(scenario())
        blocker.result()
    finally:
        busy.set()
        svc.stop()


# ---------------------------------------------------------------------------------------- output files

def _fsize_limit(limit: int):
    def set_limit() -> None:  # Python ignores SIGXFSZ: a write past the limit fails with EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return set_limit


def test_full_disk_on_out_is_one_line(tmp_path):
    """`--out` on a full filesystem (a file size limit here: the same failed write) gave a SafetensorError
    traceback; now one line naming the file, exit 1, and no partial file."""
    img = tmp_path / "a.png"
    Image.fromarray(np.full((112, 112, 3), 7, np.uint8)).save(img)
    out = tmp_path / "emb.safetensors"
    line = one_error_line(run_cli("encode", img, "--out", out, preexec_fn=_fsize_limit(2048)), 1)
    assert str(out) in line and "File too large" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.png"]
    src, dst = tmp_path / "src", tmp_path / "ds"
    src.mkdir()
    Image.fromarray(np.full((112, 112, 3), 7, np.uint8)).save(src / "a.png")
    # 6 KiB: dataset.json (~4 KB) and the journal's one entry (~5 KB) fit, the shard (~7 KB) does not.
    line = one_error_line(run_cli("encode-dataset", src, "--out", dst, "--no-progress",
                                  preexec_fn=_fsize_limit(6144)), 1)
    assert "shard-000000.safetensors" in line and "File too large" in line
    # 8 KiB: dataset.json fits, the journal's entry of a 224x224 image (64 rows, ~17 KB) does not.
    (tmp_path / "src2").mkdir()
    Image.fromarray(np.full((224, 224, 3), 7, np.uint8)).save(tmp_path / "src2" / "a.png")
    line = one_error_line(run_cli("encode-dataset", tmp_path / "src2", "--out", tmp_path / "ds2", "--no-progress",
                                  preexec_fn=_fsize_limit(8192)), 1)
    assert f"{tmp_path / 'ds2' / 'journal.bin'}: File too large" in line, line


def test_refused_dataset_folder_keeps_no_lock(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    Image.fromarray(np.full((56, 56, 3), 7, np.uint8)).save(src / "a.png")
    for out in (src, src / "sub"):  # --out is SRC itself, or a folder inside it holding someone's files
        out.mkdir(exist_ok=True)
        (out / "notes.txt").write_text("mine")
        before = sorted(p.name for p in out.iterdir())
        line = one_error_line(run_cli("encode-dataset", src, "--out", out, "--no-progress"))
        assert "not empty and has no dataset.json" in line
        assert sorted(p.name for p in out.iterdir()) == before  # no .lock left behind


def test_user_tmp_files_in_out_are_not_deleted(tmp_path):
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    out.mkdir()
    Image.fromarray(np.full((56, 56, 3), 7, np.uint8)).save(src / "a.png")
    (out / ".tmp-notes.txt").write_text("mine")
    line = one_error_line(run_cli("encode-dataset", src, "--out", out, "--no-progress"))
    assert "not empty and has no dataset.json (found '.tmp-notes.txt')" in line
    assert (out / ".tmp-notes.txt").read_text() == "mine"
    # In a dataset folder too: bivit's own leftovers are removed on resume, a user's file is not.
    (out / ".tmp-notes.txt").unlink()
    r = run_cli("encode-dataset", src, "--out", out, "--no-progress")
    assert r.returncode == 0, r.stderr
    (out / ".tmp-notes.txt").write_text("mine")
    (out / f".tmp-shard-000009.safetensors.{os.getpid()}").write_bytes(b"half a shard")
    r = run_cli("encode-dataset", src, "--out", out, "--no-progress")
    assert r.returncode == 0, r.stderr
    assert (out / ".tmp-notes.txt").read_text() == "mine"
    assert not (out / f".tmp-shard-000009.safetensors.{os.getpid()}").exists()


# ------------------------------------------------------------------------------ cost, not declarations

def scan_bomb(w: int, h: int, empty_scans: int) -> bytes:
    """A real progressive grayscale JPEG with `empty_scans` 10-byte scans (SOS headers, no data) before its EOI:
    libjpeg walks every block of the image once per scan, so each costs the decoder as much as a real one."""
    buf = io.BytesIO()
    pixels = np.random.default_rng(w * h).integers(0, 256, (h, w), dtype=np.uint8)
    Image.fromarray(pixels, "L").save(buf, "JPEG", progressive=True, quality=50)
    data = buf.getvalue()
    assert data.endswith(b"\xff\xd9")
    return data[:-2] + b"\xff\xda\x00\x08\x01\x01\x00\x01\x3f\x00" * empty_scans + b"\xff\xd9"


def test_jpeg_scan_bomb_is_refused_before_decoding(tmp_path):
    """60 KB of empty scans ran 84 s past a 2 s deadline in the service; 1 MB was still decoding in `bivit encode`
    after 45 s; the dataset job had no deadline at all. The scans are counted from the marker segments before
    anything is decoded: library, CLI, dataset job, each a one-line reason."""
    from bivit.media.decode import MAX_JPEG_SCANS, jpeg_scans

    bomb = scan_bomb(512, 512, 20_000)
    assert len(jpeg_scans(scan_bomb(512, 512, 0))) < 20 and len(jpeg_scans(bomb)) == MAX_JPEG_SCANS + 1
    with pytest.raises(MediaError, match=f"more than {MAX_JPEG_SCANS} scans"):
        load_image(bomb)
    assert load_image(scan_bomb(512, 512, 50)).size == (512, 512)  # a legal number of scans still decodes
    src = tmp_path / "src"
    src.mkdir()
    (src / "bomb.jpg").write_bytes(bomb)
    Image.fromarray(np.full((56, 56, 3), 7, np.uint8)).save(src / "ok.png")
    r = run_cli("encode", src / "bomb.jpg", src / "ok.png", "--out", tmp_path / "e.safetensors")
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert f"bivit: skipped: {src / 'bomb.jpg'}: " in r.stderr and "scans" in r.stderr, r.stderr[-2000:]
    r = run_cli("encode-dataset", src, "--out", tmp_path / "ds", "--no-progress")
    errors = [json.loads(line) for line in (tmp_path / "ds" / "errors.jsonl").read_text().splitlines()]
    assert [e["source"] for e in errors] == ["bomb.jpg"] and "scans" in json.dumps(errors), errors


def test_jpeg_decoding_checks_its_deadline_between_scans(monkeypatch):
    """The deadline was checked between 64 KB reads: ~6,500 empty scans apart. Now libjpeg is handed one scan at a
    time. Shown without timing: a clock that ticks once per look at it; the deadline falls a few ticks after the
    last look a plain progressive JPEG needs. That JPEG decodes; the same image with 80 more (empty) scans, under
    the scan limit and only 800 bytes longer, reaches its deadline inside the decode."""
    import bivit.media.decode as decode

    class Ticks:
        now = 0.0

        def monotonic(self) -> float:
            self.now += 1
            return self.now

    plain, longer = scan_bomb(256, 256, 0), scan_bomb(256, 256, 80)
    ticks = Ticks()
    monkeypatch.setattr(decode, "time", ticks)
    load_image(plain, deadline=float("inf"))
    looks = ticks.now
    ticks.now = 0.0
    assert load_image(plain, deadline=looks + 5).size == (256, 256)
    ticks.now = 0.0
    with pytest.raises(MediaError, match="decoding stopped at its deadline"):
        load_image(longer, deadline=looks + 5)


def header_lies_video(fmt: str, small: tuple[int, int], big: tuple[int, int], sampled: set[int], n: int = 30,
                      fps: int = 10) -> bytes:
    """A real MJPEG video whose stream header says `small` (its first frame's size) and whose frames not in
    `sampled` are `big`: each packet encoded at its own size, all muxed into the one stream."""
    from fractions import Fraction

    import av

    buf = io.BytesIO()
    out = av.open(buf, "w", format=fmt)
    stream = out.add_stream("mjpeg", rate=fps)
    stream.width, stream.height, stream.pix_fmt = *small, "yuvj420p"
    encoders = {}
    for w, h in (small, big):
        enc = av.CodecContext.create("mjpeg", "w")
        enc.width, enc.height, enc.pix_fmt, enc.time_base = w, h, "yuvj420p", Fraction(1, fps)
        enc.open()
        encoders[w, h] = enc
    for i in range(n):
        w, h = small if i in sampled or i == 0 else big
        frame = av.VideoFrame.from_ndarray(np.full((h, w, 3), 100, np.uint8), "rgb24").reformat(format="yuvj420p")
        frame.pts, frame.time_base = i, Fraction(1, fps)
        for packet in encoders[w, h].encode(frame):
            packet.stream, packet.pts, packet.dts, packet.time_base = stream, i, i, Fraction(1, fps)
            out.mux(packet)
    out.close()
    return buf.getvalue()


@pytest.mark.parametrize("fmt", ["matroska", "avi"])
def test_frames_bigger_than_the_header_are_refused_in_every_pass(fmt):
    """An MKV/AVI whose header says 64x48 but whose unsampled frames were 16000x16000 MJPEG (21 MB) was encoded
    with +1.5 GB of RSS: only sampled frames were checked, and --max-video-mpixels trusted the header. Shown at
    small sizes: a 12,288-pixel frame limit, frames of 640x480 wherever sampling does not look. FFmpeg's decoder
    now refuses such a frame before allocating it (its own message says so), and every frame decoded in every pass
    counts its real size."""
    from bivit.media.container import FRAME_MIN_PIXELS
    from bivit.media.video import SAMPLE_FPS, sample_frame_indices

    sampled = set(sample_frame_indices(30, 10, SAMPLE_FPS))
    work = 2 * 30 * FRAME_MIN_PIXELS  # two passes (counting, sampling) of 30 frames of at most 128x128
    video = header_lies_video(fmt, (64, 48), (640, 480), sampled)
    with pytest.raises(MediaError, match="a frame is larger than max_frame_pixels=12288"):
        preprocess_video(video, max_frame_pixels=64 * 48 * 4)
    # The work limit counts the frames' real pixels, not the header's 64x48 per frame.
    with pytest.raises(MediaError, match="max_decoded_pixels"):
        preprocess_video(video, max_decoded_pixels=work)
    honest = header_lies_video(fmt, (64, 48), (64, 48), sampled)  # the control: the same video, frames as declared
    assert len(preprocess_video(honest, max_frame_pixels=64 * 48 * 4, max_decoded_pixels=work)) == 2


VIDEO_PEAK_CHILD = """
    import ctypes, json, os, sys
    from bivit.errors import MediaError
    from bivit.media.video import preprocess_video

    def status(key):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))

    for path in sys.argv[1:]:  # each in a fresh fork: its peak is its own
        data = open(path, "rb").read()
        pid = os.fork()
        if pid == 0:
            ctypes.CDLL(None).malloc_trim(0)
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset VmHWM to the current RSS
            before = status("VmRSS:")
            try:
                preprocess_video(data, name=os.path.basename(path))
                error = None
            except MediaError as e:
                error = str(e)
            print(json.dumps({"name": os.path.basename(path), "peak": status("VmHWM:") - before, "error": error}))
            os._exit(0)
        os.waitpid(pid, 0)
"""


def test_a_still_image_named_as_a_video_never_reaches_ffmpeg(tmp_path):
    """FFmpeg decoded PNG/WebP while probing, before bivit said "is a still image": a 0.95 MB 16000x16000 PNG took
    +982 MB, a 5 KB WebP +552 MB, outside the image limits; its 38 still-image demuxers exposed EXR/PSD/DDS
    parsers to uploads. Still images are now known by their first bytes, and no still-image demuxer is allowed.
    Measured in a child (peak RSS): 8000x8000 images, 256 MB once decoded."""
    paths = []
    for name, fmt, kw in (("big.png.mp4", "PNG", {}), ("big.webp.mp4", "WEBP", {"lossless": True})):
        Image.new("RGB", (8000, 8000), (9, 9, 9)).save(tmp_path / name, fmt, **kw)
        paths.append(str(tmp_path / name))
    (tmp_path / "x.exr.mp4").write_bytes(b"v/1\x01" + bytes(4000))  # an EXR header: no FFmpeg parser reads it
    paths.append(str(tmp_path / "x.exr.mp4"))
    r = run_python(VIDEO_PEAK_CHILD, *paths)
    assert r.returncode == 0, r.stderr[-3000:]
    results = {m["name"]: m for m in map(json.loads, r.stdout.splitlines())}
    assert len(results) == 3, results
    for name, fmt in (("big.png.mp4", "png"), ("big.webp.mp4", "webp"), ("x.exr.mp4", "exr")):
        m = results[name]
        assert m["error"] == f"{name}: is a still image ({fmt}), not a video; encode it as an image", m
        assert m["peak"] < 32 * 2**20, m


def _png_chunk(kind: bytes, data: bytes = b"") -> bytes:
    import struct
    import zlib

    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def tiff_tag_bomb(values: int) -> bytes:
    """An 8x8 grayscale TIFF whose first directory also holds a private tag of `values` SHORTs."""
    import struct

    entries = [(256, 3, 1, 8), (257, 3, 1, 8), (258, 3, 1, 8), (259, 3, 1, 1), (262, 3, 1, 1), (273, 4, 1, 0),
               (278, 3, 1, 8), (279, 4, 1, 64), (65000, 3, values, 0)]
    pixels = 8 + 2 + 12 * len(entries) + 4
    out = bytearray(b"II*\x00" + struct.pack("<IH", 8, len(entries)))
    for tag, kind, count, value in entries:
        value = {273: pixels, 65000: pixels + 64}.get(tag, value)
        out += struct.pack("<HHII" if kind == 4 or count > 2 else "<HHIHH", tag, kind, count, value, *(
            () if kind == 4 or count > 2 else (0,)))
    return bytes(out + bytes(4 + 64) + bytes(2 * values))


def test_png_chunk_and_tiff_tag_floods_are_refused_before_parsing():
    """An 8x8 PNG with 5M empty chunks took 11.5 s and +850 MB to parse, a TIFF with one tag of 15M values 1.3 s
    and +1.2 GB, both on the service's event loop. Counted from the bytes now, before Pillow parses anything."""
    from bivit.media.decode import MAX_PNG_OTHER_CHUNKS, MAX_TIFF_TAG_VALUES

    buf = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buf, "PNG")
    png = buf.getvalue()
    at = png.index(b"IDAT") - 4

    def flood(n: int) -> bytes:
        return png[:at] + _png_chunk(b"tEXt") * n + png[at:]

    assert load_image(flood(100)).size == (8, 8)  # the control: chunks within the limit
    with pytest.raises(MediaError, match=f"more than {MAX_PNG_OTHER_CHUNKS} besides its image data"):
        load_image(flood(MAX_PNG_OTHER_CHUNKS + 1))
    assert load_image(tiff_tag_bomb(1000)).size == (8, 8)
    with pytest.raises(MediaError, match=f"a TIFF tag of 1048577 values, more than the {MAX_TIFF_TAG_VALUES}"):
        load_image(tiff_tag_bomb(MAX_TIFF_TAG_VALUES + 1))


def test_a_long_video_never_holds_the_thread_a_short_one_needs(tmp_path):
    """Two 4.5 M-frame videos held both video threads until small video requests timed out. A video whose decoding
    work (its header's frame count x frame size, at least 128x128 a frame) is heavy, or not known before
    decoding, decodes in a pool of its own. Shown without timing, at small sizes: the heavy-video pool is held
    busy while a long video waits in it; a short one completes meanwhile."""
    from bivit.serve.protocol import UploadItem
    from bivit.serve.admission import item_cost
    from bivit.serve.serving import Service
    from bivit.serve.settings import ServerSettings
    from bivit.media.container import FRAME_MIN_PIXELS

    svc = Service(bivit.load_encoder(), ServerSettings(cache_mb=0, preprocess_threads=1))
    svc.admission.heavy_video_work = 20 * FRAME_MIN_PIXELS  # small limits in tests
    long = UploadItem("long.mp4", make_video(tmp_path / "long.mp4", frames=40, fps=10).read_bytes())
    short = UploadItem("short.mp4", make_video(tmp_path / "short.mp4", frames=8, fps=10).read_bytes())
    assert item_cost(long, svc.encoder.processing).work > svc.admission.heavy_video_work \
        >= item_cost(short, svc.encoder.processing).work
    busy_pool_scenario(svc, "heavy_video_pool", first=short, held=long)


def test_a_light_image_never_waits_for_a_thread_decoding_a_large_one():
    """Two requests of 13 7500x7500 PNGs (under the heavy threshold) held both image threads; a one-image request
    waited for one of them. Light images (by their header) decode in a pool of their own. Shown without timing:
    the image pool is held busy; a light request completes meanwhile (the control: the busy pool holds back an
    image queued in it)."""
    from bivit.serve.protocol import UploadItem
    from bivit.serve.admission import item_cost
    from bivit.serve.serving import Service
    from bivit.serve.settings import ServerSettings

    svc = Service(bivit.load_encoder(), ServerSettings(cache_mb=0, preprocess_threads=1))
    light, mid = UploadItem("light.png", png_bytes(56, 56, 21)), UploadItem("mid.png", png_bytes(1200, 1200, 22))
    assert item_cost(light, svc.encoder.processing).work <= svc.admission.light_bytes \
        < item_cost(mid, svc.encoder.processing).work <= svc.admission.heavy_bytes
    busy_pool_scenario(svc, "pool", first=light, held=mid)


def test_decode_threads_are_shared_round_robin_between_requests():
    """Two requests of 13 legitimate 7500x7500 PNGs made a one-image request wait 61 s instead of 0.08 s: the
    decode pool served items first come, first served. Now it takes them round-robin across requests. Shown
    without timing: one thread, held busy while request A queues 6 calls and then request B one; B's call runs
    second, not seventh. The control: without other owners, calls run in the order they came."""
    from bivit.serve.pools import FairPool

    pool = FairPool(1, "test")
    busy, ran = threading.Event(), []
    try:
        blocker = pool.submit("first", busy.wait)
        futures = [pool.submit("A", ran.append, f"A{i}") for i in range(6)] + [pool.submit("B", ran.append, "B0")]
        cancelled = pool.submit("A", ran.append, "never")
        assert cancelled.cancel()
        busy.set()
        for f in [blocker, *futures]:
            f.result(60)
        assert ran == ["A0", "B0", "A1", "A2", "A3", "A4", "A5"], ran
        ran.clear()
        futures = [pool.submit("A", ran.append, i) for i in range(5)]
        for f in futures:
            f.result(60)
        assert ran == list(range(5))
    finally:
        busy.set()
        pool.shutdown()


# ------------------------------------------------------------------------------------ files read back

@pytest.fixture(scope="module")
def dataset_folder(tmp_path_factory):
    """A real dataset folder of two images (demo model), written once; tests copy it before changing it."""
    from bivit.dataset import encode_dataset

    d = tmp_path_factory.mktemp("readback")
    (d / "src").mkdir()
    for i in range(2):
        Image.fromarray(np.full((56, 56, 3), 40 * i, np.uint8)).save(d / "src" / f"{i}.png")
    encode_dataset(d / "src", d / "ds", progress=False)
    return d / "ds"


def _edited(folder: Path, dst: Path, edit) -> Path:
    """A copy of `folder` whose manifest lines are `edit`ed and sealed again (their checksums made for what they
    now hold, as a writer that wrote them so): what is checked past the checksum."""
    import shutil

    from bivit.dataset.format import LINE_KEY
    from bivit.core.integrity import sealed

    shutil.copytree(folder, dst)
    rows = [json.loads(line) for line in (dst / "manifest.jsonl").read_text().splitlines()]
    lines = [json.dumps(sealed(json.loads(x), LINE_KEY)) if x.startswith("{") else x for x in edit(rows)]
    (dst / "manifest.jsonl").write_text("".join(line + "\n" for line in lines))
    return dst


@pytest.mark.parametrize("case", ["dotdot", "absolute", "symlink", "tokens", "dtype", "nested", "types",
                                  "damaged"])
def test_a_dataset_folder_read_back_is_checked(dataset_folder, tmp_path, case):
    """`load_embeddings` on a folder whose manifest said `"shard": "../../x.safetensors"` (or an absolute path,
    or a shard linked outside) returned that file's tensor as the embedding; tensors were not checked against
    their records; nested JSON raised RecursionError, bad types TypeError/ValueError, a damaged shard
    SafetensorError. Each is now bivit's FormatError, naming what is wrong."""
    from safetensors.torch import save_file as save

    import torch
    from bivit.errors import FormatError

    outside = tmp_path / "x.safetensors"
    shard = json.loads((dataset_folder / "manifest.jsonl").read_text().splitlines()[0])["shard"]
    key = json.loads((dataset_folder / "manifest.jsonl").read_text().splitlines()[0])["tensor"]
    tokens = json.loads((dataset_folder / "manifest.jsonl").read_text().splitlines()[0])["tokens"]
    save({key: torch.zeros(tokens, 128, dtype=torch.bfloat16)}, outside)
    dst = tmp_path / "ds"

    def each(change):
        return lambda rows: [json.dumps({**r, **change(r)}) for r in rows]

    if case == "dotdot":
        _edited(dataset_folder, dst, each(lambda r: {"shard": "../x.safetensors"}))
    elif case == "absolute":
        _edited(dataset_folder, dst, each(lambda r: {"shard": str(outside)}))
    elif case == "symlink":
        _edited(dataset_folder, dst, each(lambda r: {}))
        (dst / shard).unlink()
        (dst / shard).symlink_to(outside)
    elif case == "tokens":
        _edited(dataset_folder, dst, each(lambda r: {"tokens": r["tokens"] + 1}))
    elif case == "dtype":
        import shutil

        from bivit.dataset.format import HEADER_KEY
        from bivit.core.integrity import sealed

        shutil.copytree(dataset_folder, dst)
        header = json.loads((dst / "dataset.json").read_text())
        (dst / "dataset.json").write_text(json.dumps(sealed({**header, "output_dtype": "float32"}, HEADER_KEY)))
    elif case == "nested":
        _edited(dataset_folder, dst, lambda rows: ["[" * 100_000 + "]" * 100_000])
    elif case == "types":
        _edited(dataset_folder, dst, each(lambda r: {"tokens": "many", "grid_thw": 5}))
    elif case == "damaged":
        _edited(dataset_folder, dst, each(lambda r: {}))
        (dst / shard).write_bytes(b"\xff" * 64)
    with pytest.raises(FormatError) as e:
        for record in bivit.load_embeddings(dst):
            record.embedding  # noqa: B018 - reads it
    named = {"dotdot": dst / "manifest.jsonl", "absolute": dst / "manifest.jsonl", "symlink": dst / shard,
             "nested": dst / "manifest.jsonl", "types": dst / "manifest.jsonl", "tokens": dst / "manifest.jsonl"
             }.get(case, dst / shard)
    assert str(e.value).startswith(f"{named}"), str(e.value)  # the file at fault, first
    if case in ("dotdot", "absolute", "symlink"):
        assert "outside" in str(e.value) or "not a shard file of its folder" in str(e.value), str(e.value)
    assert all(r.embedding is not None for r in bivit.load_embeddings(dataset_folder))  # the control


def test_a_fifo_is_refused_not_waited_on(tmp_path):
    """A FIFO given to `load_embeddings`, or as a dataset folder's manifest, blocked forever."""
    fifo = tmp_path / "emb.safetensors"
    os.mkfifo(fifo)
    folder = tmp_path / "ds"
    folder.mkdir()
    (folder / "dataset.json").write_text(json.dumps({"format": "bivit-encoded-dataset", "format_version": 1}))
    os.mkfifo(folder / "manifest.jsonl")
    r = run_python("""
        import sys, bivit
        for path in sys.argv[1:]:
            try:
                bivit.load_embeddings(path)
            except bivit.BivitError as e:
                print(type(e).__name__, e)
    """, str(fifo), str(folder), timeout=120)
    lines = r.stdout.splitlines()
    assert r.returncode == 0 and len(lines) == 2, r.stderr[-2000:]
    assert all("not a regular file" in line for line in lines), lines


def _folder_outcomes(folder: Path, scratch: Path, names=("manifest.jsonl", "dataset.json")) -> dict:
    """One bit flipped at each byte of a folder's `names` (the manifest's last newline kept: a line cut short
    is a writer killed mid-append, not a line), each read back whole: outcome -> count."""
    import shutil

    import torch

    want = bivit.load_embeddings(folder)
    want = (want.encoder, [(r.to_json(), r.embedding) for r in want])
    out: dict = {}
    shutil.rmtree(scratch, ignore_errors=True)
    shutil.copytree(folder, scratch)
    for name in names:
        data = (folder / name).read_bytes()
        for at in range(len(data) - (name == "manifest.jsonl")):
            body = bytearray(data)
            body[at] ^= 1 << (at % 8)
            (scratch / name).write_bytes(body)
            try:
                got = bivit.load_embeddings(scratch)
                same = got.encoder == want[0] and len(got) == len(want[1]) and all(
                    r.to_json() == j and torch.equal(r.embedding, t) for r, (j, t) in zip(got, want[1]))
                outcome = "identical" if same else "another record"
            except bivit.BivitError as e:
                outcome = type(e).__name__
            out[outcome] = out.get(outcome, 0) + 1
        (scratch / name).write_bytes(data)
    return out


def test_one_bit_flipped_in_a_dataset_folders_records_is_refused_or_changes_nothing(dataset_folder, tmp_path):
    """A dataset folder's records live in its manifest lines and its encoder in dataset.json, neither covered by
    a checksum: a flipped bit was another record. Each line and the header now carry their checksums, which
    every reader checks (required from format_version 2, which the header's checksum covers): one bit flipped at
    each byte of both files is a FormatError or the identical records.
    The control: the same flips on the folder written as a version-1 one (no checksums) give other records."""
    from bivit.dataset.format import HEADER_KEY, LINE_KEY

    import shutil

    got = _folder_outcomes(dataset_folder, tmp_path / "scratch")
    print(f"\none bit flipped at each byte of manifest.jsonl and dataset.json: {got}")
    assert set(got) <= {"FormatError", "identical"} and got["FormatError"] > 1000, got
    old = tmp_path / "v1"
    shutil.copytree(dataset_folder, old)
    header = json.loads((old / "dataset.json").read_text())
    header = {k: v for k, v in header.items() if k != HEADER_KEY}
    (old / "dataset.json").write_text(json.dumps({**header, "format_version": 1}))
    lines = [{k: v for k, v in json.loads(x).items() if k != LINE_KEY}
             for x in (old / "manifest.jsonl").read_text().splitlines()]
    (old / "manifest.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert _folder_outcomes(old, tmp_path / "scratch", ("manifest.jsonl",)).get("another record", 0) > 50


def test_a_dataset_folders_own_files_are_read_within_bounds(dataset_folder, tmp_path):
    """dataset.json and manifest.jsonl were read whole, any size. Now a header above 1 MiB, a manifest above
    8 GiB (a sparse file: nothing written) and a line above 4 MiB are each a FormatError naming the file,
    before they are read; the control: the folder as written opens."""
    import shutil

    from bivit.dataset.format import MAX_HEADER_BYTES, MAX_LINE_BYTES, MAX_LINES_BYTES
    from bivit.errors import FormatError

    assert len(bivit.load_embeddings(dataset_folder)) == 2  # the control
    for name, size, says in (("dataset.json", MAX_HEADER_BYTES + 1, "unreadable dataset header (larger than"),
                             ("manifest.jsonl", MAX_LINES_BYTES + 1, f"{MAX_LINES_BYTES + 1} bytes, more than"),
                             ("manifest.jsonl", None, "1: a line of more than")):
        dst = tmp_path / f"{name}-{size}"
        shutil.copytree(dataset_folder, dst)
        if size is None:
            (dst / name).write_bytes(b" " * (MAX_LINE_BYTES + 1) + b"\n")
        else:
            with open(dst / name, "r+b") as f:
                f.truncate(size)
        with pytest.raises(FormatError) as e:
            bivit.load_embeddings(dst)
        assert str(e.value).startswith(f"{dst / name}") and says in str(e.value), str(e.value)
