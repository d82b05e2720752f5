"""The critic's pieces against float64 references written from the definitions: GAE per response (lambda and gamma,
a masked truncated response left out of the whitening), the clipped value loss, the explained variance; its config
errors; and PPO runs on given rollouts: the critic's metrics, a warm-up that leaves the policy's weights alone, a
separate value model (built from its directory, trained, resumed, under LoRA, and at DP=2 and SP=2 packed)."""

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


def test_an_episodes_gae_skips_the_environments_tokens():
    """An episode (model tokens, then a tool's result, then model tokens): GAE over its model tokens alone, from the
    definition on that subsequence, the reward at its last model token, whitened over every sample's model tokens;
    its environment tokens get 0 and are in no statistic. Negative control: GAE over every token differs."""
    batch = samples()
    episode = batch[2]  # 7 tokens
    episode.truncated, episode.response_mask = False, [1, 1, 0, 0, 0, 1, 1]
    apply_gae(batch, 1.0, 0.95, mask_truncated=True)
    at = [i for i, m in enumerate(episode.response_mask) if m]
    own = hand_gae([0.0] * (len(at) - 1) + [episode.reward], [episode.old_values[i] for i in at], 1.0, 0.95)
    raw = {id(s): hand_gae([0.0] * (len(s.old_values) - 1) + [s.reward], s.old_values, 1.0, 0.95) for s in batch}
    raw[id(episode)] = own
    trained = torch.tensor([a for s in batch for a in raw[id(s)]], dtype=torch.float64)
    mean, std = trained.mean(), trained.var(correction=1).add(1e-8).sqrt()
    expected = [0.0] * 7
    for i, a in zip(at, own):
        expected[i] = float((a - mean) / std)
    assert episode.token_advantages == pytest.approx(expected, abs=1e-12)
    assert [episode.returns[i] for i in (2, 3, 4)] == [0.0, 0.0, 0.0]
    assert [episode.returns[i] for i in at] == pytest.approx([a + episode.old_values[i] for a, i in zip(own, at)])
    everything = hand_gae([0.0] * 6 + [episode.reward], episode.old_values, 1.0, 0.95)
    assert max(abs(everything[i] - a) for i, a in zip(at, own)) > 1e-3


def test_given_episodes_train_the_critic_on_the_models_tokens(demo, tmp_path):
    """PPO on given episodes (`turns`): the old values and GAE's advantages and returns at the environment's tokens
    are out of every statistic (0), the model's tokens get GAE over themselves, and the value head trains."""
    rows = []
    for group in range(4):
        for j in range(2):
            turns = [{"role": "assistant", "ids": [11 + group, 12 + j, 13]}, {"role": "tool", "ids": [40, 41, 42 + j]},
                     {"role": "assistant", "ids": [14 + j]}]  # fmt: skip
            rows.append({"group": f"g{group}", "prompt_ids": [5, 6, 7 + group], "turns": turns, "reward": float(j)})
    path = tmp_path / "episodes.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    args = rl_args(demo, path, tmp_path / "out", "--rl.advantage", "gae", "--rl.critic", '{"value_head": true}',
                   "--rl.prompts_per_step", "4", "--rl.num_generations", "2", "--rl.epochs", "1",
                   "--train.global_batch_size", "8", "--train.max_steps", "2", "--rl.kl_coef", "0")  # fmt: skip
    trainer = RLTrainer(config(args))
    head = trainer.model.value_head.linear.weight.detach().clone()
    train_built(trainer)
    batch = trainer.rollouts.last
    assert all(s.response_mask == [1, 1, 1, 0, 0, 0, 1] for s in batch)
    for sample in batch:
        at = [0, 1, 2, 6]
        own = hand_gae([0.0, 0.0, 0.0, sample.reward], [sample.old_values[i] for i in at], 1.0, 1.0)
        assert [sample.returns[i] for i in at] == pytest.approx([a + sample.old_values[i] for a, i in zip(own, at)])
        assert [sample.token_advantages[i] for i in (3, 4, 5)] == [0.0] * 3 == [sample.returns[i] for i in (3, 4, 5)]
    assert not torch.equal(trainer.model.value_head.linear.weight.detach(), head)


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
    gae = ["--rl.advantage", "gae", "--rl.critic"]
    with pytest.raises(ConfigError, match="rl.critic.pretrained_dir: x holds no config.json"):
        config([*base, *gae, '{"pretrained_dir": "x"}'])
    with pytest.raises(ConfigError, match="exactly one"):
        config([*base, *gae, json.dumps({"value_head": True, "pretrained_dir": str(demo / "models/qwen2_help")})])
    with pytest.raises(ConfigError, match="unknown config key 'rl.critic.clip'"):
        config([*base, *gae, '{"value_head": true, "clip": 1}'])
    with pytest.raises(ConfigError, match="set value_head: true"):
        config([*base, "--rl.advantage", "gae"])
    other = tmp_path / "other_vocab"
    other.mkdir()
    settings = json.loads((demo / "models/qwen2_help/config.json").read_text())
    (other / "config.json").write_text(json.dumps({**settings, "vocab_size": 4096}))
    with pytest.raises(ConfigError, match="vocab_size 4096, the policy 2048"):
        RLTrainer(config([*base, *gae, json.dumps({"pretrained_dir": str(other)})]))
    with pytest.raises(ConfigError, match=r"rl.critic.warmup_steps \(3\) must be fewer than the run's 3 optimizer"):
        RLTrainer(config([*base, *gae, '{"value_head": true, "warmup_steps": 3}', "--train.max_steps", "3"]))


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
    # nor did its AdamW state: the trunk's value-loss gradients are dropped in the warm-up (verl's actor waits)
    assert all(int(trainer.optimizer.state[trained[n]]["step"]) == 0 for n in policy)
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


@pytest.fixture(scope="module")
def critic_dir(demo: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A separate value model: a Qwen2 of the policy's vocabulary, narrower (hidden 32) and seeded apart."""
    from transformers import AutoConfig, AutoModelForCausalLM

    settings = json.loads((demo / "models/qwen2_help/config.json").read_text())
    settings |= {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "layer_types": ["full_attention"]}
    torch.manual_seed(7)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**settings))
    out = tmp_path_factory.mktemp("critic") / "qwen2_critic"
    model.save_pretrained(out)
    return out


def test_a_separate_value_model_warms_up_then_trains_beside_the_policy(demo, critic_dir, tmp_path):
    """`rl.critic.pretrained_dir`: the values are the directory's model's (its trunk under the value head, on the
    policy's inputs), which starts from the directory, is left out of the reference, trains alone during the warm-up
    (the policy at lr 0, its schedule delayed), then beside the policy, and resumes from the checkpoint inside a
    rollout batch that holds episodes."""
    from transformers import AutoModelForCausalLM

    rollouts = write_rollouts(tmp_path / "r.jsonl", groups=4, episodes=True)
    critic = json.dumps({"pretrained_dir": str(critic_dir), "lr": 0.01, "weight_decay": 0.0, "warmup_steps": 1})
    args = rl_args(demo, rollouts, tmp_path / "out", "--rl.advantage", "gae", "--rl.critic", critic,
                   "--train.max_steps", "3", "--optim.weight_decay", "0.1")  # fmt: skip
    trainer = RLTrainer(config(args))
    model = trainer.model
    stored = AutoModelForCausalLM.from_pretrained(str(critic_dir)).model.state_dict()
    trunk = model.critic_model.hf_model.model.state_dict()
    assert stored.keys() == trunk.keys() and all(torch.equal(trunk[k], v) for k, v in stored.items())
    mine = {id(p) for p in trainer.critic.parameters(model)}
    assert mine and not mine & {id(p) for p in trainer.reference.params}  # the reference is the policy's
    groups = trainer.optimizer.param_groups
    assert [(g["lr"], g["weight_decay"]) for g in groups if g.get("critic")] == [(0.01, 0.0), (0.01, 0.0)]
    assert [g["lr"] for g in groups if not g.get("critic")] == [0.0, 0.0]  # the policy waits for the warm-up
    policy = {n: p.detach().clone() for n, p in model.named_parameters() if id(p) not in mine}
    critics = {n: p.detach().clone() for n, p in model.named_parameters() if id(p) in mine}
    train_built(trainer, stop_after=1)
    trained = dict(model.named_parameters())
    assert all(torch.equal(trained[n].detach(), p) for n, p in policy.items())
    state = trainer.optimizer.state  # AdamW took no step for the policy: its first update will be a fresh one
    policy_state = [state[p] for n, p in trained.items() if n in policy]
    assert all(int(s["step"]) == 0 and not s["exp_avg_sq"].any() for s in policy_state)
    assert all(int(state[p]["step"]) == 1 for p in trained.values() if id(p) in mine)
    # the head starts at 0, so the first step moves it alone (the trunk's gradient goes through its weight)
    assert {n for n, p in critics.items() if not torch.equal(trained[n].detach(), p)} == {
        "value_head.linear.weight",
        "value_head.linear.bias",
    }
    assert [g["lr"] for g in groups if not g.get("critic")] == [1e-3, 1e-3]  # then the policy's schedule runs
    ids = torch.tensor([[5, 9, 13, 200, 7]])
    positions = torch.arange(5)[None]
    with torch.no_grad():
        model(input_ids=ids, position_ids=positions)
        hidden = model.critic_model.hf_model.model(input_ids=ids, position_ids=positions).last_hidden_state
        assert hidden.shape[-1] == 32  # the critic's width, not the policy's 64
        assert torch.equal(trainer.critic.take(), model.value_head(hidden))
    trainer = RLTrainer(config([*args, "--checkpoint.resume", "true"]))
    train_built(trainer)
    moved = [n for n, p in trainer.model.named_parameters() if n in policy and not torch.equal(p.detach(), policy[n])]
    assert moved  # after the warm-up the policy trains
    trained = dict(trainer.model.named_parameters())
    assert all(not torch.equal(trained[n].detach(), p) for n, p in critics.items())  # and the whole critic
    steps = {int(trainer.optimizer.state[p]["step"]) for n, p in trained.items() if n in policy and p.requires_grad}
    assert steps == {2}, steps  # steps 2 and 3: the warm-up's state (step 0) was saved and resumed
    assert sorted(by_step(tmp_path / "out", "train/value_loss")) == [1, 2, 3]
    assert by_step(tmp_path / "out", "train/policy_loss")[1] == 0.0


def test_under_lora_the_critic_trains_whole(demo, critic_dir, tmp_path):
    """`model.lora` freezes the policy's base: its adapters and the whole critic (value head, value model) train."""
    rollouts = write_rollouts(tmp_path / "r.jsonl", groups=4)
    critic = json.dumps({"pretrained_dir": str(critic_dir)})
    args = rl_args(demo, rollouts, tmp_path / "out", "--rl.advantage", "gae", "--rl.critic", critic,
                   "--train.max_steps", "1", "--model.lora", "{rank: 4, alpha: 8}")  # fmt: skip
    trainer = RLTrainer(config(args))
    mine = {id(p) for p in trainer.critic.parameters(trainer.model)}
    trained = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert all(p.requires_grad for p in trainer.critic.parameters(trainer.model))
    assert {n for n, p in trainer.model.named_parameters() if id(p) not in mine and p.requires_grad} == {
        n for n in trained if "lora_" in n
    }
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    train_built(trainer)
    after = dict(trainer.model.named_parameters())
    assert not torch.equal(after["value_head.linear.weight"].detach(), before["value_head.linear.weight"])
    assert any("lora_B" in n and not torch.equal(after[n].detach(), v) for n, v in before.items())


def _ranked(rank: int, world: int, args: list[str]) -> None:
    train_built(RLTrainer(config(args, world)))


@pytest.mark.slow
def test_ppo_logs_the_same_steps_at_one_process_dp2_and_sp2_packed(demo, critic_dir, tmp_path):
    """With a separate value model, on rollouts holding episodes: DP=2 builds the policy and the critic on meta and
    fills both shard by shard from their directories (`Critic.materialize`); SP=2 packed runs both under Ulysses and
    gathers each shard's old values. Both heads' losses, the grad norm and the critic's batch metrics equal one
    process's."""
    rollouts = write_rollouts(tmp_path / "r.jsonl", groups=4, episodes=True)
    critic = json.dumps({"pretrained_dir": str(critic_dir), "lr": 0.01, "warmup_steps": 1})
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
