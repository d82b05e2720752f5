"""`trainers/train_rl.py`'s trainer generating its own rollouts: the same config gives the same rollouts and losses at
one process and DP=2; a reward function failing on one rank's row is the same named error on every rank; the
vision-language path generates from images; an evaluation's failure names the evaluation; LoRA's reference is the
base with the adapters off."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.dist_helpers import run_distributed, run_ranks
from tests.trainer.helpers import read_events
from veomni_lite.config import load_config
from veomni_lite.rl.config import RLConfig
from veomni_lite.rl.rewards import RewardError
from veomni_lite.rl.rollout_batch import EVALUATION, batch_name
from veomni_lite.rl.trainer import RLTrainer


@pytest.fixture(scope="session")
def math_demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from examples.rl_math import write_demo

    return write_demo(tmp_path_factory.mktemp("rl_math"), sft_rows=16, rl_rows=64, eval_rows=8)


def math_args(demo: Path, out: Path, *extra: str) -> list[str]:
    return [
        "--model.arch", "auto", "--model.pretrained_dir", str(demo / "models/qwen2_math"),
        "--data.train_path", str(demo / "rl_train.jsonl"), "--data.format", "messages", "--data.max_seq_len", "64",
        "--rl.prompts_per_step", "4", "--rl.num_generations", "4", "--rl.max_new_tokens", "8",
        "--rl.rewards", "[{name: correct, function: math}]", "--rl.kl_coef", "0.05",
        "--train.micro_batch_size", "2", "--train.global_batch_size", "8", "--train.max_steps", "2",
        "--train.output_dir", str(out), "--optim.lr", "1e-3", "--optim.warmup_steps", "0",
        "--logging.log_interval", "1", "--logging.progress_bar", "false", "--logging.tensorboard", "false",
        "--logging.plot", "false", *extra,
    ]  # fmt: skip


def run(args: list[str], world_size: int = 1) -> dict[str, Any]:
    """Train; return the last rollout batch (ids, rewards, engine log-probabilities) and the per-step losses."""
    trainer = RLTrainer(load_config(None, args, world_size=world_size, sections={"rl": RLConfig}))
    try:
        trainer.train()
    finally:
        trainer.metrics.close()
    events = read_events(trainer.output_dir)
    return {
        "responses": [s.response_ids for s in trainer.rollouts.last],
        "rewards": [s.reward for s in trainer.rollouts.last],
        "logprobs": [s.engine_logprobs for s in trainer.rollouts.last],
        "losses": {e["step"]: e["train/policy_loss"] for e in events if "train/policy_loss" in e},
    }


def _ranked(rank: int, world: int, args: list[str]) -> dict[str, Any]:
    return run(args, world)


@pytest.mark.slow
def test_the_same_config_generates_the_same_rollouts_at_one_process_and_dp2(math_demo, tmp_path):
    one = run(math_args(math_demo, tmp_path / "one"))
    two = run_distributed(_ranked, 2, math_args(math_demo, tmp_path / "two"), timeout_s=600)
    assert len(one["responses"]) == 16
    for rank_result in two:
        assert rank_result["responses"] == one["responses"]
        assert rank_result["rewards"] == one["rewards"]
        for got, expected in zip(rank_result["logprobs"], one["logprobs"]):
            assert got == pytest.approx(expected, abs=1e-5)
    for step, loss in one["losses"].items():
        assert two[0]["losses"][step] == pytest.approx(loss, rel=1e-5, abs=1e-7)
    assert len({tuple(r) for r in one["responses"]}) > 4  # the samples of a prompt differ


FAULTY = """
def score(prompts, completions, answers, **columns):
    if any(a == "{answer}" for a in answers):
        raise ZeroDivisionError("cannot score this one")
    return [0.0 for _ in completions]
"""


@pytest.mark.slow
def test_a_reward_function_failing_on_one_ranks_row_is_the_same_named_error_on_every_rank(math_demo, tmp_path):
    # the answer of a prompt rank 1 generates (prompt 1 of the first rollout batch: prompts i mod 2 == 1 are rank 1's)
    probe = RLTrainer(load_config(None, math_args(math_demo, tmp_path / "probe"), world_size=1,
                                  sections={"rl": RLConfig}))  # fmt: skip
    answer = probe.train_dataset.batch(0, 4, probe.config.train.seed)[1].answer
    probe.metrics.close()
    probe.close()
    rewards = tmp_path / "faulty.py"
    rewards.write_text(FAULTY.format(answer=answer))
    args = math_args(math_demo, tmp_path / "run", "--rl.rewards", f"[{{name: mine, function: '{rewards}:score'}}]")
    outcomes = run_ranks(_ranked, 2, args, timeout_s=600)
    messages = [value.strip().splitlines()[-1] for status, value in outcomes.values()]
    assert all(status == "error" for status, _ in outcomes.values()), outcomes
    assert messages[0] == messages[1], messages
    assert messages[0].startswith("veomni_lite.rl.rewards.RewardError: rollout batch 0: rank 1: reward")
    assert "'mine'" in messages[0] and "faulty.py:score" in messages[0] and "row" in messages[0]
    assert "ZeroDivisionError" in messages[0]


def test_a_reward_failing_in_the_first_evaluation_names_the_evaluation(math_demo, tmp_path):
    rewards = tmp_path / "failing.py"
    rewards.write_text("def score(prompts, completions, answers, **columns):\n    raise ZeroDivisionError('no')\n")
    reward = f"[{{name: mine, function: '{rewards}:score'}}]"
    evaluation = ("--data.eval_path", str(math_demo / "rl_eval.jsonl"), "--train.eval_interval", "1")
    args = math_args(math_demo, tmp_path / "run", *evaluation, "--rl.rewards", reward)
    trainer = RLTrainer(load_config(None, args, world_size=1, sections={"rl": RLConfig}))
    try:
        with pytest.raises(RewardError, match=r"^the evaluation of the starting weights: rank 0: reward 'mine'"):
            trainer.train()
    finally:
        trainer.metrics.close()
        trainer.close()
    assert batch_name(0, 0) == "rollout batch 0" and batch_name(EVALUATION, 3) == "the evaluation after step 3"


def vl_args(model_dir: Path, digits: Path, out: Path, *extra: str) -> list[str]:
    """One rollout batch of 2 digit images x 2 samples, one optimizer step."""
    return [
        "--model.arch", "auto", "--model.pretrained_dir", str(model_dir), "--data.train_path", str(digits),
        "--data.format", "messages", "--data.max_seq_len", "64", "--rl.prompts_per_step", "2",
        "--rl.num_generations", "2", "--rl.max_new_tokens", "4", "--rl.rewards",
        "[{name: correct, function: exact_match}]", "--train.micro_batch_size", "2", "--train.global_batch_size", "4",
        "--train.max_steps", "1", "--train.output_dir", str(out), "--logging.progress_bar", "false",
        "--logging.tensorboard", "false", "--logging.plot", "false", *extra,
    ]  # fmt: skip


def trained(args: list[str]) -> RLTrainer:
    """A one-process RLTrainer of `args`, trained (its metrics closed)."""
    trainer = RLTrainer(load_config(None, args, world_size=1, sections={"rl": RLConfig}))
    try:
        trainer.train()
    finally:
        trainer.metrics.close()
    return trainer


def test_a_vision_language_model_generates_from_its_images_and_trains(demo, tmp_path):
    args = vl_args(demo / "models/qwen2_vl_digits", demo / "digits/eval.jsonl", tmp_path)
    trainer = trained(args)
    samples = trainer.rollouts.last
    image = trainer.model_config.image_token_id
    assert len(samples) == 4 and all("pixel_values" in s.model_inputs for s in samples)
    assert all(image in s.prompt_ids and image not in s.response_ids for s in samples)
    # the engine's log-probabilities are the trainer's (same weights, one step before the update)
    assert engine_gap(trainer) < 1e-4


def engine_gap(trainer: RLTrainer) -> float:
    """The largest |trainer - engine| log-probability of a sampled token in the run's last logged step: on policy
    the training forward's own are the old ones, and the policy loss records exp(old - engine)'s extremes."""
    row = next(r for r in reversed(read_events(trainer.output_dir)) if "rl/importance_ratio/max" in r)
    return max(abs(math.log(row["rl/importance_ratio/max"])), abs(math.log(row["rl/importance_ratio/min"])))


def test_the_lora_reference_is_the_base_with_its_adapters_off(math_demo, tmp_path):
    args = math_args(math_demo, tmp_path, "--model.lora", "{rank: 4, alpha: 8}", "--train.max_steps", "1")
    trainer = RLTrainer(load_config(None, args, world_size=1, sections={"rl": RLConfig}))
    try:
        assert trainer.reference is not None and trainer.reference.bytes == 0  # no second copy
        adapter = next(m for m in trainer.model.modules() if hasattr(m, "lora_B"))
        with torch.no_grad():
            adapter.lora_B.weight.normal_()  # the adapters now change the outputs
        ids = torch.tensor([[1, 5, 9, 13, 2]])
        inputs = {"input_ids": ids, "position_ids": torch.arange(5)[None]}
        with torch.no_grad():
            adapted = trainer.model(**inputs)["logits"]
            with trainer.reference.active():
                reference = trainer.model(**inputs)["logits"]
            adapter.lora_B.weight.zero_()
            base = trainer.model(**inputs)["logits"]
        assert torch.equal(reference, base) and not torch.allclose(adapted, base)
    finally:
        trainer.metrics.close()


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_the_other_vision_language_families_generate_and_train(families_demo, family, tmp_path):
    digits = families_demo / "digits/eval.jsonl"
    args = vl_args(families_demo / "models" / family, digits, tmp_path, "--rl.kl_coef", "0.1")
    trainer = trained(args)
    assert len(trainer.rollouts.last) == 4 and engine_gap(trainer) < 1e-4


def test_an_rl_run_exports_to_a_directory_transformers_loads_with_the_trained_logits(math_demo, tmp_path):
    from transformers import AutoModelForCausalLM

    from veomni_lite.export import export

    trainer = RLTrainer(load_config(None, math_args(math_demo, tmp_path / "run", "--train.max_steps", "1"),
                                    world_size=1, sections={"rl": RLConfig}))  # fmt: skip
    try:
        trainer.train()
        ids = torch.tensor([[1, 5, 9, 13, 2]])
        with torch.no_grad():
            trained = trainer.model(input_ids=ids, position_ids=torch.arange(5)[None])["logits"]
    finally:
        trainer.metrics.close()
    export(tmp_path / "run", tmp_path / "hf")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    with torch.no_grad():
        assert torch.allclose(loaded(input_ids=ids).logits, trained, atol=1e-5)
