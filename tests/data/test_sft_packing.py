"""Packing and token budgets through the SFT trainer (float32): the same per-step loss and gradient norm as the
unpacked run, for the help pages (text) and the digits (Qwen2-VL), at 1 process and with token-budget
micro-batches on 2 processes whose micro-batch counts differ; the padding ratio and real-token metrics."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.data.test_sft_training import REPO, digits_args, help_args
from tests.trainer.helpers import losses_by_step, read_events
from veomni_lite.config import load_config
from veomni_lite.data.loader import MicroBatchLoader
from veomni_lite.trainer.sft import SFTTrainer, build_sft_data

STEPS = ["--train.max_steps", "3", "--logging.log_interval", "1", "--train.eval_interval", "0"]
STEPS += ["--checkpoint.save_interval", "0", "--train.eval_batches", "0"]
PACKED = ["--data.packing", "true"]
BUDGET = ["--data.packing", "true", "--data.max_tokens_per_micro_batch", "256"]


def run(config: str, args: list[str]) -> list[dict]:
    trainer = SFTTrainer(load_config(REPO / "configs" / config, [*STEPS, *args], world_size=1))
    try:
        trainer.train()
    finally:
        trainer.close()
    return read_events(trainer.output_dir)


def assert_same_steps(expected: list[dict], got: list[dict], tokens: bool = True) -> None:
    """The same loss, grad norm and samples per step; `tokens`: the same tokens run (none shared)."""
    for key in ("train/loss", "train/grad_norm", "train/samples", *(["train/tokens"] if tokens else [])):
        want, have = losses_by_step(expected, key), losses_by_step(got, key)
        assert want.keys() == have.keys()
        for step in want:
            assert have[step] == pytest.approx(want[step], rel=1e-5), (key, step)


@pytest.fixture(scope="module")
def padded_help(demo, tmp_path_factory) -> list[dict]:
    """The padded help-pages run both tests compare with."""
    return run("sft_help.yaml", help_args(demo, tmp_path_factory.mktemp("padded_help")))


@pytest.mark.parametrize("job", ["help", "digits"])
def test_packed_and_token_budget_steps_equal_the_padded_steps(demo, tmp_path, job, padded_help):
    args = help_args if job == "help" else digits_args
    config = "sft_help.yaml" if job == "help" else "sft_digits.yaml"
    padded = padded_help if job == "help" else run(config, args(demo, tmp_path / "padded"))
    # packed, the help pages' common system prompt is run once per micro-batch (data.shared_prefix, the default): the
    # same steps from fewer tokens; the budget run shares nothing and runs the same tokens
    for name, extra in (("packed", PACKED), ("budget", [*BUDGET, "--data.shared_prefix", "false"])):
        got = run(config, args(demo, tmp_path / name, *extra))
        shared = name == "packed" and job == "help"
        assert_same_steps(padded, got, tokens=not shared)
        if shared:
            want, have = losses_by_step(padded, "train/tokens"), losses_by_step(got, "train/tokens")
            assert all(have[step] < want[step] for step in want), (want, have)
        ratios = losses_by_step(got, "train/padding_ratio")
        assert all(value < 0.05 for value in ratios.values()), ratios
    if job == "help":  # paragraphs of varied length; the digits' samples are nearly all one length
        assert all(value > 0.3 for value in losses_by_step(padded, "train/padding_ratio").values())


def plan_counts(demo_dir: Path, steps: int = 3) -> list[list[int]]:
    """Micro-batches per step that each of 2 dp ranks plans under the budget (the loader the trainer builds)."""
    config = load_config(REPO / "configs/sft_help.yaml", [*STEPS, *help_args(demo_dir, demo_dir / "unused", *BUDGET)])
    dataset = build_sft_data(config)[2]
    train = config.train
    loaders = [
        MicroBatchLoader(dataset, list, train.global_batch_size, train.micro_batch_size, dp_size=2, dp_rank=rank,
                         seed=train.seed, max_tokens=256, packing=True)
        for rank in range(2)
    ]  # fmt: skip
    return [[len(loader.rank_indices(step)) for step in range(steps)] for loader in loaders]


@pytest.mark.slow
def test_token_budget_micro_batches_on_two_ranks_with_different_counts_equal_one_padded_process(
    demo,
    tmp_path,
    padded_help,
):
    counts = plan_counts(demo)
    print(f"\nmicro-batches per step under the budget: rank 0 {counts[0]}, rank 1 {counts[1]}")
    assert counts[0] != counts[1], "the ranks' plans differ in count, so padding micro-batches run"
    out = tmp_path / "two"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    done = subprocess.run(
        [*command, "trainers/train_sft.py", "configs/sft_help.yaml", *STEPS, *help_args(demo, out, *BUDGET)],
        cwd=REPO, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    assert_same_steps(padded_help, read_events(out), tokens=False)  # packed: the system prompt is shared
