"""MoE router heads over real gloo processes (`check_split_invariance`): global-batch (a fixed f) and the z-loss over
GA x DP x Ulysses SP x packing (with a token budget), sequence over GA x DP x packing with shared prompts, each equal
to the float64 hand reference with ONE loss all-reduce per step; the previous step's expert counts summed over the
ranks in that same all-reduce."""

from __future__ import annotations

import pytest
import torch

from tests.dist_helpers import counting_world_all_reduces, run_distributed
from tests.models.moe_fixtures import EXPERTS, TOP_K, RoutedMoE, moe_samples, packed, packed_shared, padded, reference
from veomni_lite.distributed.parallel_state import init_parallel_state
from veomni_lite.models.moe import ROUTER_AUX, ROUTER_Z
from veomni_lite.plain_loop import LossStep
from veomni_lite.split_invariance import Layout, _mode_name, check_split_invariance
from veomni_lite.utils.loss_utils import LossModes

FIXED_F = torch.linspace(0.5, 1.5, EXPERTS, dtype=torch.float64) * TOP_K / EXPERTS  # sums to k, not uniform
F64 = 1e-12


def global_batch_model() -> RoutedMoE:
    return RoutedMoE("global-batch", FIXED_F)


def sequence_model() -> RoutedMoE:
    return RoutedMoE("sequence")


def _modes(aux: str) -> LossModes:
    return LossModes("token-mean", {ROUTER_AUX: aux, ROUTER_Z: "token-mean"})


def _check(report, modes: LossModes, expected: torch.Tensor) -> None:
    for (layout, mode), loss in report.losses.items():
        assert mode == _mode_name(modes)
        assert loss == pytest.approx(float(expected.detach()), rel=F64), layout
    assert report.worst() < 1e-10, str(report)
    assert set(report.collectives_per_step.values()) == {1}, "one loss all-reduce per step"


@pytest.mark.slow
def test_global_batch_and_z_over_ga_dp_sp_and_packing_equal_the_hand_reference():
    layouts = [
        Layout(2, 1, 2),
        Layout(1, 2, 4),
        Layout(2, 2, 2),
        Layout(2, 1, 2, packed=True, max_tokens=24),
    ]
    modes = _modes("token-mean")
    report = check_split_invariance(global_batch_model, moe_samples(), padded, [modes], layouts, packed_collate=packed)
    print(f"\n{report}")
    model = global_batch_model()
    ref = reference(model.inner, moe_samples(), FIXED_F)
    _check(report, modes, ref["global-batch"] + 0.01 * ref["z"])


@pytest.mark.slow
def test_sequence_over_ga_dp_and_shared_prompts_equals_the_hand_reference():
    layouts = [Layout(2, 1, 2), Layout(2, 1, 2, packed=True), Layout(2, 1, 4, packed=True, max_tokens=30)]
    modes = _modes("seq-mean-token-sum")
    report = check_split_invariance(sequence_model, moe_samples(), padded, [modes], layouts, packed_shared)
    print(f"\n{report}")
    ref = reference(sequence_model().inner, moe_samples())
    _check(report, modes, ref["sequence"] + 0.01 * ref["z"])


def _slots_in_the_one_all_reduce(rank: int, world_size: int) -> tuple[list[int], int]:
    init_parallel_state(world_size, 1)
    slots = torch.full((EXPERTS + 1,), rank + 1, dtype=torch.int64)
    with counting_world_all_reduces() as calls:
        step = LossStep([padded(moe_samples()[rank : rank + 1])], slots=slots)
        totals = step.step_slots(("foundation_loss",))
        loss = torch.tensor(2.0, requires_grad=True)
        for _, tokens in step:
            step.scaled({"foundation_loss": loss}, tokens)
    return totals.tolist(), len(calls)


@pytest.mark.slow
def test_the_previous_steps_counts_are_summed_over_the_ranks_in_the_steps_one_all_reduce():
    results = run_distributed(_slots_in_the_one_all_reduce, 2)
    for totals, calls in results:
        assert totals == [3] * (EXPERTS + 1)
        assert calls == 1
