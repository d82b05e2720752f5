"""Turn the merged benchmark results into `benchmarks.md` (tables, machine, command) and `benchmarks.png`.

Contract: `write_report(results, out_dir)` reads only the dict `run_all.py` builds (worker JSONs by world size, plus
mode, command, timings and an optional GPU audit) and writes `out_dir/benchmarks.md` and `out_dir/benchmarks.png`.
Ratios are median step time over veomni_lite's median step time in the same layout and GA (> 1: veomni_lite is
faster). Counts are per optimizer step, on rank 0, from the untimed counting round.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - the backend must be chosen first

Record = dict[str, Any]

LOSS_REFERENCE = "c"
METRIC_REFERENCE = "b"
LOSS_NAMES = {
    "a": "(a) per-micro-batch denominator",
    "b": "(b) VeOmni 0.1.12 step-start reduce",
    "c": "(c) veomni_lite",
}
METRIC_NAMES = {"a": "(a) reduce every record", "b": "(b) veomni_lite log-time"}
COLORS = {"a": "tab:red", "b": "tab:orange", "c": "tab:blue"}
METRIC_COLORS = {"a": "tab:red", "b": "tab:blue"}
HEADLINE_GA = (8, 16)


# ------------------------------------------------------------------------------------------------------ accessors


def all_records(results: Mapping[str, Any]) -> list[Record]:
    return [record for run in results["runs"].values() for record in run["records"]]


def select(records: Iterable[Record], **where: Any) -> list[Record]:
    return [r for r in records if all(r.get(key) == value for key, value in where.items())]


def one(records: Iterable[Record], **where: Any) -> Record | None:
    found = select(records, **where)
    return found[0] if found else None


def layouts(records: Iterable[Record]) -> list[tuple[int, int]]:
    return sorted({(r["world"], r["sp"]) for r in records})


def ga_values(records: Iterable[Record]) -> list[int]:
    return sorted({r["ga"] for r in records})


def loss_collectives(record: Record) -> float:
    """Collectives of the loss path (phase "step": everything in the micro-batch loop but the model's all-to-all)."""
    return record["counts"]["collectives"].get("step", 0.0)


def loss_host_reads(record: Record) -> float:
    return record["counts"]["host_reads"].get("step", 0.0)


def metric_collectives(record: Record) -> float:
    return record["counts"]["collectives"].get("metrics", 0.0)


def metric_host_reads(record: Record) -> float:
    return record["counts"]["host_reads"].get("metrics", 0.0)


def ms(seconds: float) -> str:
    value = seconds * 1e3
    return f"{value:.1f}" if value >= 10 else f"{value:.2f}"


def spread(record: Record) -> str:
    return f"{ms(record['median_s'])} [{ms(record['q1_s'])}–{ms(record['q3_s'])}]"


def paired_ratios(record: Record, reference: Record) -> list[float]:
    """Per-repetition ratios: both ran in the same repetition, back to back, so machine drift cancels."""
    return [t / r for t, r in zip(record["times_s"], reference["times_s"]) if r > 0]


def ratio_value(record: Record, reference: Record | None) -> float | None:
    """Median of the paired per-repetition ratios record / reference (None without a reference)."""
    if reference is None:
        return None
    ratios = paired_ratios(record, reference)
    return statistics.median(ratios) if ratios else None


def ratio(record: Record, reference: Record | None, with_spread: bool = True) -> str:
    """ "1.31x (1.20–1.45)": median [IQR] of the paired per-repetition ratios."""
    if reference is None:
        return "n/a"
    ratios = sorted(paired_ratios(record, reference))
    if not ratios:
        return "n/a"
    median = statistics.median(ratios)
    if not with_spread or record is reference or len(ratios) < 2:
        return f"{median:.2f}x"
    q1, _, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
    return f"{median:.2f}x ({q1:.2f}–{q3:.2f})"


def count(value: float) -> str:
    return f"{value:g}"


def table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


def linear_fit(points: Sequence[tuple[int, float]]) -> str:
    """ "α + β·GA" through the smallest and largest GA, checked against every point (else the raw values)."""
    if not points:
        return "n/a"
    (g0, y0), (g1, y1) = points[0], points[-1]
    slope = (y1 - y0) / (g1 - g0) if g1 != g0 else 0.0
    intercept = y0 - slope * g0
    if any(abs(intercept + slope * g - y) > 1e-9 for g, y in points):
        return ", ".join(f"GA {g}: {count(y)}" for g, y in points)
    if slope == 0:
        return count(intercept)
    slope_text = "GA" if slope == 1 else f"{count(slope)}·GA"
    return slope_text if intercept == 0 else f"{count(intercept)} + {slope_text}"


# --------------------------------------------------------------------------------------------------------- report


def headline_rows(records: list[Record]) -> list[list[str]]:
    rows = []
    for world, sp in layouts(select(records, bench="loss")):
        for ga in HEADLINE_GA:
            found = {k: one(records, bench="loss", kind="vlm", world=world, sp=sp, ga=ga, strategy=k) for k in "abc"}
            if any(value is None for value in found.values()):
                continue
            reference = found[LOSS_REFERENCE]
            rows.append(
                [
                    f"{world}",
                    f"{sp}",
                    f"{ga}",
                    *(ms(found[k]["median_s"]) for k in "abc"),
                    ratio(found["a"], reference),
                    ratio(found["b"], reference),
                    " / ".join(count(loss_collectives(found[k])) for k in "abc"),
                    " / ".join(count(loss_host_reads(found[k])) for k in "abc"),
                ]
            )
    return rows


def measured(records: list[Record], bench: str, keys: str, reference: str) -> Iterator[tuple]:
    """(world, sp, ga, key, vlm, path, vlm_ref, path_ref) for every strategy measured in both kinds of step."""
    for world, sp in layouts(select(records, bench=bench)):
        for ga in ga_values(select(records, bench=bench, world=world, sp=sp)):
            at = {"bench": bench, "world": world, "sp": sp, "ga": ga}
            vlm_ref = one(records, kind="vlm", strategy=reference, **at)
            path_ref = one(records, kind="path", strategy=reference, **at)
            for key in keys:
                vlm = one(records, kind="vlm", strategy=key, **at)
                path = one(records, kind="path", strategy=key, **at)
                if vlm is not None and path is not None:
                    yield world, sp, ga, key, vlm, path, vlm_ref, path_ref


def loss_rows(records: list[Record]) -> list[list[str]]:
    return [
        [
            f"{world}",
            f"{sp}",
            f"{ga}",
            LOSS_NAMES[key],
            spread(vlm),
            ratio(vlm, vlm_ref),
            spread(path),
            ratio(path, path_ref),
            count(loss_collectives(vlm)),
            count(loss_host_reads(vlm)),
            count(vlm["counts"]["collectives"].get("model", 0.0)),
            f"{vlm['reps']}/{path['reps']}",
            f"{vlm['check']['grad_max_rel_diff']:.1e}",
        ]
        for world, sp, ga, key, vlm, path, vlm_ref, path_ref in measured(records, "loss", "abc", LOSS_REFERENCE)
    ]


def metric_rows(records: list[Record]) -> list[list[str]]:
    return [
        [
            f"{world}",
            f"{ga}",
            METRIC_NAMES[key],
            spread(vlm),
            ratio(vlm, vlm_ref),
            spread(path),
            ratio(path, path_ref),
            count(metric_collectives(vlm)),
            count(metric_host_reads(vlm)),
            f"{vlm['reps']}/{path['reps']}",
        ]
        for world, _sp, ga, key, vlm, path, vlm_ref, path_ref in measured(records, "metrics", "ab", METRIC_REFERENCE)
    ]


def growth_rows(records: list[Record]) -> list[list[str]]:
    """Least-squares growth of collectives and host reads per step with GA, per layout and strategy."""
    benches = (
        ("loss", "abc", lambda key: LOSS_NAMES[key], loss_collectives, loss_host_reads),
        ("metrics", "ab", lambda key: f"metrics {METRIC_NAMES[key]}", metric_collectives, metric_host_reads),
    )
    rows = []
    for bench, keys, name, collectives, host_reads in benches:
        for world, sp in layouts(select(records, bench=bench)):
            for key in keys:
                found = sorted(
                    select(records, bench=bench, kind="vlm", world=world, sp=sp, strategy=key), key=lambda r: r["ga"]
                )
                rows.append(
                    [
                        f"{world}",
                        f"{sp}",
                        name(key),
                        linear_fit([(r["ga"], collectives(r)) for r in found]),
                        linear_fit([(r["ga"], host_reads(r)) for r in found]),
                    ]
                )
    return rows


def marginal_cost_rows(records: list[Record]) -> list[list[str]]:
    """Per layout, at the largest GA: extra path-alone time of (a) over (c) per extra collective (with its reads)."""
    rows = []
    for world, sp in layouts(select(records, bench="loss")):
        path = select(records, bench="loss", kind="path", world=world, sp=sp)
        if not path:
            continue
        ga = max(r["ga"] for r in path)
        a = one(path, ga=ga, strategy="a")
        c = one(path, ga=ga, strategy="c")
        if a is None or c is None:
            continue
        extra = loss_collectives(a) - loss_collectives(c)
        if extra <= 0:
            continue
        per = (a["median_s"] - c["median_s"]) / extra
        rows.append([f"{world}", f"{sp}", f"{ga}", count(extra), f"{per * 1e6:.0f}"])
    return rows


def probe_rows(results: Mapping[str, Any]) -> list[list[str]]:
    rows = []
    for world, run in sorted(results["runs"].items(), key=lambda item: int(item[0])):
        for name, summary in (run.get("all_reduce_latency") or {}).items():
            iqr = f"{summary['q1'] * 1e3:.3f}–{summary['q3'] * 1e3:.3f}"
            rows.append([f"{world}", name, f"{summary['median'] * 1e3:.3f}", iqr])
    return rows


def single_process_rows(results: Mapping[str, Any]) -> list[list[str]]:
    found = results.get("single_process") or []
    rows = []
    for ga in sorted({r["ga"] for r in found}):
        by_key = {r["strategy"]: r for r in found if r["ga"] == ga}
        if set(by_key) != set("abc"):
            continue
        rows.append([f"{ga}", *(f"{by_key[k]['median_s'] * 1e6:.0f}" for k in "abc")])
    return rows


def ratio_range(
    records: list[Record], bench: str, kind: str, sp: int, key: str, min_ga: int
) -> tuple[float, float] | None:
    """(lowest, highest) paired ratio of `key` to the bench's reference over worlds and GA >= `min_ga`."""
    reference_key = LOSS_REFERENCE if bench == "loss" else METRIC_REFERENCE
    values = []
    for record in select(records, bench=bench, kind=kind, sp=sp, strategy=key):
        if record["ga"] < min_ga:
            continue
        reference = one(
            records, bench=bench, kind=kind, world=record["world"], sp=sp, ga=record["ga"], strategy=reference_key
        )
        value = ratio_value(record, reference)
        if value is not None:
            values.append(value)
    return (min(values), max(values)) if values else None


def caveat(records: list[Record]) -> list[str]:
    """Why (b) can match or beat veomni_lite without SP on this testbed, with (b)'s counts from the data."""
    b = one(records, bench="loss", kind="vlm", sp=1, strategy="b")
    if b is None:
        return []
    return [
        "Where veomni_lite is not faster — SP 1 against (b), which without SP also needs only a fixed number of "
        f"collectives per step ({count(loss_collectives(b))} one-element all-reduces) — this CPU testbed favours "
        "(b): those cost less here than veomni_lite's one packed all-reduce (see 'Cost of one all-reduce'), and "
        "`mean_global_loss` does a little more Python and tensor work per micro-batch (see 'One process, no "
        f"communication'). What (b) still costs there is {count(loss_host_reads(b))} host reads per step, each a "
        "device sync on an accelerator, which a CPU run cannot price; the GPU audit is the place for that. With "
        "SP, (a) and (b) add SP collectives and host reads on every micro-batch; veomni_lite adds none.",
    ]


def findings(results: Mapping[str, Any], records: list[Record]) -> list[str]:
    """Bullet points computed from the numbers (ranges of paired ratios; the all-reduce probe)."""
    min_ga = 8
    lines = []

    def span(value: tuple[float, float] | None) -> str:
        return "n/a" if value is None else f"{value[0]:.2f}–{value[1]:.2f}x"

    for sp in sorted({r["sp"] for r in select(records, bench="loss")}):
        for key in "ab":
            vlm = ratio_range(records, "loss", "vlm", sp, key, min_ga)
            path = ratio_range(records, "loss", "path", sp, key, min_ga)
            lines.append(
                f"- SP {sp}, {LOSS_NAMES[key]} / veomni_lite at GA >= {min_ga}, all world sizes: VLM step {span(vlm)}, "
                f"loss path alone {span(path)}."
            )
    for sp in sorted({r["sp"] for r in select(records, bench="metrics")}):
        vlm = ratio_range(records, "metrics", "vlm", sp, "a", min_ga)
        path = ratio_range(records, "metrics", "path", sp, "a", min_ga)
        lines.append(
            f"- Metrics, {METRIC_NAMES['a']} / veomni_lite at GA >= {min_ga}: VLM step {span(vlm)}, metric path alone "
            f"{span(path)}."
        )
    for world, run in sorted(results["runs"].items(), key=lambda item: int(item[0])):
        probe = run.get("all_reduce_latency") or {}
        if len(probe) == 2:
            (_, small), (packed_name, packed) = ((name, summary["median"]) for name, summary in probe.items())
            lines.append(
                f"- World {world}: one all-reduce of {packed_name} takes {packed * 1e3:.2f} ms, of 1 element "
                f"{small * 1e3:.2f} ms ({packed / small:.1f}x): gloo's ring "
                "all-reduce makes 2(N−1) dependent transfers once a buffer has N elements or more, and every "
                "transfer waits for the peer process to be scheduled on an oversubscribed CPU."
            )
    return lines


def rss_rows(results: Mapping[str, Any]) -> list[list[str]]:
    rows = []
    for world, run in sorted(results["runs"].items(), key=lambda item: int(item[0])):
        rss = run.get("rss")
        if not rss:
            continue
        samples = rss["rss_kib_samples"]
        rows.append(
            [
                f"{world}",
                f"{rss['steps']}",
                f"{rss['grad_accum']}",
                f"{samples[1][1] / 1024:.1f} (step {samples[1][0]})" if len(samples) > 1 else "n/a",
                f"{samples[-1][1] / 1024:.1f} (step {samples[-1][0]})",
                f"{rss['rss_growth_kib_after_first_tenth']:+d}",
                f"{rss['peak_rss_kib_all_ranks'] / 1024:.1f}",
                f"{rss['memo_steps_held']}",
                f"{rss['max_metric_window_slots']} / {rss['metric_specs']}",
            ]
        )
    return rows


def check_summary(records: list[Record]) -> str:
    loss = select(records, bench="loss")
    worst_grad = max((r["check"]["grad_max_rel_diff"] for r in loss), default=0.0)
    worst_loss = max((r["check"]["loss_rel_diff"] for r in loss), default=0.0)
    metric_ok = all(r["check"].get("equal") for r in select(records, bench="metrics"))
    return (
        f"Across all {len(ga_values(loss))} GA values and {len(layouts(loss))} layouts, the largest relative gradient "
        f"difference of a baseline from veomni_lite was {worst_grad:.1e} and the largest relative difference of the "
        f"world-mean step loss {worst_loss:.1e} (float32 rounding; the benchmark fails above 1e-4 / 1e-5). "
        f"The metric strategies logged {'identical' if metric_ok else 'DIFFERENT'} values (relative 1e-9)."
    )


def gpu_section(results: Mapping[str, Any]) -> list[str]:
    lines = [
        "## GPU: host-sync audit",
        "",
        "`benchmarks/gpu_sync_audit.py` runs veomni_lite's micro-batch loop on CUDA with NCCL (count_loss_token, the",
        "tiny VLM's forward, `mean_global_loss`, backward, the trainer's per-micro-batch metric records) under",
        '`torch.cuda.set_sync_debug_mode("error")`: any host sync inside the loop raises. It first runs the same',
        'loop in "warn" mode to list every sync by region (count / forward / loss / backward / metrics). Zero syncs',
        "expected.",
        "On a machine without CUDA it prints a message and exits 0. On a GPU machine:",
        "",
        "```",
        "torchrun --standalone --nproc_per_node 2 benchmarks/gpu_sync_audit.py --sp 1 \\",
        "    --out docs/benchmarks_gpu.json",
        "torchrun --standalone --nproc_per_node 2 benchmarks/gpu_sync_audit.py --sp 2 \\",
        "    --out docs/benchmarks_gpu_sp2.json",
        "```",
        "",
        "`make bench` picks up `docs/benchmarks_gpu*.json` when it writes this page.",
        "",
    ]
    audits = [audit for audit in results.get("gpu") or [] if audit.get("audited")]
    if not audits:
        lines += ["**Results: not run yet** (no GPU was available where this page was generated).", ""]
        return lines
    rows = []
    for audit in audits:
        regions = ", ".join(f"{k}: {v}" for k, v in sorted(audit.get("warn_syncs_by_region", {}).items())) or "none"
        rows.append(
            [
                audit.get("device", "?"),
                f"{audit.get('world', '?')}",
                f"{audit.get('sp', '?')}",
                f"{audit.get('grad_accum', '?')}",
                f"{audit.get('steps', '?')}",
                regions,
                "pass" if audit.get("error_mode_passed") else f"FAIL: {audit.get('error', '')[:120]}",
            ]
        )
    lines += table(["device", "world", "SP", "GA", "steps", "syncs by region (warn pass)", '"error" pass'], rows)
    lines.append("")
    for audit in audits:
        for site, calls in sorted((audit.get("warn_sync_sites") or {}).items()):
            lines.append(f"- world {audit.get('world')}, SP {audit.get('sp')}: `{site}` ({calls} syncs over all ranks)")
    lines.append("")
    return lines


def write_markdown(results: Mapping[str, Any], out_dir: Path, png_name: str) -> Path:
    records = all_records(results)
    machine = results["machine"]
    worlds = ", ".join(str(w) for w in sorted(int(w) for w in results["runs"]))
    settings = results["settings"]
    lines = [
        "# Benchmarks: loss normalization and metrics, side by side",
        "",
        f"Generated by `{results['command']}` ({results['mode']} mode) on {results['generated']}; the whole run took "
        f"{results['total_seconds']:.0f} s. Raw numbers: `{results['raw_results']}`. Rerun: `make bench` "
        "(about 6 minutes here) or `make bench QUICK=1` (under 2 minutes; writes to `benchmarks/results/quick/`).",
        "",
        "The claim under test: veomni_lite normalizes the loss with **one collective per optimizer step** and "
        "reduces metrics with **none per micro-batch**, at the same gradients as the schemes users run today. "
        "Every strategy below runs in the same processes, interleaved, on the same data.",
        "",
        "## Headline (tiny VLM optimizer step, gloo on CPU)",
        "",
        "Median step time in ms; ratio = baseline / veomni_lite (> 1: veomni_lite faster); loss-path collectives and "
        "host reads per optimizer step for (a) / (b) / (c) (veomni_lite's one read is a CPU-only check of host "
        "memory, deferred on accelerators: see 'Loss normalization: all results').",
        "",
    ]
    lines += table(
        ["world", "SP", "GA", "(a) ms", "(b) ms", "(c) ms", "(a)/(c)", "(b)/(c)", "collectives a/b/c", "reads a/b/c"],
        headline_rows(records),
    )
    lines += [
        "",
        f"![step time and collectives per step against GA]({png_name})",
        "",
        "## Reading the numbers",
        "",
        "Ratios are medians of per-repetition paired ratios (each repetition runs every strategy back to back), "
        "with their interquartile range in parentheses in the tables below; > 1 means veomni_lite is faster.",
        "",
        *findings(results, records),
        "",
        *caveat(records),
        "",
        "## What is compared",
        "",
        "Loss normalization (the baselines are small re-implementations of the published schemes, in "
        "`benchmarks/baselines.py`, not VeOmni's code):",
        "",
        "- **(a) per-micro-batch denominator** — VeOmni's `mean_global_loss` before the step denominators were "
        "reused: on every micro-batch and loss key, the step's token count is read to the host (`.item()`) and "
        "all-reduced over the world. Under SP, the model loss is also SP-reduced (VeOmni's `ReduceLoss`: two SP "
        "all-reduces) and the micro-batch count is SP-all-reduced after a host read.",
        "- **(b) VeOmni 0.1.12** — one all-reduce per token key of the step dict at step start "
        "(`reduce_global_loss_token`, a host read before and after each); per micro-batch only the SP reductions "
        "of (a), so nothing per micro-batch without SP.",
        "- **(c) veomni_lite** — `mean_global_loss`: one packed all-reduce per step dict (denominators of the loss "
        "keys plus a key-set fingerprint), memoized for the step's later micro-batches.",
        "",
        "Metrics (10 metrics as the trainer records them: two loss means weighted by tokens, tokens, samples, FLOPs "
        "per micro-batch; grad norm, lr, step time, skipped steps, peak memory per step; logged every step, the "
        "worst case for log-time reduction):",
        "",
        "- **(a) reduce every record** — each record is all-reduced over the world and read to the host at once.",
        "- **(b) veomni_lite** — `MetricAccumulator`: local records, one packed SUM and one packed MAX all-reduce "
        "per log event (the trainer also moves that off the critical path; here it runs inline).",
        "",
        "Two kinds of timed step, each with every strategy interleaved (round-robin, order rotated every repetition, "
        "an untimed barrier before each step, the time of a step = its slowest rank):",
        "",
        "- **VLM step**: the tiny VLM of `configs/vlm_tiny.yaml` (2 layers, hidden 64, two loss heads: "
        f"`foundation_loss`, `image_decoder_loss`), micro-batch size {results['micro_batch_size']}: per micro-batch "
        "count_loss_token, forward, loss scaling, backward; then ONE flat gradient all-reduce and AdamW. No FSDP "
        "(a plain model with a manual gradient average, identical for all strategies) so the only collectives are "
        "the loss path's, the gradient all-reduce and, under SP, the Ulysses all-to-alls.",
        "- **path alone**: the same micro-batches and counts with each loss a scalar parameter times a fixed local "
        "mean, so only normalization (or metric recording and logging) and its communication remain.",
        "",
        "Before timing, each strategy runs one untimed counting round: `torch.distributed` collectives and "
        "`Tensor.item/tolist/numpy/__bool__/__float__/__int__` are wrapped and counted by phase; that round also "
        "checks equal correctness. Then one untimed warm-up repetition sizes the number of timed repetitions to a "
        f"time budget ({settings['vlm_budget_s']:g} s per VLM config, {settings['path_budget_s']:g} s per path "
        f"config, {settings['min_reps']}–{settings['max_reps']} repetitions). Spread = interquartile range.",
        "",
        check_summary(records),
        "",
        "## Machine",
        "",
        f"- CPU: {machine['cpu']}, {machine['logical_cpus']} logical CPUs; {machine['memory_gib']} GiB RAM; "
        f"{machine['os']}",
        f"- Python {machine['python']}, torch {machine['torch']}, backend {machine['backend']}, "
        f"OMP_NUM_THREADS={machine['omp_num_threads']}, torch threads per process {machine['torch_threads']}",
        f"- world sizes {worlds}, one process per rank: with {machine['logical_cpus']} CPUs, 4 processes are "
        "oversubscribed, so world-4 numbers include scheduling delay in every collective (which is exactly what a "
        "collective costs on a loaded host, but larger than on a real cluster).",
        f"- Exact command: `{results['command']}`, which runs, per world size N, `{results['worker_command']}`.",
        "",
        "## Loss normalization: all results",
        "",
        "Times are median [IQR] in ms. Collectives and host reads are the loss path's (the micro-batch loop minus "
        "the model's all-to-alls), per optimizer step; `model a2a` is the Ulysses attention all-to-alls (the same for "
        "all strategies); every VLM step also has 1 gradient all-reduce. `reps` = timed VLM/path repetitions; "
        "`grad diff` = max relative gradient difference from veomni_lite on the check step.",
        "",
    ]
    lines += table(
        [
            "world",
            "SP",
            "GA",
            "strategy",
            "VLM step ms",
            "ratio",
            "path alone ms",
            "ratio",
            "collectives",
            "host reads",
            "model a2a",
            "reps",
            "grad diff",
        ],
        loss_rows(records),
    )
    lines += [
        "",
        "(c)'s one host read per step on CPU is the rank-agreement verdict of `mean_global_loss` (`.numpy()` on a "
        "CPU tensor, no device involved). On an accelerator that verdict stays on the device and is checked by "
        "`verify_loss_keys()` at the trainer's existing per-step grad-norm read, so the device path has none; the GPU "
        "audit below is the check for that.",
        "",
        "## Metrics: all results",
        "",
        "SP does not change the metric path (records are local in (b); (a) reduces over the world either way), so "
        "it is measured at SP 1. Collectives and host reads are the metric path's per optimizer step (logging every "
        "step); the loss path is veomni_lite's in both rows.",
        "",
    ]
    lines += table(
        [
            "world",
            "GA",
            "strategy",
            "VLM step ms",
            "ratio",
            "path alone ms",
            "ratio",
            "collectives",
            "host reads",
            "reps",
        ],
        metric_rows(records),
    )
    lines += [
        "",
        "## Growth with GA and world size",
        "",
        "Counts per optimizer step on one rank, fitted exactly over all measured GA values (a list where no line "
        "fits). They do not depend on the world size; what grows with it is the price of each collective:",
        "",
    ]
    lines += table(["world", "SP", "strategy", "collectives per step", "host reads per step"], growth_rows(records))
    lines += [
        "",
        "Marginal cost of one extra loss-path collective (with its host reads), from the path-alone medians at the "
        "largest GA: ((a) − (c)) / (extra collectives):",
        "",
    ]
    lines += table(["world", "SP", "GA", "extra collectives", "µs each"], marginal_cost_rows(records))
    lines += [
        "",
        "## Cost of one all-reduce",
        "",
        "Median [IQR] latency in ms of one int64 all-reduce over the world, interleaved, measured in the same runs:",
        "",
    ]
    lines += table(["world", "buffer", "median ms", "IQR ms"], probe_rows(results))
    lines += [
        "",
        "## One process, no communication",
        "",
        "The loss path alone in one process without a process group (every all-reduce is a local no-op): the "
        "compute and Python cost of each strategy, median µs per optimizer step.",
        "",
    ]
    lines += table(["GA", "(a) µs", "(b) µs", "(c) µs"], single_process_rows(results))
    lines += [
        "",
        "## Memory over a long run",
        "",
        "veomni_lite's loss path (one `mean_global_loss` memo per step) and metric recording (log every 10 steps) "
        "for many small steps on every rank; RSS of rank 0 (VmRSS) after the first tenth of the run and at the end, "
        "peak RSS over all ranks, steps the memo holds at the end, and the most metric slots a window ever held.",
        "",
    ]
    lines += table(
        ["world", "steps", "GA", "RSS MiB early", "RSS MiB end", "growth KiB", "peak MiB", "memo steps", "slots"],
        rss_rows(results),
    )
    lines += ["", *gpu_section(results)]
    path = out_dir / "benchmarks.md"
    path.write_text("\n".join(lines).rstrip() + "\n")
    return path


# ----------------------------------------------------------------------------------------------------------- plot


def _series(records: list[Record], **where: Any) -> tuple[list[int], list[Record]]:
    found = sorted(select(records, **where), key=lambda r: r["ga"])
    return [r["ga"] for r in found], found


def _ga_axis(ax: Any, records: list[Record]) -> None:
    gas = ga_values(records)
    ax.set_xscale("log", base=2)
    ax.set_xticks(gas, [str(ga) for ga in gas])
    ax.minorticks_off()
    ax.set_xlabel("GA (micro-batches per step)")


def _time_panel(ax: Any, records: list[Record], bench: str, keys: str, names: Mapping[str, str], **where: Any) -> None:
    colors = COLORS if bench == "loss" else METRIC_COLORS
    for key in keys:
        for kind, style in (("vlm", "-"), ("path", "--")):
            gas, found = _series(records, bench=bench, kind=kind, strategy=key, **where)
            if not found:
                continue
            medians = [r["median_s"] * 1e3 for r in found]
            low = [(r["median_s"] - r["q1_s"]) * 1e3 for r in found]
            high = [(r["q3_s"] - r["median_s"]) * 1e3 for r in found]
            label = f"{names[key]}, {'VLM step' if kind == 'vlm' else 'path alone'}"
            ax.errorbar(gas, medians, yerr=[low, high], fmt=style, marker="o", ms=3, color=colors[key], label=label)
    _ga_axis(ax, records)
    ax.set_yscale("log")
    ax.set_ylabel("median step time (ms)")


def _count_panel(ax: Any, records: list[Record], bench: str, keys: str, names: Mapping[str, str], **where: Any) -> None:
    colors = COLORS if bench == "loss" else METRIC_COLORS
    collectives = loss_collectives if bench == "loss" else metric_collectives
    reads = loss_host_reads if bench == "loss" else metric_host_reads
    for key in keys:
        gas, found = _series(records, bench=bench, kind="vlm", strategy=key, **where)
        if not found:
            continue
        ax.plot(gas, [collectives(r) for r in found], "-", marker="o", ms=3, color=colors[key], label=names[key])
        ax.plot(gas, [reads(r) for r in found], ":", marker="x", ms=3, color=colors[key])
    _ga_axis(ax, records)
    ax.set_yscale("log")
    ax.set_ylabel("per step: collectives (—), host reads (··)")


def write_plot(results: Mapping[str, Any], out_dir: Path) -> Path:
    records = all_records(results)
    loss_layouts = layouts(select(records, bench="loss"))
    metric_worlds = sorted({r["world"] for r in select(records, bench="metrics")})
    columns = max(len(loss_layouts), 2 * len(metric_worlds), 1)
    fig, axes = plt.subplots(3, columns, figsize=(4.2 * columns, 11), squeeze=False)
    for col, (world, sp) in enumerate(loss_layouts):
        _time_panel(axes[0][col], records, "loss", "abc", LOSS_NAMES, world=world, sp=sp)
        axes[0][col].set_title(f"loss: step time, world {world}, SP {sp}")
        _count_panel(axes[1][col], records, "loss", "abc", LOSS_NAMES, world=world, sp=sp)
        axes[1][col].set_title(f"loss path: per step, world {world}, SP {sp}")
    for index, world in enumerate(metric_worlds):
        _time_panel(axes[2][2 * index], records, "metrics", "ab", METRIC_NAMES, world=world, sp=1)
        axes[2][2 * index].set_title(f"metrics: step time, world {world}")
        _count_panel(axes[2][2 * index + 1], records, "metrics", "ab", METRIC_NAMES, world=world, sp=1)
        axes[2][2 * index + 1].set_title(f"metrics path: per step, world {world}")
    for row in axes:
        for ax in row:
            if not ax.has_data():
                ax.set_visible(False)
            else:
                ax.grid(True, which="both", alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    metric_handles, metric_labels = axes[2][0].get_legend_handles_labels() if metric_worlds else ([], [])
    fig.legend(handles + metric_handles, labels + metric_labels, loc="lower center", ncol=4, fontsize=8)
    fig.suptitle(f"veomni_lite vs baselines, gloo on CPU ({results['mode']} mode)")
    fig.tight_layout(rect=(0, 0.07, 1, 0.97))
    path = out_dir / "benchmarks.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def write_report(results: Mapping[str, Any], out_dir: Path) -> tuple[Path, Path]:
    """Write benchmarks.md and benchmarks.png under `out_dir`; returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    png = write_plot(results, out_dir)
    md = write_markdown(results, out_dir, png.name)
    return md, png
