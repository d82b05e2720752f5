"""Write `benchmarks.md` and `benchmarks.png` from the results dict `run_all.py` builds (its results JSON).

Contract: `write_report(results, out_dir)` reads nothing but `results` and writes `out_dir/benchmarks.md` and
`out_dir/benchmarks.png`. The page is `report_template.md` filled in with `str.format`: the template's prose holds no
typed-in numbers (a test checks it has no digit outside its {fields}); every number, in tables and sentences alike,
is computed here from `results`. A ratio is baseline time /
veomni_lite time paired per repetition (both ran in that repetition, back to back), given as median (IQR); > 1 means
veomni_lite is faster. Counts are per optimizer step on rank 0, from the untimed counting round.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - the backend must be chosen first

Record = dict[str, Any]
# bench -> (veomni_lite's strategy key, the counting phase of the path under test)
BENCHES = {"loss": ("c", "step"), "metrics": ("b", "metrics")}
KINDS = {"vlm": "VLM step", "path": "path alone"}
COLORS = {"a": "tab:red", "b": "tab:orange", "c": "tab:blue"}
TEMPLATE = Path(__file__).with_name("report_template.md")  # the page's prose; its only numbers are {fields}


def select(records: Iterable[Record], **where: Any) -> list[Record]:
    return [r for r in records if all(r.get(key) == value for key, value in where.items())]


def reference(records: Iterable[Record], record: Record) -> Record:
    """veomni_lite's record at `record`'s bench, kind and configuration."""
    at = {key: record[key] for key in ("bench", "kind", "world", "sp", "ga")}
    return select(records, strategy=BENCHES[record["bench"]][0], **at)[0]


def distinct(records: Iterable[Record], *keys: str) -> list[Any]:
    values = sorted({tuple(r[key] for key in keys) for r in records})
    return values if len(keys) > 1 else [value[0] for value in values]


def count(record: Record, what: str) -> float:
    """`what` ("collectives" or "host_reads") per step in the counting phase of the record's bench."""
    return record["counts"][what].get(BENCHES[record["bench"]][1], 0.0)


def span(values: Iterable[float], fmt: str = "{:g}") -> str:
    """ "lo–hi" of `values` formatted with `fmt`, or one value when both ends read the same."""
    values = list(values)
    if not values:
        return "n/a"
    low, high = fmt.format(min(values)), fmt.format(max(values))
    return low if low == high else f"{low}–{high}"


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}" if seconds >= 0.01 else f"{seconds * 1e3:.2f}"


def paired(record: Record, ref: Record) -> tuple[float, float, float]:
    """(median, q1, q3) of the per-repetition ratios record / ref."""
    ratios = [t / r for t, r in zip(record["times_s"], ref["times_s"]) if r > 0]
    if len(ratios) < 2:
        return (ratios[0],) * 3 if ratios else (float("nan"),) * 3
    q1, median, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
    return median, q1, q3


def table(header: str | Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A Markdown table; `header` is a list of column names or one string of them joined by "|"."""
    header = header.split("|") if isinstance(header, str) else header
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(map(str, row)) + " |" for row in rows]) + "\n"


def fit(points: Sequence[tuple[int, float]]) -> str:
    """ "α + β·GA" through the first and last point when it holds at every point, else the values by GA."""
    (g0, y0), (g1, y1) = points[0], points[-1]
    slope = (y1 - y0) / (g1 - g0) if g1 != g0 else 0.0
    base = y0 - slope * g0
    if any(abs(base + slope * g - y) > 1e-9 for g, y in points):
        return ", ".join(f"GA {g}: {y:g}" for g, y in points)
    term = "" if slope == 0 else "GA" if slope == 1 else f"{slope:g}·GA"
    return f"{base:g}" if not term else term if base == 0 else f"{base:g} + {term}"


def comparison_table(records: list[Record], bench: str, kind: str) -> str:
    """One row per (world, SP, GA): every strategy's median [IQR] ms, paired ratios to veomni_lite, counts, reps."""
    found = select(records, bench=bench, kind=kind)
    ref_key, keys = BENCHES[bench][0], distinct(found, "strategy")
    others = [key for key in keys if key != ref_key]
    rows = []
    for world, sp, ga in distinct(found, "world", "sp", "ga"):
        at = {r["strategy"]: r for r in select(found, world=world, sp=sp, ga=ga)}
        rows.append(
            [world, sp, ga]
            + [f"{ms(at[k]['median_s'])} [{ms(at[k]['q1_s'])}–{ms(at[k]['q3_s'])}]" for k in keys]
            + ["{:.2f}x ({:.2f}–{:.2f})".format(*paired(at[k], at[ref_key])) for k in others]
            + [" / ".join(f"{count(at[k], what):g}" for k in keys) for what in ("collectives", "host_reads")]
            + [at[ref_key]["reps"]]
        )
    ratios = [f"({k})/({ref_key})" for k in others]
    counts = [f"collectives {'/'.join(keys)}", f"host reads {'/'.join(keys)}"]
    header = ["world", "SP", "GA", *(f"({k}) ms" for k in keys), *ratios, *counts, "reps"]
    return f"**{KINDS[kind]}**\n\n" + table(header, rows)


def summary_table(records: list[Record]) -> str:
    """Per bench, baseline and SP: the range of median ratios over every configuration and at the largest GA."""
    rows = []
    for bench, (ref_key, _) in BENCHES.items():
        found = select(records, bench=bench)
        top = max(r["ga"] for r in found)
        for key, sp in distinct(select(found, kind="vlm"), "strategy", "sp"):
            if key == ref_key:
                continue
            cells = []
            for kind in KINDS:
                medians = [
                    (r["ga"], paired(r, reference(records, r))[0])
                    for r in select(found, kind=kind, strategy=key, sp=sp)
                ]
                top_medians = [median for ga, median in medians if ga == top]
                cells.append(f"{span((m for _, m in medians), '{:.2f}')}x (GA {top}: {span(top_medians, '{:.2f}')}x)")
            rows.append([bench, f"({key}) / ({ref_key})", sp, *cells])
    return table(["bench", "ratio", "SP", *(f"{name}: all (largest GA)" for name in KINDS.values())], rows)


def growth_table(records: list[Record]) -> str:
    """Collectives and host reads per step as a function of GA per bench, SP and strategy (per world if they differ)."""
    rows = []
    for bench in BENCHES:
        found = select(records, bench=bench, kind="vlm")
        for sp, key in distinct(found, "sp", "strategy"):
            fits = {}
            for world in distinct(found, "world"):
                points = sorted(select(found, sp=sp, strategy=key, world=world), key=lambda r: r["ga"])
                fits[world] = [
                    fit([(r["ga"], count(r, what)) for r in points]) for what in ("collectives", "host_reads")
                ]
            first = next(iter(fits.values()))
            by_world = {"all": first} if all(value == first for value in fits.values()) else fits
            rows += [[bench, sp, f"({key})", world, *cells] for world, cells in by_world.items()]
    return table(["bench", "SP", "strategy", "world", "collectives per step", "host reads per step"], rows)


def caveat(records: list[Record]) -> str:
    """Where (b) beats veomni_lite on the VLM step, and why this testbed can favour it."""
    b = select(records, bench="loss", kind="vlm", strategy="b")
    faster = [r for r in b if paired(r, reference(records, r))[0] < 1]
    if not faster:
        return f"(b) is slower than veomni_lite in every one of its {len(b)} VLM-step configurations.\n"
    collectives, reads = (span(count(r, what) for r in faster) for what in ("collectives", "host_reads"))
    packed = span(count(reference(records, r), "collectives") for r in faster)
    return (
        f"(b) is faster than veomni_lite in {len(faster)} of {len(b)} VLM-step configurations (SP "
        f"{span(r['sp'] for r in faster)}, GA {span(r['ga'] for r in faster)}). There (b) makes {collectives} scalar "
        f"all-reduces and {reads} host reads per step against veomni_lite's {packed} packed all-reduce(s): on this "
        "testbed a scalar all-reduce costs less than the packed one (see 'Cost of one all-reduce') and a host read "
        "costs nothing, while on an accelerator every host read is a device sync, which a CPU run cannot price (the "
        "GPU audit is the check for that).\n"
    )


def rss_row(r: Record) -> list[Any]:
    (early_step, early), (end_step, end) = r["rss_kib_samples"][1], r["rss_kib_samples"][-1]
    rss = [f"{early / 1024:.1f} (step {early_step})", f"{end / 1024:.1f} (step {end_step})"]
    growth = [f"{r['rss_growth_kib_after_first_tenth']:+d}", f"{r['peak_rss_kib_all_ranks'] / 1024:.1f}"]
    slots = f"{r['max_metric_window_slots']} / {r['metric_specs']}"
    return [r["world"], r["steps"], r["grad_accum"], *rss, *growth, r["memo_steps_held"], slots]


def gpu_row(audit: Record) -> list[Any]:
    syncs = ", ".join(f"{k}: {v}" for k, v in sorted(audit["warn_syncs_by_region"].items())) or "none"
    verdict = "pass" if audit["error_mode_passed"] else "FAIL"
    return [audit[key] for key in ("device", "world", "sp", "grad_accum", "steps")] + [syncs, verdict]


def page_values(results: Mapping[str, Any], records: list[Record], png: str) -> dict[str, Any]:
    """The fields of the template that are not top-level keys of `results`, its machine or its settings."""
    runs = dict(sorted(results["runs"].items(), key=lambda item: int(item[0])))
    loss, vlm = select(records, bench="loss"), select(records, kind="vlm")
    c, m = select(vlm, bench="loss", strategy="c"), select(vlm, bench="metrics", strategy="b")
    single, rss = results.get("single_process") or [], [run["rss"] for run in runs.values() if run.get("rss")]
    audits = [audit for audit in results.get("gpu") or [] if audit.get("audited")]
    over = [world for world in runs if int(world) > results["machine"]["logical_cpus"]]
    probes = [
        [world, name, f"{v['median'] * 1e3:.3f}", span((v["q1"] * 1e3, v["q3"] * 1e3), "{:.3f}")]
        for world, run in runs.items()
        for name, v in (run.get("all_reduce_latency") or {}).items()
    ]
    return {
        **{f"{bench}_{kind}": comparison_table(records, bench, kind) for bench in BENCHES for kind in KINDS},
        "labels": {f"{r['bench']}_{r['strategy']}": r["label"] for r in records},
        "worlds": ", ".join(runs),
        "sps": span(r["sp"] for r in c),
        "gas": span(r["ga"] for r in c),
        "c_collectives": span(count(r, "collectives") for r in c),
        "c_reads": span(count(r, "host_reads") for r in c),
        "c_configs": len(c),
        "m_collectives": span(count(r, "collectives") for r in m),
        "m_reads": span(count(r, "host_reads") for r in m),
        "summary": summary_table(records),
        "caveat": caveat(records),
        "png": png,
        "metric_count": len(results["metric_names"]),
        "metric_names": ", ".join(f"`{name}`" for name in results["metric_names"]),
        "loss_keys": ", ".join(f"`{key}`" for key in results["loss_keys"]),
        "vlm_grad": max(r["check"]["grad_max_rel_diff"] for r in select(loss, kind="vlm")),
        "path_grad": max(r["check"]["grad_max_rel_diff"] for r in select(loss, kind="path")),
        "loss_diff": max(r["check"]["loss_rel_diff"] for r in loss),
        "metrics_equal": "equal"
        if all(r["check"].get("equal") for r in records if r["bench"] == "metrics")
        else "DIFFERENT",
        "grad_syncs": span(r["counts"]["collectives"].get("grad_sync", 0.0) for r in select(vlm, bench="loss")),
        "a2a": span(
            r["counts"]["collectives"].get("model", 0.0) / r["ga"] for r in select(vlm, bench="loss") if r["sp"] > 1
        ),
        "growth": growth_table(records),
        "single": table(
            ["GA", *(f"({key}) µs" for key in distinct(single, "strategy"))],
            ([ga, *(f"{r['median_s'] * 1e6:.0f}" for r in select(single, ga=ga))] for ga in distinct(single, "ga")),
        ),
        "log_interval": span(r["log_interval"] for r in rss),
        "rss": table(
            "world|steps|GA|RSS MiB early|RSS MiB end|growth KiB|peak MiB|memo steps|metric slots", map(rss_row, rss)
        ),
        "gpu": table("device|world|SP|GA|steps|syncs by region (warn pass)|error pass", map(gpu_row, audits))
        if audits
        else "**Not run** for this page (no audit results were found).\n",
        "oversubscribed": f"; {', '.join(over)} processes share {results['machine']['logical_cpus']} CPUs, so those "
        "collectives include scheduling delay (real on a loaded host, larger than on a cluster)"
        if over
        else "",
        "probe": table("world|buffer|median ms|IQR ms", probes),
    }


def write_plot(results: Mapping[str, Any], records: list[Record], path: Path) -> None:
    """Per (bench, world, SP) column: median step time with IQR against GA; collectives and host reads per step."""
    groups = [
        (bench, world, sp) for bench in BENCHES for world, sp in distinct(select(records, bench=bench), "world", "sp")
    ]
    fig, axes = plt.subplots(2, len(groups), figsize=(3.4 * len(groups), 7.5), squeeze=False)
    handles: dict[str, Any] = {}
    for col, (bench, world, sp) in enumerate(groups):
        found = select(records, bench=bench, world=world, sp=sp)
        for key in distinct(found, "strategy"):
            color = "tab:blue" if key == BENCHES[bench][0] else COLORS[key]
            for kind, style in (("vlm", "-"), ("path", "--")):
                runs = sorted(select(found, kind=kind, strategy=key), key=lambda r: r["ga"])
                gas, medians = [r["ga"] for r in runs], [r["median_s"] * 1e3 for r in runs]
                err = [
                    [m - r["q1_s"] * 1e3 for m, r in zip(medians, runs)],
                    [r["q3_s"] * 1e3 - m for m, r in zip(medians, runs)],
                ]
                label = f"{bench} {runs[0]['label']}, {KINDS[kind]}"
                handles[label] = axes[0][col].errorbar(gas, medians, yerr=err, fmt=style, marker="o", ms=3, color=color)
                if kind == "vlm":
                    axes[1][col].plot(gas, [count(r, "collectives") for r in runs], "-", marker="o", ms=3, color=color)
                    axes[1][col].plot(gas, [count(r, "host_reads") for r in runs], ":", marker="x", ms=3, color=color)
        axes[0][col].set_title(f"{bench}: world {world}, SP {sp}", fontsize=9)
        axes[0][col].set_ylabel("median step time (ms)", fontsize=8)
        axes[1][col].set_ylabel("per step: collectives (—), host reads (··)", fontsize=8)
        for ax in axes[:, col]:
            ax.set(xscale="log", yscale="log", xlabel="GA")
            ax.set_xticks(distinct(found, "ga"), [str(ga) for ga in distinct(found, "ga")])
            ax.minorticks_off()
            ax.grid(True, alpha=0.3)
    fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=3, fontsize=8)
    fig.suptitle(f"veomni_lite vs baselines, {results['machine']['backend']} ({results['mode']} mode)")
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    fig.savefig(path, dpi=90)
    plt.close(fig)


def write_report(results: Mapping[str, Any], out_dir: Path) -> tuple[Path, Path]:
    """Write benchmarks.md and benchmarks.png under `out_dir`; returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    records = [record for run in results["runs"].values() for record in run["records"]]
    md, png = out_dir / "benchmarks.md", out_dir / "benchmarks.png"
    write_plot(results, records, png)
    values = {**results, **results["machine"], **results["settings"], **page_values(results, records, png.name)}
    md.write_text(TEMPLATE.read_text().format(**values))
    return md, png
