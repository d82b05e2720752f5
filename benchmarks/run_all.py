"""`make bench`: run every block, write the raw results and docs/benchmarks.md (`report.py`).

Blocks, in order: the whole step against the peers' loss-normalization schemes and the trainer against a bare loop
(`bench_worker.py`, `trainer_costs.py`), packing against padding (`packing.py`), the fused LM head (`lm_head.py`), SFT
data start-up (`data_startup.py`), LoRA against full fine-tuning (`lora.py`), the MoE router losses' cost against a
dense step of equal active size (`moe.py`), RL rollout generation against transformers' own sampling
(`rl_generation.py`), an RL step's generation share and reference memory (`rl_step.py`), tokens trained per second
under bounded staleness (`rl_async.py`: `rl.async_steps` 0, 1, 2, 4 and partial rollouts), a
DPO step against an SFT step and the DPO reference's memory per rank (`preference.py`), SFT, GRPO and DPO at Qwen's
151,936-token vocabulary (`real_size.py`: peak memory against one logits tensor, time per position), our SFT, GRPO and
DPO trainers against TRL's on the same work at 1 and 2 processes (`trl_side_by_side.py`), rollouts on vLLM
and its weight sync (`rl_vllm.py`, "not run" without `.venv-vllm`). Each block's module has `block(work_dir, quick) ->
dict` in the shape `report.py` reads. `--quick` (`make bench QUICK=1`, under 5 minutes on 2 cores) runs the small size
of every block; the full mode the large ones. Raw results go to `benchmarks/results/<mode>/results.json` (ignored by
git); the page to `--out-dir` (default docs/).
`--report-only` rebuilds the page from that JSON; `--rerun BLOCK,...` runs those blocks alone and puts them in place
of theirs in that JSON, each marked with its own date, commit and load (the page says so), then rebuilds the page.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from report import write_report

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
BLOCKS = (
    "bench_worker",
    "packing",
    "lm_head",
    "data_startup",
    "lora",
    "moe",
    "rl_generation",
    "rl_step",
    "rl_async",
    "preference",
    "real_size",
    "trl_side_by_side",
    "rl_vllm",
)


def load() -> str:
    return ", ".join(f"{value:.2f}" for value in os.getloadavg())


def run_info(quick: bool) -> dict[str, Any]:
    """What the page says about the run: command, date, commit, machine, load average at the start."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=False).stdout.strip()

    commit = git("rev-parse", "--short", "HEAD") + (" + uncommitted changes" if git("status", "--porcelain") else "")
    meminfo = Path("/proc/meminfo").read_text().split()
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())  # fmt: skip
    import torch

    return {
        "command": "make bench QUICK=1" if quick else "make bench",
        "mode": "quick" if quick else "full",
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": commit,
        "load_start": load(),
        "machine": {
            "cpu": cpu,
            "cores": os.cpu_count(),
            "memory_gib": int(meminfo[1]) / 2**20,
            "torch": torch.__version__,
        },
    }


def rerun_into(
    results: dict[str, Any], names: list[str], blocks: list[dict[str, Any]], run: dict[str, Any]
) -> dict[str, Any]:
    """`results` with the blocks `names` (by module name, in BLOCKS order) replaced by `blocks`, each marked `rerun`
    with this run's date, commit and load."""
    fresh = dict(zip(names, blocks))
    marks = {key: run[key] for key in ("date", "commit", "load_start", "load_end")}
    if len(results["blocks"]) != len(BLOCKS):
        held = len(results["blocks"])
        raise SystemExit(f"--rerun needs the results JSON of a run of every block ({len(BLOCKS)}); it has {held}")
    merged = [fresh[name] | {"rerun": marks} if name in fresh else old for name, old in zip(BLOCKS, results["blocks"])]
    return {"run": results["run"], "blocks": merged}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the small size of every block (under 5 minutes)")
    parser.add_argument("--out-dir", type=Path, default=REPO / "docs", help="where benchmarks.md goes")
    parser.add_argument("--blocks", default=",".join(BLOCKS), help="comma-separated subset of " + ",".join(BLOCKS))
    parser.add_argument("--report-only", action="store_true", help="rebuild the page from the mode's results JSON")
    parser.add_argument("--rerun", default="", help="comma-separated blocks to run again into the mode's results JSON")
    args = parser.parse_args()
    raw = BENCH_DIR / "results" / ("quick" if args.quick else "full") / "results.json"
    if args.report_only:
        print(f"[bench] wrote {write_report(json.loads(raw.read_text()), args.out_dir)}")
        return 0
    sys.path[:0] = [str(BENCH_DIR), str(REPO)]  # this checkout's library, whatever the environment has installed
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), str(BENCH_DIR), os.environ.get("PYTHONPATH")]))
    run, blocks, failed = run_info(args.quick), [], False
    names = (args.rerun or args.blocks).split(",")
    unknown = sorted(set(names) - set(BLOCKS))
    if unknown:
        parser.error(f"unknown block(s) {unknown}; known: {', '.join(BLOCKS)}")
    started = time.perf_counter()
    for name in names:
        start = time.perf_counter()
        work = BENCH_DIR / "results" / "raw" / name
        work.mkdir(parents=True, exist_ok=True)
        try:
            block = importlib.import_module(name).block(work, args.quick)
        except Exception as error:  # the page says which block failed and why; the command still fails
            traceback.print_exc()
            failed = True
            block = {"title": name, "not_run": f"it failed: `{type(error).__name__}: {str(error)[-300:]}`"}
        block["seconds"] = time.perf_counter() - start
        print(f"[bench] {name}: {block['seconds']:.0f} s", flush=True)
        blocks.append(block)
    run |= {"total_s": time.perf_counter() - started, "load_end": load()}
    results = (
        rerun_into(json.loads(raw.read_text()), names, blocks, run) if args.rerun else {"run": run, "blocks": blocks}
    )
    raw.parent.mkdir(parents=True, exist_ok=True)
    raw.write_text(json.dumps(results, indent=1) + "\n")
    print(f"[bench] wrote {write_report(results, args.out_dir)} and {raw} in {run['total_s']:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
