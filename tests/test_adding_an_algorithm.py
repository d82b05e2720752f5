"""Adding an algorithm is one registered function (docs/architecture.md, "Adding an algorithm"): a toy policy loss,
advantage estimator, importance-sampling correction and pair loss, each registered here (and gone after the test), go
through the real config check (a typo is named with the closest registered name; the entry's flags and
hyperparameters are read by name) and are what the trainer's loss object or advantage call computes, against a hand
computation in float64."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.rl.test_policy_loss_unit import batch, outputs_of
from veomni_lite.config import ConfigError, load_config
from veomni_lite.loss_keys import IGNORE_INDEX
from veomni_lite.preference import register_pair_loss
from veomni_lite.preference.config import PrefConfig
from veomni_lite.preference.losses import PAIR_LOSSES, PreferenceLoss, metric_names
from veomni_lite.rl import register_advantage, register_is_correction, register_policy_loss
from veomni_lite.rl.advantages import ADVANTAGES, estimate
from veomni_lite.rl.config import RLConfig
from veomni_lite.rl.policy_loss import ADVANTAGES as ADVANTAGES_KEY
from veomni_lite.rl.policy_loss import (
    ENGINE_LOGPROBS,
    IS_CORRECTIONS,
    OLD_LOGPROBS,
    POLICY_LABELS,
    POLICY_LOSSES,
    PolicyInputs,
    PolicyLoss,
)
from veomni_lite.rl.records import rollout_specs


@pytest.fixture(autouse=True)
def scratch_registries(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test registers into copies of the registries; monkeypatch puts the originals back after it."""
    for registry in (ADVANTAGES, POLICY_LOSSES, IS_CORRECTIONS, PAIR_LOSSES):
        monkeypatch.setattr(registry, "_entries", dict(registry._entries))


def rl_config(*extra: str) -> Any:
    args = ["--rl.rollouts_path", "given.jsonl", "--rl.prompts_per_step", "2", "--rl.num_generations", "2",
            "--train.global_batch_size", "4", "--train.micro_batch_size", "1", *extra]  # fmt: skip
    return load_config(None, args, world_size=1, sections={"rl": RLConfig})


def test_a_registered_policy_loss_is_checked_by_the_config_and_is_the_trainers_loss():
    @register_policy_loss("capped", metrics=("rl/capped",), hyperparameters={"clip_high": 0.2})
    def capped(x: PolicyInputs, clip_high: float) -> tuple[torch.Tensor, dict[str, Any]]:
        ratio = torch.exp(x.logp - x.old)
        count = x.valid.sum().double()
        return -x.advantages * ratio.clamp(max=1 + clip_high), {"rl/capped": ((ratio > 1 + clip_high).sum(), count)}

    with pytest.raises(ConfigError, match=r"rl.policy_loss: unknown policy loss 'caped' \(did you mean `capped`\?\)"):
        rl_config("--rl.policy_loss", "caped")
    rl = rl_config("--rl.policy_loss", "capped", "--rl.clip_high", "0.1").rl
    loss = PolicyLoss.of(rl)
    assert loss.hyperparameters == {"clip_high": 0.1}  # read from its RLConfig field
    logits, micro_batch = batch()
    out = loss(outputs_of(logits, micro_batch), micro_batch)
    valid = micro_batch[POLICY_LABELS] != IGNORE_INDEX
    logp = torch.log_softmax(logits.detach(), -1).gather(-1, micro_batch[POLICY_LABELS].clamp(min=0)[..., None])[..., 0]
    ratio = torch.exp(logp - micro_batch[OLD_LOGPROBS])[valid]
    expected = (-micro_batch[ADVANTAGES_KEY][valid] * ratio.clamp(max=1.1)).mean()
    assert torch.allclose(out["policy_loss"], expected, rtol=1e-12)
    assert [float(v) for v in out["metrics"]["rl/capped"]] == [float((ratio > 1.1).sum()), float(valid.sum())]
    assert "rl/clip_ratio/low" not in out["metrics"]  # ppo_clip's, not this loss's
    # the trainer declares the loss's own metrics up front (every rank packs the same keys)
    names = [spec.name for spec in rollout_specs(rl, reward_names=[])]
    assert "rl/capped" in names and "rl/clip_ratio/low" not in names
    # negative control: a hyperparameter the loss does not take is refused
    with pytest.raises(ValueError, match=r"takes \['clip_high'\], not \['clip_low'\]"):
        PolicyLoss("capped", hyperparameters={"clip_low": 0.3})


def test_a_registered_advantage_estimator_is_checked_by_the_config_and_is_what_the_trainer_computes():
    @register_advantage("max_baseline", min_group_size=2)
    def max_baseline(rewards: torch.Tensor, group_size: int, lengths: torch.Tensor) -> torch.Tensor:
        grouped = rewards.reshape(-1, group_size)
        return (grouped - grouped.amax(dim=1, keepdim=True)).reshape(-1)

    with pytest.raises(ConfigError, match=r"rl.advantage: unknown advantage estimator 'max_basline' \(did you mean"):
        rl_config("--rl.advantage", "max_basline")
    with pytest.raises(ConfigError, match="rl.num_generations: max_baseline compares a group's responses, needs >= 2"):
        rl_config("--rl.advantage", "max_baseline", "--rl.num_generations", "1", "--train.global_batch_size", "2")
    with pytest.raises(ConfigError, match="rl.critic: set, but rl.advantage is 'max_baseline'; the critic is for gae"):
        rl_config("--rl.advantage", "max_baseline", "--rl.critic", "{value_head: true}")
    rl = rl_config("--rl.advantage", "max_baseline").rl
    rewards = torch.tensor([1.0, 0.5, 0.0, 2.0], dtype=torch.float64)
    got = estimate(rl, rewards, torch.tensor([3, 1, 4, 1]))
    assert got.tolist() == [0.0, -0.5, -2.0, 0.0]


def test_a_registered_importance_sampling_correction_is_checked_by_the_config_and_weighs_the_trainers_loss():
    @register_is_correction("two_sided", metrics=("rl/is/low_share",), hyperparameters={"is_low": 0.5, "is_cap": 2.0})
    def two_sided(d: torch.Tensor, x: PolicyInputs, is_low: float, is_cap: float) -> tuple[torch.Tensor, dict]:
        ratio = torch.exp(d)  # old - engine, 0 off the valid tokens
        return ratio.clamp(is_low, is_cap), {"rl/is/low_share": (((ratio < is_low) & x.valid).sum(), x.valid.sum())}

    with pytest.raises(ConfigError, match=r"rl.importance_sampling: unknown .* 'two_side' \(did you mean `two_sided`"):
        rl_config("--rl.importance_sampling", "two_side")
    rl = rl_config("--rl.importance_sampling", "two_sided", "--rl.is_low", "0.9", "--rl.is_cap", "1.1").rl
    loss = PolicyLoss.of(rl)
    assert loss.is_hyperparameters == {"is_low": 0.9, "is_cap": 1.1}
    logits, micro_batch = batch()
    out = loss(outputs_of(logits, micro_batch), micro_batch)
    valid = micro_batch[POLICY_LABELS] != IGNORE_INDEX
    logp = torch.log_softmax(logits.detach(), -1).gather(-1, micro_batch[POLICY_LABELS].clamp(min=0)[..., None])[..., 0]
    old, engine, a = (micro_batch[k][valid] for k in (OLD_LOGPROBS, ENGINE_LOGPROBS, ADVANTAGES_KEY))
    ratio, weight = torch.exp(logp[valid] - old), torch.exp(old - engine)
    expected = (torch.maximum(-a * ratio, -a * ratio.clamp(0.8, 1.2)) * weight.clamp(0.9, 1.1)).mean()
    assert torch.allclose(out["policy_loss"], expected, rtol=1e-12)
    assert [float(v) for v in out["metrics"]["rl/is/low_share"]] == [float((weight < 0.9).sum()), float(valid.sum())]
    assert "rl/is/low_share" in [spec.name for spec in rollout_specs(rl, reward_names=[])]
    # negative control: with no correction the engine's log-probabilities weigh nothing
    plain = PolicyLoss.of(rl_config().rl)(outputs_of(logits, micro_batch), micro_batch)
    assert not torch.allclose(plain["policy_loss"], expected, rtol=1e-3)


def test_a_registered_pair_loss_is_checked_by_the_config_and_is_the_trainers_head(demo):
    @register_pair_loss("margin_hinge", metrics=("rewards/margins",), hyperparameters={"beta": 0.1})
    def margin_hinge(
        chosen: torch.Tensor, rejected: torch.Tensor, z0: Any, beta: float
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        h = chosen[0] - rejected[0]  # reference-free: the sides' summed log-probabilities
        return torch.relu(1 - beta * h), {"rewards/margins": beta * h}

    def pref_config(*extra: str) -> PrefConfig:
        args = ["--model.arch", "auto", "--model.pretrained_dir", str(demo / "models/qwen2_help"),
                "--data.format", "preference", "--data.train_path", "pairs.jsonl", *extra]  # fmt: skip
        return load_config(None, args, world_size=1, sections={"pref": PrefConfig}).pref

    with pytest.raises(ConfigError, match=r"pref.loss: unknown pair loss 'margin_hing' \(did you mean `margin_hinge`"):
        pref_config("--pref.loss", "margin_hing")
    with pytest.raises(ConfigError, match="pref.precompute_reference: pref.loss margin_hinge has no reference"):
        pref_config("--pref.loss", "margin_hinge", "--pref.precompute_reference", "true")
    with pytest.raises(ConfigError, match="pref.rpo_alpha: a coefficient >= 0 of pref.loss sigmoid, ipo, hinge, simpo"):
        pref_config("--pref.loss", "margin_hinge", "--pref.rpo_alpha", "1")
    pref = pref_config("--pref.loss", "margin_hinge", "--pref.beta", "0.5")
    head = PreferenceLoss.of(pref)
    assert head.hyperparameters == {"beta": 0.5} and head.paired and not head.scores
    assert metric_names("margin_hinge") == ("rewards/margins",) and not pref.needs_reference
    chosen = torch.tensor([[-3.0, -1.0], [4.0, 2.0], [0.0, 0.0]], dtype=torch.float64)  # [K, P]: logp, tokens, ref
    rejected = torch.tensor([[-5.0, -0.5], [3.0, 1.0], [0.0, 0.0]], dtype=torch.float64)
    losses, values = head.pair_losses(chosen, rejected)
    assert losses.tolist() == [0.0, 1.25] and values["rewards/margins"].tolist() == [1.0, -0.25]


def test_every_registered_hyperparameter_is_its_config_field_with_the_same_default():
    """`Entry.read` passes a config field by the hyperparameter's name: each is a field, defaulting alike."""
    sections = ((ADVANTAGES, RLConfig()), (POLICY_LOSSES, RLConfig()), (IS_CORRECTIONS, RLConfig()),
                (PAIR_LOSSES, PrefConfig()))  # fmt: skip
    for registry, section in sections:
        for name in registry.names():
            entry = registry.get(name, "")
            assert entry.read(section) == dict(entry.hyperparameters), (registry.kind, name)
    # negative control: a default other than the field's is seen
    register_policy_loss("off_default", hyperparameters={"clip_low": 0.3})(lambda x, clip_low: (x.logp, {}))
    entry = POLICY_LOSSES.get("off_default", "")
    assert entry.read(RLConfig()) != dict(entry.hyperparameters)
