"""MoE router heads over real gloo processes (`check_split_invariance`): global-batch (a fixed f) and the z-loss over
GA x DP x Ulysses SP x packing (with a token budget), sequence over GA x DP x packing with shared prompts, each equal
to the float64 hand reference with ONE loss all-reduce per step; the previous step's expert counts summed over the
ranks in that same all-reduce; a step whose micro-batches carry their routing (RL's old pass) trains with its own
global f, exact over GA x DP x SP x packing with shared prompts, counted in that same all-reduce; under Ulysses SP,
sequence (whole samples' counts summed over the SP group, one all-reduce per micro-batch) and global-batch with
shared prompts cut across the shards equal the hand reference too."""

from __future__ import annotations

import pytest
import torch

from tests.dist_helpers import counting_world_all_reduces, run_distributed
from tests.models.moe_fixtures import (
    EXPERTS,
    LAYERS,
    TOP_K,
    RoutedMoE,
    moe_samples,
    packed,
    packed_shared,
    padded,
    reference,
    tiny_moe,
)
from veomni_lite.data.packing import padding_micro_batch
from veomni_lite.distributed.parallel_state import init_parallel_state
from veomni_lite.distributed.sequence_parallel import slice_micro_batch
from veomni_lite.models.moe import ROUTER_AUX, ROUTER_Z, RouterLosses
from veomni_lite.models.routing import ROUTED_EXPERTS, record_routing
from veomni_lite.plain_loop import LossStep
from veomni_lite.split_invariance import Layout, _chunks, _mode_name, check_split_invariance
from veomni_lite.utils.loss_utils import LossModes, mark_sequences

FIXED_F = torch.linspace(0.5, 1.5, EXPERTS, dtype=torch.float64) * TOP_K / EXPERTS  # sums to k, not uniform
F64 = 1e-12


def global_batch_model() -> RoutedMoE:
    return RoutedMoE("global-batch", FIXED_F)


def sequence_model() -> RoutedMoE:
    return RoutedMoE("sequence")


class ShardLocalSequence(RoutedMoE):
    """The negative control: the model runs Ulysses SP but the router heads count each shard's tokens as if whole."""

    def enable_sequence_parallel(self, group) -> None:  # noqa: ANN001
        self.inner.enable_sequence_parallel(group)


def shard_local_sequence_model() -> RoutedMoE:
    return ShardLocalSequence("sequence")


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


def _with_the_old_pass_routing(rank: int, world_size: int, layout: Layout, collate) -> dict:  # noqa: ANN001
    """This rank's step of `layout` as RL runs it: an old pass (no grad) records each micro-batch's experts
    (`ROUTED_EXPERTS`, this SP shard's), then the step trains the global-batch head with the f of those experts."""
    state = init_parallel_state(layout.dp, layout.sp)
    model = tiny_moe()
    if layout.sp > 1:
        model.enable_sequence_parallel(state.sp_group)
    router = RouterLosses(model, "global-batch", aux_coef=1.0, z_coef=0.0)
    modes = _modes("token-mean")
    chunks = _chunks(layout, moe_samples(), state.dp_rank)
    marked = [mark_sequences(collate(chunk or chunks[0]), modes) for chunk in chunks]
    marked = [batch if chunk else padding_micro_batch(batch) for batch, chunk in zip(marked, chunks)]
    micro_batches = [slice_micro_batch(batch, state.sp_rank, layout.sp) for batch in marked]
    for micro_batch in micro_batches:  # the old-log-probability pass: the same tokens, the same weights
        with torch.no_grad(), record_routing(model) as record:
            model(**micro_batch)
        micro_batch[ROUTED_EXPERTS] = torch.stack(record, 1).view(*micro_batch["input_ids"].shape, LAYERS, TOP_K)
    slots = router.step_slots(torch.device("cpu"), micro_batches)
    total = 0.0
    with counting_world_all_reduces() as calls:
        step = LossStep(micro_batches, modes, marked=True, extra_counts=router.counts, slots=slots)
        router.set_global_counts(step.step_slots(router.loss_keys))
        for micro_batch, tokens in step:
            inputs = {k: v for k, v in micro_batch.items() if k != ROUTED_EXPERTS}  # the trainer pops them
            outputs = router.routed(model, inputs, lambda batch: model(**batch))
            loss = step.loss({key: outputs[key] for key in router.loss_keys}, tokens)
            loss.backward()
            total += float(loss.detach())
    return {"f": router.global_f, "local": slots, "loss": total, "calls": len(calls)}


LAYOUTS_WITH_ROUTING = [
    (Layout(2, 1, 2), padded),
    (Layout(2, 1, 2, packed=True, max_tokens=24), packed),
    (Layout(2, 1, 4, packed=True, max_tokens=30), packed_shared),
    (Layout(1, 2, 4), padded),
    (Layout(2, 2, 2), padded),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("layout", "collate"), LAYOUTS_WITH_ROUTING, ids=lambda x: str(x) if isinstance(x, Layout) else x.__name__
)
def test_a_step_carrying_its_routing_trains_with_its_own_global_f(layout: Layout, collate) -> None:  # noqa: ANN001
    world = layout.dp * layout.sp
    results = run_distributed(_with_the_old_pass_routing, world, layout, collate)
    ref = reference(tiny_moe(), moe_samples())
    for result in results:
        assert torch.allclose(result["f"], ref["f"], rtol=0, atol=1e-15), (result["f"], ref["f"])
        assert result["calls"] == 1, "the counts ride in the step's one loss all-reduce"
    loss = sum(result["loss"] for result in results) / world
    assert loss == pytest.approx(float(ref["global-batch"].detach()), rel=F64)
    # negative control: one rank's own counts are not the step's f (the all-reduce is what makes it global)
    local = results[0]["local"].double()
    assert (local[:-1] / local[-1] - ref["f"]).abs().max() > 1e-3


SP_LAYOUTS = [
    Layout(1, 2, 4),
    Layout(2, 2, 2),
    Layout(1, 2, 4, packed=True),
    Layout(2, 2, 2, packed=True, max_tokens=30),
]


def _check_sp(report, expected: torch.Tensor, per_micro_batch: bool) -> None:
    for (layout, _), loss in report.losses.items():
        assert loss == pytest.approx(float(expected.detach()), rel=F64), layout
    assert report.worst() < 1e-10, str(report)
    for layout in SP_LAYOUTS:  # the step's loss all-reduce, plus (sequence) one SP all-reduce per micro-batch
        micro_batches = 8 // (layout.micro_batch_size * layout.dp) if not layout.max_tokens else None
        calls = report.collectives_per_step[str(layout)]
        if micro_batches is not None:
            assert calls == 1 + (micro_batches if per_micro_batch else 0), (layout, calls)


@pytest.mark.slow
def test_sequence_under_ulysses_sp_with_shared_prompts_equals_the_hand_reference():
    modes = _modes("seq-mean-token-sum")
    report = check_split_invariance(sequence_model, moe_samples(), padded, [modes], SP_LAYOUTS, packed_shared)
    print(f"\n{report}")
    ref = reference(sequence_model().inner, moe_samples())
    expected = ref["sequence"].detach() + 0.01 * ref["z"].detach()
    _check_sp(report, expected, per_micro_batch=True)
    # negative control: each shard's tokens counted as whole samples
    bad = check_split_invariance(shard_local_sequence_model, moe_samples(), padded, [modes], [Layout(1, 2, 4)])
    assert abs(bad.losses["dp1xsp2/mbs4", _mode_name(modes)] - float(expected)) > 1e-3


@pytest.mark.slow
def test_global_batch_under_ulysses_sp_with_shared_prompts_equals_the_hand_reference():
    modes = _modes("token-mean")
    layouts = SP_LAYOUTS[2:]
    report = check_split_invariance(global_batch_model, moe_samples(), padded, [modes], layouts, packed_shared)
    print(f"\n{report}")
    ref = reference(global_batch_model().inner, moe_samples(), FIXED_F)
    _check(report, modes, ref["global-batch"] + 0.01 * ref["z"])
