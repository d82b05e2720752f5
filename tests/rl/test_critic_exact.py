"""The value head's loss is exact as its own head beside the policy's: every value loss mode (the policy token-mean),
2 mini-batches x 2 epochs, at GA, DP=2, SP=2, DP=2 x SP=2 and packed with a token budget, against a hand-written
float64 one-process reference; one loss all-reduce per optimizer step for both heads. Negative control: each
micro-batch normalized alone is not exact."""

from __future__ import annotations

import pytest

from tests.dist_helpers import run_distributed
from tests.rl.critic_fixtures import MODES, hand_reference, layout_steps
from tests.rl.exact_fixtures import relative_error, steps
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
    return {mode: hand_reference(mode) for mode in MODES}


def _run(layout: Layout, alone: bool = False, only: tuple[str, ...] = MODES) -> dict:
    world = layout.dp * layout.sp
    if world == 1:
        return layout_steps(0, 1, layout, list(only), alone)
    return run_distributed(layout_steps, world, layout, list(only), alone, timeout_s=600)[0]


@pytest.mark.slow
def test_every_value_mode_is_exact_under_gradient_accumulation(expected):
    _check(Layout(1, 1, 2), expected)


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS[1:], ids=str)
def test_every_value_mode_is_exact_at_every_layout(layout, expected):
    _check(layout, expected)


def _check(layout: Layout, expected: dict) -> None:
    result = _run(layout)
    for mode in MODES:
        got = result[mode]
        assert len(got["grads"]) == len(steps()) == 4
        for step, (grads, reference) in enumerate(zip(got["grads"], expected[mode])):
            error = relative_error(grads, reference)
            assert error <= 1e-12, f"{layout} value {mode} step {step + 1}: relative gradient error {error:.3e}"
        world = layout.dp * layout.sp
        assert got["calls"] == [1 if world > 1 else 0] * 4, f"{layout} {mode}: loss all-reduces {got['calls']}"


@pytest.mark.slow
def test_each_micro_batch_normalized_alone_is_not_exact(expected):
    normalized = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
    result = _run(Layout(1, 1, 2), alone=True, only=normalized)
    errors = {mode: relative_error(result[mode]["grads"][0], expected[mode][0]) for mode in normalized}
    assert all(error > 1e-3 for error in errors.values()), errors
