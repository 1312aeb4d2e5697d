"""What `bivit bench` reports: medians, ratios between implementations (taken within one run), the roofline
per case, memory; as Markdown, JSON and a PNG chart.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Callable

from ..base.fileio import write_atomic
from .roofline import roofline_s
from .run import fmt_load, machine_line
from .workload import BIVIT_IMPLS, HF_IMPL


def machine_rates(run: dict) -> dict:
    """The best rates over rounds (GFLOP/s): GEMM per way and overall, attention per way and length, overall."""
    rounds = run["rates"]["rounds"]
    gemm = {way: {s: max(r["gemm"][way][s] for r in rounds) for s in rounds[0]["gemm"][way]}
            for way in rounds[0]["gemm"]}
    attention = {way: {n: max(r["attention"][way][n] for r in rounds) for n in rounds[0]["attention"][way]}
                 for way in rounds[0]["attention"] if rounds[0]["attention"][way] is not None}
    best_attention = {int(n): max(a[n] for a in attention.values()) for n in attention["sdpa"]}
    peaks = [r["kernel_peak"] for r in rounds if r.get("kernel_peak")]
    return {"gemm": gemm, "attention": attention, "gemm_rate": max(v for g in gemm.values() for v in g.values()),
            "attention_rate": best_attention, "kernel_peak": max(peaks) if peaks else None}


# CPU use (CPU seconds per wall second per thread) below which a run did not have its cores: its times are
# inflated (runs beside other jobs measured 32-52%; quiet ones 99-100%).
LOW_CPU_USE = 0.8


def summarize(record: dict) -> dict:
    """Derived numbers per dtype: per-case and whole-mix rows per implementation, ratios, rooflines, memory."""
    cases = record["cases"]
    result = {}
    for dtype, run in record["runs"].items():
        rates = machine_rates(run)
        peak = rates["gemm_rate"]
        roof = {c["name"]: roofline_s(c["gemm_flops"], c["attention_flops"], peak, rates["attention_rate"])
                for c in cases}
        rows, mix = [], {}
        threads = record["env"]["threads"]
        for impl, data in run["impls"].items():
            per_case = []
            for c in cases:
                times = data["times"][c["name"]]
                med = statistics.median(times)
                row = _row(impl, c["name"], c["items"], c["tokens"], c["flops"], med, min(times), max(times), peak)
                cpu = data.get("cpu_times", {}).get(c["name"])
                row["cpu_s"] = statistics.median(cpu) if cpu else None
                # CPU seconds per wall second per thread: ~1.0 = had its cores; well below = shared them.
                row["cpu_use"] = row["cpu_s"] / (med * threads) if cpu else None
                faults = [f for f in data.get("minor_faults", {}).get(c["name"], []) if f is not None]
                row["minor_faults"] = statistics.median(faults) if faults else None
                row["roofline_s"] = roof[c["name"]]
                row["pct_roofline"] = roof[c["name"]] / med
                row["pct_kernel_peak"] = row["gflops"] / rates["kernel_peak"] if rates["kernel_peak"] else None
                per_case.append(row)
            rows.extend(per_case)
            total = sum(r["median_s"] for r in per_case)
            round_totals = [sum(data["times"][c["name"]][i] for c in cases) for i in range(record["repeats"])]
            mix[impl] = _row(impl, "whole mix", sum(c["items"] for c in cases), sum(c["tokens"] for c in cases),
                             sum(c["flops"] for c in cases), total, min(round_totals), max(round_totals), peak)
            mix[impl]["round_totals"] = round_totals
            mix[impl]["roofline_s"] = sum(roof.values())
            mix[impl]["pct_roofline"] = sum(roof.values()) / total
            mix[impl]["pct_kernel_peak"] = (mix[impl]["gflops"] / rates["kernel_peak"] if rates["kernel_peak"]
                                            else None)
            cpus = [r["cpu_s"] for r in per_case]
            mix[impl]["cpu_s"] = sum(cpus) if None not in cpus else None
            mix[impl]["cpu_use"] = mix[impl]["cpu_s"] / (total * threads) if mix[impl]["cpu_s"] is not None else None
            faults = [r["minor_faults"] for r in per_case]
            mix[impl]["minor_faults"] = sum(faults) if None not in faults else None
            mix[impl]["memory"] = _memory_row(data.get("memory"))
            mix[impl]["load_s"] = data["load_s"]
        ratios = {}
        impls = list(run["impls"])
        pairs = [("bivit-invariant", "bivit-default"), ("bivit-invariant", HF_IMPL), ("bivit-default", HF_IMPL)]
        for a, b in pairs:
            if a in impls and b in impls:
                per_round = [x / y for x, y in zip(mix[a]["round_totals"], mix[b]["round_totals"])]
                per_case = {c["name"]: statistics.median(run["impls"][a]["times"][c["name"]]) /
                            statistics.median(run["impls"][b]["times"][c["name"]]) for c in cases}
                ratios[f"{a} / {b}"] = {"time_ratio": mix[a]["median_s"] / mix[b]["median_s"],
                                        "per_round": per_round, "per_case": per_case}
        result[dtype] = {"peak_gflops": peak, "rates": rates, "roofline_s": roof, "rows": rows, "mix": mix,
                         "ratios": ratios, "parity": run["parity"]}
    return result


def _row(impl, case, items, tokens, flops, med, lo, hi, peak) -> dict:
    gflops = flops / med / 1e9
    return {"impl": impl, "case": case, "items": items, "tokens": tokens, "median_s": med, "min_s": lo, "max_s": hi,
            "items_per_s": items / med, "tokens_per_s": tokens / med, "gflops": gflops,
            "pct_peak": gflops / peak}


def _memory_row(mem: dict | None) -> dict | None:
    if not mem:
        return None
    loaded, final = mem["loaded"], mem.get("final") or mem["loaded"]
    peak_run = final["hwm_mib"] if mem.get("peak_reset") else None
    return {"baseline_rss_mib": mem["baseline"]["rss_mib"], "loaded_rss_mib": loaded["rss_mib"],
            "load_peak_mib": loaded["hwm_mib"], "run_peak_mib": peak_run,
            "peak_mib": max(loaded["hwm_mib"], final["hwm_mib"]), "ru_maxrss_mib": final["ru_maxrss_mib"]}


def _mib(v: float | None) -> str:
    return "n/a" if v is None else f"{v / 1024:.2f} GiB" if v >= 1024 else f"{v:.0f} MiB"


def format_report(record: dict, summary: dict | None = None) -> str:
    """Markdown: the machine, per dtype its rates, the roofline per case beside every implementation's time,
    the whole mix, ratios, per-case details, parity, memory."""
    summary = summary or summarize(record)
    env = record["env"]
    names = {c["name"]: c for c in record["cases"]}
    lines = [f"bivit bench: preset {record['preset']}, {machine_line(env)} -> {fmt_load(env.get('loadavg_end'))}; "
             f"transformers {env['transformers']}; {record['repeats']} interleaved repeat(s) (+{record['warmup']} "
             f"warm-up), medians"]
    if env.get("gemm"):
        lines.append("Kernels: attention " + env["attention"] + "; GEMMs " + "; ".join(env["gemm"].values()))
    lines += [f"Fallback: {line.removeprefix('bivit: ')}" for line in env.get("fallbacks") or ()]
    use = [m["cpu_use"] for s in summary.values() for m in s["mix"].values() if m["cpu_use"] is not None]
    if use and min(use) < LOW_CPU_USE:
        lines.append(f"CPU use {100 * min(use):.0f}% (below {100 * LOW_CPU_USE:.0f}%): other processes shared "
                     "the cores, so every time here is inflated; ratios within this run still compare")
    if env.get("rt_share"):
        lost = 100 * (1 - env["rt_share"])
        lines.append(f"Real-time priority (chrt): Linux ran this run's processes at most {100 * env['rt_share']:.0f}% "
                     f"of each second (kernel.sched_rt_runtime_us): timed calls of a second or more lost up to "
                     f"{lost:.0f}% to its pauses and the short rate probes did not, so % of roofline and of peak read "
                     f"up to {lost:.0f} points low. Measure at normal priority on a quiet machine")
    for name, reason in record["skipped"].items():
        lines.append(f"{name} skipped: {reason}")
    lines.append("")
    lines.append("Cases: " + "; ".join(f"{c['name']} ({c['items']} item{'s' if c['items'] > 1 else ''}, "
                                       f"{c['patches']} patches, {c['tokens']} tokens)" for c in record["cases"]))
    for dtype, s in summary.items():
        rates = s["rates"]
        lines += ["", f"### {dtype}", "",
                  f"Machine rates (best of {record['repeats'] + record['warmup']} rounds): GEMMs at "
                  f"{record['runs'][dtype]['rates']['rows']} rows, stock `F.linear` and bivit's GEMM call "
                  "(pre-packed / widened weights); attention for one item of n patches, PyTorch's SDPA and "
                  "bivit's compiled kernel.", "",
                  "| GEMM (out x in) | stock GFLOP/s | bivit GFLOP/s |", "|---|---:|---:|"]
        for shape in rates["gemm"]["stock"]:
            lines.append(f"| {shape} | {rates['gemm']['stock'][shape]:.0f} | {rates['gemm']['bivit'][shape]:.0f} |")
        kpeak = rates.get("kernel_peak")
        if kpeak:
            lines += ["", f"Kernel peak: {kpeak:.0f} GFLOP/s (invariant mode's GEMM instruction alone, every thread, "
                      f"no memory); best GEMM rate {100 * s['peak_gflops'] / kpeak:.0f}% of it, best attention rate "
                      f"{100 * max(rates['attention_rate'].values()) / kpeak:.0f}%."]
        bivit_att = rates["attention"].get("bivit")
        lines += ["", "| attention, n | SDPA GFLOP/s | bivit compiled GFLOP/s |", "|---:|---:|---:|"]
        for n, v in sorted(rates["attention"]["sdpa"].items(), key=lambda kv: int(kv[0])):
            lines.append(f"| {n} | {v:.0f} | {'n/a' if bivit_att is None else f'{bivit_att[n]:.0f}'} |")
        impls = list(s["mix"])
        by = {(r["impl"], r["case"]): r for r in s["rows"]}
        lines += ["", f"**Roofline** per case: GEMM FLOPs at {s['peak_gflops']:.0f} GFLOP/s (the best GEMM rate "
                  "above) + each item's attention FLOPs at the best attention rate for its length; % = roofline / "
                  "measured time" + ("; % of peak = the case's GEMM + attention GFLOP/s / the kernel peak" if kpeak
                                     else "") + ". Other FLOPs (elementwise, approximate) are not in the roofline.", "",
                  "| case | GEMM TFLOP | attention TFLOP | other TFLOP | roofline s | "
                  + " | ".join(f"{impl} s (% of roofline)" for impl in impls)
                  + (" | invariant vs port | invariant vs default |" if len(impls) > 1 else " |"),
                  "|---|---:|---:|---:|---:|" + "---:|" * len(impls) + ("---:|---:|" if len(impls) > 1 else "")]
        for name, c in names.items():
            cells = [f"{by[(impl, name)]['median_s']:.3f} ({_pct(by[(impl, name)]['pct_roofline'])}"
                     + (f"; {_pct(by[(impl, name)]['pct_kernel_peak'])} of peak)" if kpeak else ")") for impl in impls]
            extra = []
            if len(impls) > 1:
                inv, dflt, hf = (by.get((i, name)) for i in ("bivit-invariant", "bivit-default", HF_IMPL))
                # Both as the other's time / invariant's: a time ratio beside a speed ratio read as one figure
                # and its inverse ("1.06x" and "0.941").
                extra = [f"{other['median_s'] / inv['median_s']:.2f}x" if inv and other else "n/a"
                         for other in (hf, dflt)]
            attention = sum(f for _, f in c["attention_flops"])
            lines.append(f"| {name} | {c['gemm_flops'] / 1e12:.2f} | {attention / 1e12:.2f} | "
                         f"{c.get('other_flops', 0) / 1e12:.3f} | {s['roofline_s'][name]:.3f} | " + " | ".join(cells)
                         + (" | " + " | ".join(extra) if extra else "") + " |")
        lines += ["", "| implementation | whole mix s (min-max) | items/s | tokens/s | GFLOP/s | % of GEMM rate | "
                  "% of roofline | speed vs HF | CPU use | page faults | peak RSS | RSS loaded | run peak RSS | "
                  "load s |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        hf = s["mix"].get(HF_IMPL)
        for impl, m in s["mix"].items():
            mem = m["memory"] or {}
            speed = f"{hf['median_s'] / m['median_s']:.2f}x" if hf else "n/a"
            lines.append(f"| {impl} | {m['median_s']:.2f} ({m['min_s']:.2f}-{m['max_s']:.2f}) | "
                         f"{m['items_per_s']:.2f} | {m['tokens_per_s']:.0f} | {m['gflops']:.0f} | "
                         f"{100 * m['pct_peak']:.0f}% | {_pct(m.get('pct_roofline'))} | {speed} | "
                         f"{_pct(m['cpu_use'])} | {_count(m['minor_faults'])} | {_mib(mem.get('peak_mib'))} | "
                         f"{_mib(mem.get('loaded_rss_mib'))} | {_mib(mem.get('run_peak_mib'))} | {m['load_s']:.2f} |")
        lines.append("")
        for pair, r in s["ratios"].items():  # time ratios a / b, shown as a's speed: b's time / a's
            pr = [1 / v for v in r["per_round"]]
            lines.append(f"{pair.replace(' / ', ' vs ')}: {1 / r['time_ratio']:.2f}x (per round: median "
                         f"{statistics.median(pr):.2f}x, range {min(pr):.2f}x-{max(pr):.2f}x); per case: "
                         + ", ".join(f"{k} {1 / v:.2f}x" for k, v in r["per_case"].items()))
        lines += ["", "| case | implementation | median s (min-max) | items/s | tokens/s | GFLOP/s | % of GEMM rate | "
                  "CPU use |", "|---|---|---:|---:|---:|---:|---:|---:|"]
        for row in sorted(s["rows"], key=lambda r: list(names).index(r["case"])):
            lines.append(f"| {row['case']} | {row['impl']} | {row['median_s']:.3f} ({row['min_s']:.3f}-"
                         f"{row['max_s']:.3f}) | {row['items_per_s']:.2f} | {row['tokens_per_s']:.0f} | "
                         f"{row['gflops']:.0f} | {100 * row['pct_peak']:.0f}% | {_pct(row['cpu_use'])} |")
        lines.append("")
        parity = "; ".join(f"{case}: " + ", ".join(f"{k} max {v['max_rel']:.1e} mean {v['mean_rel']:.1e}"
                                                   for k, v in d.items()) for case, d in s["parity"].items())
        lines.append(f"Parity (|a - b| relative to max |b|, first run of each case): {parity}")
        sub = record["runs"][dtype].get("subnormals")
        if sub:
            lines.append(f"Subnormal values among all op outputs of one {sub['impl']} forward of {sub['case']}: "
                         f"{sub['subnormal']} of {sub['values']}.")
        sources = {impl: d.get("source") for impl, d in record["runs"][dtype]["impls"].items() if impl in BIVIT_IMPLS}
        lines.append("bivit source versions measured (hash of imported modules): "
                     + ", ".join(f"{k} {v}" for k, v in sources.items()))
    lines += ["", "Memory: per worker process, VmHWM/VmRSS of /proc/self/status. 'RSS loaded' = resident after "
              "imports + model load; 'run peak' = high-water mark over warm-up and timed runs (reset after load), "
              "so run peak - RSS loaded = working memory of encoding; 'peak RSS' = max(load peak, run peak).",
              "CPU use: CPU seconds of the worker process per wall second per thread; near 100% means the run had "
              "its cores, far below means it shared them with other processes (the numbers are then inflated).",
              "Page faults: minor page faults per whole mix (median per case, summed): freshly mapped 4 KiB pages, "
              "i.e. large temporaries the allocator returned to the OS and had to fault in again."]
    return "\n".join(lines)


def _count(v: float | None) -> str:
    return "n/a" if v is None else f"{v / 1e3:.0f}k" if v >= 1e3 else f"{v:.0f}"


def _pct(v: float | None) -> str:
    return "n/a" if v is None else f"{100 * v:.0f}%"


def plot_report(summary: dict, path: Path, title: str) -> None:
    """Bar charts: tokens/s and % of roofline per case, one column per dtype, one bar per implementation."""
    # optional (the plot extra); a Figure of its own draws with no pyplot, no backend, no display
    from matplotlib.figure import Figure

    dtypes = list(summary)
    fig = Figure(figsize=(7 * len(dtypes), 8))
    axes = fig.subplots(2, len(dtypes), squeeze=False)
    for col, dtype in enumerate(dtypes):
        s = summary[dtype]
        impls = list(s["mix"])
        case_names = list(dict.fromkeys(r["case"] for r in s["rows"])) + ["whole mix"]
        rows = {(r["impl"], r["case"]): r for r in s["rows"]}
        rows.update({(impl, "whole mix"): m for impl, m in s["mix"].items()})
        width = 0.8 / len(impls)
        for row, (metric, label) in enumerate((("tokens_per_s", "tokens/s"), ("pct_roofline", "% of roofline"))):
            ax = axes[row][col]
            for k, impl in enumerate(impls):
                values = [rows[(impl, c)][metric] * (100 if metric == "pct_roofline" else 1) for c in case_names]
                bars = ax.bar([i + k * width for i in range(len(case_names))], values, width, label=impl)
                ax.bar_label(bars, fmt="%.0f", fontsize=7)
            ax.set_xticks([i + width * (len(impls) - 1) / 2 for i in range(len(case_names))])
            ax.set_xticklabels(case_names, rotation=15, fontsize=8)
            ax.set_ylabel(label)
            ax.set_title(f"{dtype}: {label}" + (f" (GEMM rate {s['peak_gflops']:.0f} GFLOP/s)" if row else ""))
            ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    save_figure(fig, path)


def save_figure(fig, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))


def write_text(path: Path, text: str) -> None:
    """`text` to `path` atomically (the one atomic write of `bivit.base.fileio`), creating its folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, text.encode())


def write_outputs(record: dict, report: str, summary: dict, out_dir: Path, stem: str, title: str,
                  log: Callable[[str], None]) -> list[Path]:
    """JSON (raw record + summary), Markdown report, PNG chart (skipped with a note if matplotlib is missing)."""
    written = []
    write_text(out_dir / f"{stem}.json", json.dumps({"record": record, "summary": summary}, indent=1, default=str))
    written.append(out_dir / f"{stem}.json")
    write_text(out_dir / f"{stem}.md", report + "\n")
    written.append(out_dir / f"{stem}.md")
    try:
        plot_report(summary, out_dir / f"{stem}.png", title)
        written.append(out_dir / f"{stem}.png")
    except ImportError:
        log("bivit bench: PNG chart skipped: matplotlib is not installed (pip install 'bivit[plot]')")
    return written
