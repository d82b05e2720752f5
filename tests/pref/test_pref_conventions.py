"""The ORPO and KTO heads follow TRL's formulas: ORPO's odds-ratio term is TRL's `ORPOTrainer.odds_ratio_loss` on
the same length-averaged log-probabilities (its loss is the NLL minus that term); KTO's per-row loss is TRL's
KTOTrainer "kto" branch written out, desirable and undesirable, with the reference point given; kto's reference point
is the mean over rows clamped at 0 (a negative mean is 0)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from veomni_lite.preference.losses import PreferenceLoss, kto_reference_point


def totals(pi: list[float], tokens: list[float], ref: list[float] | None = None, label: list[float] | None = None):
    rows = [pi, tokens, ref or [0.0] * len(pi)] + ([label] if label is not None else [])
    return torch.tensor(rows, dtype=torch.float64)


def test_orpo_is_trls_odds_ratio_loss_beside_the_nll():
    from trl.experimental.orpo import ORPOTrainer

    chosen, rejected = totals([-3.0, -12.5, -0.4], [4, 10, 2]), totals([-5.0, -6.0, -9.0], [5, 3, 6])
    head = PreferenceLoss("orpo", {"orpo_lambda": 0.7})
    losses, values = head.pair_losses(chosen, rejected)
    l_c, l_r = chosen[0] / chosen[1], rejected[0] / rejected[1]
    trl = SimpleNamespace(beta=0.7, accelerator=SimpleNamespace(device="cpu"))
    terms, reward_c, reward_r, ratio, log_odds = ORPOTrainer.odds_ratio_loss(trl, l_c, l_r)
    assert losses.tolist() == pytest.approx((-l_c - terms.double()).tolist(), rel=1e-6)
    assert values["rewards/chosen"].tolist() == pytest.approx(reward_c.tolist(), rel=1e-6)
    assert values["rewards/rejected"].tolist() == pytest.approx(reward_r.tolist(), rel=1e-6)
    assert float(values["log_odds_ratio"].mean()) == pytest.approx(float(ratio), rel=1e-6)
    assert float(values["log_odds_chosen"].mean()) == pytest.approx(float(log_odds), rel=1e-6)
    assert values["nll_loss"].tolist() == pytest.approx((-l_c).tolist())


def test_kto_is_trls_kto_loss_for_both_labels():
    head = PreferenceLoss("kto", {"beta": 0.3, "desirable_weight": 1.4, "undesirable_weight": 0.6})
    pi, ref, label = [-4.0, -7.0, -2.0, -9.0], [-5.0, -6.0, -2.5, -8.0], [1.0, 0.0, 1.0, 0.0]
    chosen = totals(pi, [3, 3, 3, 3], ref, label)
    z0 = torch.tensor(0.8, dtype=torch.float64)
    losses, values = head.pair_losses(chosen, torch.zeros_like(chosen), z0)
    d = torch.tensor(pi, dtype=torch.float64) - torch.tensor(ref, dtype=torch.float64)
    desirable = torch.tensor(label) > 0
    expected = torch.where(desirable, 1.4 * (1 - F.sigmoid(0.3 * (d - z0))), 0.6 * (1 - F.sigmoid(0.3 * (z0 - d))))
    assert losses.tolist() == pytest.approx(expected.tolist(), rel=1e-12)
    reward, weight = values["rewards/chosen"]
    assert float((reward * weight).sum() / weight.sum()) == pytest.approx(float(0.3 * d[desirable].mean()))
    assert values["kl"].tolist() == [0.8] * 4


def test_kto_reference_point_is_the_row_mean_clamped_at_zero():
    assert float(kto_reference_point(torch.tensor([6.0, 4.0], dtype=torch.float64))) == 1.5
    assert float(kto_reference_point(torch.tensor([-6.0, 4.0], dtype=torch.float64))) == 0.0
    assert float(kto_reference_point(torch.zeros(2, dtype=torch.float64))) == 0.0
