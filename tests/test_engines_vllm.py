"""bivit.integrations.vllm without vLLM: the inputs it builds, the encoder-cache files it writes, the errors it raises.

What vLLM does with them is proven in tests/vllm_engine (a real vLLM, in the environment scripts/vllm-env.sh
builds); here, that each input is exactly the rows bivit produced, placed where the prompt says, under ids that
pin the encoder and the content, and that every mismatch is refused with a bivit error.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

import bivit
from bivit.core.encoder_cache import EC_FILE, EC_KEY, ec_id
from bivit.core.items import content_sha256
from bivit.errors import BivitError, ConfigError
from bivit.integrations import vllm as bv
from bivit.integrations.rows import Media, encode, load_media
from bivit.serve.client import Client
from support.media import make_video, png_bytes
from support.server import ServerProcess
from vllm_engine.tiny_kimi import write_tokenizer

PAD = 999


@pytest.fixture(scope="module")
def enc():
    return bivit.load_encoder(None, dtype="float32")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("media")
    (d / "a.png").write_bytes(png_bytes(70, 42, 1))
    (d / "b.png").write_bytes(png_bytes(30, 90, 2))
    make_video(d / "c.mp4", frames=8, fps=2, size=(56, 42))
    return d


@pytest.fixture(scope="module")
def media(enc, files):
    return encode(enc, [files / "a.png", files / "b.png", files / "c.mp4"])


@pytest.fixture(scope="module")
def target(enc):
    return bv.Target.from_encoder(enc)


def test_encode_gives_the_encoders_bits_placeholders_and_content_hashes(enc, files, media):
    a, b, c = media
    want = enc.encode([files / "a.png", files / "b.png", files / "c.mp4"])
    for m, w in zip(media, want):
        assert torch.equal(m.embedding, w)
        assert m.fingerprint == enc.fingerprint
    assert [m.kind for m in media] == ["image", "image", "video"]
    assert a.sha256 == hashlib.sha256((files / "a.png").read_bytes()).hexdigest()
    assert c.sha256 == hashlib.sha256((files / "c.mp4").read_bytes()).hexdigest()
    assert a.placeholders == tuple(enc.placeholders([files / "a.png"])[0])
    assert c.placeholders == tuple(enc.placeholders([files / "c.mp4"])[0]) and len(c.placeholders) == 2
    assert a.sizes == ((70, 42),) and c.frames == (4, 4) and c.sizes == ((56, 42), (56, 42))
    assert [x.shape[0] for x in c.chunks()] == [p.tokens for p in c.placeholders]


def test_in_memory_images_hash_their_pixels(enc):
    arr = np.random.default_rng(0).integers(0, 256, (20, 30, 3), dtype=np.uint8)
    same = content_sha256(Image.fromarray(arr))
    assert same == content_sha256(Image.fromarray(arr.copy()))
    arr[0, 0, 0] ^= 1
    assert content_sha256(Image.fromarray(arr)) != same
    with pytest.raises(BivitError, match="cannot hash"):
        content_sha256(3.5)


def test_ec_ids_pin_encoder_content_kind_and_chunk(media):
    a, _, c = media
    ids = c.ec_ids()
    assert len(ids) == 2 and len(set(ids)) == 2
    assert ids == c.ec_ids()  # deterministic
    base = (a.fingerprint, a.sha256, "image", 0)
    assert a.ec_ids() == [ec_id(*base)]
    for i in range(4):  # any component changed -> another id
        changed = list(base)
        changed[i] = changed[i] + 1 if i == 3 else changed[i][:-1] + ("0" if changed[i][-1] != "0" else "1")
        assert ec_id(*changed) != ec_id(*base)
    assert all(i.replace("-", "").isalnum() for i in ids)  # a folder name anywhere


def test_media_refuses_rows_its_placeholders_do_not_announce(media):
    a = media[0]
    with pytest.raises(BivitError, match="announce"):
        Media(a.embedding[:-1], a.placeholders, a.fingerprint, a.sha256)


def test_target_refuses_another_encoder_width_or_dtype(media, target, enc, kimi_hf_ckpt):
    a = media[0]
    target.check(a)
    with pytest.raises(BivitError, match="fingerprint"):
        bv.Target(target.hidden_size, target.dtype, "0" * 64).check(a)
    with pytest.raises(ConfigError, match="hidden size is 64"):
        bv.Target(64, target.dtype).check(a)
    with pytest.raises(ConfigError, match="bfloat16"):
        bv.Target(target.hidden_size, torch.bfloat16).check(a)
    t = bv.Target.from_checkpoint(kimi_hf_ckpt, "bf16")
    assert (t.hidden_size, t.dtype, t.fingerprint) == (512, torch.bfloat16, None)


def test_target_for_any_encoder_the_demo_included(media):
    """The demo model has no checkpoint folder: its Target comes from the encoder (the demo's projector writes
    128-wide rows, float32 here); a language-model dtype other than the encoder's output is refused at once."""
    demo = bivit.load_encoder(None, dtype="float32")
    t = bv.Target.from_encoder(demo)
    assert (t.hidden_size, t.dtype, t.fingerprint) == (128, torch.float32, demo.fingerprint)
    assert bv.Target.from_encoder(demo, "fp32") == t
    t.check(media[0])  # rows of an encoder of the same weights and dtypes pass
    with pytest.raises(ConfigError, match="output_dtype=bfloat16"):
        bv.Target.from_encoder(demo, "bfloat16")
    with pytest.raises(ConfigError, match=r"demo: .*Target\.from_encoder"):
        bv.Target.from_checkpoint("demo")


def test_target_from_checkpoint_needs_the_language_model_width(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {}}))
    with pytest.raises(ConfigError, match="text_config.hidden_size"):
        bv.Target.from_checkpoint(tmp_path)


def test_build_prompt_places_each_placeholders_rows(media, target):
    a, b, c = media
    ids = [1, 2, PAD, 3, PAD, 4, PAD, PAD, 5]  # a, b, then the video's two chunks
    p = bv.build_prompt(ids, [a, b, c], target=target, media_pad_id=PAD)
    chunks = a.chunks() + b.chunks() + c.chunks()
    assert [n for _, n in p.spans] == [x.shape[0] for x in chunks]
    assert len(p.prompt_token_ids) == len(ids) - 4 + sum(n for _, n in p.spans) == len(p.prompt_is_token_ids)
    text = [t for t, keep in zip(p.prompt_token_ids, p.prompt_is_token_ids) if keep]
    assert text == [1, 2, 3, 4, 5]
    for (s, n), rows in zip(p.spans, chunks):
        assert torch.equal(p.prompt_embeds[s:s + n], rows)  # the bits, uncast
        assert p.prompt_token_ids[s:s + n] == [PAD] * n and not any(p.prompt_is_token_ids[s:s + n])
    assert not p.prompt_embeds[torch.tensor(p.prompt_is_token_ids)].any()
    assert torch.equal(p.rows(), torch.cat(chunks))
    e = p.embeds_prompt()
    assert set(e) == {"prompt_embeds", "prompt_token_ids", "prompt_is_token_ids"}


def test_build_prompt_refuses_a_placeholder_count_that_does_not_match(media, target):
    a, _, c = media
    with pytest.raises(BivitError, match=r"1 <\|media_pad\|> .* 3 placeholder"):
        bv.build_prompt([PAD], [a, c], target=target, media_pad_id=PAD)
    other = Media(a.embedding, a.placeholders, "f" * 64, a.sha256)
    with pytest.raises(BivitError, match="mixes rows of 2 encoders"):
        bv.build_prompt([PAD, PAD], [a, other], target=bv.Target(target.hidden_size, target.dtype),
                        media_pad_id=PAD)
    with pytest.raises(BivitError, match="tokenizer"):
        bv.build_prompt("text", [a], target=target)


def test_build_prompt_from_text_with_a_kimi_tokenizer(media, target, tmp_path):
    from transformers import PreTrainedTokenizerFast  # optional (the rl extra); only this test needs it

    write_tokenizer(tmp_path)
    tok = PreTrainedTokenizerFast.from_pretrained(str(tmp_path))
    a, _, c = media
    text = bv.render(["<|im_user|>user<|im_middle|>see ", a, " and ", c, "<|im_end|>"])
    assert text.count("<|media_pad|>") == 3 and "video<|media_content|>" in text
    p = bv.build_prompt(text, [a, c], target=target, tokenizer=tok)
    pad = bv.media_pad_id(tok)
    assert pad == tok.convert_tokens_to_ids("<|media_pad|>")
    assert sum(1 for t in p.prompt_token_ids if t == pad) == a.embedding.shape[0] + c.embedding.shape[0]
    # The tokens around the rows are the tokenizer's tokens of the text.
    assert [t for t, k in zip(p.prompt_token_ids, p.prompt_is_token_ids) if k] == \
        [t for t in tok.encode(text, add_special_tokens=False) if t != pad]


def test_scatter_gives_a_trainer_what_vllm_sees(media, target):
    a = media[0]
    p = bv.build_prompt([7, PAD, 8], [a], target=target, media_pad_id=PAD)
    embed = torch.nn.Embedding(1000, target.hidden_size)
    with torch.no_grad():
        x = embed(torch.tensor(p.prompt_token_ids))
        out = p.scatter(x[None])[0]
    (s, n), = p.spans
    assert torch.equal(out[s:s + n], a.embedding)
    assert torch.equal(out[:s], x[:s]) and torch.equal(out[s + n:], x[s + n:])
    with pytest.raises(BivitError, match="inputs_embeds must be"):
        p.scatter(x[:-1])


def test_chat_content_carries_the_rows_in_place_of_each_pad(media, target):
    a, _, c = media
    parts = bv.chat_content(["<|im_user|>user<|im_middle|>look ", a, " then ", c, "<|im_end|>"], target=target)
    kinds = [p["type"] for p in parts]
    assert kinds == ["text", "prompt_embeds", "text", "prompt_embeds", "text", "prompt_embeds", "text"]
    assert parts[0]["text"].endswith("<|media_begin|>image<|media_content|>")
    assert parts[2]["text"].startswith("<|media_end|> then ")
    rows = [torch.load(io.BytesIO(base64.b64decode(p["data"])), weights_only=True)
            for p in parts if p["type"] == "prompt_embeds"]
    for got, want in zip(rows, a.chunks() + c.chunks()):
        assert torch.equal(got, want)
    # The text parts and pads put back together are the prompt build_prompt expands.
    joined = "".join(p["text"] if p["type"] == "text" else "<|media_pad|>" for p in parts)
    assert joined == bv.render(["<|im_user|>user<|im_middle|>look ", a, " then ", c, "<|im_end|>"])


def test_encoder_cache_files_are_the_connectors_layout(media, target, tmp_path):
    ids = bv.write_encoder_cache(tmp_path, media, target=target)
    assert ids == [m.ec_ids() for m in media]
    for m, item_ids in zip(media, ids):
        for i, rows in zip(item_ids, m.chunks()):
            stored = load_file(str(tmp_path / i / "encoder_cache.safetensors"))
            assert list(stored) == ["ec_cache"] and torch.equal(stored["ec_cache"], rows)
            assert stored["ec_cache"].is_contiguous()
    bv.check_encoder_cache(tmp_path, media, target)
    # Present ids are left alone (a consumer may be reading them).
    first = tmp_path / ids[0][0] / "encoder_cache.safetensors"
    inode = first.stat().st_ino
    bv.write_encoder_cache(tmp_path, media, target=target)
    assert first.stat().st_ino == inode
    assert not [p for p in tmp_path.rglob(".tmp-*")]


def test_concurrent_producers_leave_whole_files(media, target, tmp_path):
    errors = []

    def produce():
        try:
            bv.write_encoder_cache(tmp_path, media, target=target)
        except Exception as e:  # noqa: BLE001 - collected and asserted below
            errors.append(e)

    threads = [threading.Thread(target=produce) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    bv.check_encoder_cache(tmp_path, media, target)
    for m in media:
        for i, rows in zip(m.ec_ids(), m.chunks()):
            assert torch.equal(load_file(str(tmp_path / i / "encoder_cache.safetensors"))["ec_cache"], rows)
    assert not [p for p in tmp_path.rglob(".tmp-*")]


def test_a_consumer_request_refuses_missing_or_foreign_files(media, target, tmp_path):
    a, b, c = media
    with pytest.raises(BivitError, match="missing encoder-cache file"):
        bv.ec_prompt([PAD], [a], target=target, ec_dir=tmp_path, media_pad_id=PAD)
    bv.write_encoder_cache(tmp_path, [a, c], target=target)
    req = bv.ec_prompt([1, PAD, 2, PAD, PAD], [a, c], target=target, ec_dir=tmp_path, media_pad_id=PAD)
    assert req["prompt_token_ids"] == [1, PAD, 2, PAD, PAD]  # vLLM expands the pads itself
    assert req["multi_modal_uuids"] == {"vision_chunk": a.ec_ids() + c.ec_ids()}
    items = req["multi_modal_data"]["vision_chunk"]
    assert items[0]["type"] == "image" and items[0]["image"].size == (70, 42)
    assert [i["type"] for i in items[1:]] == ["video_chunk"] * 2 and len(items[1]["video_chunk"]) == 4
    assert not np.asarray(items[0]["image"]).any()
    # Rows of another width (or dtype) under the right id are refused, not fed.
    path = tmp_path / b.ec_ids()[0] / "encoder_cache.safetensors"
    path.parent.mkdir()
    save_file({"ec_cache": torch.zeros(b.embedding.shape[0], 7)}, str(path))
    with pytest.raises(BivitError, match=r"holds F32 \[\d+, 7\]"):
        bv.ec_prompt([PAD], [b], target=target, ec_dir=tmp_path, media_pad_id=PAD)
    with pytest.raises(BivitError, match="server splits videos"):
        bv.ec_chat_content(["x", c], target=target, ec_dir=tmp_path)
    (part,) = [p for p in bv.ec_chat_content(["x", a], target=target, ec_dir=tmp_path) if p["type"] != "text"]
    assert part["uuid"] == a.ec_ids()[0] and part["image_url"]["url"].startswith("data:image/png;base64,")


# ----------------------------------------------------------------- front ends: one id per item, everywhere

def cli(*args):
    return subprocess.run([sys.executable, "-m", "bivit.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=600)


def test_encode_command_writes_the_encoder_cache_under_the_apis_ids(files, media, tmp_path):
    inputs = [files / "a.png", files / "b.png", files / "c.mp4"]
    out, ec = tmp_path / "e.safetensors", tmp_path / "ec"
    r = cli("encode", *inputs, "--out", out, "--dtype", "float32", "--ec-dir", ec)
    assert r.returncode == 0, r.stderr
    assert "encoder cache: 4 items" in r.stdout
    loaded = load_media(out)
    for got, want in zip(loaded, media):  # the file gives back what the API encodes, ids and all
        assert torch.equal(got.embedding, want.embedding) and got.placeholders == want.placeholders
        assert got.ec_ids() == want.ec_ids() and got.sizes == want.sizes and got.kind == want.kind
        for i, rows in zip(got.ec_ids(), want.chunks()):
            assert torch.equal(load_file(str(ec / i / "encoder_cache.safetensors"))["ec_cache"], rows)
    with bivit.load_embeddings(out) as records:  # the ids are in the file's records too
        assert [r.ec_ids for r in records] == [m.ec_ids() for m in media]


def test_encode_dataset_command_writes_the_encoder_cache_under_the_same_ids(files, media, tmp_path):
    out, ec = tmp_path / "ds", tmp_path / "ec"
    r = cli("encode-dataset", files, "--out", out, "--dtype", "float32", "--ec-dir", ec, "--no-progress")
    assert r.returncode == 0, r.stderr
    by_name = {Path(m.source).name: m for m in load_media(out)}
    assert len(by_name) == 3
    for want in media:
        got = by_name[Path(want.source).name]
        assert torch.equal(got.embedding, want.embedding) and got.placeholders == want.placeholders
        assert got.ec_ids() == want.ec_ids() and got.sizes == want.sizes  # the dataset job and the API alike
        for i in got.ec_ids():
            assert (ec / i / "encoder_cache.safetensors").is_file()


def test_service_writes_the_encoder_cache_and_answers_the_ids(files, media, tmp_path):
    pytest.importorskip("fastapi")

    ec = tmp_path / "ec"
    with ServerProcess(["--dtype", "float32", "--ec-dir", str(ec)], tmp_path) as srv, Client(srv.url) as c:
        results = c.encode_results([files / "a.png", files / "c.mp4"])
    for r, want in zip(results, (media[0], media[2])):
        assert r.error is None and r.ec_ids == want.ec_ids()
        for i, rows in zip(r.ec_ids, want.chunks()):
            assert torch.equal(load_file(str(ec / i / "encoder_cache.safetensors"))["ec_cache"], rows)


def test_an_unwritable_ec_dir_is_one_line_before_any_work(files, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    r = cli("encode", files / "a.png", "--out", tmp_path / "o.safetensors", "--ec-dir", blocker)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert [ln for ln in r.stderr.splitlines() if ln.startswith("bivit: error: --ec-dir")], r.stderr
    assert not (tmp_path / "o.safetensors").exists()


def test_encoder_cache_writes_replace_what_is_not_theirs(media, tmp_path):
    """An id already holding a readable file of the right rows is left as it is; anything else there is replaced,
    never reported written as it was and never written through: an empty (planted) file, a foreign tensor, a
    link at the file, a link at the id folder pointing outside the cache."""
    ec, outside = tmp_path / "ec", tmp_path / "outside"
    outside.mkdir()
    (i, *_) = media[0].ec_ids()
    bv.write_encoder_cache(ec, media[:1])
    path = ec / i / EC_FILE
    kept = path.stat().st_mtime_ns
    bv.write_encoder_cache(ec, media[:1])
    assert path.stat().st_mtime_ns == kept  # the right rows: left as they are
    rows = media[0].chunks()[0]
    planted = {"empty": lambda: path.write_bytes(b""),
               "foreign": lambda: save_file({EC_KEY: torch.zeros(3, 3)}, str(path)),
               "file link": lambda: (path.unlink(), os.symlink(outside / "x.safetensors", path)),
               "folder link": lambda: (__import__("shutil").rmtree(ec / i), os.symlink(outside, ec / i))}
    for name, plant in planted.items():
        plant()
        bv.write_encoder_cache(ec, media[:1])
        assert not (ec / i).is_symlink() and not path.is_symlink(), name
        assert torch.equal(load_file(str(path))[EC_KEY], rows), name
        assert list(outside.iterdir()) == [], name


def test_encode_writes_out_before_the_encoder_cache(enc, files, tmp_path):
    """A failing `--ec-dir` (here: an id's folder taken by a file) fails `bivit encode` in one line, after --out
    was written with every embedding: nothing encoded is lost, and the record says why it has no ids."""
    image = files / "a.png"
    (i,) = encode(enc, [image])[0].ec_ids()
    ec, out = tmp_path / "ec", tmp_path / "out.safetensors"
    ec.mkdir()
    (ec / i).write_text("in the way")
    done = subprocess.run([sys.executable, "-m", "bivit", "encode", str(image), "--out", str(out), "--ec-dir",
                           str(ec), "--dtype", "float32"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 1
    errors = [line for line in done.stderr.splitlines() if line.startswith("bivit: error:")]
    assert len(errors) == 1 and "--ec-dir" in errors[0] and str(out) in errors[0], done.stderr
    (r,) = bivit.load_embeddings(out)
    assert torch.equal(r.embedding, enc.encode([image])[0]) and "cannot write the encoder cache" in r.ec_error
    assert "ec_ids" not in r.extra
