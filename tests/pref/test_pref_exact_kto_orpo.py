"""ORPO and KTO are exact: 2 steps of 4 rows at GA, DP=2, SP=2, DP=2 x SP=2 and packed with a token budget (DP=2 with
ranks of uneven micro-batch counts, and SP=2), against a hand-written float64 one-process reference; one loss
all-reduce per optimizer step, and for KTO one more, its KL pass's; the metrics (TRL's names) against a hand
computation. Negative controls: KTO's reference point z0 taken per rank or per micro-batch (not over the whole step)
is not exact on the uneven layout; each SP shard applying the loss to its own partial sums is not exact."""

from __future__ import annotations

import pytest

from tests.dist_helpers import run_distributed
from tests.pref.exact_fixtures import Layout, hand_metrics, hand_reference, layout_steps, name, orpo_kto_cases
from tests.rl.exact_fixtures import relative_error

LAYOUTS = [
    Layout(1, 1, 1),
    Layout(1, 1, 2, packed=True),
    Layout(2, 1, 1),
    Layout(1, 2, 2),
    Layout(2, 2, 1),
    Layout(2, 1, 2, packed=True, max_tokens=40),
    Layout(1, 2, 4, packed=True, max_tokens=56),
]
UNEVEN = Layout(2, 1, 2, packed=True, max_tokens=40)


@pytest.fixture(scope="module")
def expected():
    return {name(case): hand_reference(case) for case in orpo_kto_cases()}


def _run(layout: Layout, shard_local: bool = False, z0_scope: str = "step") -> list[dict]:
    world = layout.dp * layout.sp
    if world == 1:
        return [layout_steps(0, 1, layout, orpo_kto_cases(), shard_local, z0_scope)]
    return run_distributed(layout_steps, world, layout, orpo_kto_cases(), shard_local, z0_scope, timeout_s=600)


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_orpo_and_kto_are_exact_at_every_layout(layout, expected):
    result = _run(layout)[0]
    world = layout.dp * layout.sp
    for case in orpo_kto_cases():
        got = result[name(case)]
        assert len(got["grads"]) == 2
        for step, (grads, reference) in enumerate(zip(got["grads"], expected[name(case)])):
            error = relative_error(grads, reference)
            assert error <= 1e-12, f"{layout} {name(case)} step {step + 1}: relative gradient error {error:.3e}"
        assert got["calls"] == [1 if world > 1 else 0] * 2, f"{layout} {name(case)}: loss all-reduces {got['calls']}"
        if case.loss == "kto":
            assert got["kl_calls"] == [1 if world > 1 else 0] * 2, f"{layout}: KL all-reduces {got['kl_calls']}"
        hand = hand_metrics(case)
        assert got["metrics"][0].keys() == hand.keys()
        for key, value in hand.items():
            assert got["metrics"][0][key] == pytest.approx(value, rel=1e-10, abs=1e-12), (layout, name(case), key)
    kl = hand_metrics(orpo_kto_cases()[1])["kl"]
    assert kl > 0.5, f"z0 {kl}: the KL estimate must not be clamped to 0 for the test to see it"


@pytest.mark.slow
@pytest.mark.parametrize("scope", ["rank", "micro"])
def test_kto_reference_point_per_rank_or_per_micro_batch_is_not_exact(expected, scope):
    """The negative control of the step-wide KL pass, on ranks with uneven micro-batch counts."""
    ranks = _run(UNEVEN, z0_scope=scope)
    plans = [r["kto"]["plans"] for r in ranks]
    assert plans[0] != plans[1], f"the layout's ranks must be uneven: micro-batches per step {plans}"
    error = relative_error(ranks[0]["kto"]["grads"][0], expected["kto"][0])
    assert error > 1e-3, f"z0 per {scope}: relative gradient error {error:.3e}"


@pytest.mark.slow
def test_orpo_and_kto_each_sp_shard_on_its_partial_sums_is_not_exact(expected):
    result = _run(Layout(1, 2, 2), shard_local=True)[0]
    errors = {name(c): relative_error(result[name(c)]["grads"][0], expected[name(c)][0]) for c in orpo_kto_cases()}
    assert all(error > 1e-3 for error in errors.values()), errors


def test_kto_logged_metrics_are_trls_exact_on_one_process_and_dp2():
    """Issue 51: KTO logs TRL's KTOTrainer names (`rewards/margins`, `logits/chosen`, `logits/rejected` beside `kl`,
    `rewards/*`, `logps/*`), each exact over the world: the accumulator's reduction (then the derived margin) equals a
    float64 one-row-at-a-time reference of step 1's rows (3 desirable, 1 not), on one process (micro-batches of 2
    rows, one of them desirable only) and at DP=2 (rank 1's rows all desirable), and DP=2 equals one process."""
    kto = orpo_kto_cases()[1]
    hand = hand_metrics(kto)
    assert set(hand) == {"kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen",
                         "logps/rejected", "logits/chosen", "logits/rejected"}  # fmt: skip
    one = layout_steps(0, 1, Layout(1, 1, 2), [kto])["kto"]
    dp2 = run_distributed(layout_steps, 2, Layout(2, 1, 2), [kto], timeout_s=300)
    assert one["one_sided"][0] == 1, "one micro-batch of step 1 holds desirable rows only"
    assert [r["kto"]["one_sided"][0] for r in dp2] == [0, 1], "rank 1 holds desirable rows only"
    for got in (one["metrics"][0], dp2[0]["kto"]["metrics"][0], dp2[1]["kto"]["metrics"][0]):
        assert got.keys() == hand.keys()
        for key, value in hand.items():
            assert got[key] == pytest.approx(value, rel=1e-10, abs=1e-12), key
    for key, value in one["metrics"][0].items():
        assert dp2[0]["kto"]["metrics"][0][key] == pytest.approx(value, rel=1e-12, abs=1e-12), key
    assert abs(hand["logits/chosen"] - hand["logits/rejected"]) > 1e-6, "the two sides' means differ"
