"""benchmarks/harness.py's torchrun: a failed launch's error names the rank's own exception (the launcher's report
alone fills the tail of its stderr)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

BENCH_DIR = Path(__file__).resolve().parents[2] / "benchmarks"
_spec = importlib.util.spec_from_file_location("bench_harness", BENCH_DIR / "harness.py")
harness = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(harness)

FAILING = """import os, time
if os.environ["RANK"] == "1":
    raise ValueError("rank 1's own cause: a missing results key 'times_s'")
time.sleep(30)
"""


@pytest.mark.slow
def test_a_failed_launch_names_the_ranks_exception(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(FAILING)
    with pytest.raises(RuntimeError) as failed:
        harness.torchrun(script, 2, ["--flag"], timeout_s=120)
    message = str(failed.value)
    assert message.startswith("worker.py --flag exited 1:"), message[:200]
    assert "ValueError: rank 1's own cause: a missing results key 'times_s'" in message, message
    assert "Root Cause (first observed failure)" in message, "and the launcher's report after it"
