"""Nothing silent: a faster path that is off is said once, with the reason and the fix, by every command, and
`bivit doctor` reports it. Real `bivit` processes without a C compiler (CC=/bin/false, an empty PATH)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys

import torch
from PIL import Image

from bivit import kernels, notices
from bivit.kernels.cpu import amx_unused
from support.media import random_image


def _can_run() -> bool:
    """A variant of the compiled kernels would run here (else the CPU, not the compiler, is why they are off)."""
    try:
        kernels.pick_variant("bivit", kernels.cpu_info()[1], torch.backends.cpu.get_cpu_capability())
        return True
    except kernels.KernelUnavailable:
        return False


CAN_RUN = _can_run()
FALSE = shutil.which("false") or "/bin/false"


def no_compiler_env(tmp_path) -> dict:
    """A machine without a C compiler: CC names a program that is not one, and PATH holds no cc or gcc. The
    kernel is forced where the CPU can run it (on AMX CPUs `auto` would leave PyTorch's attention in place
    without trying to build)."""
    empty = tmp_path / "empty-path"
    empty.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("CC", kernels.ATTENTION_ENV)}
    return {**env, "CC": FALSE, "PATH": str(empty), "BIVIT_KERNEL_CACHE": str(tmp_path / "kernel-cache"),
            **({kernels.ATTENTION_ENV: "bivit"} if CAN_RUN else {})}


def bivit_cli(*args, env):
    return subprocess.run([sys.executable, "-m", "bivit.cli", *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=300)


def test_encode_without_a_compiler_says_once_which_kernel_is_off_why_and_the_fix(tmp_path):
    image = tmp_path / "a.png"
    Image.fromarray(random_image(56, 84, seed=1)).save(image)
    r = bivit_cli("encode", image, "--out", tmp_path / "e.safetensors", env=no_compiler_env(tmp_path))
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if "compiled kernels" in ln]
    assert len(lines) == 1, r.stderr  # one line, said once
    line = lines[0]
    assert line.startswith("bivit: compiled kernels off: ") and "attention and RoPE run instead" in line
    if CAN_RUN:  # the reason is the compiler, and the fix says what to do about it
        assert FALSE in line and "does not work" in line and "fix: install a C compiler" in line


def test_doctor_reports_the_missing_compiler_fast_and_without_a_traceback(tmp_path):
    env = no_compiler_env(tmp_path)
    r = bivit_cli("doctor", env=env)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stdout + r.stderr
    assert "DEMO" not in r.stderr  # no model was loaded
    attention = next(ln for ln in r.stdout.splitlines() if ln.startswith("attention"))
    assert "PyTorch SDPA" in attention and "compiled attention not used" in attention
    compiler = next(ln for ln in r.stdout.splitlines() if ln.startswith("compiler"))
    assert FALSE in compiler and "$CC" in compiler and "does not work" in compiler
    for section in ("cpu ", "  flags", "pytorch", "gemm ", "extra ", "fallbacks"):
        assert any(ln.startswith(section) for ln in r.stdout.splitlines()), section
    report = json.loads(bivit_cli("doctor", "--json", env=env).stdout)
    assert report["attention"]["in_use"] is False and report["compiler"]["found"] == FALSE
    assert set(report["gemm"]) == {"float32", "bfloat16", "float16"}
    assert {"serve", "ray", "hub", "plot", "vllm"} <= set(report["extras"])
    assert report["cpu"]["flags"] == "unknown (no /proc/cpuinfo)" or "avx512_bf16" in report["cpu"]["flags"]
    if CAN_RUN:
        assert FALSE in report["attention"]["why"] and "install" in report["attention"]["fix"]
        assert any(n["key"] == "attention" for n in report["fallbacks"])


def test_widened_gemms_are_said_where_the_cpu_has_no_bf16_gemm(tmp_path):
    """Where bivit's compiled library has no bf16 GEMM kernel for the CPU (an AVX2 CPU; here PyTorch's AVX2
    dispatch on any x86 CPU, which picks the avx2 library), bf16 weights are widened to float32, and the command
    says so in one line (no fix: it is the CPU's limit)."""
    image = tmp_path / "a.png"
    Image.fromarray(random_image(28, 28, seed=2)).save(image)
    r = bivit_cli("encode", image, "--out", tmp_path / "e.safetensors", "--dtype", "bfloat16",
                  env={**os.environ, "ATEN_CPU_CAPABILITY": "avx2", "BIVIT_KERNEL_CACHE": str(tmp_path / "cache")})
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
