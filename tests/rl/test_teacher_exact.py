"""On-policy distillation is exact: the teacher's per-token reverse KL in the advantage (`rl.teacher.coef`), alone on
policy and added to the rewards' advantage off policy (2 mini-batches x 2 epochs), under ppo_clip and gspo at three
loss modes, at GA, DP=2, SP=2, DP=2 x SP=2 and packed with token budgets, against the hand-written float64
one-process reference (`exact_fixtures.hand_reference`: A_t = A - coef (old_t - teacher_t), one sample at a time); one
loss all-reduce per optimizer step. Negative controls: the teacher's log-probabilities one token out of place, and
each micro-batch normalized alone, are not exact."""

from __future__ import annotations

import dataclasses

import pytest

from tests.dist_helpers import run_distributed
from tests.rl.exact_fixtures import Case, hand_reference, layout_steps, relative_error, steps
from tests.rl.test_policy_exact import LAYOUTS
from veomni_lite.rl.policy_loss import PolicyLoss
from veomni_lite.split_invariance import Layout

pytestmark = pytest.mark.slow  # the float64 references of four steps per case, and gloo worlds of 2 and 4
COEF = 0.5


def teacher_cases() -> list[Case]:
    """Three modes x {ppo_clip with token IS and the KL, gspo} with the teacher; on policy (old = logp, one epoch's
    worth of fresh weights each step) the rewards' advantage stays, so the term adds to it."""
    out = []
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        clip = {"clip_low": 0.2, "clip_high": 0.28, "dual_clip": 3.0}
        out.append(Case(mode, PolicyLoss("ppo_clip", 0.1, "k3", 0.01, "token", 0.9, clip, {"is_cap": 1.5},
                                         teacher_coef=COEF)))  # fmt: skip
        gspo = {"clip_low": 0.1, "clip_high": 0.15, "dual_clip": 0.0}
        out.append(Case(mode, PolicyLoss("gspo", 0.0, "k3", 0.0, "none", 0.9, gspo, teacher_coef=COEF), True))
    return out


@pytest.fixture(scope="module")
def expected():
    return {str(case): hand_reference(case) for case in teacher_cases()}


def _run(layout: Layout, chosen: list[Case], alone: bool = False) -> dict:
    world = layout.dp * layout.sp
    if world == 1:
        return layout_steps(0, 1, layout, chosen, alone)
    return run_distributed(layout_steps, world, layout, chosen, alone, timeout_s=600)[0]


def test_the_reference_feels_the_teacher(expected):
    """The cases differ from the same losses without the teacher (the term is not a no-op)."""
    for case in teacher_cases()[:2]:
        plain = dataclasses.replace(case, loss=dataclasses.replace(case.loss, teacher_coef=0.0))
        assert relative_error(hand_reference(plain)[0], expected[str(case)][0]) > 1e-2, case


def test_exact_with_accumulation(expected):
    _check(Layout(1, 1, 2), expected)


@pytest.mark.parametrize("layout", LAYOUTS[1:], ids=str)
def test_exact_at_every_layout(layout, expected):
    _check(layout, expected)


def _check(layout: Layout, expected: dict) -> None:
    result = _run(layout, teacher_cases())
    for case in teacher_cases():
        got = result[str(case)]
        assert len(got["grads"]) == len(steps()) == 4
        for step, (grads, reference) in enumerate(zip(got["grads"], expected[str(case)])):
            error = relative_error(grads, reference)
            assert error <= 1e-12, f"{layout} {case} step {step + 1}: relative gradient error {error:.3e}"
        world = layout.dp * layout.sp
        assert got["calls"] == [1 if world > 1 else 0] * 4, f"{layout} {case}: loss all-reduces {got['calls']}"


def test_teacher_one_token_out_of_place_is_not_exact(expected, monkeypatch):
    """The negative control of the alignment: the teacher's value of token t read at token t + 1."""
    import tests.rl.exact_fixtures as fixtures

    made = fixtures.rollout_batch

    def shifted(episodes: bool = False):
        samples = made(episodes)
        for sample in samples:
            sample.teacher_logprobs = [0.0, *sample.teacher_logprobs[:-1]]
        return samples

    monkeypatch.setattr(fixtures, "rollout_batch", shifted)
    cases = teacher_cases()[:2]
    result = layout_steps(0, 1, Layout(1, 1, 2), cases)
    errors = {str(c): relative_error(result[str(c)]["grads"][0], expected[str(c)][0]) for c in cases}
    assert all(error > 1e-3 for error in errors.values()), errors


def test_each_micro_batch_normalized_alone_is_not_exact(expected):
    cases = [c for c in teacher_cases() if c.mode != "token-sum"]
    result = _run(Layout(1, 1, 2), cases, alone=True)
    wrong = [str(c) for c in cases if relative_error(result[str(c)]["grads"][0], expected[str(c)][0]) > 1e-3]
    assert len(wrong) == len(cases), wrong
