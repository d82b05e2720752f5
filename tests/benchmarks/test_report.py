"""benchmarks/report.py on small synthetic results: the page has its tables, and its numbers come from the input.

No benchmark runs here: `write_report` gets a hand-built results dict shaped like the one `run_all.py` writes.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parents[2] / "benchmarks"
_spec = importlib.util.spec_from_file_location("bench_report", BENCH_DIR / "report.py")
report = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(report)

NUMBER = re.compile(r"\d+(?:[.,]\d+)*(?:e[-+]?\d+)?")
# digits the template may hold: a command flag, the meaning of a ratio, a rank's name, API and dtype names (none of
# them a measurement)
LITERALS = ("make bench QUICK=1", "(> 1:", "rank 0", "FSDP2", "bf16")


def without_literals(text: str) -> str:
    for literal in LITERALS:
        text = text.replace(literal, "")
    return text


def record(bench: str, kind: str, world: int, sp: int, ga: int, key: str, times: list[float], **extra: Any) -> Any:
    return {
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
        **extra,
    }


def results(worlds: list[int], sps: list[int], gas: list[int], free: dict[str, Any]) -> dict[str, Any]:
    """Results for `worlds` x `sps` x `gas`; every other number comes from `free` (so two inputs can share none)."""
    coll = {
        "a": lambda ga: free["a"] * ga,
        "b": lambda ga: free["b"],
        "c": lambda ga: free["c"],
        "d": lambda ga: free["d"],
        "o": lambda ga: free["o"],
    }
    runs = {}
    for world in worlds:
        records = []
        for sp in (sp for sp in sps if world % sp == 0):
            for ga in gas:
                base = free["ms"] * ga * 1e-3
                # (b) beats (c) at the first SP size only, so the page has its caveat
                speed = {"a": free["slow"], "b": 0.9 if sp == sps[0] else free["slow"], "c": 1.0}
                speed |= {"d": free["hf"], "o": 1 / free["floor"]}
                benches = [("loss", "abcdo", "step")] + ([("metrics", "ab", "metrics")] if sp == sps[0] else [])
                for bench, keys, phase in benches:
                    for kind in ("vlm", "path"):
                        for key in keys:
                            times = [base * speed[key] * (1 + 0.01 * i) for i in range(free["reps"])]
                            extra = {"grad_sync": free["grad"], "model": free["a2a"] * ga if sp > 1 else 0.0}
                            check = {
                                "heads": ["foundation_loss", "image_decoder_loss"],
                                "grad_max_rel_diff": free["diff"],
                                "loss_rel_diff": free["diff"] / free["reads"],
                                "equal": True,
                            }
                            if key == "d":
                                check |= {"heads": ["foundation_loss"], "not_global": ["image_decoder_loss"]}
                            if key == "o" and kind == "path":
                                check = {"heads": [], "not_compared": "the floor"}
                            counts = {
                                "collectives": {phase: float(coll[key](ga)), **extra},
                                "host_reads": {phase: float(coll[key](ga) * free["reads"])},
                                "elements": {phase: float(coll[key](ga) * free["elements"])},
                            }
                            records.append(record(bench, kind, world, sp, ga, key, times, counts=counts, check=check))
        for ga in gas[:2]:
            for key, speed in (("trainer", free["trainer"]), ("bare", 1.0)):
                times = [free["ms"] * ga * 1e-3 * speed * (1 + 0.01 * i) for i in range(free["reps"])]
                counts = {
                    "collectives": {"step": free["c"] + free["grad"]},
                    "host_reads": {"step": free["reads"]},
                    "collectives_by_op": {"step/all_reduce": free["c"], "step/all_gather_single": free["grad"]},
                }
                parts = {"control all-reduce": free["part"], "rest": free["part"] * 3, "step": free["ms"]}
                records.append(
                    record("trainer", "step", world, 1, ga, key, times, counts=counts, cpu_times_s=times)
                    | {"check": {"grad_norm_rel_diff": free["diff"] / 3}, "log_interval": free["log"] + 1}
                    | {"breakdown_ms": parts if key == "trainer" else {"rest": free["part"] * 2, "step": free["ms"]}}
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
    targets = [
        {"name": "VLM vs the oracle", "bench": "loss", "kind": "vlm", "num": "c", "den": "o", "op": "<="}
        | {"bound": free["floor"] * 1.01},
        {"name": "VLM vs (b)", "bench": "loss", "kind": "vlm", "num": "b", "den": "c", "op": ">="}
        | {"bound": free["bound"], "sp": sps[:1]},
        {"name": "trainer vs bare", "bench": "trainer", "kind": "step", "num": "trainer", "den": "bare", "op": "<="}
        | {"bound": free["trainer"] * 0.99, "ga": gas[1:2]},
    ]
    gpu = [
        {
            "audited": True,
            "device": "Some GPU",
            "backend": "nccl",
            "world": worlds[0],
            "sp": sps[0],
            "grad_accum": free["rss_ga"],
            "precision": "bf16",
            "warn_syncs_by_region": {},
            "error_mode_passed": True,
            "step_time_s": {mode: {"median": free["probe"] * (i + 2)} for i, mode in enumerate(report.GPU_MODES)},
            "normalization_ratio": [free["slow"], free["slow"] / 2, free["slow"] * 2],
        }
    ]
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
        "targets": targets,
        "gpu": gpu if free["gpu"] else [],
    }


FREE_A = {
    "a": 2,
    "b": 2,
    "c": 1,
    "d": 1,
    "o": 1,
    "elements": 3,
    "hf": 0.8,
    "floor": 1.25,
    "bound": 1.0,
    "trainer": 1.05,
    "part": 0.5,
    "gpu": False,
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
    "d": 47,
    "o": 53,
    "elements": 59,
    "hf": 0.71,
    "floor": 2.3,
    "bound": 0.85,
    "trainer": 1.37,
    "part": 2.9,
    "gpu": True,
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
    for heading in ("## Targets", "## Summary", "## Loss normalization", "## The trainer's own per-step costs"):
        assert heading in text
    for heading in ("## Metrics", "## Counts per step against GA", "## GPU"):
        assert heading in text
    loss_header = (
        "| world | SP | GA | (a) ms | (b) ms | (c) ms | (d) ms | (o) ms | (a)/(c) | (b)/(c) | (d)/(c) | (c)/(o) |"
    )
    assert text.count(loss_header) == 2
    assert text.count("| world | SP | GA | (a) ms | (b) ms | (a)/(b) |") == 2
    assert "![step time and collectives per step against GA](benchmarks.png)" in text
    assert "| loss | 2 | (a) | all | 2·GA | 2·GA | 6·GA |" in text  # the exact fit of counts against GA
    assert "1.50x" in text and "0.90x" in text and "0.80x" in text  # paired ratios of the synthetic times
    # (c)/(o) of the VLM step, under its bound at every GA measured (the target sets no GA)
    oracle_rows = [line for line in text.splitlines() if line.startswith("| VLM vs the oracle |")]
    assert len(oracle_rows) == 4  # worlds 6 and 12, SP 2 and 3
    for row in oracle_rows:
        assert "(c)/(o) <= 1.2625" in row
        assert row.count("1.25x (1.25–1.25) [1.25–1.25] met") == 2 and "not a target" not in row
    # trainer / bare: above its bound at the GA it is set at, "not a target" at the other
    trainer_row = (
        "| trainer vs bare | (trainer)/(bare) <= 1.0395 | 6 | 1 | 1.05x (1.05–1.05) [1.05–1.05] not a target |"
    )
    assert trainer_row + " 1.05x (1.05–1.05) [1.05–1.05] missed |" in text
    assert "`image_decoder_loss`" in text.split("## What is compared")[1].split("Metrics:")[0]  # (d)'s 2nd head
    assert "**Not run** for this page (no GPU results" in text
    # (c)'s counts in the intro come from its records: 1 all-reduce of 3 elements and 1 host read per step
    prose = " ".join(text.split())  # the template's line breaks are not part of the sentence
    assert "(c) made 1 loss-path collective(s) (of 3 elements each) and 1 host read(s) per step" in prose
    assert "reads the rank-agreement verdict of the step's one all-reduce with `bool()`, once per step" in text
    # the retired one-process overhead section is gone
    assert "One process" not in text and "(o+)" not in text and "(o+n)" not in text


def test_the_targets_run_all_sets_are_checked_on_the_page(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.setitem(sys.modules, "report", report)  # run_all.py imports it by its bare name
    spec = importlib.util.spec_from_file_location("bench_run_all", BENCH_DIR / "run_all.py")
    run_all = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run_all)
    targets = run_all.TARGETS
    # VLM-step parity with the oracle, set at every configuration measured; no target on the path alone vs the oracle
    oracle = [t for t in targets if (t["bench"], t["num"], t["den"]) == ("loss", "c", "o")]
    assert oracle == [
        {"name": "VLM step vs the oracle", "bench": "loss", "kind": "vlm", "num": "c", "den": "o"}
        | {"op": "<=", "bound": 1.05}
    ]
    md, _ = report.write_report(results([2, 4], [1, 2], [1, 8], FREE_A) | {"targets": targets}, tmp_path)
    text = md.read_text()
    for target in targets:
        assert f"| {target['name']} | ({target['num']})/({target['den']}) {target['op']} {target['bound']:g} |" in text
    rows = [line for line in text.splitlines() if line.startswith("| VLM step vs the oracle |")]
    assert len(rows) == 4  # worlds 2 and 4, SP 1 and 2
    for row in rows:  # (c)/(o) = 1.25 in the synthetic times: above the parity bound at every GA
        assert row.count("1.25x (1.25–1.25) [1.25–1.25] missed") == 2 and "not a target" not in row


def test_gpu_results_and_missing_parts(tmp_path: Path) -> None:
    text = page(tmp_path, B)
    assert "| Some GPU | nccl |" in text and "| bf16 | none | pass |" in text
    bare = results(*A)
    for run in bare["runs"].values():
        run["records"] = [r for r in run["records"] if r["bench"] != "trainer"]
    del bare["targets"]
    out = tmp_path / "bare"
    md, _ = report.write_report(bare, out)
    text = md.read_text()
    assert "**Not run** for this page (the results hold no trainer benchmark)" in text
    assert "**No targets** in these results." in text


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
