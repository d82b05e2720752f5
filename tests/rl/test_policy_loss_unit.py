"""`PolicyLoss` on one micro-batch against a hand computation: the loss value (a shard's mean over its valid tokens),
the token-level metrics (kl, entropy, clip ratios as (total, count)), an exact 0 without targets."""

from __future__ import annotations

import torch

from veomni_lite.loss_keys import IGNORE_INDEX
from veomni_lite.models.heads import token_logprobs
from veomni_lite.rl.policy_loss import (
    ADVANTAGES,
    ENGINE_LOGPROBS,
    OLD_LOGPROBS,
    POLICY_LABELS,
    REF_LOGPROBS,
    PolicyLoss,
)


def batch(seed: int = 0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(2, 6, 11, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 11, (2, 6), generator=g)
    labels[0, :2] = labels[1, 4:] = IGNORE_INDEX
    values = {key: torch.randn(2, 6, generator=g, dtype=torch.float64) - 2.0 for key in
              (OLD_LOGPROBS, REF_LOGPROBS, ENGINE_LOGPROBS)}  # fmt: skip
    values[ADVANTAGES] = torch.tensor([[0.7] * 6, [-1.2] * 6], dtype=torch.float64)
    return logits, {POLICY_LABELS: labels, "sequence_ids": torch.tensor([[0] * 6, [1] * 6]), **values}


def outputs_of(logits: torch.Tensor, micro_batch: dict, temperature: float = 1.0) -> dict[str, torch.Tensor]:
    """What the model's forward gives the loss (`LogprobRequest`), here from whole logits."""
    logp, entropy = token_logprobs(logits, micro_batch[POLICY_LABELS], temperature, entropy=True)
    return {"logprobs": logp, "entropy": entropy}


def test_the_loss_and_its_metrics_are_the_hand_computation():
    logits, micro_batch = batch()
    clip = {"clip_low": 0.2, "clip_high": 0.28, "dual_clip": 3.0}
    loss = PolicyLoss("ppo_clip", 0.1, "k2", 0.01, "token", 0.7, clip, is_hyperparameters={"is_cap": 1.5})
    out = loss(outputs_of(logits, micro_batch, 0.7), micro_batch)
    labels = micro_batch[POLICY_LABELS]
    valid = labels != IGNORE_INDEX
    logp_all = torch.log_softmax(logits.detach() / 0.7, -1)
    logp = logp_all.gather(-1, labels.clamp(min=0)[..., None])[..., 0][valid]
    entropy = -(logp_all.exp() * logp_all).sum(-1)[valid]
    old, ref, engine, a = (micro_batch[k][valid] for k in (OLD_LOGPROBS, REF_LOGPROBS, ENGINE_LOGPROBS, ADVANTAGES))
    ratio = (logp - old).exp()
    pg = torch.maximum(-a * ratio, -a * ratio.clamp(0.8, 1.28))
    pg = torch.where(a < 0, torch.minimum(pg, -a * 3.0), pg) * (old - engine).exp().clamp(max=1.5)
    kl = (logp - ref) ** 2 / 2
    expected = (pg + 0.1 * kl - 0.01 * entropy).mean()
    assert torch.allclose(out["policy_loss"], expected, rtol=1e-12)
    n = float(valid.sum())
    metrics = {name: (float(total), float(count)) for name, (total, count) in out["metrics"].items()}
    assert metrics["rl/kl"] == (pytest_approx(kl.sum()), n)
    assert metrics["rl/entropy"] == (pytest_approx(entropy.sum()), n)
    assert metrics["rl/clip_ratio/low"] == (float(((ratio < 0.8) & (a < 0)).sum()), n)
    assert metrics["rl/clip_ratio/high"] == (float(((ratio > 1.28) & (a > 0)).sum()), n)
    assert 0 < metrics["rl/clip_ratio/low"][0] + metrics["rl/clip_ratio/high"][0] < n  # both kinds of tokens


def pytest_approx(value: torch.Tensor):
    import pytest

    return pytest.approx(float(value), rel=1e-12)


def test_a_micro_batch_without_targets_is_an_exact_zero_with_a_zero_gradient():
    logits, micro_batch = batch(1)
    micro_batch[POLICY_LABELS] = torch.full_like(micro_batch[POLICY_LABELS], IGNORE_INDEX)
    loss = PolicyLoss("gspo", kl_coef=0.1, entropy_coef=0.01, importance_sampling="sequence")
    out = loss(outputs_of(logits, micro_batch), micro_batch)
    out["policy_loss"].backward()
    assert out["policy_loss"].item() == 0.0 and torch.equal(logits.grad, torch.zeros_like(logits))
