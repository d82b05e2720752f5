"""A controller merges worker metric windows without torch.distributed, equal to the distributed reduction.

Three worker processes (multiprocessing, no process group) record the same values the gloo ranks record, export
their windows as plain data, and the controller merges them: every reduction (mean, sum, min, max, last), keys that
only some workers recorded, a key no worker recorded, and an empty window.
"""

from __future__ import annotations

import json
import math
import multiprocessing

import pytest
import torch

from tests.dist_helpers import run_distributed
from veomni_lite.metrics import MetricAccumulator, MetricSpec

SPECS = [
    MetricSpec("loss", "mean"),
    MetricSpec("lr", "last"),
    MetricSpec("grad_min", "min"),
    MetricSpec("grad_max", "max"),
    MetricSpec("tokens", "sum"),
    MetricSpec("only_rank2", "max"),
    MetricSpec("never", "mean"),
]
WORLD = 3


def record(rank: int) -> MetricAccumulator:
    """Rank-dependent records (rank 1 records nothing at all: an empty window)."""
    accumulator = MetricAccumulator(SPECS, sp_rank=0)
    if rank == 1:
        return accumulator
    gen = torch.Generator().manual_seed(rank)
    for step in range(4):
        value = torch.rand((), generator=gen, dtype=torch.float64) * 10 - 5
        accumulator.record("loss", value, count=torch.tensor(3 + rank + step))
        accumulator.record("grad_min", value)
        accumulator.record("grad_max", float(value))
        accumulator.record("tokens", 100 * rank + step)
        accumulator.record("lr", 1e-3 * (step + 1))
    if rank == 2:
        accumulator.record("only_rank2", -7.5)
    return accumulator


def _worker(rank: int, queue) -> None:
    queue.put((rank, json.dumps(record(rank).export_window())))  # plain data: JSON survives the trip


def _distributed(rank: int, world_size: int) -> dict[str, float]:
    return record(rank).reduce()


def test_a_controller_merge_of_worker_windows_equals_the_distributed_reduction():
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    workers = [context.Process(target=_worker, args=(rank, queue)) for rank in range(WORLD)]
    for worker in workers:
        worker.start()
    windows = dict(queue.get(timeout=120) for _ in workers)
    for worker in workers:
        worker.join(timeout=30)
    merged = MetricAccumulator(SPECS).merge_windows(json.loads(windows[rank]) for rank in range(WORLD))
    distributed = run_distributed(_distributed, WORLD)[0]
    assert list(merged) == list(distributed) and "never" not in merged
    for name, value in distributed.items():
        assert merged[name] == pytest.approx(value, rel=1e-12, abs=1e-12), name
    # the hand reference of the extrema and the weighted mean
    records = {rank: record(rank).take_window() for rank in (0, 2)}  # {name: [value, weight]}
    assert merged["grad_max"] == max(float(s["grad_max"][0]) for s in records.values())
    assert merged["grad_min"] == min(float(s["grad_min"][0]) for s in records.values())
    total = sum(float(s["loss"][0]) for s in records.values())
    count = sum(float(s["loss"][1]) for s in records.values())
    assert merged["loss"] == pytest.approx(total / count, rel=1e-14)
    assert merged["only_rank2"] == -7.5 and merged["tokens"] == sum(100 * r + s for r in (0, 2) for s in range(4))


def test_merging_empty_windows_logs_nothing_and_mismatched_specs_are_an_error():
    accumulator = MetricAccumulator(SPECS)
    assert accumulator.merge_windows([]) == {}
    empty = MetricAccumulator(SPECS, sp_rank=0).export_window()
    assert accumulator.merge_windows([empty, empty]) == {}
    other = MetricAccumulator([MetricSpec("loss", "sum")], sp_rank=0)
    other.record("loss", 1.0)
    with pytest.raises(RuntimeError, match="different layouts"):
        accumulator.merge_windows([empty, other.export_window()])
    one = MetricAccumulator([MetricSpec("loss", "mean")], sp_rank=0)
    with pytest.raises(RuntimeError, match="declared different metric specs"):
        one.merge_windows([other.export_window()])
    assert math.isinf(empty["max"][-1])
