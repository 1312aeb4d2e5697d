"""Equal fingerprints, equal rows, for every knob bivit has (docs/cpu-kinds.md lists them).

The same inputs are encoded in fresh processes under each knob that selects kernels or changes bits: the
compiled variant (`BIVIT_ATTENTION`), the GEMM kernel (`BIVIT_GEMM`), `BIVIT_ARITH=native`, the thread count,
PyTorch held to AVX2 (or to no vector code), an install without one variant's library (or with the portable one
only), and default mode under several of them. The runs are grouped by fingerprint: within a group the rows are
`torch.equal`, and every run whose class is bivit-arith/1 shares one fingerprint and one set of rows, whichever
kernels computed it. Configurations invariant mode cannot run (PyTorch's attention, an install without kernels)
are refused, never run with another arithmetic. Control: a process whose attention is nudged by one ulp
without its class changing is caught by the same check.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bivit import kernels
from bivit.ops import bits
from support.installs import env_for, package_without
from support.media import mixed_inputs
from support.variants import CAPABILITY, RUNNABLE

RUN = """
import sys, torch, bivit
from bivit.ops import attend
mode, threads, out, *inputs = sys.argv[1:]
torch.set_num_threads(int(threads))
if mode == "nudged":  # the control: other bits (still invariant: the proof passes), the same kernels named
    compiled = attend._compiled

    def nudged(*args):
        y = compiled(*args)
        return torch.nextafter(y, torch.full_like(y, float("inf")))

    attend._compiled = nudged
try:
    enc = bivit.load_encoder(None, dtype="bfloat16", batch_invariant=mode != "stock")
except bivit.ConfigError as e:
    torch.save({"refused": str(e)}, out)
    sys.exit(0)
torch.save({"fingerprint": enc.fingerprint, "bits": enc.bits, "rows": enc.encode(inputs)}, out)
"""


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> list[str]:
    paths = mixed_inputs(tmp_path_factory.mktemp("knob-inputs"), [(28, 28), (84, 140), (224, 168)], 60, frames=8,
                         fps=4)
    return [str(p) for p in paths]


@pytest.fixture(scope="module")
def installs(tmp_path_factory) -> dict[str, Path | None]:
    """PYTHONPATH roots of installs other than this one: without the best variant, with `portable` only, and
    with no library at all."""
    present = [v.name for v in kernels.VARIANTS if v.name in kernels.installed()]
    out: dict[str, Path | None] = {"no kernels": package_without(tmp_path_factory.mktemp("bare"), present)}
    if len(present) > 1:
        out[f"without {present[0]}"] = package_without(tmp_path_factory.mktemp("less"), present[:1])
        out["portable only"] = package_without(tmp_path_factory.mktemp("portable"), present[:-1])
    return out


def configurations(installs: dict) -> dict[str, tuple[str, int, dict, Path | None]]:
    """name -> (mode, threads, environment variables, install root or None for this one)."""
    configs = {"default": ("invariant", 2, {}, None), "1 thread": ("invariant", 1, {}, None),
               "3 threads": ("invariant", 3, {}, None), "BIVIT_ARITH=native": ("invariant", 2,
                                                                             {"BIVIT_ARITH": "native"}, None),
               "BIVIT_ATTENTION=bivit": ("invariant", 2, {"BIVIT_ATTENTION": "bivit"}, None),
               "ATEN_CPU_CAPABILITY=default": ("invariant", 2, {"ATEN_CPU_CAPABILITY": "default"}, None),
               "BIVIT_ATTENTION=sdpa": ("invariant", 2, {"BIVIT_ATTENTION": "sdpa"}, None)}
    for v in RUNNABLE:
        configs[f"BIVIT_ATTENTION={v.name}"] = ("invariant", 2, {"BIVIT_ATTENTION": v.name}, None)
    for k in kernels.gemm_kernels():
        configs[f"BIVIT_GEMM={k.name}"] = ("invariant", 2, {"BIVIT_GEMM": k.name}, None)
    if CAPABILITY == "AVX512":
        held = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
        configs["held to AVX2"] = ("invariant", 2, held, None)
        configs["stock, held to AVX2"] = ("stock", 2, held, None)
    for name, root in installs.items():
        configs[f"install {name}"] = ("invariant", 2, {}, root)
    configs.update({"stock": ("stock", 2, {}, None), "stock, BIVIT_GEMM=fp32": ("stock", 2, {"BIVIT_GEMM": "fp32"},
                                                                               None),
                    "stock, 1 thread": ("stock", 1, {}, None),
                    "stock, BIVIT_ATTENTION=sdpa": ("stock", 2, {"BIVIT_ATTENTION": "sdpa"}, None),
                    "stock, install no kernels": ("stock", 2, {}, installs["no kernels"])})
    return configs


def encode_under(name: str, config: tuple, inputs: list[str], tmp: Path) -> dict:
    mode, threads, extra, root = config
    env = env_for(root if root is not None else Path(kernels.__file__).parents[2], **extra)
    env = {k: v for k, v in env.items() if not (k.startswith("BIVIT_") and k not in extra)}
    out = tmp / f"{abs(hash(name))}.pt"
    done = subprocess.run([sys.executable, "-c", RUN, mode, str(threads), str(out), *inputs], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{name}: {done.stderr[-2000:]}"
    return torch.load(out)


def violations(runs: dict[str, dict]) -> list[str]:
    """What breaks "equal fingerprints, equal rows" among `runs` (name -> what `RUN` saved): runs of one
    fingerprint with other rows, and bivit-arith/1 runs with another fingerprint or other rows than the first."""
    found = []
    first: dict[str, tuple[str, list]] = {}
    arith = None
    for name, r in runs.items():
        if "refused" in r:
            continue
        seen = first.setdefault(r["fingerprint"], (name, r["rows"]))
        if not all(torch.equal(a, b) for a, b in zip(r["rows"], seen[1])):
            found.append(f"{name} and {seen[0]}: one fingerprint, other rows")
        if r["bits"] == bits.ARITH:
            arith = arith or (name, r)
            if r["fingerprint"] != arith[1]["fingerprint"]:
                found.append(f"{name} and {arith[0]}: both {bits.ARITH}, other fingerprints")
            if not all(torch.equal(a, b) for a, b in zip(r["rows"], arith[1]["rows"])):
                found.append(f"{name} and {arith[0]}: both {bits.ARITH}, other rows")
    return found


@pytest.mark.slow
def test_equal_fingerprints_mean_equal_rows_under_every_knob(inputs, installs, tmp_path):
    configs = configurations(installs)
    runs = {name: encode_under(name, config, inputs, tmp_path) for name, config in configs.items()}
    summary = {name: r.get("bits") or f"refused: {r['refused'][:60]}" for name, r in runs.items()}
    assert violations(runs) == [], summary

    # What invariant mode cannot run is refused, never computed with another arithmetic.
    assert "BIVIT_ATTENTION=sdpa" in runs["BIVIT_ATTENTION=sdpa"].get("refused", ""), summary
    assert "compiled kernels only" in runs["install no kernels"].get("refused", ""), summary
    refused = {name for name, r in runs.items() if "refused" in r}
    # Also refused: a GEMM kernel forced by name that does not compute bivit-arith/1 here (AMX tiles may not).
    forced_off = {name for name in refused if name.startswith("BIVIT_GEMM=amx")
                  and name in runs[name].get("refused", "")}
    assert refused - forced_off == {"BIVIT_ATTENTION=sdpa", "install no kernels"}, summary
    # Every other invariant configuration computes bivit-arith/1 (or, where it asked for it, AMX's native class).
    for name, r in runs.items():
        if configs[name][0] == "invariant" and name not in refused:
            assert r["bits"] == bits.ARITH or (name == "BIVIT_ARITH=native" and r["bits"].startswith("native/")), \
                (name, r["bits"])
    # Default mode names what changes its bits: the attention, the threads, PyTorch's steering variables.
    stock = {name: r["fingerprint"] for name, r in runs.items() if configs[name][0] == "stock"}
    assert stock["stock"] == stock["stock, BIVIT_GEMM=fp32"]  # a knob of invariant mode's only
    assert stock["stock"] != stock["stock, 1 thread"]
    # PyTorch's attention by choice or for want of a library: one class, so the rows must agree (checked above).
    assert stock["stock, BIVIT_ATTENTION=sdpa"] == stock["stock, install no kernels"]
    assert all(runs[n]["bits"].startswith("stock/") for n in stock)

    # The control: bits changed by one ulp under the same kernels' names are caught.
    nudged = encode_under("nudged", ("nudged", 2, {}, None), inputs, tmp_path)
    assert nudged["bits"] == bits.ARITH
    caught = violations({**runs, "nudged": nudged})
    assert caught and all("nudged" in line for line in caught), caught
