"""benchmarks/gpu.py (`make bench-gpu`) without a GPU: `--dry-run` runs the same code (our trainer's step and
transformers' own under torchrun, the dense step alone, the report) on tiny models on the CPU, so the script a lent
GPU's 15 minutes rely on is exercised by every `make test`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_gpu_bench_runs_both_jobs_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    command = [sys.executable, str(REPO / "benchmarks" / "gpu.py"), "--dry-run", "--work-dir", str(tmp_path / "work")]
    done = subprocess.run([*command, "--out", str(out)], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["command"] == "make bench-gpu (dry run)" and report["device"] == "cpu"
    moe, dense = report["jobs"]["moe"], report["jobs"]["dense"]
    assert (moe["result"]["shape"], dense["result"]["shape"]) == ("dry_run", "dry_run_dense")
    assert [row["side"] for row in moe["rows"]] == ["ours", "theirs"] and [r["side"] for r in dense["rows"]] == ["ours"]
    assert moe["result"]["sequential"], "one side after the other, as on the GPU"
    assert moe["result"]["loss_rel_diff"] < 1e-5, "equal work: the first step's losses from equal weights"
    for row in moe["rows"] + dense["rows"]:
        assert row["tokens_per_s"] > 0 and row["steps"] == 1 and row["mfu"] is None  # no known peak on a CPU
    assert "[bench-gpu] wrote" in done.stdout
