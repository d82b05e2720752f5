"""Write `benchmarks.md` and `benchmarks.png` from the results dict `run_all.py` builds (its results JSON).

Contract: `write_report(results, out_dir)` reads nothing but `results` and writes `out_dir/benchmarks.md` and
`out_dir/benchmarks.png`. The page is `report_template.md` filled in with `str.format`: the template's prose holds no
typed-in numbers (a test checks it has no digit outside its {fields}); every number, in tables and sentences alike,
is computed here from `results`, the targets included (`results["targets"]`, which run_all.py writes). A ratio is
one strategy's time / another's, paired per repetition (both ran in that repetition, back to back), given as median
(IQR) or median (IQR) [min–max]. Against veomni_lite a ratio is baseline / veomni_lite (> 1: veomni_lite faster);
against a floor (the oracle) it is veomni_lite / floor (> 1: slower than the floor); the trainer's is trainer / bare
loop. Counts are per optimizer step on rank 0, from the untimed counting round. What `results` lacks (no trainer
benchmark, no GPU results, no targets) is reported as not run.
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
FLOORS = {"loss": "o"}  # bench -> its lower-bound strategy: that ratio column is veomni_lite / floor
KINDS = {"vlm": "VLM step", "path": "path alone"}
COLORS = {"a": "tab:red", "b": "tab:orange", "c": "tab:blue", "d": "tab:green", "o": "tab:gray"}
PASSES = {"<=": lambda value, bound: value <= bound, ">=": lambda value, bound: value >= bound}
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
    """`what` ("collectives", "host_reads", "elements") per step in the counting phase of the record's bench."""
    return record["counts"].get(what, {}).get(BENCHES[record["bench"]][1], 0.0)


def span(values: Iterable[float], fmt: str = "{:g}") -> str:
    """ "lo–hi" of `values` formatted with `fmt`, or one value when both ends read the same."""
    values = list(values)
    if not values:
        return "n/a"
    low, high = fmt.format(min(values)), fmt.format(max(values))
    return low if low == high else f"{low}–{high}"


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}" if seconds >= 0.01 else f"{seconds * 1e3:.2f}"


def spread(record: Record, ref: Record) -> tuple[float, float, float, float, float]:
    """(median, q1, q3, min, max) of the per-repetition ratios record / ref."""
    ratios = [t / r for t, r in zip(record["times_s"], ref["times_s"]) if r > 0]
    if len(ratios) < 2:
        return (ratios[0],) * 5 if ratios else (float("nan"),) * 5
    q1, median, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
    return median, q1, q3, min(ratios), max(ratios)


def paired(record: Record, ref: Record) -> tuple[float, float, float]:
    """(median, q1, q3) of the per-repetition ratios record / ref."""
    return spread(record, ref)[:3]


def ratio_text(values: Sequence[float], with_range: bool = False) -> str:
    text = "{:.2f}x ({:.2f}–{:.2f})".format(*values[:3])
    return text + " [{:.2f}–{:.2f}]".format(*values[3:5]) if with_range else text


def oriented(bench: str, key: str) -> tuple[str, str]:
    """(numerator, denominator) of `key`'s ratio column: baseline / veomni_lite, or veomni_lite / floor."""
    ref = BENCHES[bench][0]
    return (ref, key) if FLOORS.get(bench) == key else (key, ref)


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


# ------------------------------------------------------------------------------------------------ side by side


def comparison_table(records: list[Record], bench: str, kind: str) -> str:
    """One row per (world, SP, GA): every strategy's median [IQR] ms, paired ratios, counts, reps."""
    found = select(records, bench=bench, kind=kind)
    ref_key, keys = BENCHES[bench][0], distinct(found, "strategy")
    others = [key for key in keys if key != ref_key]
    rows = []
    for world, sp, ga in distinct(found, "world", "sp", "ga"):
        at = {r["strategy"]: r for r in select(found, world=world, sp=sp, ga=ga)}
        ratios = []
        for key in others:
            num, den = oriented(bench, key)
            ratios.append(ratio_text(paired(at[num], at[den])))
        rows.append(
            [world, sp, ga]
            + [f"{ms(at[k]['median_s'])} [{ms(at[k]['q1_s'])}–{ms(at[k]['q3_s'])}]" for k in keys]
            + ratios
            + [" / ".join(f"{count(at[k], what):g}" for k in keys) for what in ("collectives", "host_reads")]
            + [at[ref_key]["reps"]]
        )
    ratio_names = ["({})/({})".format(*oriented(bench, key)) for key in others]
    counts = [f"collectives {'/'.join(keys)}", f"host reads {'/'.join(keys)}"]
    header = ["world", "SP", "GA", *(f"({k}) ms" for k in keys), *ratio_names, *counts, "reps"]
    return f"**{KINDS[kind]}**\n\n" + table(header, rows)


def summary_table(records: list[Record]) -> str:
    """Per bench, ratio and SP: the range of median ratios over every configuration and at the largest GA."""
    rows = []
    for bench, (ref_key, _) in BENCHES.items():
        found = select(records, bench=bench)
        top = max(r["ga"] for r in found)
        for key, sp in distinct(select(found, kind="vlm"), "strategy", "sp"):
            if key == ref_key:
                continue
            num, den = oriented(bench, key)
            cells = []
            for kind in KINDS:
                medians = []
                for r in select(found, kind=kind, strategy=key, sp=sp):
                    at = {k: reference(records, r) if k == ref_key else r for k in (num, den)}
                    medians.append((r["ga"], paired(at[num], at[den])[0]))
                top_medians = [median for ga, median in medians if ga == top]
                cells.append(f"{span((m for _, m in medians), '{:.2f}')}x (GA {top}: {span(top_medians, '{:.2f}')}x)")
            rows.append([bench, f"({num}) / ({den})", sp, *cells])
    return table(["bench", "ratio", "SP", *(f"{name}: all (largest GA)" for name in KINDS.values())], rows)


def growth_table(records: list[Record]) -> str:
    """Collectives, host reads and elements sent per step against GA per bench, SP and strategy (per world if they
    differ)."""
    whats = ("collectives", "host_reads", "elements")
    rows = []
    for bench in BENCHES:
        found = select(records, bench=bench, kind="vlm")
        for sp, key in distinct(found, "sp", "strategy"):
            fits = {}
            for world in distinct(found, "world"):
                points = sorted(select(found, sp=sp, strategy=key, world=world), key=lambda r: r["ga"])
                fits[world] = [fit([(r["ga"], count(r, what)) for r in points]) for what in whats]
            first = next(iter(fits.values()))
            by_world = {"all": first} if all(value == first for value in fits.values()) else fits
            rows += [[bench, sp, f"({key})", world, *cells] for world, cells in by_world.items()]
    header = ["bench", "SP", "strategy", "world", "collectives per step", "host reads per step", "elements sent"]
    return table(header, rows)


def caveat(records: list[Record], probes: Mapping[str, Mapping[str, Any]]) -> str:
    """Where (b) beats veomni_lite on the VLM step, with both schemes' counts there."""
    b = select(records, bench="loss", kind="vlm", strategy="b")
    faster = [r for r in b if paired(r, reference(records, r))[0] < 1]
    if not faster:
        return f"(b) is slower than veomni_lite in every one of its {len(b)} VLM-step configurations.\n"
    collectives, reads = (span(count(r, what) for r in faster) for what in ("collectives", "host_reads"))
    ours = span(count(reference(records, r), "collectives") for r in faster)
    elements = span(
        count(reference(records, r), "elements") / max(count(reference(records, r), "collectives"), 1) for r in faster
    )
    # the probe's first buffer is a count alone, the second veomni_lite's (absent when it is the same size)
    dearer = {
        world: next(iter(run))
        for world, run in probes.items()
        if len(run) > 1 and list(run.values())[-1]["median"] > next(iter(run.values()))["median"]
    }
    why = (
        f"on this testbed one all-reduce of veomni_lite's buffer costs more than one of {next(iter(dearer.values()))} "
        f"at world {', '.join(dearer)} (see 'Cost of one all-reduce') and "
        if dearer
        else "on this testbed "
    )
    return (
        f"(b) is faster than veomni_lite in {len(faster)} of {len(b)} VLM-step configurations (SP "
        f"{span(r['sp'] for r in faster)}, GA {span(r['ga'] for r in faster)}). There (b) makes {collectives} scalar "
        f"all-reduces and {reads} host reads per step against veomni_lite's {ours} all-reduce(s) of {elements} "
        f"elements: {why}a host read costs nothing, while on an accelerator every host read is a device sync, which "
        "a CPU run cannot price (the GPU section is the check for that).\n"
    )


# ----------------------------------------------------------------------------------------------------- targets


def target_records(records: list[Record], target: Mapping[str, Any]) -> list[tuple[Record, Record]]:
    """(numerator, denominator) record pairs of `target` at every configuration measured."""
    pairs = []
    for num in select(records, bench=target["bench"], kind=target["kind"], strategy=target["num"]):
        at = {key: num[key] for key in ("world", "sp", "ga")}
        den = select(records, bench=target["bench"], kind=target["kind"], strategy=target["den"], **at)
        if den and (not target.get("sp") or num["sp"] in target["sp"]):
            pairs.append((num, den[0]))
    return pairs


def verdict(values: Sequence[float], op: str, bound: float) -> str:
    """ "met" when the whole IQR passes, "median only" when the median does, else "missed"."""
    median, q1, q3 = values[:3]
    if PASSES[op](q1, bound) and PASSES[op](q3, bound):
        return "met"
    return "median only" if PASSES[op](median, bound) else "missed"


def targets_section(records: list[Record], targets: Sequence[Mapping[str, Any]]) -> str:
    """One row per target, world and SP; a cell per GA: paired ratio median (IQR) [min–max] and its verdict where
    the target applies (`ga` lists the GA values it is set at; none: every GA)."""
    if not targets:
        return "**No targets** in these results.\n"
    gas = distinct([num for target in targets for num, _ in target_records(records, target)], "ga")
    rows, tally = [], {"met": 0, "median only": 0, "missed": 0}
    for target in targets:
        pairs = target_records(records, target)
        for world, sp in distinct([num for num, _ in pairs], "world", "sp"):
            cells = []
            for ga in gas:
                found = [(n, d) for n, d in pairs if (n["world"], n["sp"], n["ga"]) == (world, sp, ga)]
                if not found:
                    cells.append("—")
                    continue
                values = spread(*found[0])
                applies = not target.get("ga") or ga in target["ga"]
                word = verdict(values, target["op"], target["bound"]) if applies else "not a target"
                if applies:
                    tally[word] += 1
                cells.append(f"{ratio_text(values, with_range=True)} {word}")
            rows.append(
                [
                    target["name"],
                    f"({target['num']})/({target['den']}) {target['op']} {target['bound']:g}",
                    world,
                    sp,
                    *cells,
                ]
            )
    header = ["target", "ratio", "world", "SP", *(f"GA {ga}" for ga in gas)]
    tally_table = table(["configurations a target is set at", *tally], [[sum(tally.values()), *tally.values()]])
    return table(header, rows) + "\n" + tally_table


# ------------------------------------------------------------------------------------------------------ trainer


def trainer_section(records: list[Record], targets: Sequence[Mapping[str, Any]]) -> str:
    """Trainer step vs bare loop: times, paired ratio with spread, counts, and the per-component breakdown."""
    found = select(records, bench="trainer")
    if not found:
        return "**Not run** for this page (the results hold no trainer benchmark).\n"
    bound = next((t for t in targets if t["bench"] == "trainer"), None)
    rows, parts_rows = [], {}
    configs = distinct(found, "world", "ga")
    for world, ga in configs:
        at = {r["strategy"]: r for r in select(found, world=world, ga=ga)}
        trainer, bare = at["trainer"], at["bare"]
        values = spread(trainer, bare)
        word = verdict(values, bound["op"], bound["bound"]) if bound and ga in (bound.get("ga") or [ga]) else ""
        ops = sorted(set(trainer["counts"]["collectives_by_op"]) | set(bare["counts"]["collectives_by_op"]))
        by_op = ", ".join(
            f"{op.split('/')[-1]} {trainer['counts']['collectives_by_op'].get(op, 0):g}/"
            f"{bare['counts']['collectives_by_op'].get(op, 0):g}"
            for op in ops
        )
        reads = "/".join(f"{r['counts']['host_reads'].get('step', 0):g}" for r in (trainer, bare))
        cpu = "—"
        if trainer.get("cpu_times_s") and bare.get("cpu_times_s"):
            cpu = ratio_text(spread({"times_s": trainer["cpu_times_s"]}, {"times_s": bare["cpu_times_s"]}))
        rows.append(
            [world, ga]
            + [f"{ms(r['median_s'])} [{ms(r['q1_s'])}–{ms(r['q3_s'])}]" for r in (trainer, bare)]
            + [f"{ratio_text(values, with_range=True)} {word}".strip(), cpu, by_op, reads, trainer["reps"]]
        )
        for r in (trainer, bare):
            for name, value in r["breakdown_ms"].items():
                parts_rows.setdefault(name, {})[(world, ga, r["strategy"])] = value
    times = table(
        [
            "world",
            "GA",
            "trainer ms",
            "bare ms",
            "trainer/bare",
            "CPU time trainer/bare",
            "collectives trainer/bare",
            "host reads trainer/bare",
            "reps",
        ],
        rows,
    )
    header = ["component (median ms per step)"] + [f"world {w}, GA {g}: trainer / bare" for w, g in configs]
    breakdown_rows = []
    for name, cells in parts_rows.items():
        if not any(cells.values()):
            continue
        row = [name]
        for world, ga in configs:
            pair = [cells.get((world, ga, who)) for who in ("trainer", "bare")]
            row.append(" / ".join("—" if value is None or value == 0 else f"{value:.2f}" for value in pair))
        breakdown_rows.append(row)
    return times + "\n" + table(header, breakdown_rows)


# ------------------------------------------------------------------------------------------------------ GPU


def gpu_section(audits: Sequence[Record]) -> str:
    """Every GPU result found: the sync audit's verdict by region and the step time with and without normalization."""
    audited = [audit for audit in audits if audit.get("audited")]
    if not audited:
        return "**Not run** for this page (no GPU results were found).\n"
    rows = []
    for audit in audited:
        syncs = ", ".join(f"{k}: {v}" for k, v in sorted(audit["warn_syncs_by_region"].items())) or "none"
        verdict_text = "pass" if audit["error_mode_passed"] else "FAIL"
        step = audit.get("step_time_s") or {}
        times = " / ".join(f"{step[mode]['median'] * 1e3:.2f}" if mode in step else "—" for mode in GPU_MODES)
        ratio = audit.get("normalization_ratio")
        rows.append(
            [audit[key] for key in ("device", "backend", "world", "sp", "grad_accum")]
            + [audit.get("precision", "—"), syncs, verdict_text, times]
            + ["—" if ratio is None else "{:.2f}x ({:.2f}–{:.2f})".format(*ratio)]
        )
    header = "device|backend|world|SP|GA|precision|syncs by region (warn pass)|error pass|"
    header += f"step ms {' / '.join(GPU_MODES)}|veomni_lite / none"
    return table(header, rows)


GPU_MODES = ("none", "oracle", "veomni_lite")  # the loss normalizations the GPU step is timed with


# --------------------------------------------------------------------------------------------------------- page


def rss_row(r: Record) -> list[Any]:
    (early_step, early), (end_step, end) = r["rss_kib_samples"][1], r["rss_kib_samples"][-1]
    rss = [f"{early / 1024:.1f} (step {early_step})", f"{end / 1024:.1f} (step {end_step})"]
    growth = [f"{r['rss_growth_kib_after_first_tenth']:+d}", f"{r['peak_rss_kib_all_ranks'] / 1024:.1f}"]
    slots = f"{r['max_metric_window_slots']} / {r['metric_specs']}"
    return [r["world"], r["steps"], r["grad_accum"], *rss, *growth, r["memo_steps_held"], slots]


def checked(records: Iterable[Record], field: str) -> float:
    values = [r["check"][field] for r in records if field in r["check"]]
    return max(values) if values else float("nan")


def sft_input_table(sft: Mapping[str, Any] | None) -> str:
    """The SFT job's step without / with the prefetch thread (median [IQR] ms), or a note that it was not run."""
    if not sft:
        return "Not measured in this run."
    cells = [f"{sft['median_ms'][k]:.1f} [{sft['q1_ms'][k]:.1f}–{sft['q3_ms'][k]:.1f}]" for k in ("without", "with")]
    ratio = sft["median_ms"]["without"] / sft["median_ms"]["with"]
    return table(
        "steps|global batch|step ms without prefetch|step ms with prefetch|without / with",
        [[sft["steps"], sft["global_batch_size"], *cells, f"{ratio:.2f}x"]],
    )


def packing_table(packing: Mapping[str, Any] | None) -> str:
    """Per SFT job, padded vs packed (token budgets): step time, real tokens/s, padding, peak RSS; the verdicts."""
    if not packing:
        return "Not measured in this run."
    rows, summary = [], []
    for job in packing["jobs"]:
        for name, v in job["variants"].items():
            rows.append(
                [job["job"], name, f"{v['micro_batches_per_step']:.2f}",
                 f"{v['median_ms']:.1f} [{v['q1_ms']:.1f}–{v['q3_ms']:.1f}]", f"{v['real_tokens_per_s']:,.0f}",
                 f"{v['padding_ratio']:.3f}", f"{v['peak_rss_mib']:.0f}"]
            )  # fmt: skip
        for budget, r in job["speedups"].items():
            verdict = "met" if r["speedup"] >= job["target"] and r["low"] >= 1.0 else "missed"
            summary.append(
                [job["job"], f"{job['lengths'][0]}–{job['lengths'][1]}", job["steps"], job["global_batch_size"],
                 budget, f"{r['speedup']:.2f}x [{r['low']:.2f}–{r['high']:.2f}]", f">= {job['target']:g}x", verdict]
            )  # fmt: skip
    header = "job|variant|micro-batches per step|step ms median [IQR]|real tokens per s|padding ratio|peak RSS MiB"
    summary_header = (
        "job|sample tokens|steps|global batch|packed budget (tokens)|packed / padded real tokens per s "
        "[lowest–highest block]|target|verdict"
    )
    return table(header, rows) + "\n" + table(summary_header, summary)


def lm_head_table(head: Mapping[str, Any] | None) -> str:
    """Fused vs plain LM head: peak RSS of a step at both vocabularies, the growth against one [tokens, vocab]
    float32 tensor, tokens/s; the verdicts."""
    if not head:
        return "Not measured in this run."
    growth_target, speed_target = head["targets"]
    rows, plain = [], {r["tokens"]: r for r in head["rows"] if not r["fused"] and "skipped" not in r}
    for r in head["rows"]:
        name = "fused" if r["fused"] else "plain"
        if "skipped" in r:
            rows.append([r["tokens"], name, f"{r['logits_mib']:,.0f}", "not run: " + r["skipped"], "", "", "", "", ""])
            continue
        verdict = ""
        if r["fused"]:
            speed = r["tokens_per_s"] / plain[r["tokens"]]["tokens_per_s"] if r["tokens"] in plain else None
            met = r["growth_per_logits"] <= growth_target and (speed is None or speed >= speed_target)
            verdict = ("met" if met else "missed") + (
                " (growth only)" if speed is None else f" ({speed:.2f}x the plain tokens/s)"
            )
        rows.append(
            [r["tokens"], name, f"{r['logits_mib']:,.0f}", f"{r['base_peak_mib']:,.0f}", f"{r['peak_mib']:,.0f}",
             f"{r['growth_mib']:,.0f}", f"{r['growth_per_logits']:.2f}", f"{r['tokens_per_s']:,.0f}", verdict]
        )  # fmt: skip
    header = (
        f"tokens|head|one [tokens, vocab] float32 MiB|peak MiB, vocab {head['base_vocab']:,}|peak MiB, vocab "
        f"{head['vocab']:,}|growth MiB|growth / logits (fused target <= {growth_target:g})|tokens per s|verdict "
        f"(tokens per s >= {speed_target:g}x plain)"
    )
    return table(header, rows)


def lora_table(lora: Mapping[str, Any] | None) -> str:
    """Full fine-tuning against LoRA on one job: per-rank optimizer state, gradients and peak RSS, step time; the
    verdicts."""
    if not lora:
        return "Not measured in this run."
    rows = [
        [name, f"{v['trained']:,} of {v['parameters']:,}", f"{v['optimizer_bytes'] / 2**20:.2f}",
         f"{v['grad_bytes'] / 2**20:.2f}", f"{v['peak_rss_mib']:.0f}", f"{v['median_ms']:.0f}"]
        for name, v in lora["variants"].items()
    ]  # fmt: skip
    header = "variant|parameters trained|optimizer state MiB per rank|gradients MiB per rank|peak RSS MiB per rank|"
    state_ok, peak_ok = (
        lora["optimizer_ratio"] <= lora["target"],
        lora["peak_saved_mib"] >= lora["state_and_grads_saved_mib"],
    )
    summary = table(
        "model|model.lora|steps|optimizer state LoRA / full|target|peak RSS saved MiB|state + gradients saved MiB|"
        "verdicts",
        [[", ".join(f"{k} {v}" for k, v in lora["model"].items()), f"`{lora['lora']}`", lora["steps"],
          f"{lora['optimizer_ratio']:.4f}", f"<= {lora['target']:g}", f"{lora['peak_saved_mib']:.1f}",
          f"{lora['state_and_grads_saved_mib']:.1f}",
          f"state {'met' if state_ok else 'missed'}, peak {'met' if peak_ok else 'missed'}"]],
    )  # fmt: skip
    return table(header + "median step ms", rows) + "\n" + summary


def data_startup_table(startup: Mapping[str, Any] | None) -> str:
    """Per set and size: seconds to step 1 and peak RSS per rank on the first and second run, first-run rows/s."""
    if not startup:
        return "Not measured in this run."
    rss = lambda run: " / ".join(f"{v:.0f}" for v in run["peak_rss_mib"]) if run else "–"  # noqa: E731
    step = lambda run: f"{run['to_first_step_s']:.1f}" if run else "–"  # noqa: E731 - the quick mode runs once
    rows = [
        [r["kind"], f"{r['rows']:,}", step(r["first"]), step(r["second"]), rss(r["first"]), rss(r["second"]),
         f"{r['rows_per_s']:,.0f}", f"{r.get('cpu_ms_per_row', 0):.2f}"]
        for r in startup["runs"]
    ]  # fmt: skip
    header = "set|rows|first run: s to step 1|second run: s to step 1|first run peak RSS MiB (rank 0 / 1)"
    return table(header + "|second run peak RSS MiB|first run rows/s (both ranks)|first run CPU ms per row", rows)


def many_machines_tables(many: Mapping[str, Any] | None) -> str:
    """World x GA: loss all-reduces and host reads per step, the step's, step time; memory growth per choice; peak
    memory while building, whole or scattered."""
    if not many:
        return "Not measured in this run."
    scaling = [
        [r["world"], r["ga"], f"{r['loss_collectives']:g}", f"{r['loss_host_reads']:g}", f"{r['step_collectives']:g}",
         f"{r['step_host_reads']:g}", f"{r['median_ms']:.1f}"]
        for r in many["scaling"]
    ]  # fmt: skip
    header = "world|GA|loss all-reduces per step|loss host reads per step|step collectives|step host reads|step ms"

    def per_rank(rows: list[dict[str, Any]], label: str, mib: str) -> list[list[Any]]:
        return [
            [r["size"], f"{r['parameters'] / 1e6:.1f}M", r[label], *(f"{rank[mib]:.0f}" for rank in r["ranks"]),
             f"{r['loss_max_rel_diff']:.1e}"]
            for r in rows
        ]  # fmt: skip

    memory = per_rank(many["memory"], "choice", "growth_mib")
    memory_header = "model|parameters|choice|rank 0 growth MiB|rank 1 growth MiB|loss rel diff vs the first row"
    builds = per_rank(many.get("builds", []), "build", "build_mib")
    build_header = "model|parameters|built|rank 0 build peak MiB|rank 1 build peak MiB|loss rel diff vs the whole build"
    tables = [table(header, scaling), table(memory_header, memory)] + ([table(build_header, builds)] if builds else [])
    return "\n".join(tables)


def page_values(results: Mapping[str, Any], records: list[Record], png: str) -> dict[str, Any]:
    """The fields of the template that are not top-level keys of `results`, its machine or its settings."""
    runs = dict(sorted(results["runs"].items(), key=lambda item: int(item[0])))
    loss, vlm = select(records, bench="loss"), select(records, kind="vlm")
    c, m = select(vlm, bench="loss", strategy="c"), select(vlm, bench="metrics", strategy="b")
    rss = [run["rss"] for run in runs.values() if run.get("rss")]
    over = [world for world in runs if int(world) > results["machine"]["logical_cpus"]]
    latency = {world: run.get("all_reduce_latency") or {} for world, run in runs.items()}
    probes = [
        [world, name, f"{v['median'] * 1e3:.3f}", span((v["q1"] * 1e3, v["q3"] * 1e3), "{:.3f}")]
        for world, run in latency.items()
        for name, v in run.items()
    ]
    partial = [r for r in loss if r["check"].get("not_global")]
    trainer = select(records, bench="trainer")
    targets = results.get("targets") or []
    labels = {f"{r['bench']}_{r['strategy']}": r["label"] for r in records}
    return {
        **{f"{bench}_{kind}": comparison_table(records, bench, kind) for bench in BENCHES for kind in KINDS},
        "labels": labels,
        "worlds": ", ".join(runs),
        "sps": span(r["sp"] for r in c),
        "gas": span(r["ga"] for r in c),
        "c_collectives": span(count(r, "collectives") for r in c),
        "c_reads": span(count(r, "host_reads") for r in c),
        "c_elements": span(count(r, "elements") / max(count(r, "collectives"), 1) for r in c),
        "c_reads_note": f"(c)'s {span(count(r, 'host_reads') for r in c)} host read(s) per step on CPU are reads of "
        "host memory (no device involved): `mean_global_loss` reads the rank-agreement verdict of the step's one "
        "all-reduce with `bool()`, once per step (`count_loss_token` reads nothing to the host). On an accelerator the "
        "verdict stays on the device until the trainer's per-step grad-norm read (`verify_loss_keys()`), which the GPU "
        "audit checks. "
        if any(count(r, "host_reads") for r in c)
        else "(c) reads nothing to the host on the loss path. ",
        "c_configs": len(c),
        "m_collectives": span(count(r, "collectives") for r in m),
        "m_reads": span(count(r, "host_reads") for r in m),
        "targets_table": targets_section(records, targets),
        "summary": summary_table(records),
        "caveat": caveat(records, latency),
        "png": png,
        "metric_count": len(results["metric_names"]),
        "metric_names": ", ".join(f"`{name}`" for name in results["metric_names"]),
        "loss_keys": ", ".join(f"`{key}`" for key in results["loss_keys"]),
        "partial_heads": ", ".join(f"`{h}`" for h in sorted({h for r in partial for h in r["check"]["heads"]})) or "—",
        "not_global": ", ".join(f"`{h}`" for h in sorted({h for r in partial for h in r["check"]["not_global"]}))
        or "—",
        "vlm_grad": checked(select(loss, kind="vlm"), "grad_max_rel_diff"),
        "path_grad": checked(select(loss, kind="path"), "grad_max_rel_diff"),
        "loss_diff": checked(loss, "loss_rel_diff"),
        "metrics_equal": "equal"
        if all(r["check"].get("equal") for r in records if r["bench"] == "metrics")
        else "DIFFERENT",
        "grad_syncs": span(r["counts"]["collectives"].get("grad_sync", 0.0) for r in select(vlm, bench="loss")),
        "a2a": span(
            r["counts"]["collectives"].get("model", 0.0) / r["ga"] for r in select(vlm, bench="loss") if r["sp"] > 1
        ),
        "growth": growth_table(records),
        "log_interval": span(r["log_interval"] for r in rss),
        "rss": table(
            "world|steps|GA|RSS MiB early|RSS MiB end|growth KiB|peak MiB|memo steps|metric slots", map(rss_row, rss)
        ),
        "trainer": trainer_section(records, targets),
        "trainer_log_interval": span(r["log_interval"] for r in trainer),
        "trainer_norm_diff": checked(trainer, "grad_norm_rel_diff"),
        "gpu": gpu_section(results.get("gpu") or []),
        "sft_input": sft_input_table(results.get("sft_input")),
        "packing": packing_table(results.get("packing")),
        "lm_head": lm_head_table(results.get("lm_head")),
        "many_machines": many_machines_tables(results.get("many_machines")),
        "lora": lora_table(results.get("lora")),
        "data_startup": data_startup_table(results.get("data_startup")),
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
    fig.tight_layout(rect=(0, 0.14, 1, 1))
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
