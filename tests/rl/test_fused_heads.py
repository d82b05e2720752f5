"""The policy head (`PolicyLoss`) and the preference head (`PreferenceLoss`) computed from the fused LM head
(`LogprobRequest`, `model.fused_lm_head` on: the trainers' path) equal the same heads computed from the whole logits
(`model.fused_lm_head` off), in float64: the loss, its metrics and every parameter's gradient, on a packed micro-batch
and a padded one, for every policy-loss variant the exactness tests run (ppo_clip with dual clip and token IS, gspo
with sequence IS, KL, entropy in the loss, a temperature) and every DPO-family loss. The layouts themselves (GA x DP x
SP x packed budgets, against a float64 hand reference) are tests/rl/test_policy_exact.py and
tests/pref/test_pref_exact.py, which run the fused path."""

from __future__ import annotations

import pytest
import torch

from tests.models.test_fused_ce import _rel
from tests.pref import exact_fixtures as pref_fixtures
from tests.rl import exact_fixtures as rl_fixtures
from veomni_lite.data.collator import collate
from veomni_lite.models.heads import LogprobRequest
from veomni_lite.preference.losses import PREF_LABELS, PreferenceLoss
from veomni_lite.preference.pairs import collate_pairs
from veomni_lite.rl.policy_loss import POLICY_LABELS
from veomni_lite.rl.rollouts import collate_rollouts
from veomni_lite.utils.loss_utils import LossModes, mark_sequences

TOL = 1e-11
INPUTS = ("input_ids", "position_ids", "attention_sequence_ids")


def _run(model: torch.nn.Module, fused: bool, head, batch: dict, request: LogprobRequest, pick) -> tuple:
    model.zero_grad(set_to_none=True)
    model.fused_lm_head = fused
    outputs = model(**{k: v for k, v in batch.items() if k in INPUTS}, logprobs=request)
    out = head(pick(outputs), batch)
    loss = out[next(k for k in out if k.endswith("_loss"))]
    loss.backward()
    grads = [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in model.parameters()]
    metrics = {k: tuple(float(x) for x in (v if isinstance(v, tuple) else (v,))) for k, v in out["metrics"].items()}
    return float(loss.detach()), metrics, grads


def _compare(fused: tuple, plain: tuple) -> None:
    assert fused[0] != 0.0 and abs(fused[0] - plain[0]) <= TOL * abs(plain[0])
    assert fused[1].keys() == plain[1].keys()
    for name, values in fused[1].items():
        assert values == pytest.approx(plain[1][name], rel=1e-9, abs=1e-12), name
    for got, want in zip(fused[2], plain[2]):
        assert _rel(got, want) < TOL


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("case", rl_fixtures.cases()[:4], ids=str)
def test_the_policy_head_is_the_same_fused_and_unfused(case, packed):
    samples = rl_fixtures.rollout_batch()[:6]
    whole = collate_rollouts([s.tensors() for s in samples], lambda b: collate(b, packing=packed), packed)
    batch = mark_sequences(whole, LossModes("seq-mean-token-mean", {}, 1.0))
    loss = case.loss
    model = rl_fixtures.build_model()
    request = LogprobRequest(batch[POLICY_LABELS], loss.temperature, entropy=True)
    runs = [_run(model, fused, loss, batch, request, lambda out: out) for fused in (True, False)]
    _compare(*runs)


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("case", pref_fixtures.cases()[:5], ids=pref_fixtures.name)
def test_the_preference_head_is_the_same_fused_and_unfused(case, packed):
    items = [pref_fixtures.pair_item(pair, reward_model=False) for pair in pref_fixtures.pairs()[:4]]
    batch = collate_pairs(items, lambda sides: collate(sides, packing=packed))
    model = pref_fixtures.build_model(case)
    request = LogprobRequest(batch[PREF_LABELS])
    head = PreferenceLoss.of(case)
    runs = [_run(model, fused, head, batch, request, lambda out: out["logprobs"]) for fused in (True, False)]
    _compare(*runs)
