"""bivit feeds a real vLLM (CPU) a tiny random Kimi-K2.5-architecture checkpoint that both load, in bfloat16
(what Kimi-K2.6 serves in) and in float32, one engine per dtype, the language model and bivit's rows in the
same dtype.

The engine serves every test of its dtype: `ec_role="ec_both"` on a shared folder (an item whose id has a file
there is loaded from it; any other item is encoded by vLLM's own tower and its rows saved there, which is how
the tests read vLLM's own rows), with prompt embeddings enabled. Each compared generation is one request alone
(vLLM 0.32's CPU attention gives a request other results when it shares a step with other requests: the
language model's batch behaviour is vLLM's matter, measured in `test_batched_requests_get_the_same_rows`).

What is proven, in both dtypes unless said:
1. bivit's rows vs vLLM's own vision tower on the same pixels (images of several sizes, a video's chunks): the
   same token counts, and within ROWS_RTOL of the item's largest value (float32: 1e-5; bfloat16: four bf16
   epsilons, two independent bf16 computations that each round at every layer); rows of another item are
   outside it (control).
2. vLLM's own rows given back as prompt embeddings reproduce its run bit for bit (the prompt-embeds path adds
   nothing); in float32, bivit's rows as prompt embeddings give the same greedy tokens as vLLM encoding the
   media itself, log-probs within LOGPROB_ATOL. In bfloat16 that is not a guarantee (the rows differ by
   rounding, which the language model may amplify into another token): measured and reported, not asserted.
3. bivit as encoder-cache producer, vLLM as consumer with the returned ids: the same tokens and log-probs bit
   for bit as bivit's rows as prompt embeddings, while a probe in vLLM's worker counts zero encoder runs (and
   counts them when vLLM does encode); the stand-in pictures vLLM is given are black, and a file with other
   rows changes the output, so the rows come from the files.
4. the same request batched with others gets exactly the file's rows into the language model.
"""

from __future__ import annotations

import json
import subprocess
import sys

import av
import numpy as np
import pytest
import torch
from PIL import Image

pytest.importorskip("vllm", reason="vLLM is not installed here; run scripts/vllm-env.sh test (its own venv)")

import vllm_hooks  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from engine_support import ASSISTANT, ROWS_RTOL, USER, cpu_kind, load_ec  # noqa: E402
from support import doc_code  # noqa: E402
from support.media import make_video, random_image  # noqa: E402

import bivit  # noqa: E402
from bivit.integrations import vllm as bv  # noqa: E402
from bivit.integrations.rows import Media, encode  # noqa: E402
from bivit.media.video import sample_frame_indices  # noqa: E402

LOGPROB_ATOL = 1e-4  # (2), float32: the rows differ by ~1e-6 relative; through two layers the log-probs move less
MAX_TOKENS = 8
IMAGE_SIZES = {"square": (112, 112), "wide": (140, 112), "odd": (203, 97), "tall": (60, 250)}


@pytest.fixture(scope="module")
def encoder(encoders, dtype):
    return encoders(dtype)


@pytest.fixture(scope="module")
def llm(llm):
    """conftest's engine with the probes (`vllm_hooks`) installed in its worker."""
    assert llm.apply_model(vllm_hooks.install) == [True]
    return llm


def probe(llm) -> dict:
    (seen,) = llm.apply_model(vllm_hooks.take)
    return seen


def greedy(llm, request) -> tuple[list[int], list[float]]:
    (out,) = llm.generate(request, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, logprobs=1), use_tqdm=False)
    o = out.outputs[0]
    return list(o.token_ids), [d[t].logprob for d, t in zip(o.logprobs, o.token_ids)]


# ------------------------------------------------------------------------------------------------ inputs

@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """name -> (what bivit encodes, what vLLM is given: its vision_chunk items with the same pixels)."""
    out = {}
    for seed, (name, (w, h)) in enumerate(IMAGE_SIZES.items()):
        img = Image.fromarray(random_image(h, w, seed), "RGB")
        out[name] = (img, [{"type": "image", "image": img, "uuid": None}])
    path = make_video(tmp_path_factory.mktemp("video") / "clip.mp4", frames=8, fps=2, size=(84, 56),
                      content=lambda i, size: random_image(size[1], size[0], 100 + i))
    frames = decoded_frames(path, sample_frame_indices(8, 2.0, 2.0))
    out["video"] = (path, [{"type": "video_chunk", "video_chunk": frames[i:i + 4], "uuid": None, "prompt": "",
                            "video_idx": 0} for i in range(0, len(frames), 4)])
    return out


def decoded_frames(path, indices) -> list[Image.Image]:
    with av.open(str(path)) as container:
        frames = [Image.fromarray(f.to_ndarray(format="rgb24"), "RGB") for f in container.decode(video=0)]
    return [frames[i] for i in indices]


PROMPTS = {  # name -> the inputs it shows, in order (one <|media_pad|> per image and per video chunk)
    "one image": ["square"],
    "two images": ["wide", "odd"],
    "image and video": ["tall", "video"],
}


@pytest.fixture(scope="module")
def media(encoder, inputs):
    names = list(inputs)
    return dict(zip(names, encode(encoder, [inputs[n][0] for n in names])))


@pytest.fixture(scope="module")
def target(encoder, tiny_kimi, dtype):
    t = bv.Target.from_checkpoint(tiny_kimi, dtype, fingerprint=encoder.fingerprint)
    assert t == bv.Target.from_encoder(encoder)
    return t


def text_of(names, media) -> str:
    return USER + "Look: " + bv.render([s for n in names for s in (media[n], " and ")]) + "what now?" + ASSISTANT


@pytest.fixture(scope="module")
def own(llm, inputs, media, ec_dir):
    """vLLM encoding the media itself, one request per prompt: name -> (tokens, logprobs, its rows per input).

    The raw items carry ids of our choosing that have no file yet, so the engine (a producer too) encodes them
    and saves its rows under those ids."""
    tok = llm.get_tokenizer()
    runs = {}
    for pname, names in PROMPTS.items():
        items, uuids = [], []
        for n in names:
            for c, item in enumerate(inputs[n][1]):
                items.append(item)
                uuids.append(f"vllm-own-{n}-{c}")
        ids = tok.encode(text_of(names, media), add_special_tokens=False)
        tokens, logprobs = greedy(llm, {"prompt_token_ids": ids, "multi_modal_data": {"vision_chunk": items},
                                        "multi_modal_uuids": {"vision_chunk": uuids}})
        seen = probe(llm)
        assert seen["encoded_items"] == len(items)  # the probe sees vLLM's encoder runs (control for (3))
        rows = {n: torch.cat([load_ec(ec_dir, f"vllm-own-{n}-{c}") for c in range(len(inputs[n][1]))])
                for n in names}
        runs[pname] = (tokens, logprobs, rows, ids)
    return runs


# ------------------------------------------------------------------------------------------------- tests

def test_bivit_does_not_import_vllm():
    """Here vLLM is installed, so this can fail: bivit's vLLM module builds plain dicts and tensors."""
    code = "import sys, bivit, bivit.integrations.vllm; print('vllm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out == "False\n"


def test_rows_match_vllms_own_vision_tower(own, media, inputs, tiny_kimi, dtype, encoders):
    """(1) The same pixels through bivit and through vLLM's Kimi-K2.5 tower + projector (its EC dump).

    Also reported, not asserted: whether bivit with stock PyTorch kernels (`batch_invariant=False`, the ops
    vLLM's tower calls too) gives vLLM's bits, and (bfloat16) how far each side's rows are from bivit's float32
    rows (which match vLLM's float32 tower to ~1e-6)."""
    def rel(a, b):
        return float((a.float() - b.float()).abs().max() / b.float().abs().max())

    stock = bivit.load_encoder(str(tiny_kimi), dtype=dtype, batch_invariant=False)
    exact = encoders("float32") if dtype != "float32" else None
    report, rows_seen = {}, {}
    for _, _, rows, _ in own.values():
        for name, theirs in rows.items():
            ours = media[name].embedding
            assert ours.shape == theirs.shape, name  # the same token count per image / chunk
            assert ours.dtype == theirs.dtype == getattr(torch, dtype)
            (plain,) = stock.encode([inputs[name][0]])
            report[name] = {"tokens": ours.shape[0], "max_rel": rel(ours, theirs),
                            "bit_equal": torch.equal(ours, theirs),
                            "stock_kernels_max_rel": rel(plain, theirs),
                            "stock_kernels_bit_equal": torch.equal(plain, theirs)}
            if exact is not None:
                (ref,) = exact.encode([inputs[name][0]])
                report[name].update(bivit_vs_float32=rel(ours, ref), vllm_vs_float32=rel(theirs, ref))
            assert rel(ours, theirs) <= ROWS_RTOL[dtype], (name, report[name])
            rows_seen[name] = theirs
    # Control: the tolerance tells items apart (vLLM's rows of the square image against bivit's of the others,
    # on their common rows).
    theirs = rows_seen["square"]
    for name in ("wide", "odd", "tall"):
        n = min(len(theirs), len(media[name].embedding))
        assert rel(media[name].embedding[:n], theirs[:n]) > ROWS_RTOL[dtype], name
    print(f"\n(1) bivit vs vLLM rows, {dtype}, {cpu_kind()} CPU:", json.dumps(report, indent=1))


def test_vllms_own_rows_as_prompt_embeds_reproduce_its_run(llm, own, media, target):
    """Control for (2): the prompt-embeds path is exact, so any difference in (2) comes from the rows."""
    for pname, (tokens, logprobs, rows, ids) in own.items():
        theirs = [Media(rows[n], media[n].placeholders, media[n].fingerprint, media[n].sha256, media[n].kind,
                           media[n].sizes, media[n].frames, n) for n in PROMPTS[pname]]
        prompt = bv.build_prompt(ids, theirs, target=target, tokenizer=llm.get_tokenizer())
        assert greedy(llm, prompt.embeds_prompt()) == (tokens, logprobs), pname
        assert probe(llm)["encoded_items"] == 0


def test_generation_with_bivit_rows_matches_vllm_encoding_itself(llm, own, media, target, dtype):
    """(2) bivit's rows as prompt embeddings vs vLLM's own encoder on the same media: asserted in float32,
    measured in bfloat16."""
    worst, same_tokens = {}, {}
    for pname, (tokens, logprobs, _, ids) in own.items():
        prompt = bv.build_prompt(ids, [media[n] for n in PROMPTS[pname]], target=target,
                                 tokenizer=llm.get_tokenizer())
        got_tokens, got_logprobs = greedy(llm, prompt.embeds_prompt())
        same_tokens[pname] = got_tokens == tokens
        n = min(len(got_tokens), len(tokens))
        worst[pname] = max(abs(a - b) for a, b in zip(got_logprobs[:n], logprobs[:n]))
        if dtype == "float32":
            assert got_tokens == tokens, pname
            assert worst[pname] <= LOGPROB_ATOL, (pname, worst[pname])
    print(f"\n(2) {dtype}: same greedy tokens {same_tokens}; max |logprob(bivit rows) - logprob(vLLM rows)| "
          f"{json.dumps(worst)}")
    if dtype != "float32":
        pytest.skip(f"not a {dtype} guarantee (rows equal up to rounding, which the language model may amplify "
                    f"into another token); measured: same tokens {same_tokens}, max |d logprob| {worst}")


def test_encoder_cache_consumer_never_runs_the_tower(llm, own, media, target, ec_dir, encoder):
    """(3) bivit writes the files; vLLM, given black stand-ins named by bivit's ids, loads bivit's rows."""
    tok = llm.get_tokenizer()
    for pname, (_, _, _, ids) in own.items():
        shown = [media[n] for n in PROMPTS[pname]]
        returned = bv.write_encoder_cache(ec_dir, shown, target=target)
        assert returned == [m.ec_ids() for m in shown]
        request = bv.ec_prompt(ids, shown, target=target, ec_dir=ec_dir, tokenizer=tok)
        assert request["multi_modal_uuids"]["vision_chunk"] == [i for r in returned for i in r]
        assert all(not np.asarray(item.get("image", item.get("video_chunk", [None])[0])).any()
                   for item in request["multi_modal_data"]["vision_chunk"])  # black: no pixels of the media
        consumed = greedy(llm, request)
        seen = probe(llm)
        assert seen["encoder_calls"] == 0 and seen["encoded_items"] == 0, pname  # the tower never ran
        as_embeds = greedy(llm, bv.build_prompt(ids, shown, target=target, tokenizer=tok).embeds_prompt())
        assert consumed == as_embeds, pname  # the same bits into the language model, the same bits out
    # The files are what is read: other rows under another id change the output.
    m = media["square"]
    other = Media(torch.zeros_like(m.embedding), m.placeholders, "zeroed-" + m.fingerprint, m.sha256, m.kind,
                     m.sizes, m.frames, "zeroed")
    bv.write_encoder_cache(ec_dir, [other])
    ids = own["one image"][3]
    changed = greedy(llm, bv.ec_prompt(ids, [other], target=bv.Target(target.hidden_size, target.dtype),
                                       ec_dir=ec_dir, tokenizer=tok))
    assert changed != greedy(llm, bv.ec_prompt(ids, [m], target=target, ec_dir=ec_dir, tokenizer=tok))
    assert probe(llm)["encoded_items"] == 0


def test_batched_requests_get_the_same_rows(llm, own, media, target, ec_dir, inputs):
    """(4) A request batched with others (other EC items, media vLLM encodes, plain text) gets the file's rows
    into the language model exactly; the check sees a change of one ulp (control)."""
    tok = llm.get_tokenizer()
    m = media["odd"]
    ids = tok.encode(text_of(["odd"], media), add_special_tokens=False)
    bv.write_encoder_cache(ec_dir, media.values(), target=target)
    file_rows = load_ec(ec_dir, m.ec_ids()[0])
    assert torch.equal(file_rows, m.embedding)
    probe(llm)
    greedy(llm, bv.ec_prompt(ids, [m], target=target, ec_dir=ec_dir, tokenizer=tok))
    alone = probe(llm)["rows_in"]
    assert len(alone) == 1 and torch.equal(alone[0], file_rows)

    nudged = m.embedding.clone()
    bits = nudged.view({torch.float32: torch.int32, torch.bfloat16: torch.int16}[nudged.dtype])
    bits[0, 0] += 1  # the next representable value (one ulp away)
    twin = Media(nudged, m.placeholders, "nudged-" + m.fingerprint, m.sha256, m.kind, m.sizes, m.frames, "nudged")
    bv.write_encoder_cache(ec_dir, [twin])
    others = [bv.ec_prompt(tok.encode(text_of(PROMPTS[p], media), add_special_tokens=False),
                           [media[n] for n in PROMPTS[p]], target=target, ec_dir=ec_dir, tokenizer=tok)
              for p in ("one image", "image and video")]
    raw = {"prompt_token_ids": tok.encode(text_of(["wide"], media), add_special_tokens=False),
           "multi_modal_data": {"vision_chunk": inputs["wide"][1]}}  # vLLM encodes this one itself
    batch = [others[0], raw, bv.ec_prompt(ids, [m], target=target, ec_dir=ec_dir, tokenizer=tok), others[1],
             {"prompt_token_ids": tok.encode(USER + "no media" + ASSISTANT, add_special_tokens=False)},
             bv.ec_prompt(ids, [twin], target=bv.Target(target.hidden_size, target.dtype), ec_dir=ec_dir,
                          tokenizer=tok)]
    llm.generate(batch, SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
    rows_in = probe(llm)["rows_in"]
    same = [r for r in rows_in if r.shape == file_rows.shape and torch.equal(r, file_rows)]
    near = [r for r in rows_in if r.shape == file_rows.shape and torch.equal(r, nudged)]
    assert len(same) == 1 and len(near) == 1  # exactly the file's bits; the nudged twin is told apart
    for n in ("square", "tall", "video"):  # every other EC item of the batch came in as its file holds it
        for rows in media[n].chunks():
            assert any(r.shape == rows.shape and torch.equal(r, rows) for r in rows_in), n


def test_guides_offline_code_runs_as_written(llm, tiny_kimi, ec_dir, dtype, tmp_path, monkeypatch):
    """docs/encode-once.md's offline blocks (prompt embeddings, then bivit's encoder-cache files consumed) as
    written, on the tiny checkpoint. The guide's `LLM(...)` calls are answered by this module's engine (the
    same model and dtype, a superset of the options) rather than by two more engines."""
    if dtype != "bfloat16":
        pytest.skip("the guide's examples run in bfloat16")
    monkeypatch.chdir(tmp_path)
    doc_code.write_inputs(tmp_path)

    def engine(model, dtype, **options):
        assert (model, dtype) == (str(tiny_kimi), "bfloat16")
        assert set(options) <= {"enable_prompt_embeds", "ec_transfer_config"}
        if "ec_transfer_config" in options:
            ec = options["ec_transfer_config"]
            assert (ec.ec_connector, ec.ec_role) == ("ECExampleConnector", "ec_consumer")
            assert ec.ec_connector_extra_config["shared_storage_path"] == str(ec_dir)
        return llm

    ns = doc_code.run(["encode"], {}, ckpt=tiny_kimi)
    probe(llm)
    doc_code.run(["offline"], ns, engine=engine)
    assert ns["out"][0].outputs[0].token_ids and probe(llm)["encoded_items"] == 0
    doc_code.run(["ec-write", "ec-offline"], ns, engine=engine, ec_dir=ec_dir)
    assert ns["out"][0].outputs[0].token_ids
    seen = probe(llm)
    assert seen["encoded_items"] == 0  # the guide's consumer request never ran the tower ...
    assert len(seen["rows_in"]) == 1 and torch.equal(seen["rows_in"][0], ns["media"][0].embedding)  # ... bivit's rows
