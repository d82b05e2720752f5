"""The preference losses are exact: sigmoid (cDPO), ipo, hinge, simpo and bradley_terry, 2 steps of 4 pairs, at GA,
DP=2, SP=2, DP=2 x SP=2 and packed with a token budget (DP=2 and SP=2), against a hand-written float64 one-process
reference; one loss all-reduce per optimizer step; the metrics against a hand computation. Negative control: each SP
shard applying the loss to its own partial sums is not exact."""

from __future__ import annotations

import pytest

from tests.dist_helpers import run_distributed
from tests.pref.exact_fixtures import Layout, cases, hand_metrics, hand_reference, layout_steps, name
from tests.rl.exact_fixtures import relative_error

LAYOUTS = [
    Layout(1, 1, 1),
    Layout(2, 1, 1),
    Layout(1, 2, 2),
    Layout(2, 2, 1),
    Layout(2, 1, 2, packed=True, max_tokens=40),
    Layout(1, 2, 4, packed=True, max_tokens=56),
]


@pytest.fixture(scope="module")
def expected():
    return {name(case): hand_reference(case) for case in cases()}


def _run(layout: Layout, shard_local: bool = False) -> dict:
    world = layout.dp * layout.sp
    if world == 1:
        return layout_steps(0, 1, layout, cases())
    return run_distributed(layout_steps, world, layout, cases(), shard_local, timeout_s=600)[0]


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_every_preference_loss_is_exact_at_every_layout(layout, expected):
    result = _run(layout)
    world = layout.dp * layout.sp
    for case in cases():
        got = result[name(case)]
        assert len(got["grads"]) == 2
        for step, (grads, reference) in enumerate(zip(got["grads"], expected[name(case)])):
            error = relative_error(grads, reference)
            assert error <= 1e-12, f"{layout} {name(case)} step {step + 1}: relative gradient error {error:.3e}"
        assert got["calls"] == [1 if world > 1 else 0] * 2, f"{layout} {name(case)}: loss all-reduces {got['calls']}"
        assert (got["shared"] > 0) == layout.packed, "packed micro-batches keep a pair's prompt once"
        hand = hand_metrics(case)
        assert got["metrics"][0].keys() == hand.keys()
        for key, value in hand.items():
            assert got["metrics"][0][key] == pytest.approx(value, rel=1e-10, abs=1e-12), (layout, name(case), key)


@pytest.mark.slow
def test_each_sp_shard_applying_the_loss_to_its_partial_sums_is_not_exact(expected):
    """The negative control of the sequence completion: without the SP all-reduce, each shard's sigmoid (square,
    hinge, score) sees its partial log-probability sums."""
    result = _run(Layout(1, 2, 2), shard_local=True)
    errors = {name(c): relative_error(result[name(c)]["grads"][0], expected[name(c)][0]) for c in cases()}
    assert all(error > 1e-3 for error in errors.values()), errors
