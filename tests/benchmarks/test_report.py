"""benchmarks/report.py on small synthetic results: the page has its tables, and its numbers come from the input.

No benchmark runs here: `write_report` gets a hand-built results dict shaped like the one `run_all.py` writes.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parents[2] / "benchmarks"
_spec = importlib.util.spec_from_file_location("bench_report", BENCH_DIR / "report.py")
report = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(report)

NUMBER = re.compile(r"\d+(?:[.,]\d+)*(?:e[-+]?\d+)?")
# digits the template may hold: a command flag, the meaning of a ratio, a rank's name (none of them a measurement)
LITERALS = ("make bench QUICK=1", "(> 1:", "rank 0")


def without_literals(text: str) -> str:
    for literal in LITERALS:
        text = text.replace(literal, "")
    return text


def results(worlds: list[int], sps: list[int], gas: list[int], free: dict[str, Any]) -> dict[str, Any]:
    """Results for `worlds` x `sps` x `gas`; every other number comes from `free` (so two inputs can share none)."""
    coll = {"a": lambda ga: free["a"] * ga, "b": lambda ga: free["b"], "c": lambda ga: free["c"]}
    runs = {}
    for world in worlds:
        records = []
        for sp in (sp for sp in sps if world % sp == 0):
            for ga in gas:
                base = free["ms"] * ga * 1e-3
                # (b) beats (c) at the first SP size only, so the page has its caveat
                speed = {"a": free["slow"], "b": 0.9 if sp == sps[0] else free["slow"], "c": 1.0}
                benches = [("loss", "abc", "step")] + ([("metrics", "ab", "metrics")] if sp == sps[0] else [])
                for bench, keys, phase in benches:
                    for kind in ("vlm", "path"):
                        for key in keys:
                            times = [base * speed[key] * (1 + 0.01 * i) for i in range(free["reps"])]
                            extra = {"grad_sync": free["grad"], "model": free["a2a"] * ga if sp > 1 else 0.0}
                            records.append(
                                {
                                    "bench": bench,
                                    "kind": kind,
                                    "world": world,
                                    "sp": sp,
                                    "ga": ga,
                                    "strategy": key,
                                    "label": f"({key}) strategy {key} of {bench}",
                                    "times_s": times,
                                    "reps": len(times),
                                    "median_s": times[len(times) // 2],
                                    "q1_s": times[1],
                                    "q3_s": times[-2],
                                    "counts": {
                                        "collectives": {phase: float(coll[key](ga)), **extra},
                                        "host_reads": {phase: float(coll[key](ga) * free["reads"])},
                                    },
                                    "check": {
                                        "grad_max_rel_diff": free["diff"],
                                        "loss_rel_diff": free["diff"] / free["reads"],
                                        "equal": True,
                                    },
                                }
                            )
        kib = free["rss"]
        runs[str(world)] = {
            "records": records,
            "rss": {
                "world": world,
                "steps": free["steps"],
                "grad_accum": free["rss_ga"],
                "log_interval": free["log"],
                "rss_kib_samples": [[1, kib], [free["steps"] // 10, kib], [free["steps"], kib + free["growth"]]],
                "rss_growth_kib_after_first_tenth": free["growth"],
                "peak_rss_kib_all_ranks": float(kib + free["growth"]),
                "memo_steps_held": free["memo"],
                "max_metric_window_slots": len(free["metrics"]),
                "metric_specs": len(free["metrics"]),
            },
            "all_reduce_latency": {
                "one element": {"median": free["probe"], "q1": free["probe"] / 2, "q3": free["probe"] * 2},
                "the packed buffer": {"median": free["probe"] * 3, "q1": free["probe"], "q3": free["probe"] * 4},
            },
        }
    return {
        "mode": "full",
        "command": "make bench",
        "worker_command": f"torchrun --nproc_per_node N benchmarks/bench_worker.py --ga {','.join(map(str, gas))}",
        "generated": free["date"],
        "total_seconds": free["seconds"],
        "settings": {"vlm_budget_s": free["budget"], "path_budget_s": free["budget"] / 4, "min_reps": free["reps"]}
        | {"max_reps": free["reps"] * 3},
        "machine": {
            "cpu": "Some CPU",
            "logical_cpus": free["cpus"],
            "memory_gib": free["memory"],
            "os": f"Linux {free['version']}",
            "python": free["version"],
            "torch": free["version"],
            "backend": "gloo",
            "omp_num_threads": str(free["threads"]),
            "torch_threads": free["threads"],
        },
        "micro_batch_size": free["mbs"],
        "loss_keys": ["foundation_loss", "image_decoder_loss"],
        "metric_names": free["metrics"],
        "model": {"num_layers": free["layers"], "hidden_size": free["hidden"]},
        "tolerances": {"vlm_grad": free["tol"], "path_grad": free["tol"] / 8, "loss": free["tol"] / 8}
        | {"metrics": free["mtol"]},
        "raw_results": "benchmarks/results/full/benchmarks_results.json",
        "runs": runs,
        "single_process": [
            {"ga": ga, "strategy": key, "median_s": free["ms"] * ga * 1e-6 * (i + 3)}
            for ga in gas
            for i, key in enumerate("abc")
        ],
        "gpu": [],
    }


FREE_A = {
    "a": 2,
    "b": 2,
    "c": 1,
    "reads": 1,
    "grad": 1,
    "a2a": 4,
    "ms": 10.0,
    "slow": 1.5,
    "reps": 6,
    "diff": 3e-7,
    "rss": 300000,
    "steps": 200,
    "rss_ga": 4,
    "log": 25,
    "growth": 0,
    "memo": 1,
    "probe": 2e-4,
    "mtol": 1e-9,
    "date": "2026-11-29 07:18 UTC",
    "seconds": 285.0,
    "budget": 5.5,
    "cpus": 2,
    "memory": 23.5,
    "version": "3.11.7",
    "threads": 1,
    "mbs": 2,
    "metrics": ["foundation_loss", "lr", "tokens"],
    "layers": 2,
    "hidden": 64,
    "tol": 1e-4,
}
FREE_B = {
    "a": 17,
    "b": 19,
    "c": 23,
    "reads": 29,
    "grad": 31,
    "a2a": 37,
    "ms": 41.0,
    "slow": 1.93,
    "reps": 43,
    "diff": 4.7e-6,
    "rss": 530000,
    "steps": 590,
    "rss_ga": 61,
    "log": 67,
    "growth": 71,
    "memo": 73,
    "probe": 9.7e-3,
    "mtol": 7e-11,
    "date": "2033-08-14 13:56 UTC",
    "seconds": 859.0,
    "budget": 8.9,
    "cpus": 83,
    "memory": 89.9,
    "version": "9.97.83",
    "threads": 97,
    "mbs": 101,
    "metrics": [f"metric_{c}" for c in "abcdefg"],
    "layers": 103,
    "hidden": 107,
    "tol": 6.1e-3,
}
A = ([6, 12], [2, 3], [4, 9], FREE_A)
B = ([35, 70], [5, 7], [10, 11, 13, 14, 15], FREE_B)


def page(tmp_path: Path, case: tuple) -> str:
    out = tmp_path / str(id(case))
    md, png = report.write_report(results(*case), out)
    assert png.stat().st_size > 0
    return md.read_text()


def prose_numbers(text: str) -> set[str]:
    """Numbers outside tables and the image link."""
    lines = [line for line in text.splitlines() if not line.startswith(("|", "!["))]
    return set(NUMBER.findall(without_literals("\n".join(lines))))


def test_page_has_every_table_and_the_plot(tmp_path: Path) -> None:
    text = page(tmp_path, A)
    for heading in ("## Summary", "## Loss normalization", "## Metrics", "## Counts per step against GA"):
        assert heading in text
    assert text.count("| world | SP | GA | (a) ms | (b) ms | (c) ms | (a)/(c) | (b)/(c) |") == 2
    assert text.count("| world | SP | GA | (a) ms | (b) ms | (a)/(b) |") == 2
    assert "![step time and collectives per step against GA](benchmarks.png)" in text
    assert "| loss | 2 | (a) | all | 2·GA | 2·GA |" in text  # the exact fit of counts against GA
    assert "1.50x" in text and "0.90x" in text  # paired ratios of the synthetic times
    assert "**Not run**" in text


def test_template_prose_types_in_no_number() -> None:
    template = report.TEMPLATE.read_text()
    assert not re.findall(r"\d", re.sub(r"\{[^{}]*\}", "", without_literals(template)))


def test_every_number_in_the_prose_comes_from_the_input(tmp_path: Path) -> None:
    # Two inputs that share no number: a number typed into the page would show up in both.
    shared = prose_numbers(page(tmp_path, A)) & prose_numbers(page(tmp_path, B))
    assert not shared, f"numbers in the prose that do not follow the input: {sorted(shared)}"


def test_changing_one_input_changes_the_page(tmp_path: Path) -> None:
    before = page(tmp_path, A)
    after = page(tmp_path, (*A[:3], FREE_A | {"cpus": 7}))
    assert "2 logical CPUs" in before and "7 logical CPUs" in after
    assert before.replace("2 logical CPUs", "7 logical CPUs") != after  # the oversubscription note follows too
