"""Hub repo ids resolved from a real Hugging Face cache layout on disk, offline (no network in tests)."""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import bivit
from bivit.checkpoint.hub import parse_repo_ref
from bivit.checkpoint.state_dict import INDEX
from support.checkpoints import KIMI_SMALL, write_checkpoint

hub_constants = pytest.importorskip("huggingface_hub.constants")

REPO = "moonshotai/Kimi-K2.6"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def build_cache(cache: Path, files: dict[str, bytes], repo: str = REPO, commit: str = COMMIT,
                refs: tuple[str, ...] = ("main",)) -> Path:
    """The on-disk layout huggingface_hub writes: blobs by hash, snapshot symlinks, refs naming the commit."""
    root = cache / ("models--" + repo.replace("/", "--"))
    snapshot = root / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (root / "blobs").mkdir()
    for name, data in files.items():
        blob = root / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / name).symlink_to(os.path.relpath(blob, snapshot))
    (root / "refs").mkdir()
    for ref in refs:
        (root / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """A K2-shaped checkpoint in 5 shards: 3 language-model stand-ins first, the vision tensors in the last 2."""
    d = write_checkpoint(tmp_path_factory.mktemp("sharded"), KIMI_SMALL, shards=2, lm_shards=3)
    index = json.loads((d / INDEX).read_text())
    vision = sorted({f for k, f in index["weight_map"].items() if k.startswith(("vision_tower.", "mm_projector."))})
    lm = sorted(set(index["weight_map"].values()) - set(vision))
    assert len(vision) == 2 and len(lm) == 3
    return d, vision, lm


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(cache))
    return cache


PREPROCESSOR = json.dumps({"media_proc_cfg": {"in_patch_limit": 16384, "in_patch_limit_each_frame": 4096}}).encode()


def _files(d: Path, names) -> dict[str, bytes]:
    """The named files of checkpoint `d`, plus a preprocessor_config.json as every Kimi repo has."""
    files = {n: (d / n).read_bytes() for n in names if n != "preprocessor_config.json"}
    if "preprocessor_config.json" in names:
        files["preprocessor_config.json"] = PREPROCESSOR
    return files


def test_repo_id_resolves_offline_with_only_the_vision_shards(sharded, offline_cache):
    d, vision, lm = sharded
    build_cache(offline_cache, _files(d, ["config.json", "preprocessor_config.json", INDEX, *vision]))  # no LM shard at all
    enc = bivit.load_encoder(REPO, dtype="float32")
    local = bivit.load_encoder(d, dtype="float32")
    assert enc.fingerprint == local.fingerprint
    assert enc.model_name == REPO
    img = np.random.default_rng(0).integers(0, 256, (70, 90, 3), np.uint8)
    assert torch.equal(enc.encode([img])[0], local.encode([img])[0])


def test_language_model_shards_in_the_cache_are_never_opened(sharded, offline_cache):
    d, vision, lm = sharded
    files = _files(d, ["config.json", "preprocessor_config.json", INDEX, *vision])
    files.update({name: b"not a safetensors file" for name in lm})  # would fail loudly if opened
    build_cache(offline_cache, files)
    bivit.load_encoder(REPO, dtype="float32")


def test_revision_by_branch_commit_and_option(sharded, offline_cache):
    d, vision, _ = sharded
    build_cache(offline_cache, _files(d, ["config.json", "preprocessor_config.json", INDEX, *vision]), refs=("main", "v1"))
    base = bivit.load_encoder(REPO, dtype="float32").fingerprint
    assert bivit.load_encoder(f"{REPO}@v1", dtype="float32").fingerprint == base
    assert bivit.load_encoder(f"{REPO}@{COMMIT}", dtype="float32").fingerprint == base
    enc = bivit.load_encoder(REPO, dtype="float32", revision="v1")
    assert enc.fingerprint == base and enc.model_name == f"{REPO}@v1"
    with pytest.raises(bivit.CheckpointError, match="hf download .*--revision v2"):
        bivit.load_encoder(f"{REPO}@v2")
    with pytest.raises(bivit.ConfigError, match="revision"):
        bivit.load_encoder(f"{REPO}@v1", revision="v2")


def test_preprocessor_config_from_the_cache_applies(sharded, offline_cache):
    d, vision, _ = sharded
    files = _files(d, ["config.json", "preprocessor_config.json", INDEX, *vision])
    media = {"in_patch_limit": 64, "patch_size": 14, "merge_kernel_size": 2, "patch_limit_on_one_side": 512}
    files["preprocessor_config.json"] = json.dumps({"media_proc_cfg": media}).encode()
    build_cache(offline_cache, files)
    enc = bivit.load_encoder(REPO, dtype="float32")
    assert enc.processing.in_patch_limit == 64
    assert enc.image_token_count(1000, 1000) == bivit.image_token_count(1000, 1000, 64)


@pytest.mark.parametrize("drop", ["config.json", "preprocessor_config.json", INDEX, "vision"])
def test_missing_file_says_what_to_download(sharded, offline_cache, drop):
    d, vision, _ = sharded
    names = ["config.json", "preprocessor_config.json", INDEX, *vision]
    names = [n for n in names if n != drop and not (drop == "vision" and n == vision[-1])]
    build_cache(offline_cache, _files(d, names))
    with pytest.raises(bivit.CheckpointError) as info:
        bivit.load_encoder(REPO)
    msg = str(info.value)
    want = vision[-1] if drop == "vision" else drop
    assert f"hf download {REPO} " in msg and want in msg and "cache" in msg
    if drop == "vision":
        assert vision[0] not in msg.split("hf download")[1]  # only what is missing


def test_a_repo_known_to_have_no_preprocessor_config_gets_the_published_defaults(sharded, offline_cache):
    d, vision, _ = sharded
    snapshot = build_cache(offline_cache, _files(d, ["config.json", INDEX, *vision]))
    no_exist = snapshot.parents[1] / ".no_exist" / COMMIT  # what huggingface_hub records after a 404
    no_exist.mkdir(parents=True)
    (no_exist / "preprocessor_config.json").touch()
    assert bivit.load_encoder(REPO, dtype="float32").processing == bivit.load_encoder(d).processing


def test_uncached_repo_offline_lists_config_and_index(offline_cache):
    with pytest.raises(bivit.CheckpointError, match=r"config\.json.*model\.safetensors\.index\.json"):
        bivit.load_encoder("someorg/not-cached")


def test_cli_encode_with_a_repo_id_and_hf_hub_offline(sharded, tmp_path):
    d, vision, _ = sharded
    cache = tmp_path / "hub"
    build_cache(cache, _files(d, ["config.json", "preprocessor_config.json", INDEX, *vision]))
    img = tmp_path / "a.png"
    from PIL import Image
    Image.fromarray(np.random.default_rng(1).integers(0, 256, (60, 80, 3), np.uint8)).save(img)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache),
           "PYTHONPATH": os.pathsep.join([str(Path(bivit.__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    out = tmp_path / "e.safetensors"
    r = subprocess.run([sys.executable, "-m", "bivit.cli", "encode", str(img), "--model", REPO, "--dtype", "float32",
                        "--out", str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    from safetensors.torch import load_file
    want = bivit.load_encoder(d, dtype="float32").encode([img])[0]
    assert torch.equal(next(iter(load_file(str(out)).values())), want)


def test_parse_repo_ref(tmp_path):
    assert parse_repo_ref("moonshotai/Kimi-K2.6") == ("moonshotai/Kimi-K2.6", None)
    assert parse_repo_ref("moonshotai/Kimi-K2.6@abc") == ("moonshotai/Kimi-K2.6", "abc")
    assert parse_repo_ref("moonshotai/Kimi-K2.6", "r") == ("moonshotai/Kimi-K2.6", "r")
    assert parse_repo_ref(str(tmp_path)) is None  # an existing directory is a path
    assert parse_repo_ref("/abs/path") is None and parse_repo_ref("a/b/c") is None and parse_repo_ref("x") is None


# ------------------------------------------------------------------------------------------ unreachable hub
# Never the real network: HF_ENDPOINT points at a loopback port that refuses connections, or at a loopback socket
# that accepts and never answers.


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when the block ends: connections are refused


def test_refused_hub_is_one_error_naming_it_the_reason_and_the_fix(tmp_path):
    """A hub that refuses connections is reported from one attempt (huggingface_hub alone retries each file with
    backoff), naming the endpoint, why, and what to do."""
    endpoint = f"http://127.0.0.1:{_closed_port()}"
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    env.update(HF_ENDPOINT=endpoint, HF_HUB_CACHE=str(tmp_path / "hub"), HF_HOME=str(tmp_path / "home"),
               PYTHONPATH=os.pathsep.join([str(Path(bivit.__file__).parents[1]), os.environ.get("PYTHONPATH", "")]))
    img = tmp_path / "a.png"
    from PIL import Image
    Image.fromarray(np.zeros((28, 28, 3), np.uint8)).save(img)
    r = subprocess.run([sys.executable, "-m", "bivit.cli", "encode", str(img), "--model", "someorg/somemodel"],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("bivit: error: ")]
    assert len(errors) == 1 and "Retrying" not in r.stderr, r.stderr
    msg = errors[0]
    assert f"the Hugging Face hub at {endpoint} does not answer" in msg and "refused" in msg
    assert "HF_ENDPOINT" in msg and "hf download someorg/somemodel config.json" in msg


def test_silent_hub_times_out_then_the_cache_serves(sharded, tmp_path, monkeypatch, caplog):
    """A hub that accepts connections and never answers costs one read timeout; the files then come from the
    local cache (with one warning), and a file the cache lacks is an error naming the timeout."""
    import logging
    import socket

    from bivit.checkpoint import hub

    d, vision, _ = sharded
    cache = tmp_path / "hub"
    build_cache(cache, _files(d, ["config.json", "preprocessor_config.json", INDEX, *vision]))
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)  # the kernel completes the handshake; nobody ever reads or answers
        monkeypatch.setattr(hub_constants, "ENDPOINT", f"http://127.0.0.1:{silent.getsockname()[1]}")
        monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(cache))
        monkeypatch.setattr(hub, "TIMEOUT_S", 1.0)
        with caplog.at_level(logging.WARNING, logger="bivit"):
            enc = bivit.load_encoder(REPO, dtype="float32")
        assert enc.fingerprint == bivit.load_encoder(d, dtype="float32").fingerprint
        assert "does not answer (connected, but no answer within 1 s)" in caplog.text and "local cache" in caplog.text
        with pytest.raises(bivit.CheckpointError, match=r"no answer within 1 s.*hf download someorg/other"):
            bivit.load_encoder("someorg/other")
