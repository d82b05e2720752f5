"""`trainers/train_rl.py`'s trainer with tools and an environment: episodes train on the embedded engine, log the
episode metrics and write their turns; an environment failing on one rank's row is the same named error on every
rank, in seconds."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.dist_helpers import run_ranks
from tests.trainer.helpers import read_events
from veomni_lite.config import load_config
from veomni_lite.rl.config import RLConfig
from veomni_lite.rl.trainer import RLTrainer


@pytest.fixture(scope="module")
def agent_demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from examples.agent_calc import write_demo

    return write_demo(tmp_path_factory.mktemp("agent_train"), sft_rows=16, rl_rows=16, eval_rows=4)


def agent_args(demo: Path, out: Path, *extra: str) -> list[str]:
    return [
        "--model.arch", "auto", "--model.pretrained_dir", str(demo / "models/qwen2_agent"),
        "--data.train_path", str(demo / "rl_train.jsonl"), "--data.format", "messages", "--data.max_seq_len", "160",
        "--rl.prompts_per_step", "2", "--rl.num_generations", "2", "--rl.max_new_tokens", "12",
        "--rl.tools", f"[{demo}/calculator.py:calculate]", "--rl.max_turns", "2",
        "--rl.rewards", "[{name: correct, function: exact_match}]",
        "--train.micro_batch_size", "2", "--train.global_batch_size", "4", "--train.max_steps", "2",
        "--train.output_dir", str(out), "--optim.lr", "1e-3", "--optim.warmup_steps", "0",
        "--logging.log_interval", "1", "--logging.progress_bar", "false", "--logging.tensorboard", "false",
        "--logging.plot", "false", *extra,
    ]  # fmt: skip


def run(args: list[str], world_size: int = 1) -> RLTrainer:
    trainer = RLTrainer(load_config(None, args, world_size=world_size, sections={"rl": RLConfig}))
    try:
        trainer.train()
    finally:
        trainer.metrics.close()
    return trainer


def _ranked(rank: int, world: int, args: list[str]) -> Any:
    run(args, world)


def test_episodes_train_and_log_their_metrics(agent_demo: Path, tmp_path: Path):
    trainer = run(agent_args(agent_demo, tmp_path / "run"))
    events = read_events(trainer.output_dir)
    logged = {k for e in events for k in e}
    for name in ("rl/turns/mean", "rl/turns/max", "rl/tool_calls/mean", "rl/tool_errors", "rl/episode_truncated",
                 "rl/tool_calls/calculate", "rl/episode/model_tokens", "train/policy_loss"):  # fmt: skip
        assert name in logged, (name, sorted(logged))
    samples = trainer.rollouts.last
    assert len(samples) == 4 and all(s.response_mask is not None and s.episode for s in samples)
    assert all(len(s.response_mask) == len(s.response_ids) for s in samples)
    rows = [json.loads(line) for line in (trainer.output_dir / "rollouts.jsonl").read_text().splitlines()]
    assert rows and all("turns" in row and row["turns"][0]["role"] == "assistant" for row in rows)


TALKER = """
class Talker:
    def reset(self, row):
        self.turn = 0
        return ""

    def step(self, text):
        self.turn += 1
        return "go on", 0.0, self.turn == 2


def varied(prompts, completions, answers, **columns):
    return [float(len(c) % 2) for c in completions]
"""


def test_dynamic_sampling_filters_episodes(agent_demo: Path, tmp_path: Path):
    """DAPO's dynamic sampling on generated episodes (an environment's), with PPO's critic: the flat groups are
    dropped, every kept group's rewards differ, and both heads train."""
    env = tmp_path / "talker.py"
    env.write_text(TALKER)
    args = agent_args(agent_demo, tmp_path / "run", "--rl.tools", "[]", "--rl.environment", f"{env}:Talker",
                      "--rl.rewards", f"[{{name: varied, function: '{env}:varied'}}]", "--rl.advantage", "gae",
                      "--rl.critic", "{value_head: true}", "--rl.dynamic_sampling", "{max_generation_rounds: 20}",
                      "--train.max_steps", "1")  # fmt: skip
    trainer = run(args)
    samples = trainer.rollouts.last
    assert len(samples) == 4 and all(s.response_mask is not None and s.episode for s in samples)
    for group in (samples[:2], samples[2:]):
        assert group[0].reward != group[1].reward
    events = read_events(trainer.output_dir)
    assert {"critic/value_loss", "train/value_loss"} <= {k for e in events for k in e}
    assert [e["rl/dynamic_sampling/dropped_groups"] for e in events if "rl/dynamic_sampling/dropped_groups" in e] > [0]


ENV = """
class Env:
    def reset(self, row):
        if row["answer"] == "{answer}":
            raise KeyError("cannot start this one")
        return ""

    def step(self, text):
        return "", 0.0, True
"""


@pytest.mark.slow
def test_an_environment_failing_on_one_ranks_row_is_the_same_named_error_on_every_rank(agent_demo, tmp_path):
    probe = RLTrainer(load_config(None, agent_args(agent_demo, tmp_path / "probe"), world_size=1,
                                  sections={"rl": RLConfig}))  # fmt: skip
    answer = probe.train_dataset.batch(0, 2, probe.config.train.seed)[1].answer  # prompt 1: rank 1's
    probe.metrics.close()
    probe.close()
    env = tmp_path / "env.py"
    env.write_text(ENV.format(answer=answer))
    args = agent_args(agent_demo, tmp_path / "run", "--rl.environment", f"{env}:Env")
    outcomes = run_ranks(_ranked, 2, args, timeout_s=600)
    messages = [value.strip().splitlines()[-1] for status, value in outcomes.values()]
    assert all(status == "error" for status, _ in outcomes.values()), outcomes
    assert messages[0] == messages[1], messages
    assert messages[0].startswith("veomni_lite.rl.environments.EpisodeError: rollout batch 0: rank 1: environment")
    assert "env.py:Env (Env)" in messages[0] and "row" in messages[0] and "turn 0: reset raised KeyError" in messages[0]
