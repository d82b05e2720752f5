from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.dist_helpers import counting_calls, run_distributed
from veomni_lite.distributed.collectives import agree, all_reduce, name_problems


def test_without_process_group_returns_local_values():
    assert all_reduce(3) == 3
    assert all_reduce(2.5, op="mean") == 2.5
    assert all_reduce([1, 2, 3], op="max") == [1, 2, 3]
    tensor = torch.tensor([1.0, 2.0])
    out = all_reduce(tensor, op="sum")
    assert isinstance(out, torch.Tensor)
    assert torch.equal(out, tensor)
    assert all_reduce(torch.tensor([3], dtype=torch.int32)).dtype == torch.int64


def test_rejects_unknown_op_and_types():
    with pytest.raises(ValueError, match="unknown op 'avg'"):
        all_reduce(1, op="avg")
    with pytest.raises(TypeError, match="list item 1 is str"):
        all_reduce([1, "a"])
    with pytest.raises(TypeError, match="unsupported data type dict"):
        all_reduce({"a": 1})


def _reduce_everything(rank: int, world_size: int) -> dict:
    with counting_calls(dist, "all_reduce") as calls:
        big = 2**24 + 1
        out = {
            "scalar_sum": all_reduce(rank + 1),
            "scalar_mean": all_reduce(float(rank), op="mean"),
            "list": all_reduce([rank, big, 0.5 * rank], op="sum"),
            "int_exact": all_reduce([big, big + rank]),
            "max": all_reduce([rank, -rank], op="max"),
            "min": all_reduce(torch.tensor([rank, -rank]), op="min"),
            "tensor_mean": all_reduce(torch.tensor([1, 3]) * (rank + 1), op="mean"),
            "tensor_list": all_reduce([torch.tensor(rank), torch.tensor(2 * rank)]),
        }
        out["calls"] = len(calls)
    return out


@pytest.mark.slow
def test_reduces_across_two_gloo_ranks_one_collective_per_call():
    results = run_distributed(_reduce_everything, 2)
    for out in results:
        assert out["scalar_sum"] == 3 and isinstance(out["scalar_sum"], int)
        assert out["scalar_mean"] == 0.5
        assert out["list"] == [1.0, 2 * (2**24 + 1), 0.5]
        assert out["int_exact"] == [2 * (2**24 + 1), 2 * (2**24 + 1) + 1]  # exact in int64
        assert out["max"] == [1, 0]
        assert torch.equal(out["min"], torch.tensor([0, -1]))
        assert torch.allclose(out["tensor_mean"], torch.tensor([1.5, 4.5], dtype=torch.float64))
        assert [int(t) for t in out["tensor_list"]] == [1, 2]
        assert out["calls"] == 8  # one collective per call, lists packed


class _Fault(Exception):
    pass


def _agree_with_a_fault_on_rank_one(rank: int, world_size: int) -> dict:
    out: dict = {}
    with counting_calls(dist, "all_reduce") as reduces, counting_calls(dist, "all_gather_object") as gathers:
        out["flags"] = agree(None, _Fault, flags=[rank, -rank])
        out["calm"] = (len(reduces), len(gathers))
        try:
            agree(ValueError("sample 7 has 40 tokens") if rank == 1 else None, _Fault, flags=[rank], where="step 2: ")
            out["error"] = "no error"
        except _Fault as exc:
            out["error"] = str(exc)
            out["cause"] = type(exc.__cause__).__name__
        out["calls"] = (len(reduces), len(gathers))
    return out


@pytest.mark.slow
def test_agree_raises_the_same_error_naming_the_rank_and_cause_on_every_rank_when_one_rank_fails():
    results = run_distributed(_agree_with_a_fault_on_rank_one, 2)
    for rank, out in enumerate(results):
        assert out["flags"] == [1, 0], "the flags reduced by MAX"
        assert out["calm"] == (1, 0), "no problem: one all-reduce, no gather"
        assert out["error"] == "step 2: rank 1: sample 7 has 40 tokens", out
        assert out["calls"] == (2, 1), "a problem: the same all-reduce, then one gather of the causes"
        assert out["cause"] == ("ValueError" if rank == 1 else "NoneType")


def test_problems_are_named_with_the_ranks_that_share_a_message():
    assert name_problems({3: "b", 0: "a", 1: "a"}) == "ranks 0, 1: a; rank 3: b"


def test_agree_without_a_process_group_raises_the_local_problem():
    assert agree(None, _Fault, flags=[3]) == [3]
    with pytest.raises(_Fault, match=r"^rank 0: broken$"):
        agree("broken", _Fault)
