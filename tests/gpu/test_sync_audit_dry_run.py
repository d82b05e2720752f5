"""tests/gpu/sync_audit.py without a GPU: `--cpu-dry-run` drives the trainer's own step on 2 gloo processes (fp32, no
sync audit), so the script `make test-gpu` relies on is exercised by every `make test`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "sp"), [("qwen2", 1), ("qwen2_vl", 2)])
def test_the_gpu_audit_runs_the_trainers_step_on_cpu(demo: Path, tmp_path: Path, kind: str, sp: int) -> None:
    out = tmp_path / "audit.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    command += [str(REPO / "tests" / "gpu" / "sync_audit.py"), kind, str(demo), "--sp", str(sp), "--steps", "1"]
    command += ["--cpu-dry-run", "--out", str(out), "--output-dir", str(tmp_path / "run")]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    result = json.loads(out.read_text())
    assert (result["kind"], result["sp"], result["world"], result["audited"]) == (kind, sp, 2, False)
    assert result["trainer_step"] == 4, "2 warm-up + 1 audited + 1 timed steps of the trainer's own train_step"
    assert result["micro_batches"] >= 1 and result["syncs_per_micro_batch"] == 0
    rows = [json.loads(line) for line in (tmp_path / "run" / kind / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows if "train/loss" in row] == [1, 2, 3, 4], "the trainer logged every step"
