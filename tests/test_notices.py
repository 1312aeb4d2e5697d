"""Nothing silent: a faster path that is off is said once, with the reason and the fix, by every command, and
`bivit doctor` reports it. Real `bivit` processes of an install without its compiled kernels (a copy of this one
with every library left out)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest
from PIL import Image

from bivit import kernels
from bivit.base import notices
from bivit.kernels.cpu import amx_unused
from support.installs import env_for, package_without
from support.media import random_image


@pytest.fixture(scope="module")
def bare_env(tmp_path_factory) -> dict:
    """The environment of a process whose bivit has no compiled kernels."""
    root = package_without(tmp_path_factory.mktemp("bare"), kernels.installed())
    return env_for(root, **{kernels.ATTENTION_ENV: "auto"})


def bivit_cli(*args, env):
    return subprocess.run([sys.executable, "-m", "bivit.cli", *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=300)


def test_default_mode_without_kernels_says_once_what_is_off_why_and_the_fix(tmp_path, bare_env):
    image = tmp_path / "a.png"
    Image.fromarray(random_image(56, 84, seed=1)).save(image)
    r = bivit_cli("encode", image, "--out", tmp_path / "e.safetensors", "--no-batch-invariant", env=bare_env)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if "compiled kernels" in ln]
    assert len(lines) == 1, r.stderr  # one line, said once
    assert lines[0].startswith("bivit: compiled kernels not used: this install has none of bivit's compiled kernels")
    assert "PyTorch's kernels run" in lines[0] and "fix: reinstall bivit" in lines[0]


def test_doctor_reports_the_missing_kernels_and_the_refusal_without_a_traceback(bare_env):
    r = bivit_cli("doctor", env=bare_env)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stdout + r.stderr
    assert "DEMO" not in r.stderr  # no model was loaded
    lines = r.stdout.splitlines()
    kernel_line = next(ln for ln in lines if ln.startswith("kernels"))
    assert "none in use (installed: none)" in kernel_line and "fix: reinstall" in kernel_line
    attention = next(ln for ln in lines if ln.startswith("attention"))
    assert "default mode: PyTorch SDPA" in attention and "invariant mode: float32 refused:" in attention
    for section in ("cpu ", "  flags", "pytorch", "bits ", "gemm ", "extra ", "fallbacks"):
        assert any(ln.startswith(section) for ln in lines), section
    report = json.loads(bivit_cli("doctor", "--json", env=bare_env).stdout)
    assert report["attention"]["in_use"] is False and report["attention"]["installed"] == []
    assert "reinstall" in report["attention"]["fix"]
    assert set(report["gemm"]) == {"float32", "bfloat16", "float16"}
    assert all(c.startswith("refused: invariant mode runs bivit's compiled kernels only")
               for d, c in report["bits"].items() if d != "mode")
    assert {"serve", "ray", "hub", "plot", "vllm"} <= set(report["extras"])
    assert report["cpu"]["flags"] == "unknown (no /proc/cpuinfo)" or "avx512_bf16" in report["cpu"]["flags"]
    assert any(n["key"] == "attention" for n in report["fallbacks"])


def test_widened_gemms_are_said_where_the_cpu_has_no_bf16_gemm(tmp_path):
    """Where bivit's compiled library has no bf16 GEMM kernel for the CPU (an AVX2 CPU; here PyTorch's AVX2
    dispatch on any x86 CPU, which picks the avx2 library), bf16 weights are widened to float32, and the command
    says so in one line (no fix: it is the CPU's limit)."""
    image = tmp_path / "a.png"
    Image.fromarray(random_image(28, 28, seed=2)).save(image)
    r = bivit_cli("encode", image, "--out", tmp_path / "e.safetensors", "--dtype", "bfloat16",
                  env={**os.environ, "ATEN_CPU_CAPABILITY": "avx2"})
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if "GEMMs widened" in ln]
    assert lines == ["bivit: bfloat16 GEMMs widened to float32: bivit has no bfloat16 GEMM kernel for this CPU "
                     "(bf16: AVX-512 BF16 or AMX); its weights are widened to float32 once, exact products; same "
                     "math, float32 speed, twice the weight memory"], r.stderr


def test_a_fallback_is_logged_once_and_kept(caplog):
    with caplog.at_level(logging.INFO, logger="bivit"):
        first = notices.fallback("test-path", "test path off", "a reason", "what runs", "the fix")
        again = notices.fallback("test-path", "test path off", "another reason")
        notices.note("test-choice", "test choice", "chosen")
    assert again is first  # the first word stands: said once per process
    said = [r for r in caplog.records if "test path off" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING
    assert said[0].getMessage() == "bivit: test path off: a reason; what runs; fix: the fix"
    assert [r.levelno for r in caplog.records if "test choice" in r.getMessage()] == [logging.INFO]
    assert "bivit: test path off: a reason; what runs; fix: the fix" in notices.warnings()
    assert all("test choice" not in w for w in notices.warnings())  # a choice is not a warning


def test_amx_unused_rule():
    amx = frozenset({"amx_bf16", "amx_tile", "avx512_bf16"})
    assert amx_unused(frozenset({"avx512_bf16"}), False, None) is None  # no AMX: nothing lost
    assert amx_unused(amx, True, None) is None  # AMX granted: used
    why, fix = amx_unused(amx, False, None)
    assert "does not grant" in why and "5.16" in fix
    why, fix = amx_unused(amx, True, "AVX512_CORE_BF16")
    assert "ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16" in why and fix == "unset ONEDNN_MAX_CPU_ISA"
    assert amx_unused(amx, True, "AVX512_CORE_AMX") is None and amx_unused(amx, True, "ALL") is None
