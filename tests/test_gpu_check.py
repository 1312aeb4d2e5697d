"""scripts/gpu-check.sh --dry-run: the whole GPU check on the CPU (Triton's interpreter, toy model), as CI runs it
on every run, so every section's code runs before the one GPU run it is written for (docs/gpu.md).

Run as the GPU machine would: PyAV is made unimportable (that machine has none), results go to $OUT. A section
made to fail (`--fail model`) is recorded in its JSON and the summary while every other section still runs and
writes its JSON.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install 'bivit[gpu]')")

ROOT = Path(__file__).resolve().parents[1]
SECTIONS = ["preflight", "correctness", "invariance", "ops", "model", "cross_device"]


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-check")
    no_av = tmp_path_factory.mktemp("no-av")  # the GPU machine has no PyAV: importing it fails here too
    (no_av / "av").mkdir()
    (no_av / "av" / "__init__.py").write_text("raise ImportError('no PyAV on the GPU machine')\n")
    env = dict(os.environ, OUT=str(out), PYTHON=sys.executable, PYTHONPATH=str(no_av),
               TRITON_CACHE_DIR=str(out.parent / "triton-cache"))
    run = subprocess.run(["bash", "scripts/gpu-check.sh", "--dry-run", "--fail", "model"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    return run, out


def test_every_section_writes_its_json_under_out_and_the_failing_one_is_recorded(dry_run):
    run, out = dry_run
    assert sorted(p.name for p in out.iterdir()) == sorted([f"{s}.json" for s in SECTIONS] + ["summary.txt"])
    results = {s: json.loads((out / f"{s}.json").read_text()) for s in SECTIONS}
    assert results["model"]["error"] == "RuntimeError: injected failure (--fail model)"
    assert [s for s in SECTIONS if "error" in results[s]] == ["model"], run.stdout[-3000:]
    assert run.returncode == 1  # a failed section fails the run
    summary = (out / "summary.txt").read_text()
    assert "model        ERROR RuntimeError: injected failure" in summary and summary in run.stdout
    assert len(summary.splitlines()) <= 40  # one screen


def test_dry_run_sections_report_what_they_measured(dry_run):
    _, out = dry_run
    r = {s: json.loads((out / f"{s}.json").read_text()) for s in SECTIONS}
    assert r["preflight"]["ok"] and any("smoke" in n["need"] for n in r["preflight"]["needs"])
    assert r["correctness"]["ok"] and r["correctness"]["float32"]["worst_rel"] <= r["correctness"]["tolerance"]["float32"]
    inv = r["invariance"]["invariant"]
    assert inv["ok"] and inv["packed_equal"] == inv["large_batch_equal"] == len(r["invariance"]["items"])
    assert len(set(inv["batch_sizes"])) == 2 and any(i.endswith("x2") for i in r["invariance"]["items"])  # video
    assert set(r["ops"]["gemm"]) >= {"qkv", "fc1", "fc2", "patch_conv"} and r["ops"]["attention"]["triton_tflops"] > 0
    assert r["cross_device"]["float32"]["max_rel_to_scale"] < 1e-4


def test_fetch_wheels_and_wrapper_name_what_they_need():
    """The wrapper fetches exactly what the check installs when missing (one list: gpu_check.NEEDED), and the
    carried folder is git-ignored (so the device tool's `carry` must name it)."""
    text = (ROOT / "scripts" / "gpu-check.sh").read_text()
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import gpu_check
    finally:
        sys.path.pop(0)
    for name in gpu_check.NEEDED:
        assert f'"{name}>=' in text
    assert ".gpu-wheels/" in (ROOT / ".gitignore").read_text().splitlines()
