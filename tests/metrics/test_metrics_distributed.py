"""Metric reduction on 2 real gloo ranks. One spawn runs every scenario in order; the tests check its results."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import veomni_lite.metrics.accumulator as accumulator_module
from tests.dist_helpers import run_distributed, run_ranks
from tests.metrics.helpers import TIME_KEYS, make_logger, record_step
from veomni_lite.distributed.parallel_state import destroy_parallel_state, init_parallel_state
from veomni_lite.metrics import MetricAccumulator, MetricSpec

SPECS = [
    MetricSpec("loss", "mean"),
    MetricSpec("lr", "last", ".1e"),
    MetricSpec("grad_min", "min"),
    MetricSpec("grad_max", "max"),
    MetricSpec("samples", "sum", sp_dedup=True),
    MetricSpec("tokens", "sum"),
    MetricSpec("only_rank0", "mean"),
    MetricSpec("only_rank1", "max"),
    MetricSpec("never", "mean"),
]


def _scenarios(rank: int, world_size: int, output_dir: str) -> dict:
    out: dict = {}
    calls: list[str] = []
    original = accumulator_module.all_reduce

    def counting(data, op="sum", group=None):
        calls.append(op)
        return original(data, op=op, group=group)

    accumulator_module.all_reduce = counting
    try:
        acc = MetricAccumulator(SPECS)
        if rank == 0:  # weighted mean across ranks: 3.0 x 1 here, 1.0 x 9 on rank 1
            acc.record("loss", torch.tensor(3.0), count=torch.tensor(1))
            acc.record("grad_min", torch.tensor(5.0))
            acc.record("grad_min", 2.5)
            acc.record("grad_max", torch.tensor(-4.0))
            acc.record("only_rank0", torch.tensor(2.0))
            acc.record("lr", 1e-4)
        else:
            acc.record("loss", 1.0, count=torch.tensor(9))
            acc.record("grad_min", torch.tensor(-1.25))
            acc.record("grad_max", torch.tensor(7.0))
            acc.record("grad_max", 0.5)
            acc.record("only_rank1", torch.tensor(-3.0))
            acc.record("lr", 3e-4)
        acc.record("tokens", torch.tensor(100 + rank))
        out["mixed"] = acc.reduce()
        out["record_calls"] = len(calls)
        calls.clear()

        # A rank with an empty window still packs every key; the other rank's values are logged.
        if rank == 1:
            acc.record("loss", torch.tensor(2.0), count=torch.tensor(4))
            acc.record("grad_max", torch.tensor(-9.0))
        out["one_rank_empty"] = acc.reduce()
        out["empty_everywhere"] = acc.reduce()
        out["reduce_calls"] = calls.copy()
    finally:
        accumulator_module.all_reduce = original

    # sp_dedup: dp=1 x sp=2, both ranks saw the same 8 samples.
    init_parallel_state(dp_size=1, sp_size=2)
    acc = MetricAccumulator(SPECS)
    acc.record("samples", 8)
    acc.record("tokens", 8)
    out["sp_dedup"] = acc.reduce()
    destroy_parallel_state()

    # The logger: asynchronous logging over its own gloo group while the main thread issues its own collectives.
    parallel = init_parallel_state(dp_size=2, sp_size=1)
    logger = make_logger(Path(output_dir), parallel, max_steps=5, log_interval=2, async_step_end=True, plot=False)
    logger.sinks = logger.sinks[1:]  # no console
    for step in range(1, 6):
        logger.wait_bookkeeping()
        record_step(logger, [(float(step * (rank + 1)), 4)], grad_norm=1.0, skipped=step == 3)
        logger.end_step(step, 0)
        training_collective = torch.ones(1)
        dist.all_reduce(training_collective)
        assert training_collective.item() == world_size
    logger.finish(5, 0)
    logger.close()
    destroy_parallel_state()
    out["series"] = logger.series
    out["sinks"] = len(logger.sinks)
    return out


def _mismatched_specs(rank: int, world_size: int) -> None:
    acc = MetricAccumulator([MetricSpec("loss" if rank == 0 else "lossy", "mean")])
    acc.reduce()


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> tuple[list[dict], Path]:
    output_dir = tmp_path_factory.mktemp("metrics_dist")
    return run_distributed(_scenarios, 2, str(output_dir), timeout_s=120, pg_timeout_s=30), output_dir


@pytest.mark.slow
def test_weighted_mean_min_max_last_across_ranks(results):
    ranks, _ = results
    for out in ranks:
        mixed = out["mixed"]
        assert mixed["loss"] == pytest.approx(1.2)
        assert mixed["grad_min"] == -1.25 and mixed["grad_max"] == 7.0  # exact
        assert mixed["lr"] == pytest.approx(2e-4)  # `last`: mean of the ranks' last values
        assert mixed["tokens"] == 201.0
        assert "never" not in mixed and "samples" not in mixed
    assert ranks[0]["mixed"] == ranks[1]["mixed"]


@pytest.mark.slow
def test_asymmetric_keys_reduce_without_hanging(results):
    ranks, _ = results
    for out in ranks:
        assert out["mixed"]["only_rank0"] == 2.0
        assert out["mixed"]["only_rank1"] == -3.0


@pytest.mark.slow
def test_a_rank_with_an_empty_window(results):
    ranks, _ = results
    for out in ranks:
        assert out["one_rank_empty"] == {"loss": 2.0, "grad_max": -9.0}
        assert out["empty_everywhere"] == {}


@pytest.mark.slow
def test_collectives_per_record_and_per_window(results):
    ranks, _ = results
    for out in ranks:
        assert out["record_calls"] == 2  # the first reduce only: recording issued none
        assert out["reduce_calls"] == ["sum", "max"] * 2


@pytest.mark.slow
def test_sp_dedup_counts_each_sample_once(results):
    ranks, _ = results
    for out in ranks:
        assert out["sp_dedup"] == {"samples": 8.0, "tokens": 16.0}


@pytest.mark.slow
def test_async_logging_on_a_metrics_group(results):
    ranks, output_dir = results
    reduced = [{k: v for k, v in r["series"].items() if k not in TIME_KEYS} for r in ranks]  # not rates: local clocks
    assert reduced[0] == reduced[1] and "train/loss" in reduced[0]
    loss = ranks[0]["series"]["train/loss"]
    # Steps 1-2: rank 0 logs 1, 2 and rank 1 logs 2, 4 -> mean 2.25; the final step 5 is logged.
    assert [(p["step"], p["value"]) for p in loss] == [(2, 2.25), (4, 5.25), (5, 7.5)]
    # recorded by the main rank alone (an asymmetric key): the skipped step 3 counted once
    assert [p["value"] for p in ranks[0]["series"]["train/skipped_steps"]] == [0.0, 1.0, 0.0]
    assert [p["value"] for p in ranks[0]["series"]["train/tokens"]] == [16.0, 16.0, 8.0]  # summed over the ranks
    assert [r["sinks"] for r in ranks] == [2, 0]  # only the main rank writes (JSONL, TensorBoard; no console)
    events = [json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events] == [2, 4, 5]
    assert all(e["train/grad_norm"] == 1.0 and "train/never" not in e for e in events)
    assert not any(math.isnan(e["train/loss"]) for e in events)


@pytest.mark.slow
def test_ranks_with_different_specs_get_a_clear_error():
    outcomes = run_ranks(_mismatched_specs, 2, timeout_s=60, pg_timeout_s=20)
    for status, value in outcomes.values():
        assert status == "error"
        assert "ranks declared different metric specs" in value
