"""The critic's pieces against float64 references written from the definitions: GAE per response (lambda and gamma,
a masked truncated response left out of the whitening), the clipped value loss, the explained variance; its config
errors; and a PPO run on given rollouts: the critic's metrics, and a warm-up that leaves the policy's weights alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.dist_helpers import run_distributed
from tests.rl.test_train_rl import by_step, config, rl_args, write_rollouts
from tests.trainer.helpers import train_built
from veomni_lite.config import ConfigError
from veomni_lite.loss_keys import IGNORE_INDEX
from veomni_lite.rl.critic import OLD_VALUES, RETURNS, VALUE_LABELS, ValueLoss, apply_gae, critic_metrics, gae
from veomni_lite.rl.rollouts import RolloutSample
from veomni_lite.rl.trainer import RLTrainer


def hand_gae(rewards: list[float], values: list[float], gamma: float, lam: float) -> list[float]:
    """A_t = sum_l (gamma lam)^l delta_{t+l}, delta_t = r_t + gamma V_{t+1} - V_t, V_T = 0 (the definition, no
    recursion)."""
    n = len(values)
    nxt = values[1:] + [0.0]
    deltas = [rewards[t] + gamma * nxt[t] - values[t] for t in range(n)]
    return [sum((gamma * lam) ** k * deltas[t + k] for k in range(n - t)) for t in range(n)]


def samples() -> list[RolloutSample]:
    g = torch.Generator().manual_seed(0)
    out = []
    for index, (length, reward) in enumerate([(5, 1.0), (1, 0.0), (7, 0.5), (3, 1.0), (4, 0.0)]):
        values = torch.randn(length, generator=g, dtype=torch.float64).tolist()
        out.append(RolloutSample(group=index // 2, prompt_ids=[1, 2], response_ids=list(range(3, 3 + length)),
                                 reward=reward, truncated=index == 2, old_values=values))  # fmt: skip
    return out


@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (1.0, 0.95), (0.9, 0.8)])
def test_gae_equals_the_definition_and_whitens_over_the_trained_responses(gamma, lam):
    batch = samples()
    apply_gae(batch, gamma, lam, mask_truncated=True)
    raw = [hand_gae([0.0] * (len(s.old_values) - 1) + [s.reward], s.old_values, gamma, lam) for s in batch]
    trained = torch.tensor([a for s, a in zip(batch, raw) if not s.truncated for a in a], dtype=torch.float64)
    mean, std = trained.mean(), trained.var(correction=1).add(1e-8).sqrt()
    for sample, advantages in zip(batch, raw):
        assert sample.returns == pytest.approx([a + v for a, v in zip(advantages, sample.old_values)], abs=1e-12)
        expected = [(a - mean) / std for a in advantages]
        assert sample.token_advantages == pytest.approx([float(x) for x in expected], abs=1e-12)
    # negative controls: whitening over every response (the truncated one too), and lam taken as 1
    everything = torch.tensor([a for a in raw for a in a], dtype=torch.float64)
    assert abs(float(everything.mean()) - float(mean)) > 1e-3
    if lam != 1.0:
        assert gae(torch.tensor([0.0, 0.0, 1.0]), torch.tensor([0.1, 0.2, 0.3]), gamma, 1.0)[0][0] != pytest.approx(
            hand_gae([0.0, 0.0, 1.0], [0.1, 0.2, 0.3], gamma, lam)[0]
        )


def test_value_loss_is_the_clipped_squared_error_over_the_valid_tokens():
    g = torch.Generator().manual_seed(1)
    values = torch.randn(2, 6, generator=g, dtype=torch.float64, requires_grad=True)
    old = values.detach() + 0.5 * torch.randn(2, 6, generator=g, dtype=torch.float64)
    returns = torch.randn(2, 6, generator=g, dtype=torch.float64)
    labels = torch.tensor([[IGNORE_INDEX, 4, 5, 6, IGNORE_INDEX, IGNORE_INDEX], [IGNORE_INDEX] * 2 + [7, 8, 9, 9]])
    batch = {VALUE_LABELS: labels, OLD_VALUES: old, RETURNS: returns}
    valid = labels != IGNORE_INDEX
    for clip in (0.0, 0.2):
        out = ValueLoss(clip)(values, batch)
        v, o, r = values[valid], old[valid], returns[valid]
        expected = (v - r) ** 2
        if clip:
            expected = torch.maximum(expected, (o + (v - o).clamp(-clip, clip) - r) ** 2)
        assert float(out["value_loss"].detach()) == pytest.approx(float(0.5 * expected.mean()), abs=1e-12)
        total, count = out["metrics"]["critic/value_loss"]
        assert float(total / count) == pytest.approx(float(0.5 * expected.mean()), abs=1e-12)
    unclipped = (v - r) ** 2
    clipped = (o + (v - o).clamp(-0.2, 0.2) - r) ** 2
    assert bool((clipped > unclipped).any()) and bool((clipped < unclipped).any())  # both branches taken
    empty = ValueLoss()(values, {**batch, VALUE_LABELS: torch.full_like(labels, IGNORE_INDEX)})["value_loss"]
    assert float(empty) == 0.0


def test_explained_variance_is_one_minus_the_residual_variance_over_the_returns():
    v = [torch.tensor([0.1, 0.5]), torch.tensor([0.9])]
    r = [torch.tensor([0.0, 1.0]), torch.tensor([1.0])]
    flat_v, flat_r = torch.cat(v).double(), torch.cat(r).double()
    expected = 1 - (flat_r - flat_v).var(correction=0) / flat_r.var(correction=0)
    got = critic_metrics([x.double() for x in v], [x.double() for x in r])
    assert got["critic/explained_variance"] == pytest.approx(float(expected), abs=1e-12)
    assert (got["critic/values/min"], got["critic/values/max"]) == (pytest.approx(0.1), pytest.approx(0.9))


def test_critic_config_errors_are_named(demo, tmp_path):
    rollouts = write_rollouts(tmp_path / "r.jsonl", groups=4)
    base = rl_args(demo, rollouts, tmp_path / "out")
    with pytest.raises(ConfigError, match="the critic is for gae"):
        config([*base, "--rl.critic", '{"value_head": true}'])
    with pytest.raises(ConfigError, match="not supported yet"):
        config([*base, "--rl.advantage", "gae", "--rl.critic", '{"pretrained_dir": "x"}'])
    with pytest.raises(ConfigError, match="unknown key"):
        config([*base, "--rl.advantage", "gae", "--rl.critic", '{"value_head": true, "clip": 1}'])
    with pytest.raises(ConfigError, match="set value_head: true"):
        config([*base, "--rl.advantage", "gae"])


def test_ppo_on_given_rollouts_warms_the_critic_up_then_trains_both(demo, tmp_path):
    rollouts = write_rollouts(tmp_path / "r.jsonl", groups=4)
    critic = '{"value_head": true, "lr": 0.01, "warmup_steps": 2}'
    args = rl_args(demo, rollouts, tmp_path / "out", "--rl.advantage", "gae", "--rl.critic", critic,
                   "--rl.lam", "0.95", "--train.max_steps", "4", "--rl.kl_coef", "0")  # fmt: skip
    trainer = RLTrainer(config(args))
    policy = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "value_head" not in n}
    head = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "value_head" in n}
    assert [g["lr"] for g in trainer.optimizer.param_groups if g.get("critic")] == [0.01, 0.01]
    train_built(trainer, stop_after=2)
    trained = dict(trainer.model.named_parameters())
    assert all(torch.equal(trained[n].detach(), p) for n, p in policy.items())  # the policy did not move
    assert not torch.equal(trained["value_head.linear.weight"].detach(), head["value_head.linear.weight"])
    trainer = RLTrainer(config([*args, "--checkpoint.resume", "true"]))
    train_built(trainer)
    moved = [n for n, p in trainer.model.named_parameters() if n in policy and not torch.equal(p.detach(), policy[n])]
    assert moved  # after the warm-up the policy trains
    events = [json.loads(line) for line in Path(tmp_path / "out/metrics.jsonl").read_text().splitlines()]
    steps = {e["step"]: e for e in events if "train/value_loss" in e}
    assert sorted(steps) == [1, 2, 3, 4]
    assert steps[1]["train/policy_loss"] == 0.0 and steps[3]["train/policy_loss"] != 0.0
    first = steps[1]
    assert first["critic/values/mean"] == 0.0 and first["critic/explained_variance"] == pytest.approx(0.0, abs=1e-12)
    assert first["critic/value_loss"] == pytest.approx(first["train/value_loss"], rel=1e-6)  # float32 loss
    assert first["rl/advantage/mean"] == pytest.approx(0.0, abs=1e-9)


def _ranked(rank: int, world: int, args: list[str]) -> None:
    train_built(RLTrainer(config(args, world)))


@pytest.mark.slow
def test_ppo_logs_the_same_steps_at_one_process_dp2_and_sp2_packed(demo, tmp_path):
    """DP=2 builds the value head on meta and fills the policy shard by shard (`Critic.materialize`); SP=2 packed
    gathers each shard's old values. Both heads' losses, the grad norm and the critic's batch metrics equal one
    process's."""
    rollouts = write_rollouts(tmp_path / "r.jsonl", groups=4)
    critic = '{"value_head": true, "lr": 0.01, "warmup_steps": 1}'
    extra = ("--rl.advantage", "gae", "--rl.critic", critic, "--train.max_steps", "4")
    train_built(RLTrainer(config(rl_args(demo, rollouts, tmp_path / "one", *extra))))
    layouts = {
        "dp2": [],
        "sp2": ["--parallel.sp_size", "2", "--data.packing", "true", "--data.max_tokens_per_micro_batch", "40"],
    }
    keys = ("train/policy_loss", "train/value_loss", "train/grad_norm", "critic/explained_variance")
    for name, more in layouts.items():
        run_distributed(_ranked, 2, rl_args(demo, rollouts, tmp_path / name, *extra, *more), timeout_s=600)
        for key in keys:
            expected, got = by_step(tmp_path / "one", key), by_step(tmp_path / name, key)
            assert sorted(got) == sorted(expected) and expected, (name, key)
            for step, value in expected.items():
                assert got[step] == pytest.approx(value, rel=1e-5, abs=1e-7), (name, key, step)
