"""DAPO's dynamic sampling (`rl.dynamic_sampling`), overlong buffer (`rl.overlong_buffer`) and REINFORCE++
(`rl.advantage: reinforce_pp`) on the trainer generating its own rollouts: the same kept groups and advantages at one
process and on two uneven ranks (3 prompts over 2), dropped groups counted against a hand count from the prompt
order, a resume inside a rollout batch making the same batches, and the round limit the same named error on every
rank; REINFORCE++'s statistics are the world's batch (a rank's share gives other advantages)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.dist_helpers import run_distributed, run_ranks
from tests.trainer.helpers import read_events, train_built
from veomni_lite.config import ConfigError, load_config
from veomni_lite.rl.advantages import ADVANTAGES
from veomni_lite.rl.config import RLConfig
from veomni_lite.rl.dynamic_sampling import learning_groups, metric_values
from veomni_lite.rl.rewards import overlong_penalty
from veomni_lite.rl.rollouts import RolloutSample
from veomni_lite.rl.trainer import RLTrainer

# flat (0) for answers divisible by 3, else a value of the completion's text (differs within a group: 4 samples)
REWARD = """
def score(prompts, completions, answers, **columns):
    return [0.0 if int(a) % 3 == 0 else float(sum(map(ord, c)) % 7) for c, a in zip(completions, answers)]
"""
CONSTANT = """
def score(prompts, completions, answers, **columns):
    return [1.0 for _ in completions]
"""
P, G = 3, 4  # 3 prompts over 2 ranks: rank 0 generates 2, rank 1 one


@pytest.fixture(scope="module")
def math_demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from examples.rl_math import write_demo

    return write_demo(tmp_path_factory.mktemp("rl_math"), sft_rows=16, rl_rows=64, eval_rows=8)


def ds_args(demo: Path, out: Path, reward: Path, *extra: str) -> list[str]:
    return [
        "--model.arch", "auto", "--model.pretrained_dir", str(demo / "models/qwen2_math"),
        "--data.train_path", str(demo / "rl_train.jsonl"), "--data.format", "messages", "--data.max_seq_len", "64",
        "--rl.prompts_per_step", str(P), "--rl.num_generations", str(G), "--rl.max_new_tokens", "8",
        "--rl.rewards", f"[{{name: mine, function: '{reward}:score'}}]",
        "--rl.dynamic_sampling", "{metric: mine, max_generation_rounds: 4}",
        "--rl.overlong_buffer", "{length: 4, penalty: 0.5}", "--rl.advantage", "reinforce_pp",
        "--train.micro_batch_size", "2", "--train.global_batch_size", str(P * G), "--train.max_steps", "3",
        "--train.output_dir", str(out), "--optim.lr", "1e-3", "--optim.warmup_steps", "0",
        "--logging.log_interval", "1", "--logging.progress_bar", "false", "--logging.tensorboard", "false",
        "--logging.plot", "false", *extra,
    ]  # fmt: skip


def build(args: list[str], world_size: int = 1) -> RLTrainer:
    return RLTrainer(load_config(None, args, world_size=world_size, sections={"rl": RLConfig}))


def run(args: list[str], world_size: int = 1, stop_after: int | None = None) -> dict[str, Any]:
    trainer = train_built(build(args, world_size), stop_after)
    return {"last": [s.plain() for s in trainer.rollouts.last], "events": read_events(trainer.output_dir)}


def _ranked(rank: int, world: int, args: list[str]) -> dict[str, Any]:
    return run(args, world)


def series(events: list[dict[str, Any]], key: str) -> dict[int, float]:
    return {e["step"]: e[key] for e in events if key in e}


def reward_file(tmp_path: Path, text: str = REWARD) -> Path:
    path = tmp_path / "reward.py"
    path.write_text(text)
    return path


def test_learning_groups_and_metric_values():
    values = torch.tensor([1.0, 0.0, 0.5, 0.5, 0.1, 0.1 + 2**-40, 2.0, 2.0], dtype=torch.float64)
    assert learning_groups(values, 2) == [True, False, True, False]
    assert learning_groups(values, 1) == [True] * 8  # verl keeps single-response groups
    assert learning_groups(values, 4) == [True, True]
    with pytest.raises(ValueError, match="do not split into groups of 3"):
        learning_groups(values, 3)
    samples = [RolloutSample(0, [1], [2], reward=0.5, rewards={"a": 1.0}), RolloutSample(0, [1], [2], reward=0.7)]
    samples[1].rewards = {"a": 1.0}
    assert metric_values(samples, "reward").tolist() == [0.5, 0.7]
    assert metric_values(samples, "a").tolist() == [1.0, 1.0]
    # the filter follows the named metric: the total differs, the named reward does not
    assert learning_groups(metric_values(samples, "reward"), 2) == [True]
    assert learning_groups(metric_values(samples, "a"), 2) == [False]


def test_bad_dynamic_sampling_configs_are_named_errors(math_demo, tmp_path):
    reward = reward_file(tmp_path)
    for extra, match in (
        (["--rl.dynamic_sampling", "{metric: nope}"], "rl.dynamic_sampling.metric: 'nope' is neither"),
        (["--rl.dynamic_sampling", "{max_generation_rounds: 0}"], "max_generation_rounds: must be >= 1"),
        (["--rl.dynamic_sampling", "{rounds: 2}"], "unknown config key 'rl.dynamic_sampling.rounds'"),
        (["--train.epochs", "1", "--train.max_steps", "0"], "set train.max_steps instead"),
        (["--rl.overlong_buffer", "{length: 9}"], "rl.overlong_buffer.length: must be in"),
    ):
        with pytest.raises(ConfigError, match=match):
            load_config(None, ds_args(math_demo, tmp_path / "x", reward, *extra), sections={"rl": RLConfig})


def expected_counts(demo: Path, args: list[str], batches: int) -> tuple[list[dict[str, int]], list[list[str]]]:
    """Per rollout batch, from the prompt order alone: {generated, kept, dropped}_groups and rounds, and the kept
    prompts' texts (a group learns unless its answer is divisible by 3, `REWARD`)."""
    probe = build(args)
    try:
        dataset, seed = probe.train_dataset, probe.config.train.seed
        block, counts, texts = 0, [], []
        for _ in range(batches):
            kept, generated, dropped, rounds = [], 0, 0, 0
            while len(kept) < P:
                for prompt in dataset.batch(block, P, seed):
                    generated += 1
                    if int(prompt.answer) % 3 == 0:
                        dropped += 1
                    elif len(kept) < P:
                        kept.append(prompt.text)
                block, rounds = block + 1, rounds + 1
            counts.append(
                {"generated_groups": generated, "kept_groups": P, "dropped_groups": dropped, "rounds": rounds}
            )
            texts.append(kept)
        return counts, texts
    finally:
        probe.metrics.close()
        probe.close()


@pytest.mark.slow
def test_dynamic_sampling_keeps_the_same_groups_at_one_process_and_two_uneven_ranks(math_demo, tmp_path):
    args = ds_args(math_demo, tmp_path / "one", reward_file(tmp_path))
    counts, texts = expected_counts(math_demo, args, 3)
    assert sum(c["dropped_groups"] for c in counts) > 0 and max(c["rounds"] for c in counts) > 1  # the test bites
    one = run(args)
    two = run_distributed(_ranked, 2, ds_args(math_demo, tmp_path / "two", reward_file(tmp_path)), timeout_s=900)
    for step, expected in enumerate(counts, start=1):
        for name, value in expected.items():
            assert series(one["events"], f"rl/dynamic_sampling/{name}")[step] == value, (step, name)
            assert series(two[0]["events"], f"rl/dynamic_sampling/{name}")[step] == value, (step, name)
    last = [RolloutSample(**s) for s in one["last"]]
    assert [s.prompt_text for s in last[::G]] == texts[-1]  # the first learning groups of the prompt order
    assert all(learning_groups(metric_values(last, "mine"), G))
    for rank_result in two:  # every rank holds the world's batch, the same as one process's
        got = [RolloutSample(**s) for s in rank_result["last"]]
        assert [s.response_ids for s in got] == [s.response_ids for s in last]
        assert [s.reward for s in got] == [s.reward for s in last]
        assert [s.advantage for s in got] == pytest.approx([s.advantage for s in last], abs=1e-12)
    # overlong: its own reward, DAPO's formula on the response lengths, in the total
    lengths = [len(s.response_ids) for s in last]
    overlong = overlong_penalty(lengths, 8, 4, 0.5).tolist()
    assert [s.rewards["overlong"] for s in last] == overlong
    assert [s.reward for s in last] == pytest.approx([s.rewards["mine"] + o for s, o in zip(last, overlong)])
    assert series(one["events"], "rl/rewards/overlong")[3] == pytest.approx(sum(overlong) / len(overlong))
    # REINFORCE++: whitened over the world's batch; a rank's share (rank 1: group 1 alone) gives other advantages
    rewards = torch.tensor([s.reward for s in last], dtype=torch.float64)
    reinforce_pp = ADVANTAGES.get("reinforce_pp", "rl.advantage").fn
    world = reinforce_pp(rewards, 1, torch.tensor(lengths))
    assert [s.advantage for s in last] == pytest.approx(world.tolist(), abs=1e-12)
    share = torch.tensor([i for i, s in enumerate(last) if s.group % 2 == 1])
    local = reinforce_pp(rewards[share], 1, torch.tensor(lengths)[share])
    assert not torch.allclose(local, world[share], atol=1e-3)


@pytest.mark.slow
def test_a_resume_inside_a_rollout_batch_makes_the_same_batches(math_demo, tmp_path):
    reward = reward_file(tmp_path)
    extra = ("--rl.epochs", "2", "--train.max_steps", "6")  # 2 steps per rollout batch; stop inside batch 1
    whole = run(ds_args(math_demo, tmp_path / "whole", reward, *extra))
    run(ds_args(math_demo, tmp_path / "cut", reward, *extra), stop_after=3)
    resumed = run(ds_args(math_demo, tmp_path / "cut", reward, *extra, "--checkpoint.resume", "true"))
    assert [s["response_ids"] for s in resumed["last"]] == [s["response_ids"] for s in whole["last"]]
    assert [s["prompt_text"] for s in resumed["last"]] == [s["prompt_text"] for s in whole["last"]]
    for key in ("rl/dynamic_sampling/rounds", "rl/dynamic_sampling/dropped_groups", "rl/reward/mean"):
        expected, got = series(whole["events"], key), series(resumed["events"], key)
        assert sorted(got) == sorted(expected) == [1, 3, 5], key
        assert got == pytest.approx(expected, abs=1e-12), key


@pytest.mark.slow
def test_the_round_limit_is_the_same_named_error_on_every_rank(math_demo, tmp_path):
    args = ds_args(math_demo, tmp_path / "run", reward_file(tmp_path, CONSTANT), "--rl.dynamic_sampling",
                   "{max_generation_rounds: 2}")  # fmt: skip
    outcomes = run_ranks(_ranked, 2, args, timeout_s=600)
    messages = [value.strip().splitlines()[-1] for status, value in outcomes.values()]
    assert all(status == "error" for status, _ in outcomes.values()), outcomes
    assert messages[0] == messages[1], messages
    assert messages[0].startswith("veomni_lite.rl.dynamic_sampling.DynamicSamplingError: rollout batch 0: 2 ")
    assert "raise rl.dynamic_sampling.max_generation_rounds" in messages[0]
    assert "lower rl.prompts_per_step" in messages[0] and "check the reward" in messages[0]


def run_async(rank: int, world: int, args: list[str]) -> dict[str, Any]:
    trainer = train_built(build([*args, "--rl.async_steps", "1", "--rl.importance_sampling", "token"], world))
    return {"last": [s.plain() for s in trainer.rollouts.last], "events": read_events(trainer.output_dir)}


@pytest.mark.slow
def test_one_step_async_filters_the_background_round_and_generates_further_rounds_now(math_demo, tmp_path):
    args = ds_args(math_demo, tmp_path / "one", reward_file(tmp_path), "--train.max_steps", "4")
    counts, texts = expected_counts(math_demo, args, 4)
    one = run_async(0, 1, args)
    two = run_distributed(run_async, 2, ds_args(math_demo, tmp_path / "two", reward_file(tmp_path),
                                                 "--train.max_steps", "4"), timeout_s=900)  # fmt: skip
    for step, expected in enumerate(counts, start=1):  # the prompt order decides the rounds, async or not
        for name, value in expected.items():
            assert series(one["events"], f"rl/dynamic_sampling/{name}")[step] == value, (step, name)
    last = [RolloutSample(**s) for s in one["last"]]
    assert [s.prompt_text for s in last[::G]] == texts[-1] and all(learning_groups(metric_values(last, "mine"), G))
    # batch k's first round was sampled by the weights before batch k-1 trained (staleness 1 optimizer step here),
    # its further rounds by the current weights (0)
    stale = {s.version for s in last}
    assert stale <= {2, 3} and (3 - min(stale)) == 1, stale
    rounds = series(one["events"], "rl/dynamic_sampling/rounds")
    staleness = series(one["events"], "rl/staleness/max")
    assert all(staleness[step] == (1.0 if step > 1 else 0.0) for step in rounds), staleness
    for rank_result in two:
        got = [RolloutSample(**s) for s in rank_result["last"]]
        assert [s.response_ids for s in got] == [s.response_ids for s in last]
        assert [s.version for s in got] == [s.version for s in last]


VARIED = """
def score(prompts, completions, answers, **columns):
    return [float(sum(map(ord, c)) % 7) for c in completions]
"""


@pytest.mark.slow
def test_with_no_flat_group_dynamic_sampling_is_the_run_without_it(math_demo, tmp_path):
    """Every group learns (a reward of the completion's text): one round per batch, block k for batch k, so the run
    is the plain run's, step for step; negative control: a run on other seeds differs."""
    reward = reward_file(tmp_path, VARIED)
    args = ds_args(math_demo, tmp_path / "ds", reward, "--rl.advantage", "grpo", "--rl.overlong_buffer", "{}")
    plain = [a if a != "{metric: mine, max_generation_rounds: 4}" else "{}" for a in args]
    plain[plain.index(str(tmp_path / "ds"))] = str(tmp_path / "plain")
    with_ds, without = run(args), run(plain)
    assert series(with_ds["events"], "rl/dynamic_sampling/dropped_groups") == {1: 0.0, 2: 0.0, 3: 0.0}
    assert "rl/dynamic_sampling/rounds" not in {k for e in without["events"] for k in e}
    losses = series(with_ds["events"], "train/policy_loss")
    assert losses == pytest.approx(series(without["events"], "train/policy_loss"), rel=1e-6, abs=1e-9)
    assert [s["response_ids"] for s in with_ds["last"]] == [s["response_ids"] for s in without["last"]]
    other = run([*plain[: plain.index("--train.output_dir")], "--train.output_dir", str(tmp_path / "seed"),
                 *plain[plain.index("--train.output_dir") + 2 :], "--train.seed", "7"])  # fmt: skip
    assert [s["response_ids"] for s in other["last"]] != [s["response_ids"] for s in with_ds["last"]]
