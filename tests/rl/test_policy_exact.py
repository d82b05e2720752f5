"""The policy loss is exact: every loss mode x {ppo_clip, gspo} x kl {0, k3}, and the importance-sampling corrections
(masked token / sequence IS, IcePop, decoupled PPO) at two modes, 2 mini-batches x 2 epochs, at GA, DP=2, SP=2,
DP=2 x SP=2 and packed with a token budget, against a hand-written float64 one-process reference with the batch's
given engine (behaviour) log-probabilities; one loss all-reduce per optimizer step. Negative controls: each
micro-batch normalized alone, and GSPO and the sequence-level corrections with each SP shard reducing only its own
part of a sequence, are not exact."""

from __future__ import annotations

import pytest

from tests.dist_helpers import run_distributed
from tests.rl.exact_fixtures import cases, hand_reference, layout_steps, relative_error, steps
from veomni_lite.split_invariance import Layout

LAYOUTS = [
    Layout(1, 1, 2),
    Layout(2, 1, 2),
    Layout(1, 2, 4),
    Layout(2, 2, 2),
    Layout(2, 1, 4, packed=True, max_tokens=24),
    Layout(1, 2, 8, packed=True, max_tokens=40),
]


@pytest.fixture(scope="module")
def expected():
    return {str(case): hand_reference(case) for case in cases()}


def _run(layout: Layout, alone: bool = False, shard_local: bool = False, only: list | None = None) -> dict:
    world, chosen = layout.dp * layout.sp, cases() if only is None else only
    if world == 1:
        return layout_steps(0, 1, layout, chosen, alone)
    return run_distributed(layout_steps, world, layout, chosen, alone, shard_local, timeout_s=600)[0]


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_every_mode_and_loss_is_exact_at_every_layout(layout, expected):
    result = _run(layout)
    for case in cases():
        got = result[str(case)]
        assert len(got["grads"]) == len(steps()) == 4
        for step, (grads, reference) in enumerate(zip(got["grads"], expected[str(case)])):
            error = relative_error(grads, reference)
            assert error <= 1e-12, f"{layout} {case} step {step + 1}: relative gradient error {error:.3e}"
        world = layout.dp * layout.sp
        assert got["calls"] == [1 if world > 1 else 0] * 4, f"{layout} {case}: loss all-reduces {got['calls']}"
        assert (got["shared"] > 0) == layout.packed, "packed micro-batches keep a group's prompt once"


@pytest.mark.slow
def test_each_micro_batch_normalized_alone_is_not_exact(expected):
    normalized = [c for c in cases(corrections=False) if c.mode != "token-sum" and c.loss.kl_coef]  # token-sum: none
    result = _run(Layout(1, 1, 2), alone=True, only=normalized)
    wrong = [str(c) for c in normalized if relative_error(result[str(c)]["grads"][0], expected[str(c)][0]) > 1e-3]
    assert len(wrong) == len(normalized) == 8, wrong


@pytest.mark.slow
def test_gspo_with_each_shard_reducing_its_own_tokens_is_not_exact(expected):
    """The negative control of the sequence reduction: without the SP all-reduce, GSPO's ratio (and the sequence
    importance weight, truncated or masked) are each shard's partial ones."""
    gspo = [c for c in cases() if c.loss.policy_loss == "gspo" or c.loss.importance_sampling == "sequence_mask"]
    result = _run(Layout(1, 2, 4), shard_local=True, only=gspo)
    errors = {str(c): relative_error(result[str(c)]["grads"][0], expected[str(c)][0]) for c in gspo}
    assert all(error > 1e-3 for error in errors.values()), errors
