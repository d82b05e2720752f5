"""benchmarks/report.py on hand-built results: verdicts, spreads and the summary against a plain reference, and no
number on the page that the results do not hold. No benchmark runs here."""

from __future__ import annotations

import importlib.util
import re
import statistics
import sys
from pathlib import Path
from typing import Any

import pytest

BENCH_DIR = Path(__file__).resolve().parents[2] / "benchmarks"
_spec = importlib.util.spec_from_file_location("bench_report", BENCH_DIR / "report.py")
report = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(report)

NUMBER = re.compile(r"\d+(?:[.,]\d+)*(?:e[-+]?\d+)?")


def target(name: str, op: str, bound: float, values: list[float], unit: str = "x") -> dict[str, Any]:
    return {"name": name, "op": op, "bound": bound, "unit": unit, "values": values}


def results(blocks: list[dict[str, Any]]) -> dict[str, Any]:
    run = {"command": "make bench QUICK=1", "mode": "quick", "date": "D", "commit": "abcdef", "total_s": 123.4}
    run |= {"load_start": "L", "load_end": "M", "machine": {"cpu": "C", "cores": 7, "memory_gib": 9.5, "torch": "T"}}
    return {"run": run, "blocks": blocks}


def reference_verdict(op: str, bound: float, values: list[float]) -> tuple[str, int]:
    """The rule by hand: the median decides; count the repeats that pass alone."""
    ok = (lambda v: v <= bound) if op == "<=" else (lambda v: v >= bound)
    return ("met" if ok(statistics.median(values)) else "missed"), sum(ok(v) for v in values)


def test_verdicts_and_spread_follow_the_median_rule() -> None:
    cases = [
        ("<=", 1.05, [0.9, 1.0, 1.2]),  # median passes, one repeat does not
        ("<=", 1.05, [1.0, 1.1, 1.2]),  # median fails
        (">=", 1.5, [1.4, 1.6, 1.7, 1.9]),  # even count: median 1.65
        (">=", 1.5, [1.49]),  # n=1, a miss by a hair
    ]
    for op, bound, values in cases:
        got = report.verdict(target("t", op, bound, values))
        expected, passing = reference_verdict(op, bound, values)
        assert got["verdict"] == expected and got["passing"] == passing, (op, bound, values, got)
        assert (got["low"], got["high"], got["n"]) == (min(values), max(values), len(values))
        assert got["median"] == statistics.median(values)
    assert report.verdict(target("t", "<=", 1.0, []))["verdict"] == "not run"


def rows_of(page: str, header_start: str) -> list[list[str]]:
    lines = page.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header_start))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def test_the_targets_table_has_every_target_with_its_verdict_and_spread() -> None:
    step = {"title": "Step", "about": "about step", "tables": [], "seconds": 12.5}
    step["targets"] = [target("ratio A", "<=", 1.05, [0.9, 1.0, 1.2]), target("ratio B", ">=", 1.0, [0.8, 0.95, 0.97])]
    data = {"title": "Data", "about": "about data", "seconds": 3.25, "tables": []}
    data["targets"] = [target("rate", ">=", 2372, [887.0], "rows/s"), target("second run", "<=", 60, [], "s")]
    data["targets"][1]["note"] = "quick mode skips it"
    page = report.render(results([step, data]))
    rows = rows_of(page, "| block | target |")
    assert [row[1] for row in rows] == ["ratio A", "ratio B", "rate", "second run"]
    assert [row[-1] for row in rows] == ["**met**", "**missed**", "**missed**", "**not run**"]
    assert rows[0][3:5] == ["1.000x", "0.9000–1.200, 2 of 3 pass"]
    assert rows[1][2] == ">= 1.00x" and rows[1][4] == "0.8000–0.9700, 0 of 3 pass"
    assert rows[2][3:5] == ["887 rows/s", "n=1"] and rows[2][2] == ">= 2,372 rows/s"
    assert rows[3][4] == "quick mode skips it"
    assert "1 of 4 targets met, 2 missed, 1 not run." in page
    assert rows_of(page, "| block | seconds |") == [["Step", "12.5"], ["Data", "3.25"]]


def test_all_met_and_a_block_that_did_not_run_are_said_plainly(tmp_path: Path) -> None:
    good = {"title": "Good", "about": "", "tables": [], "targets": [target("r", "<=", 2.0, [1.0, 1.5])]}
    failed = {"title": "Broken", "not_run": "it failed: `RuntimeError: boom`"}
    path = report.write_report(results([good, failed]), tmp_path)
    page = path.read_text()
    assert path == tmp_path / "benchmarks.md"
    assert "All 1 targets are met." in page
    assert "## Broken\n" in page and "**Not run** in this run: it failed: `RuntimeError: boom`" in page
    # a missed target makes the summary stop saying "all"
    good["targets"].append(target("s", ">=", 3.0, [1.0]))
    assert "All " not in report.render(results([good]))


def test_every_number_on_the_page_comes_from_the_results() -> None:
    """The generator types in no number: every number printed is one of the inputs', formatted, or a count of them."""
    table = {"columns": ["n", "ms"], "rows": [[3, 41.26], [17, 0.0004], [2048, "7.5 [7.0–8.1]"]]}
    block = {"title": "B", "about": "text", "tables": [table], "seconds": 4.5}
    block["targets"] = [target("r", "<=", 1.05, [0.93, 1.11, 1.07]), target("q", ">=", 250.0, [300.0], "rows/s")]
    data = results([block])
    page = report.render(data).replace("n=1", "")
    allowed = {"41.3", "4.0e-04", "7.5", "7.0", "8.1", "2,048", "3", "17", "123", "7", "9.50", "4.50"}
    allowed |= {"1.05", "1.070", "0.9300", "1.110", "250", "300"}  # bounds; medians, lows and highs to four digits
    allowed |= {"1", "2", "0"}  # 1 of 2 met, 1 missed, 0 not run; 1 of 3 pass; 1 of 1 pass
    printed = set(NUMBER.findall(page))
    assert printed <= allowed, printed - allowed
    assert {"41.3", "2,048", "1.070", "300"} <= printed


def test_a_near_miss_does_not_read_as_the_bound() -> None:
    block = {"title": "P", "about": "", "tables": [], "targets": [target("packed", ">=", 1.5, [1.37, 1.4987, 1.64])]}
    row = rows_of(report.render(results([block])), "| block | target |")[0]
    assert row[2:] == [">= 1.50x", "1.499x", "1.370–1.640, 1 of 3 pass", "**missed**"]


def test_a_block_run_again_alone_replaces_its_old_self_and_the_page_says_when(tmp_path: Path) -> None:
    """`run_all.py --rerun`: the block's new results take its place, marked with that run's date and commit; the other
    blocks and the run's header stay the first run's."""
    spec = importlib.util.spec_from_file_location("bench_run_all", BENCH_DIR / "run_all.py")
    run_all = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(BENCH_DIR))  # run_all imports report by its plain name, as make bench runs it
    try:
        spec.loader.exec_module(run_all)
    finally:
        sys.path.remove(str(BENCH_DIR))
    old = [{"title": name, "about": "", "tables": [], "targets": [target(name, "<=", 2.0, [1.0])]}
           for name in run_all.BLOCKS]  # fmt: skip
    old[0] = {"title": run_all.BLOCKS[0], "not_run": "it failed: `RuntimeError: boom`"}
    fresh = {"title": "Again", "about": "", "tables": [], "targets": [target("again", "<=", 2.0, [1.5])]}
    later = {"date": "LATER", "commit": "fedcba", "load_start": "X", "load_end": "Y"}
    merged = run_all.rerun_into(results(old), [run_all.BLOCKS[0]], [fresh], later | {"total_s": 9.0})
    assert merged["run"] == results(old)["run"]
    assert merged["blocks"][0] == fresh | {"rerun": later} and merged["blocks"][1:] == old[1:]
    page = report.render(merged)
    assert "Not run" not in page and "Run again alone later, as its section says: Again." in page
    assert "## Again\n\n\n\n*This block was run again alone* on LATER at commit `fedcba` (load X at its start" in page
    with pytest.raises(SystemExit, match="needs the results JSON of a run of every block"):
        run_all.rerun_into(results(old[:2]), [run_all.BLOCKS[0]], [fresh], later)


def test_the_gpu_section_names_the_card_or_says_no_gpu_ran() -> None:
    page = report.render(results([]))
    assert "## One GPU (`make bench-gpu`)\n\nNo GPU was lent to this project, so there are no GPU numbers" in page
    dry = {"device": "cpu", "command": "make bench-gpu (dry run)", "jobs": {}}
    assert "No GPU was lent" in report.render(results([]) | {"gpu": dry}), "a CPU dry run is no GPU number"
    moe = {"shape": "qwen3_30b_a3b", "num_hidden_layers": 2, "loss_rel_diff": 3e-4}
    rows = [{"side": "ours", "step_ms": 812.5, "tokens_per_s": 5041.2, "mfu": 0.1234, "steps": 10},
            {"side": "theirs", "step_ms": 1625.0, "tokens_per_s": 2520.6, "mfu": 0.0617, "steps": 10}]  # fmt: skip
    gpu = {"device": "NVIDIA H100 80GB HBM3", "command": "make bench-gpu", "date": "D", "commit": "c0ffee"}
    gpu["jobs"] = {"moe": {"result": moe, "rows": rows}}
    page = report.render(results([]) | {"gpu": gpu})
    assert "No GPU was lent" not in page and "one NVIDIA H100 80GB HBM3" in page
    assert rows_of(page, "| job | shape |") == [
        ["moe", "qwen3_30b_a3b", "ours", "2", "812", "5,041", "12.3", "3.0e-04", "10"],
        ["moe", "qwen3_30b_a3b", "theirs", "2", "1,625", "2,521", "6.17", "3.0e-04", "10"],
    ]
