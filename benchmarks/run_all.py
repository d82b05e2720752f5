"""`make bench`: run every side-by-side benchmark and regenerate docs/benchmarks.md and docs/benchmarks.png.

For each world size (2 and 4) this launches `torchrun --standalone --nproc_per_node N benchmarks/bench_worker.py`
(gloo, OMP_NUM_THREADS=1), merges the workers' JSON into benchmarks/results/<mode>/benchmarks_results.json (ignored
by git: the page is generated from it, the raw numbers are not committed) and writes the report from that file.
- full mode (default, under 8 minutes on 2 CPUs): GA 1, 8, 16; SP 1 and 2; the trainer against a bare loop at GA 1
  and 8; writes docs/benchmarks.md and docs/benchmarks.png.
- `--quick` (about 2 minutes): GA 1 and 8, fewer repetitions; writes the page and plot under
  benchmarks/results/quick/ so the committed full-run page is not overwritten (override with `--out-dir`).
- `--report-only`: rebuild the page and plot from the mode's results JSON (refreshing the GPU results) without
  running anything.
GPU results (benchmarks/results/gpu/*.json, written by benchmarks/gpu_sync_audit.py, e.g. through `make test-gpu`)
are included when present. The targets (`TARGETS`) travel in the results JSON, so the page computes every verdict
from it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from report import write_report

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
DOCS = REPO / "docs"
WORKER = BENCH_DIR / "bench_worker.py"
sys.path.insert(0, str(REPO))  # the benches below import the repository's top-level examples/

# What the page checks, as paired ratios num / den of one bench and kind (see report.targets_section); `sp` and
# `ga` restrict where a target is set (absent: everywhere measured).
TARGETS: list[dict[str, Any]] = [
    {"name": "VLM step vs the oracle", "bench": "loss", "kind": "vlm", "num": "c", "den": "o"}
    | {"op": "<=", "bound": 1.05},
    {"name": "VLM step vs VeOmni 0.1.12, SP 1", "bench": "loss", "kind": "vlm", "num": "b", "den": "c"}
    | {"op": ">=", "bound": 1.0, "sp": [1]},
    {"name": "loss path alone vs VeOmni 0.1.12, SP 2", "bench": "loss", "kind": "path", "num": "b", "den": "c"}
    | {"op": ">=", "bound": 4.0, "sp": [2]},
    {"name": "trainer step vs the bare loop", "bench": "trainer", "kind": "step", "num": "trainer", "den": "bare"}
    | {"op": "<=", "bound": 1.1, "ga": [8]},
]

MODES: dict[str, dict[str, Any]] = {
    "full": {
        "ga": "1,8,16",
        "trainer_ga": "1,8",
        "trainer_budget_s": 10.0,
        "sp": "1,2",
        "vlm_budget_s": 5.5,
        "path_budget_s": 1.5,
        "min_reps": 6,
        "max_reps": 40,
        "rss_steps": 2000,
        "sft_steps": 20,
        "sft_blocks": 4,
        "scaling_steps": 5,
        "timeout_s": 420,
    },
    "quick": {
        "ga": "1,8",
        "trainer_ga": "1,8",
        "trainer_budget_s": 2.0,
        "sp": "1,2",
        "vlm_budget_s": 0.8,
        "path_budget_s": 0.3,
        "min_reps": 3,
        "max_reps": 10,
        "rss_steps": 300,
        "sft_steps": 5,
        "sft_blocks": 2,
        "scaling_steps": 2,
        "timeout_s": 150,
    },
}


def worker_args(settings: dict[str, Any], out: Path) -> list[str]:
    return [
        "--out",
        str(out),
        "--ga",
        settings["ga"],
        "--sp",
        settings["sp"],
        "--vlm-budget-s",
        str(settings["vlm_budget_s"]),
        "--path-budget-s",
        str(settings["path_budget_s"]),
        "--min-reps",
        str(settings["min_reps"]),
        "--max-reps",
        str(settings["max_reps"]),
        "--rss-steps",
        str(settings["rss_steps"]),
        "--trainer-ga",
        settings["trainer_ga"],
        "--trainer-budget-s",
        str(settings["trainer_budget_s"]),
    ]


def run_world(world: int, settings: dict[str, Any], out: Path) -> dict[str, Any]:
    """One torchrun launch of the worker on `world` processes; returns its JSON. Raises on failure or timeout."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(world),
        str(WORKER),
        *worker_args(settings, out),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONWARNINGS": "ignore"}
    start = time.perf_counter()
    print(f"[bench] world {world}: {' '.join(command[1:])}", flush=True)
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    assert process.stdout is not None
    try:
        for line in process.stdout:
            lines.append(line)
            if line.startswith("[bench]"):
                print(f"  {line.rstrip()}", flush=True)
            if time.perf_counter() - start > settings["timeout_s"]:
                raise subprocess.TimeoutExpired(command, settings["timeout_s"])
        process.wait(timeout=max(1.0, settings["timeout_s"] - (time.perf_counter() - start)))
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        raise RuntimeError(f"world {world}: the worker ran past {settings['timeout_s']}s") from None
    if process.returncode != 0:
        tail = "".join(lines[-60:])
        raise RuntimeError(f"world {world}: the worker exited with {process.returncode}:\n{tail}")
    print(f"[bench] world {world}: done in {time.perf_counter() - start:.0f}s", flush=True)
    return json.loads(out.read_text())


GPU_RESULTS = BENCH_DIR / "results" / "gpu"


def gpu_results() -> list[dict[str, Any]]:
    """Every benchmarks/results/gpu/*.json that gpu_sync_audit.py wrote (sorted by name)."""
    return [json.loads(path.read_text()) for path in sorted(GPU_RESULTS.glob("*.json"))]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the < 2 minute mode (writes to benchmarks/results/quick)")
    parser.add_argument("--worlds", default="2,4", help="comma-separated world sizes")
    parser.add_argument("--out-dir", type=Path, default=None, help="where benchmarks.md and benchmarks.png go")
    parser.add_argument("--report-only", action="store_true", help="rebuild the page from the mode's results JSON")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    mode = "quick" if args.quick else "full"
    out_dir = args.out_dir or (BENCH_DIR / "results" / "quick" if args.quick else DOCS)
    raw_path = BENCH_DIR / "results" / mode / "benchmarks_results.json"
    if args.report_only:
        if not raw_path.exists():
            raise SystemExit(f"no results at {raw_path}: run `make bench{' QUICK=1' if args.quick else ''}` first")
        results = json.loads(raw_path.read_text())
        results["gpu"] = gpu_results()
        results["targets"] = TARGETS
    else:
        settings = MODES[mode]
        started = time.perf_counter()
        runs = {}
        scratch = BENCH_DIR / "results" / "raw"
        scratch.mkdir(parents=True, exist_ok=True)
        for world in (int(value) for value in args.worlds.split(",") if value):
            runs[str(world)] = run_world(world, settings, scratch / f"{mode}_world{world}.json")
        import sft_input  # here: it imports the library, which the page alone does not need

        sft_start = time.perf_counter()
        sft = sft_input.measure(scratch / "sft", settings["sft_steps"], settings["sft_blocks"])
        print(f"[bench] SFT input pipeline: done in {time.perf_counter() - sft_start:.0f}s", flush=True)
        import packing

        packing_start = time.perf_counter()
        packed = packing.measure(scratch / "sft", settings["sft_steps"], settings["sft_blocks"])
        print(f"[bench] packing: done in {time.perf_counter() - packing_start:.0f}s", flush=True)
        import lm_head

        head_start = time.perf_counter()
        head = lm_head.measure((4096,) if args.quick else (4096, 32768))
        print(f"[bench] LM head: done in {time.perf_counter() - head_start:.0f}s", flush=True)
        import data_startup

        startup_start = time.perf_counter()
        startup = data_startup.measure(scratch / "data_startup", args.quick)
        print(f"[bench] data start-up: done in {time.perf_counter() - startup_start:.0f}s", flush=True)
        import many_machines

        many_start = time.perf_counter()
        many = many_machines.measure(scratch / "many_machines", settings["scaling_steps"])
        print(f"[bench] many machines: done in {time.perf_counter() - many_start:.0f}s", flush=True)
        import lora

        lora_start = time.perf_counter()
        lora_results = lora.measure(scratch / "lora", settings["scaling_steps"])
        print(f"[bench] LoRA against full fine-tuning: done in {time.perf_counter() - lora_start:.0f}s", flush=True)
        first = next(iter(runs.values()))
        command = "make bench QUICK=1" if args.quick else "make bench"
        results = {
            "mode": mode,
            "command": command,
            "worker_command": "OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node N benchmarks/bench_worker.py "
            + " ".join(worker_args(settings, Path("OUT.json"))),
            "generated": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "total_seconds": time.perf_counter() - started,
            "settings": settings,
            **{
                key: first[key]
                for key in ("machine", "micro_batch_size", "loss_keys", "metric_names", "model", "tolerances")
            },
            "raw_results": str(raw_path.relative_to(REPO)) if raw_path.is_relative_to(REPO) else str(raw_path),
            "runs": runs,
            "sft_input": sft,
            "packing": packed,
            "lm_head": head,
            "many_machines": many,
            "lora": lora_results,
            "data_startup": startup,
            "targets": TARGETS,
            "gpu": gpu_results(),
        }
    raw_path.parent.mkdir(parents=True, exist_ok=True)
    raw_path.write_text(json.dumps(results, indent=1) + "\n")
    md, png = write_report(results, out_dir)
    print(f"[bench] wrote {md} and {png} ({results['mode']} mode, {results['total_seconds']:.0f}s of benchmarks)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
