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


def _bytes_on_ranks(rank: int, world_size: int) -> dict:
    import sys

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    sys.path.insert(0, str(BENCH_DIR))
    import harness as bench

    class Experts(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(4, 6, 8))  # [E, out, in]: 768 float32 bytes

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x @ self.weight.sum(0).T

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), Experts())
    if world_size > 1:
        fully_shard(model[1])
        fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters())
    experts = {id(model[1].weight)}
    with bench.gathered_bytes([model[1]]) as gathered:
        model(torch.randn(3, 8)).sum().backward()
    optimizer.step()
    out = {"bytes": bench.rank_bytes(model, optimizer, experts), "gathered": list(gathered)}
    quiet_s, quiet = bench.collective_seconds(lambda: torch.randn(64, 64) @ torch.randn(64, 64))
    gather = [torch.zeros(1 << 16) for _ in range(world_size)]
    wall_s, busy = bench.collective_seconds(lambda: dist.all_gather(gather, torch.ones(1 << 16)))
    return out | {"quiet": quiet, "wall_s": wall_s, "busy": busy}


@pytest.mark.parametrize("world_size", [1, 2])
def test_rank_bytes_are_local_shards_and_gathered_bytes_whole(world_size: int) -> None:
    """FSDP2 on 2 ranks: each holds half the experts' parameters, gradients and AdamW moments, its forward sees all
    of them (1 rank: the same whole tensors, the control); the profiler finds the all-gather, and nothing in a step
    without a collective."""
    from tests.dist_helpers import run_distributed

    whole = 4 * 6 * 8 * 4
    for report in run_distributed(_bytes_on_ranks, world_size, timeout_s=300):
        experts = report["bytes"]["experts"]
        assert experts["parameters"] == experts["gradients"] == whole // world_size
        assert experts["optimizer"] == 2 * whole // world_size + 4  # exp_avg, exp_avg_sq, the float32 step count
        other = report["bytes"]["other"]
        assert other["parameters"] == (8 * 8 + 8) * 4 // world_size
        assert report["gathered"] == [whole]
        assert report["quiet"] == {}
        assert 0 < report["busy"]["all_gather"] <= report["wall_s"]
