"""benchmarks/gpu_sync_audit.py without a GPU: `--cpu-dry-run` runs its code path on 2 gloo processes (fp32, no sync
check), so the script `make test-gpu` relies on is exercised by every `make test`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_gpu_audit_runs_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "audit.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    command += [str(REPO / "benchmarks" / "gpu_sync_audit.py"), "--cpu-dry-run", "--sp", "2", "--ga", "2"]
    command += ["--steps", "1", "--time-reps", "2", "--out", str(out)]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    result = json.loads(out.read_text())
    assert not result["audited"] and result["error_mode_passed"]
    assert (result["backend"], result["precision"], result["world"], result["sp"]) == ("gloo", "fp32", 2, 2)
    assert set(result["step_time_s"]) == {"none", "oracle", "veomni_lite"}
    assert result["time_reps"] == 2 and len(result["normalization_ratio"]) == 3
