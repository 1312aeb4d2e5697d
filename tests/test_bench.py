"""The benchmark code path on the demo model: FLOP accounting, workers, report and files. Nothing here is timed.

The performance numbers themselves come from `bivit bench` on the full-size model (see benchmarks/README.md).
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

import bivit
from bivit import bench, kernels
from bivit.bench.roofline import attention_flops_per_item, flops_per_item, gemm_flops_per_item
from bivit.checkpoint.config import PRESETS
from support.checkpoints import KIMI_SMALL

GRIDS = [(1, 8, 8), (1, 6, 10), (4, 4, 6), (2, 8, 4)]


@pytest.mark.parametrize("grid", GRIDS)
def test_flops_formula_counts_what_the_model_executes(kimi_ckpt, grid, monkeypatch):
    """flops_per_item against torch's own FLOP counter on a real forward pass (default mode: no padded tiles).

    PyTorch's math SDPA backend is forced so that attention's matmuls are visible to the counter (neither the
    fused CPU kernel nor bivit's compiled one has a FLOP formula registered); it does the same two matmuls.
    """
    monkeypatch.setattr(kernels, "attention", lambda: None)
    enc = bivit.load_encoder(kimi_ckpt, dtype="float32", batch_invariant=False)
    pixels = torch.randn(grid[0] * grid[1] * grid[2], 3, 14, 14)
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
        enc.encode_pixels(pixels, torch.tensor([grid]))
    counts = {str(k): v for k, v in counter.get_flop_counts()["Global"].items()}
    assert counter.get_total_flops() == flops_per_item(KIMI_SMALL, *grid)
    assert counts["aten.bmm"] == attention_flops_per_item(KIMI_SMALL, *grid)
    assert counter.get_total_flops() - counts["aten.bmm"] == gemm_flops_per_item(KIMI_SMALL, *grid)


def test_standard_cases_are_the_documented_mix():
    cases = bench.standard_cases()
    assert [(c.items, c.patches, c.tokens) for c in cases] == [(1, 1024, 256), (1, 3072, 768), (32, 2048, 512),
                                                               (1, 2304, 144)]
    assert cases[3].grids() == [(4, 18, 32)]
    assert bench.square_case(16384).grids() == [(1, 128, 128)]


def test_in_process_run_summary_and_files(tmp_path):
    """Every implementation (bivit both modes + the transformers port) on the same pixels and weights."""
    pytest.importorskip("transformers")
    cases = [bench.make_case("one 56x84", [[bench.noise_image(56, 84, 0)]]),
             bench.make_case("two 28x28", [[bench.noise_image(28, 28, 1)], [bench.noise_image(28, 28, 2)]]),
             bench.make_case("chunk 3x56x56", [[bench.noise_image(56, 56, 3 + f) for f in range(3)]], 4096)]
    record = bench.run_benchmark(preset="demo", dtypes=["float32"], repeats=2, warmup=0, isolate=False, cases=cases,
                                 log=lambda s: None)
    run = record["runs"]["float32"]
    assert list(run["impls"]) == list(bench.IMPLS)
    for data in run["impls"].values():
        assert all(len(t) == 2 and min(t) > 0 for t in data["times"].values())
    # The same weights and pixels reach every implementation: fp32 results agree to parity precision.
    for case in cases:
        for pair in run["parity"][case.name].values():
            assert pair["max_rel"] <= 1e-4
    summary = bench.summarize(record)
    mix = summary["float32"]["mix"]
    assert mix["bivit-invariant"]["tokens"] == sum(c.tokens for c in cases) == 6 + 2 + 4
    report = bench.format_report(record, summary)
    assert "| implementation | whole mix s" in report and "hf-sdpa" in report
    # The roofline: GEMM FLOPs at the best GEMM rate any round measured (either way) + each item's attention
    # FLOPs at the best attention rate for its length (either kernel), against each implementation's median.
    rounds = run["rates"]["rounds"]
    gemm_rate = max(v for r in rounds for way in r["gemm"].values() for v in way.values())
    for c in record["cases"]:
        attention = sum(f / 1e9 / max(way[str(n)] for r in rounds for way in r["attention"].values() if way)
                        for n, f in c["attention_flops"])
        roofline = c["gemm_flops"] / 1e9 / gemm_rate + attention
        assert summary["float32"]["roofline_s"][c["name"]] == pytest.approx(roofline)
        for row in summary["float32"]["rows"]:
            if row["case"] == c["name"]:
                assert row["pct_roofline"] == pytest.approx(roofline / row["median_s"])
        assert 0 < c["other_flops"] < c["flops"]
    assert "**Roofline** per case" in report and "hf-sdpa s (% of roofline)" in report
    # The kernel peak: measured in every round where invariant mode's GEMM kernel has a peak loop; every case's
    # share of it is its GFLOP/s over the best round's peak, printed beside its share of the roofline.
    peaks = [r["kernel_peak"] for r in rounds if r["kernel_peak"] is not None]
    if peaks:
        assert "Kernel peak:" in report and "of peak)" in report
        for row in summary["float32"]["rows"]:
            assert row["pct_kernel_peak"] == pytest.approx(row["gflops"] / max(peaks))
    else:
        assert all(row["pct_kernel_peak"] is None for row in summary["float32"]["rows"])
    written = bench.write_outputs(record, report, summary, tmp_path / "out", "bench", "test", lambda s: None)
    assert sorted(p.name for p in written) == ["bench.json", "bench.md", "bench.png"]
    assert json.loads((tmp_path / "out" / "bench.json").read_text())["record"]["preset"] == "demo"
    assert (tmp_path / "out" / "bench.png").read_bytes()[:4] == b"\x89PNG"


def test_report_says_once_that_times_are_inflated_and_compares_as_speeds_only():
    """A run that shared its cores showed it only as a CPU-use column (150 s for "about a minute"), and the case
    table put a speed ratio beside a time ratio ("1.06x" and "0.941": one figure and its inverse). Now one line
    says the times are inflated when CPU use is below LOW_CPU_USE, and every comparison is the other's time /
    invariant's. Control: the same run with its cores (CPU use 100%) has no such line."""
    cases = [bench.make_case("one 56x56", [[bench.noise_image(56, 56, 0)]])]
    record = bench.run_benchmark(preset="demo", dtypes=["float32"], repeats=1, warmup=0, isolate=False, cases=cases,
                                 log=lambda s: None)
    impls = record["runs"]["float32"]["impls"]

    def report(use: float) -> str:  # the CPU seconds a worker at `use` of its threads spends in its timed run
        for data in impls.values():
            data["cpu_times"] = {c: [t * record["env"]["threads"] * use for t in ts] for c, ts in data["times"].items()}
        return bench.format_report(record, bench.summarize(record))

    shared, quiet = report(0.3), report(1.0)
    said = [ln for ln in shared.splitlines() if ln.startswith("CPU use ")]
    assert said == ["CPU use 30% (below 80%): other processes shared the cores, so every time here is inflated; "
                    "ratios within this run still compare"], shared
    assert not [ln for ln in quiet.splitlines() if ln.startswith("CPU use ")]
    row = next(ln for ln in quiet.splitlines() if ln.startswith("| one 56x56 |"))
    t = {impl: data["times"]["one 56x56"][0] for impl, data in impls.items()}
    inv = t["bivit-invariant"]
    port = next(impl for impl in t if impl not in bench.BIVIT_IMPLS)
    assert row.endswith(f"| {t[port] / inv:.2f}x | {t['bivit-default'] / inv:.2f}x |"), row
    assert "invariant / default" not in quiet and "time bivit" not in quiet


def test_isolated_workers_report_their_own_memory(tmp_path):
    """The real path: one spawned process per implementation, each reporting its own RSS."""
    cases = [bench.make_case("one 56x56", [[bench.noise_image(56, 56, 0)]])]
    checkpoint = bench.write_checkpoint(tmp_path / "ckpt", "demo")
    record = bench.run_benchmark(preset="demo", dtypes=["bfloat16"], impls=bench.BIVIT_IMPLS, repeats=1, warmup=0,
                                 cases=cases, checkpoint=checkpoint, log=lambda s: None)
    mix = bench.summarize(record)["bfloat16"]["mix"]
    for impl in bench.BIVIT_IMPLS:
        assert mix[impl]["minor_faults"] >= 0 and mix[impl]["cpu_s"] > 0
        mem = mix[impl]["memory"]
        assert mem["loaded_rss_mib"] > mem["baseline_rss_mib"] > 0
        assert mem["peak_mib"] >= mem["loaded_rss_mib"]


def test_transformers_comparison_only_where_the_port_implements_the_model():
    assert bench.hf_supports(PRESETS["kimi-k2.6"]) and bench.hf_supports(PRESETS["demo"])
    assert "K2.x" in bench.hf_unavailable_reason(PRESETS["kimi-k3"])


def test_bench_command_user_errors_are_one_line(tmp_path):
    from typer.testing import CliRunner

    from bivit.cli import app

    result = CliRunner().invoke(app, ["bench", "--dtype", "int8", "--out-dir", str(tmp_path)])
    assert result.exit_code == 2 and "--dtype 'int8'" in result.output
    result = CliRunner().invoke(app, ["bench", "--preset", "nope", "--skip-hf", "--out-dir", str(tmp_path)])
    assert result.exit_code == 2 and "unknown preset 'nope'" in result.output
    result = CliRunner().invoke(app, ["bench", "--case", "1x1", "--out-dir", str(tmp_path)])
    assert result.exit_code == 2 and "--case 1x1: no case matches (cases: image 448x448" in result.output
    assert not (tmp_path / "bench.json").exists()


def test_bench_results_that_cannot_be_written_are_a_failure_not_a_usage_error(tmp_path, monkeypatch):
    """The run itself worked; the disk refused its results: one line, exit 1 (failure), not 2 (usage)."""
    from typer.testing import CliRunner

    from bivit.cli import app

    def full_disk(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(bench, "write_outputs", full_disk)
    result = CliRunner().invoke(app, ["bench", "--preset", "demo", "--skip-hf", "--in-process", "--dtype", "float32",
                                      "--repeats", "1", "--warmup", "0", "--out-dir", str(tmp_path)])
    assert result.exit_code == 1, result.output
    assert "cannot write results" in result.output and "No space left" in result.output


def test_a_real_time_run_says_its_roofline_reads_low():
    """Under `chrt -f` Linux runs a process at most sched_rt_runtime_us of each sched_rt_period_us (95%), so a
    multi-second encode pauses while the short GEMM probes do not: a run measured so put 32 x 112x112 at 86-88% of
    the roofline where the same code at normal priority measured 91-94%. The report now says so, and the
    machine line names the cap. Control: the same record at normal priority says nothing of it."""
    cases = [bench.make_case("one 56x56", [[bench.noise_image(56, 56, 0)]])]
    record = bench.run_benchmark(preset="demo", dtypes=["float32"], repeats=1, warmup=0, isolate=False, cases=cases,
                                 log=lambda s: None)
    assert record["env"]["rt_share"] is None  # this test runs at a normal priority

    def lines(share):
        record["env"]["rt_share"] = share
        return bench.format_report(record, bench.summarize(record)).splitlines()

    capped, normal = lines(0.95), lines(None)
    said = [ln for ln in capped if ln.startswith("Real-time priority")]
    assert len(said) == 1 and "at most 95% of each second" in said[0] and "up to 5 points low" in said[0], said
    assert "real-time priority: capped at 95% of each second" in capped[0]
    assert not [ln for ln in normal if "eal-time priority" in ln]


def test_the_real_time_cap_is_read_from_the_running_process():
    """`rt_share` in a process started under `chrt -f 1`: the kernel's own cap (runtime / period), or None where
    real-time tasks are not capped; at a normal priority, None."""
    from bivit.bench.run import rt_share

    assert rt_share() is None
    if shutil.which("chrt") is None:
        pytest.skip("no chrt here")
    run = subprocess.run(["chrt", "-f", "1", sys.executable, "-c",
                          "from bivit.bench.run import rt_share; print(rt_share())"],
                         capture_output=True, text=True, timeout=120)
    if run.returncode != 0 and "Operation not permitted" in run.stderr:
        pytest.skip("this user may not set a real-time priority")
    assert run.returncode == 0, run.stderr
    runtime = int(Path("/proc/sys/kernel/sched_rt_runtime_us").read_text())
    period = int(Path("/proc/sys/kernel/sched_rt_period_us").read_text())
    expected = runtime / period if 0 <= runtime < period else None
    assert run.stdout.strip() == str(expected)
