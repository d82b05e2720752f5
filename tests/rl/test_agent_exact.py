"""Multi-turn episodes train exactly: the model's tokens alone are in every loss mode's numerator and denominator
(GSPO's sequence ratio, the sequence IS weight, KL and entropy over them), the environment's tokens in the sequence
(attended to) but in no sum; at GA, DP=2, SP=2 and packed SP=2 against the float64 one-process reference over model
tokens. Negative control: the environment's tokens trained as the model's are not exact."""

from __future__ import annotations

import pytest

from tests.dist_helpers import run_distributed
from tests.rl.exact_fixtures import cases, hand_reference, layout_steps, relative_error, rollout_batch, steps
from veomni_lite.split_invariance import Layout

LAYOUTS = [
    Layout(1, 1, 2),
    Layout(2, 1, 2),
    Layout(1, 2, 4),
    Layout(1, 2, 8, packed=True, max_tokens=48),
]
# The two ways a mode counts model tokens (over the step's tokens, or each episode's mean) x {ppo_clip + token IS, gspo
# + sequence IS}, KL on; every mode at every layout is tests/rl/test_policy_exact.py's, on the same fixtures.
CASES = [c for c in cases(corrections=False) if c.loss.kl_coef and c.mode in ("token-mean", "seq-mean-token-mean")]


@pytest.fixture(scope="module")
def expected():
    return {str(case): hand_reference(case, episodes=True) for case in CASES}


def _run(layout: Layout, leak: bool = False) -> dict:
    world = layout.dp * layout.sp
    if world == 1:
        return layout_steps(0, 1, layout, CASES, episodes=True, leak=leak)
    return run_distributed(layout_steps, world, layout, CASES, False, False, True, leak, timeout_s=600)[0]


def test_the_episodes_hold_environment_tokens_between_model_turns():
    batch = rollout_batch(episodes=True)
    assert sum(0 in s.response_mask for s in batch) >= 12  # an environment turn between two model turns
    for sample in batch:
        mask = sample.response_mask
        assert mask is not None and len(mask) == len(sample.response_ids) and mask[0] == 1 and mask[-1] == 1
        labels = sample.tensors()["policy_labels"][len(sample.prompt_ids) :]
        assert [int(x != -100) for x in labels] == mask


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_episodes_train_exactly_at_every_layout(layout, expected):
    result = _run(layout)
    for case in CASES:
        got = result[str(case)]
        assert len(got["grads"]) == len(steps()) == 4
        for step, (grads, reference) in enumerate(zip(got["grads"], expected[str(case)])):
            error = relative_error(grads, reference)
            assert error <= 1e-12, f"{layout} {case} step {step + 1}: relative gradient error {error:.3e}"


@pytest.mark.slow
def test_environment_tokens_that_leak_into_the_loss_are_not_exact(expected):
    result = _run(Layout(1, 1, 2), leak=True)
    errors = {str(c): relative_error(result[str(c)]["grads"][0], expected[str(c)][0]) for c in CASES}
    assert all(error > 1e-3 for error in errors.values()), errors
