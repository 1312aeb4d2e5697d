"""The `bivit` command line, run as a real process: outputs, one-line errors, exit codes."""

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors import safe_open

import bivit
from support.media import make_video, random_image


def run(*args, cwd=None, **kw):
    return subprocess.run([sys.executable, "-m", "bivit.cli", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, timeout=300, **kw)


def one_error_line(r, code=2) -> str:
    assert r.returncode == code and "Traceback" not in r.stderr, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("bivit: error: ")]
    assert len(lines) == 1, r.stderr
    return lines[0]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("files")
    good = []
    for i, (h, w) in enumerate([(28, 28), (60, 90), (150, 100)]):
        p = d / f"img{i}.png"
        Image.fromarray(random_image(h, w, seed=i)).save(p)
        good.append(p)
    (d / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\nbroken")
    (d / "empty.jpg").write_bytes(b"")
    video = make_video(d / "clip.mp4", frames=60, fps=10, size=(84, 56))
    return {"good": good, "corrupt": d / "corrupt.png", "empty": d / "empty.jpg", "video": video}


def test_encode_writes_one_tensor_per_input_with_metadata(files, tmp_path):
    out = tmp_path / "emb.safetensors"
    r = run("encode", *files["good"], files["video"], "--out", out, "--dtype", "float32")
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr and "DEMO" in r.stderr
    assert r.stdout.strip().startswith("encoded 4 of 4 inputs")
    enc = bivit.load_encoder(dtype="float32")
    inputs = files["good"] + [files["video"]]
    with safe_open(str(out), "pt") as f:  # the raw file: the format's three keys, tensor "i" for input i
        meta = f.metadata()
        assert meta["format"] == "bivit.embeddings/2" and sorted(f.keys()) == ["0", "1", "2", "3"]
        written, here = json.loads(meta["encoder"]), enc.describe()
        assert written.pop("kernels")["gemm"] == here.pop("kernels")["gemm"] and written == here
    items = bivit.load_embeddings(out)
    assert items.encoder["demo"] is True and items.encoder["dtype"] == "float32"
    assert items.encoder["batch_invariant"] is True and items.encoder["fingerprint"] == enc.fingerprint
    assert items.sources == [str(p) for p in inputs]
    for i, p in enumerate(files["good"]):
        assert torch.equal(items[i].embedding, enc.encode([p])[0])  # the CLI's bits are the library's bits
        assert items[i].grid_thw == enc.preprocess([p]).grid_thw.tolist() and items[i].kind == "image"
        assert items[i].sha256 == hashlib.sha256(p.read_bytes()).hexdigest() and items[i].dtype == "float32"
    video = items[3]
    chunks = enc.encode_video(files["video"])
    assert len(chunks) == 3  # 6 s at 10 fps -> 12 frames sampled at 2 fps -> chunks of 4
    assert video.kind == "video" and video.timestamps == [c.timestamp for c in chunks]
    assert chunks[0].timestamp == "00:00:00.000"
    assert video.grid_thw == [list(c.grid_thw) for c in chunks]
    assert video.chunk_tokens == [c.token_count for c in chunks]
    assert torch.equal(video.embedding, torch.cat([c.embedding for c in chunks]))
    assert all(torch.equal(a, c.embedding) for a, c in zip(video.chunks, chunks))
    # The prompt placeholders, one per image or chunk, are the encoder's, and their rows add up.
    got = [[bivit.Placeholder(**p) for p in item.placeholders] for item in items]
    assert got == enc.placeholders(inputs)
    assert [sum(p.tokens for p in ps) for ps in got] == [i.tokens for i in items]
    assert items.encoder["alpha"] == "model" and items.encoder["processing"]["processor"] == "kimi_k25"


def run_on_a_terminal(*args):
    """The CLI with its stderr on a pseudo-terminal, as in an interactive shell -> (exit status, stderr)."""
    import fcntl
    import pty
    import struct
    import termios

    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))  # a new pty is 0 columns wide
    proc = subprocess.Popen([sys.executable, "-m", "bivit.cli", *map(str, args)], stdout=subprocess.DEVNULL,
                            stderr=follower)
    os.close(follower)
    out = b""
    while True:
        try:
            data = os.read(leader, 65536)
        except OSError:  # EIO: every writer of the terminal has closed it
            break
        if not data:
            break
        out += data
    os.close(leader)
    return proc.wait(timeout=300), out.decode(errors="replace")


def test_encode_of_a_long_video_shows_progress_on_a_terminal(files, tmp_path):
    """One video: the bar counts its chunks (3 here, one forward pass each under a small patch budget)."""
    code, stderr = run_on_a_terminal("encode", files["video"], "--out", tmp_path / "e.safetensors",
                                     "--max-batch-patches", "64")
    assert code == 0, stderr
    assert "encoding: 100%" in stderr and "3/3" in stderr and "chunk" in stderr, stderr


def test_no_progress_bar_when_stderr_is_not_a_terminal_and_counts_in_words(files, tmp_path):
    """Captured stderr (a log, a pipe) gets no bar: each redraw would be one more line. Counts of one are
    singular."""
    r = run("encode", files["video"], "--out", tmp_path / "e.safetensors", "--max-batch-patches", "64")
    assert r.returncode == 0, r.stderr
    assert "\r" not in r.stderr and "chunk" not in r.stderr and "%|" not in r.stderr, r.stderr
    assert re.match(r"encoded 1 of 1 input, \d+ tokens in ", r.stdout), r.stdout
    r = run("encode", files["corrupt"], "--out", tmp_path / "x.safetensors")
    assert r.stdout == "encoded 0 of 1 input (nothing written); 1 failed\n", r.stdout
    src = tmp_path / "in"
    src.mkdir()
    (src / "a.png").write_bytes(files["good"][0].read_bytes())
    (src / "b.png").write_bytes(files["corrupt"].read_bytes())
    r = run("encode-dataset", src, "--out", tmp_path / "ds")  # --progress is the default
    assert r.returncode == 1 and "\r" not in r.stderr and "%|" not in r.stderr, r.stderr
    assert "encoded 1, skipped 0, deduplicated 0, failed 1; " in r.stdout, r.stdout
    assert f"1 input failed; see {tmp_path / 'ds' / 'errors.jsonl'}" in r.stderr


def test_encode_alpha_option(tmp_path):
    rgba = random_image(40, 50, seed=3)
    img = tmp_path / "t.png"
    Image.fromarray(rgba).convert("RGBA").save(img)
    a = Image.open(img)
    a.putalpha(Image.fromarray((random_image(40, 50, seed=4)[..., 0] // 2).astype("uint8")))
    a.save(img)
    outs = {}
    for alpha in ("model", "white"):
        out = tmp_path / f"{alpha}.safetensors"
        r = run("encode", img, "--out", out, "--dtype", "float32", "--alpha", alpha)
        assert r.returncode == 0, r.stderr
        with safe_open(str(out), "pt") as f:
            outs[alpha] = f.get_tensor("0")
            assert json.loads(f.metadata()["encoder"])["alpha"] == alpha
    enc = bivit.load_encoder(dtype="float32")
    assert torch.equal(outs["white"], enc.encode([img], alpha="white")[0])
    assert torch.equal(outs["model"], enc.encode([img])[0]) and not torch.equal(outs["model"], outs["white"])
    r = run("encode", img, "--alpha", "pink", "--out", tmp_path / "x.safetensors")
    assert r.returncode == 2 and "alpha" in r.stderr and "Traceback" not in r.stderr


def test_bad_files_are_reported_skipped_and_exit_nonzero(files, tmp_path):
    out = tmp_path / "emb.safetensors"
    r = run("encode", files["good"][0], files["corrupt"], files["empty"], tmp_path / "missing.png",
            files["good"][1], "--out", out)
    assert r.returncode == 1
    assert "Traceback" not in r.stderr
    for bad in ("corrupt.png", "empty.jpg", "missing.png"):
        assert sum(bad in line for line in r.stderr.splitlines()) == 1
    assert "encoded 2 of 5 inputs" in r.stdout and "3 failed" in r.stdout
    with safe_open(str(out), "pt") as f:  # tensor "i" is input i's: the failed ones have none
        assert sorted(f.keys()) == ["0", "4"]
    items = bivit.load_embeddings(out)  # every input in order, the failed ones with their error
    assert [r.ok for r in items] == [True, False, False, False, True]
    assert [r.tensor for r in items] == ["0", None, None, None, "4"] and items[2].embedding is None
    assert "empty" in items[2].error and "does not exist" in items[3].error


def test_nothing_half_written_when_everything_fails(files, tmp_path):
    out = tmp_path / "emb.safetensors"
    r = run("encode", files["corrupt"], "--out", out)
    assert r.returncode == 1 and not out.exists() and list(tmp_path.iterdir()) == []


def test_user_errors_are_one_line(tmp_path):
    r = run("encode", tmp_path, "--model", tmp_path / "nope", "--out", tmp_path / "o.safetensors")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().count("\n") == 0 and "nope" in r.stderr
    r = run("encode", "x.png", "--dtype", "int3")
    assert r.returncode == 2 and "int3" in r.stderr and "Traceback" not in r.stderr


def test_inputs_and_options_are_checked_before_the_model_loads(files, tmp_path):
    """Every unusable input is named with its reason before any model loads (so before a checkpoint is read or
    a hub is asked); when none is left, nothing loads at all. A model path that does not exist says so."""
    (tmp_path / "notes.txt").write_text("not media\n")
    (tmp_path / "fake.mp4").write_text("not a video\n")
    bad = {tmp_path / "missing.png": "does not exist", tmp_path: "a directory", files["empty"]: "file is empty",
           tmp_path / "notes.txt": "not an image", tmp_path / "fake.mp4": "corrupt or unsupported video",
           files["corrupt"]: "not an image format"}
    r = run("encode", *bad, "--out", tmp_path / "e.safetensors")
    assert r.returncode == 1 and "Traceback" not in r.stderr and "DEMO" not in r.stderr, r.stderr
    lines = r.stderr.splitlines()
    for path, reason in bad.items():
        assert any(ln.startswith(f"bivit: skipped: {path}: ") and reason in ln for ln in lines), (path, r.stderr)
    assert "encoded 0 of 6 inputs (nothing written)" in r.stdout
    r = run("encode", files["good"][0], "--model", tmp_path / "no-such-checkpoint")
    assert "no-such-checkpoint: does not exist" in one_error_line(r) and "DEMO" not in r.stderr
    r = run("verify", *bad)
    assert r.returncode == 1 and "Traceback" not in r.stderr and "DEMO" not in r.stderr, r.stderr
    assert sum(ln.startswith("bivit: skipped: ") for ln in r.stderr.splitlines()) == 6, r.stderr
    assert "verified 0 of 6 inputs; 6 failed" in r.stdout


def test_verify_skips_a_bad_file_and_verifies_the_rest(files, tmp_path):
    """`bivit verify a.png bad.jpg` stopped at the bad file (exit 2, nothing verified) where `encode` skips it.
    It is now named in one line and the rest verified; exit 1 as `encode` (control: the good files alone: 0)."""
    r = run("verify", files["good"][0], files["corrupt"], tmp_path / "missing.png", files["good"][1], "--layouts", "2")
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    skipped = [ln for ln in r.stderr.splitlines() if ln.startswith("bivit: skipped: ")]
    assert len(skipped) == 2 and "not an image format" in skipped[0] and "does not exist" in skipped[1], r.stderr
    assert "invariant mode (float32): BIT-STABLE" in r.stdout and r.stdout.count("img") == 4, r.stdout
    assert "2 inputs skipped" in r.stdout
    assert run("verify", files["good"][0], files["good"][1], "--layouts", "2").returncode == 0


def test_verify_demo_invariant_stable_default_differs_and_bisect(tmp_path):
    plot = tmp_path / "new folder" / "v.png"  # created
    r = run("verify", "--dtype", "float32", "--bisect", "--plot", plot, "--layouts", "4")
    assert r.returncode == 0, r.stdout + r.stderr
    inv, default = r.stdout.split("default mode")
    assert "invariant mode (float32): BIT-STABLE" in inv and "DIFFERS" not in inv
    assert "NOT bit-stable" in default and "DIFFERS" in default
    assert "no op differs" in inv
    # The first op to differ is named by its module path and op kind (which op it is depends on the CPU's
    # kernels: a GEMM where stock GEMMs change kernels with the row count, attention or another op elsewhere).
    assert re.search(r"first difference at (vision_tower|mm_projector)[\w.]* \(\w+, call \d+\)", default)
    assert plot.stat().st_size > 1000
    with Image.open(plot) as im:
        assert im.format == "PNG"


def test_verify_by_default_shows_default_mode_differing_and_bisects_an_item_that_differs():
    """No options: the demo run must demonstrate (default mode not bit-stable, on every CPU kind: float32 by default)
    and --bisect must pick an item that differs in default mode, not always item 0."""
    r = run("verify", "--bisect", "--layouts", "4")
    assert r.returncode == 0, r.stdout + r.stderr
    inv, default = r.stdout.split("default mode")
    assert "invariant mode (float32): BIT-STABLE" in inv and "NOT bit-stable" in default
    needle = re.search(r"bisect \((.+?) alone vs first of \d+\): first difference at", default).group(1)
    listed = {m.group(1).strip(): m.group(2) for m in re.finditer(r"^  (synthetic \S+)\s+\d+ tokens?\s+(\S+)", default, re.M)}
    assert listed[needle] == "DIFFERS", default
    # Invariant mode is bisected on the same item, and no op differs there.
    assert f"bisect ({needle} alone vs first of" in inv and "no op differs" in inv


def test_verify_on_files(files):
    r = run("verify", *files["good"], "--dtype", "float32", "--layouts", "3")
    assert r.returncode == 0 and r.stdout.count("img") >= 6


def test_encode_dataset_says_the_demo_notice_once_and_a_local_ray_run_adds_no_noise(files, tmp_path):
    """Both engines say the demo notice once (the library's, shown by the CLI); a local Ray run prints no
    error-level core_worker line, no token-auth warning, no worker-prefixed repeat and no raw ANSI escapes."""
    pytest.importorskip("ray")
    src = tmp_path / "in"
    src.mkdir()
    for p in files["good"][:2]:
        (src / p.name).write_bytes(p.read_bytes())
    for engine in ("local", "ray"):
        # Two workers for two files: Ray warns that the pool will not use all its actors, which stays out.
        r = run("encode-dataset", src, "--out", tmp_path / engine, "--engine", engine, "--no-progress",
                *(["--workers", "2"] if engine == "ray" else []))
        assert r.returncode == 0, r.stderr
        assert r.stderr.count("DEMO model") == 1, r.stderr
        for noise in ("core_worker", "Token authentication", "\x1b[", "pid=", "Progress bars", "Traceback",
                      "Warning", "warnings.warn"):
            assert noise not in r.stderr, (noise, r.stderr)


@pytest.mark.parametrize("command", ["", "encode", "verify", "serve", "encode-dataset", "bench", "doctor"])
def test_help_fits_80_columns_without_type_noise(command):
    """--help in an 80-column terminal: every option name whole (no "…"), no line past 80 columns, no <bool> on
    flags; bivit serve's --dtype names float16 like the other commands'."""
    r = run(*([command] if command else []), "--help", env={**os.environ, "COLUMNS": "80"})
    assert r.returncode == 0, r.stderr
    assert "<bool>" not in r.stdout and "…" not in r.stdout
    assert max(len(line) for line in r.stdout.splitlines()) <= 80
    if command in ("encode", "serve", "encode-dataset"):
        assert "--dtype" in r.stdout and "float16" in r.stdout.split("--dtype", 1)[1].split("--", 1)[0]


def test_encode_needs_no_compiler_and_writes_nothing_but_its_output(files, tmp_path):
    """The kernels come with the install: `bivit encode` with no C compiler reachable (no CC, a PATH with none)
    and a new empty home runs bivit-arith/1, says nothing about compiling, and writes no file outside --out."""
    home, empty = tmp_path / "home", tmp_path / "no-compiler"
    home.mkdir()
    empty.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("CC", "XDG_CACHE_HOME", "BIVIT_ATTENTION")}
    env.update(PATH=str(empty), HOME=str(home), TMPDIR=str(home))
    out = tmp_path / "e.safetensors"
    r = run("encode", files["good"][0], "--out", out, env=env)
    assert r.returncode == 0, r.stderr
    assert "compil" not in r.stderr.lower(), r.stderr
    with bivit.load_embeddings(out) as f:
        assert f.encoder["bits"] == "bivit-arith/1"
    assert list(home.rglob("*")) == [], list(home.rglob("*"))


def test_version_is_the_installed_package_version():
    import importlib.metadata

    r = run("--version")
    assert r.returncode == 0 and r.stdout == f"bivit {importlib.metadata.version('bivit')}\n", r.stdout + r.stderr


def test_help_lists_every_command_with_a_whole_sentence():
    """Click cuts a command's summary to fit the line and marks the cut with "..."; every summary must be a whole
    sentence that fits an 80-column terminal."""
    r = run("--help", env={**os.environ, "COLUMNS": "80"})
    assert r.returncode == 0, r.stderr
    listed = r.stdout.split("Commands:\n", 1)[1].splitlines()
    summaries = {ln.split()[0]: ln.split(None, 1)[1] for ln in listed if ln.strip()}
    assert set(summaries) == {"encode", "verify", "serve", "encode-dataset", "bench", "doctor"}, r.stdout
    for name, summary in summaries.items():
        assert summary.endswith(".") and not summary.endswith("..."), (name, summary)


def run_without(module, *args):
    """The CLI in a process where `module` cannot be imported, as on a machine without its extra."""
    code = (f"import sys; sys.modules[{module!r}] = None; sys.argv[0] = 'bivit'; "
            "from bivit.cli import main; main()")
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("module,args,extra", [
    ("fastapi", ["serve", "--port", "8123"], "serve"),
    ("matplotlib", ["verify", "--plot", "v.png"], "plot"),
    ("ray", ["encode-dataset", ".", "--out", "o", "--engine", "ray"], "ray"),
])
def test_missing_extra_is_one_line(module, args, extra):
    r = run_without(module, *args)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith("bivit: error: ") and r.stderr.strip().count("\n") == 0
    assert f"bivit[{extra}]" in r.stderr


def test_encoding_commands_take_the_same_encoder_options(files, tmp_path):
    """--model, --dtype, --projector-dtype, --output-dtype and --device: one spelling and one help text in every
    command that encodes."""
    def options(command):  # option -> its type and help text, unwrapped
        text = run(command, "--help").stdout.split("Options:\n", 1)[1]
        return {m.group(1): " ".join(m.group(2).split()) for m in re.finditer(r"^  (--\S+(?: <\w+>)?)(.*?)(?=^  -|\Z)",
                                                                             text, re.M | re.S)}
    helps = {c: options(c) for c in ("encode", "serve", "encode-dataset", "verify")}
    for flag in ("--model <str>", "--projector-dtype <str>", "--output-dtype <str>", "--device <str>"):
        assert len({h.get(flag) for h in helps.values()}) == 1 and helps["encode"].get(flag), (flag, helps)
    assert len({helps[c]["--dtype <str>"] for c in ("encode", "serve", "encode-dataset")}) == 1  # verify: float32
    out = tmp_path / "e.safetensors"
    r = run("encode", files["good"][0], "--out", out, "--device", "cpu", "--output-dtype", "float32")
    assert r.returncode == 0, r.stderr
    assert bivit.load_embeddings(out)[0].embedding.dtype == torch.float32
    r = run("encode", files["good"][0], "--out", tmp_path / "n.safetensors", "--device", "nonsense")
    assert "'nonsense' is not available here" in one_error_line(r) and "DEMO" not in r.stderr
    assert not (tmp_path / "n.safetensors").exists()


def test_encode_dataset_output_dtype(files, tmp_path):
    src = tmp_path / "in"
    src.mkdir()
    (src / "a.png").write_bytes(files["good"][1].read_bytes())
    r = run("encode-dataset", src, "--out", tmp_path / "ds", "--output-dtype", "float32", "--device", "cpu")
    assert r.returncode == 0, r.stderr
    (item,) = bivit.load_embeddings(tmp_path / "ds")
    assert item.dtype == "float32" and item.embedding.dtype == torch.float32
    assert torch.equal(item.embedding, bivit.load_encoder(output_dtype="float32").encode([src / "a.png"])[0])


def test_unavailable_device_is_one_line():
    r = run("serve", "--device", "cuda:99", "--port", "8123")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert [ln for ln in r.stderr.splitlines() if ln.startswith("bivit: error:")] == [
        ln for ln in r.stderr.splitlines() if "cuda:99" in ln]


def test_import_bivit_loads_neither_torch_nor_the_service_nor_the_writer():
    code = ("import sys, bivit; from bivit import open_dataset; "
            "print(sorted(m for m in ('torch', 'typer', 'fcntl', 'fastapi', 'bivit.dataset.writer') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr


def test_output_problems_are_found_before_encoding(files, tmp_path):
    from support.users import ordinary

    image = tmp_path / "a.png"
    image.write_bytes(files["good"][0].read_bytes())
    r = run("encode", image, "--out", image)
    assert "one of the inputs" in one_error_line(r) and image.read_bytes() == files["good"][0].read_bytes()
    assert "DEMO" not in r.stderr  # refused before the model was even loaded
    assert "a directory" in one_error_line(run("encode", image, "--out", tmp_path))
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    r = run("encode", image, "--out", locked / "e.safetensors", preexec_fn=ordinary)
    assert "Permission denied" in one_error_line(r) and "DEMO" not in r.stderr
    r = run("encode-dataset", image, "--out", locked / "ds", preexec_fn=ordinary)
    assert "Permission denied" in one_error_line(r)
    assert "a directory" in one_error_line(run("verify", "--plot", tmp_path))


def test_encode_dataset_of_a_missing_source_or_a_bad_option_creates_no_output_folder(files, tmp_path):
    r = run("encode-dataset", tmp_path / "missing_dir", "--out", tmp_path / "x")
    assert f"{tmp_path / 'missing_dir'}: no such file or directory" in one_error_line(r)
    assert not (tmp_path / "x").exists() and "DEMO" not in r.stderr
    for option, says in ((["--engine", "bogus"], "expected 'local' or 'ray'"),
                         (["--workers", "0"], "--workers 0: expected a whole number from 1 to 4096"),
                         (["--shard-mb", "0"],
                          "--shard-mb 0.0: expected a size in MiB from 9.5367431640625e-07 (1 byte)"),
                         (["--shard-mb", "nan"], "--shard-mb nan: expected")):
        r = run("encode-dataset", files["good"][0], "--out", tmp_path / "x", *option)
        assert says in one_error_line(r) and not (tmp_path / "x").exists(), option


def test_replacing_an_output_keeps_its_permissions(files, tmp_path):
    out = tmp_path / "e.safetensors"
    r = run("encode", files["good"][0], "--out", out, preexec_fn=lambda: os.umask(0o022))
    assert r.returncode == 0 and out.stat().st_mode & 0o777 == 0o644, r.stderr  # a new file: 0666 & ~umask
    out.chmod(0o640)
    r = run("encode", files["good"][1], "--out", out)
    assert r.returncode == 0 and out.stat().st_mode & 0o777 == 0o640
    with safe_open(str(out), "pt"):
        assert bivit.load_embeddings(out)[0].source == str(files["good"][1])
    assert [p.name for p in tmp_path.iterdir()] == ["e.safetensors"]  # no temp file left behind


def test_the_cli_starts_without_torch_numpy_pillow_or_pyav():
    """What `bivit --help` and every refused option pay: the command modules defer the library's heavy imports."""
    code = ("import sys, bivit.cli; "
            "print(sorted(m for m in ('torch', 'numpy', 'PIL', 'av', 'fastapi') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr


def test_import_client_loads_neither_torch_nor_pyav():
    code = ("import sys, bivit.serve.client; "
            "print(sorted(m for m in ('torch', 'av', 'numpy', 'PIL', 'httpx', 'bivit.media.video') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr


# Each command with what it needs besides --dtype, and a later option that is refused once --dtype is accepted.
_DTYPE_COMMANDS = {
    "encode": (["x.png"], ["--projector-dtype", "int8"]),
    "encode-dataset": (["x", "--out", "y"], ["--projector-dtype", "int8"]),
    "serve": (["--port", "0"], ["--projector-dtype", "int8"]),
    "verify": ([], ["--projector-dtype", "int8"]),
    "doctor": ([], ["--projector-dtype", "int8"]),
    "bench": ([], ["--repeats", "0"]),
}


def test_every_command_takes_the_same_dtype_spellings_with_the_same_refusal(tmp_path):
    import concurrent.futures

    def line(command, spelling, later):
        needs, refused_later = _DTYPE_COMMANDS[command]
        return one_error_line(run(command, *needs, "--dtype", spelling, *(refused_later if later else ()),
                                  cwd=tmp_path))

    # One accepted and one refused spelling per command (a process each); `bivit.base.dtypes` lists them all.
    jobs = [(c, s, later) for c in _DTYPE_COMMANDS for s, later in (("bf16", True), ("Int8", False))]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        lines = dict(zip(jobs, pool.map(lambda j: line(*j), jobs)))
    for (command, spelling, later), said in lines.items():
        if later:  # accepted: the command went on to the next option
            assert "--dtype" not in said and ("--projector-dtype" in said or "--repeats" in said), (command, said)
        else:
            assert said == f"bivit: error: --dtype {spelling!r}: expected bfloat16, float32 or float16", command
    # bench measures two of the three: float16 in any spelling is refused naming them, "both" is its own word.
    assert one_error_line(run("bench", "--dtype", "half")) == \
        "bivit: error: --dtype 'half': this command runs bfloat16 or float32, not float16"
    assert "--repeats 0" in one_error_line(run("bench", "--dtype", "both", "--repeats", "0"))
    # The benchmark scripts parse --dtype with the same rule: same spellings, same words.
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "invariance_cost.py"
    for spelling, says in (("half", "--dtype 'half': this command runs bfloat16 or float32, not float16"),
                            ("bf16", "argument --repeats: invalid int value: 'x'")):
        r = subprocess.run([sys.executable, str(script), "--dtype", spelling, "--repeats", "x"], capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].endswith(says), r.stderr
