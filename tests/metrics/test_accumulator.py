from __future__ import annotations

import math
import pickle

import pytest
import torch

import veomni_lite.metrics.accumulator as accumulator_module
from veomni_lite.metrics import MetricAccumulator, MetricSpec

SPECS = [
    MetricSpec("loss", "mean"),
    MetricSpec("lr", "last", ".1e"),
    MetricSpec("grad_min", "min"),
    MetricSpec("grad_max", "max"),
    MetricSpec("tokens", "sum", ",.0f", sp_dedup=True),
]


@pytest.fixture
def counted_all_reduce(monkeypatch):
    calls: list[str] = []
    original = accumulator_module.all_reduce

    def counting(data, op="sum", group=None):
        calls.append(op)
        return original(data, op=op, group=group)

    monkeypatch.setattr(accumulator_module, "all_reduce", counting)
    return calls


@pytest.fixture
def no_host_reads(monkeypatch):
    """Make every host read of a tensor raise; yields a function that restores them early."""
    reads = ("item", "tolist", "__float__", "__int__", "__bool__", "cpu", "numpy")

    def forbidden(name):
        def fail(self, *args, **kwargs):
            raise AssertionError(f"host read: Tensor.{name}")

        return fail

    for name in reads:
        monkeypatch.setattr(torch.Tensor, name, forbidden(name))
    return monkeypatch.undo


def test_mean_is_window_weighted():
    acc = MetricAccumulator(SPECS)
    acc.record("loss", torch.tensor(3.0), count=torch.tensor(1))
    acc.record("loss", 1.0, count=9)
    assert acc.reduce()["loss"] == pytest.approx(1.2)


def test_record_total_adds_a_weighted_total_and_its_count():
    acc = MetricAccumulator(SPECS)
    acc.record_total("loss", torch.tensor(3.0 * 1 + 1.0 * 9, dtype=torch.float64), torch.tensor(10))
    acc.record("loss", 2.0, count=10)
    assert acc.reduce()["loss"] == pytest.approx((12.0 + 20.0) / 20)
    acc.record_total("loss", 5.0, 0)  # no tokens: recorded, omitted
    assert acc.reduce() == {}
    with pytest.raises(ValueError, match="only 'mean' metrics take a weighted total"):
        acc.record_total("tokens", 5, 1)
    with pytest.raises(KeyError, match="'typo' was not declared"):
        acc.record_total("typo", 5, 1)


def test_every_reduction_single_process():
    acc = MetricAccumulator(SPECS)
    for step, value in enumerate([2.0, -1.5, 4.0], start=1):
        acc.record("loss", torch.tensor(value))
        acc.record("lr", step * 1e-4)
        acc.record("grad_min", torch.tensor(value))
        acc.record("grad_max", value)
        acc.record("tokens", torch.tensor(10, dtype=torch.int64))
    out = acc.reduce()
    assert out == pytest.approx({"loss": 1.5, "lr": 3e-4, "grad_min": -1.5, "grad_max": 4.0, "tokens": 30.0})
    assert list(out) == ["loss", "lr", "grad_min", "grad_max", "tokens"]  # declaration order
    assert acc.is_empty


def test_record_is_local_no_collective_no_host_read(counted_all_reduce, no_host_reads):
    acc = MetricAccumulator(SPECS)
    for _ in range(3):
        acc.record("loss", torch.tensor(2.0, requires_grad=True) * 1, count=torch.tensor(7))
        acc.record("lr", torch.tensor(1e-4))
        acc.record("grad_min", torch.tensor([0.5]))
        acc.record("grad_max", torch.tensor(0.5))
        acc.record("tokens", torch.tensor(3))
        acc.record("grad_max", 0.25)
    assert counted_all_reduce == []
    no_host_reads()
    assert acc.reduce()["grad_max"] == 0.5


def test_reduce_costs_two_collectives_and_one_host_read(counted_all_reduce, monkeypatch):
    acc = MetricAccumulator(SPECS)
    acc.record("loss", torch.tensor(1.0))
    tolist_calls = []
    original_tolist = torch.Tensor.tolist

    def counting_tolist(self):
        tolist_calls.append(1)
        return original_tolist(self)

    monkeypatch.setattr(torch.Tensor, "tolist", counting_tolist)
    acc.reduce()
    assert counted_all_reduce == ["sum", "max"]
    assert len(tolist_calls) == 1

    # No extrema declared: still exactly one SUM and one MAX (the MAX carries the spec fingerprint).
    counted_all_reduce.clear()
    plain = MetricAccumulator([MetricSpec("loss", "mean")])
    plain.record("loss", 1.0)
    plain.reduce()
    assert counted_all_reduce == ["sum", "max"]


def test_empty_keys_are_omitted_never_zero():
    acc = MetricAccumulator(SPECS)
    assert acc.reduce() == {}
    acc.record("loss", torch.tensor(5.0), count=torch.tensor(0))  # recorded, but covers no tokens
    acc.record("grad_max", -math.inf)
    acc.record("lr", 1e-3)
    out = acc.reduce()
    assert out == {"lr": 1e-3, "grad_max": -math.inf}


def test_undeclared_name_and_bad_arguments_raise_at_record_time():
    acc = MetricAccumulator(SPECS)
    with pytest.raises(KeyError, match="'typo_loss' was not declared"):
        acc.record("typo_loss", 1.0)
    with pytest.raises(ValueError, match="only 'mean' metrics take a count"):
        acc.record("tokens", 5, count=2)
    with pytest.raises(TypeError, match="must be a scalar"):
        acc.record("loss", torch.ones(3))
    with pytest.raises(TypeError, match="got str"):
        acc.record("loss", "1.0")
    with pytest.raises(ValueError, match="declared more than once"):
        MetricAccumulator([MetricSpec("a", "sum"), MetricSpec("a", "max")])


def test_window_is_reset_only_after_a_successful_reduce(monkeypatch):
    acc = MetricAccumulator(SPECS)
    acc.record("loss", 2.0)

    def broken(*args, **kwargs):
        raise RuntimeError("collective failed")

    monkeypatch.setattr(accumulator_module, "all_reduce", broken)
    with pytest.raises(RuntimeError, match="collective failed"):
        acc.reduce()
    monkeypatch.undo()
    acc.record("loss", 4.0)
    assert acc.reduce() == {"loss": 3.0}
    assert acc.reduce() == {}


def test_take_window_hands_over_and_opens_a_new_one():
    acc = MetricAccumulator(SPECS)
    acc.record("loss", 1.0)
    window = acc.take_window()
    acc.record("loss", 9.0)
    assert acc.reduce(window) == {"loss": 1.0}
    assert acc.reduce() == {"loss": 9.0}


def test_sp_dedup_counts_only_sp_rank_zero():
    follower = MetricAccumulator(SPECS, sp_rank=1)
    follower.record("tokens", 100)
    follower.record("loss", 1.0)
    assert follower.reduce() == {"loss": 1.0}
    leader = MetricAccumulator(SPECS, sp_rank=0)
    leader.record("tokens", 100)
    assert leader.reduce() == {"tokens": 100.0}


def test_an_exported_window_is_plain_data_that_merges_like_the_reduction():
    acc = MetricAccumulator(SPECS, sp_rank=0)
    acc.record("loss", torch.tensor(3.0), count=torch.tensor(1))
    acc.record("grad_min", torch.tensor(-2.0))
    acc.record("lr", 1e-4)
    state = pickle.loads(pickle.dumps(acc.export_window()))
    assert all(isinstance(v, float) for items in state.values() for v in items)
    assert acc.is_empty, "exporting the open window resets it"

    other = MetricAccumulator(SPECS, sp_rank=0)
    other.record("loss", 1.0, count=9)
    assert other.merge_windows([state, other.export_window()]) == pytest.approx(
        {"loss": 1.2, "lr": 1e-4, "grad_min": -2.0}
    )
    with pytest.raises(RuntimeError, match="different layouts"):
        other.merge_windows([state, MetricAccumulator(SPECS[:1], sp_rank=0).export_window()])
