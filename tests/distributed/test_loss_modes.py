"""Every loss mode, exact over GA x DP x SP on real gloo processes, against a hand-written float64 reference.

The split-invariance harness runs a float64 TinyVLM (two heads, each plan gives them different modes) over one
global batch of 8 samples of varied lengths, with a sample without any target, caption samples without
image-decoder targets, and every sequence cut across the SP shards; each layout must equal the per-token reference
written by hand, with one loss all-reduce per step. Faults on ONE rank (another mode, a step dict edited) end every
rank with an error, never a hang or a wrong value. Trainer runs with each `--loss.mode` log the same per-step
train/loss and grad norm at 1 process, DP=2 and SP=2.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from tests.dist_helpers import run_distributed, run_ranks
from tests.distributed.modes_fixtures import (
    MODE_PLANS,
    SCALE_FACTOR,
    build_model,
    collate_samples,
    hand_reference,
    samples,
)
from tests.trainer.helpers import losses_by_step, run_trainer, tiny_config
from veomni_lite.distributed.parallel_state import init_parallel_state
from veomni_lite.split_invariance import Layout, _mode_name, check_split_invariance
from veomni_lite.utils.loss_utils import (
    LOSS_MODES,
    LossKeyMismatchError,
    LossMemoError,
    LossModes,
    count_loss_token,
    mean_global_loss,
)

PLANS = [LossModes(default, {"image_decoder": image}, SCALE_FACTOR) for default, image in MODE_PLANS]
LAYOUTS = [Layout(1, 1, 1), Layout(1, 1, 2), Layout(2, 1, 2), Layout(1, 2, 4), Layout(2, 2, 2)]


@pytest.fixture(scope="module")
def report():
    start = time.monotonic()
    result = check_split_invariance(build_model, samples(), collate_samples, PLANS, LAYOUTS)
    print(f"\n{result}\n({time.monotonic() - start:.0f} s)")
    return result


@pytest.mark.slow
def test_every_mode_at_every_layout_equals_the_hand_written_reference(report):
    worst = 0.0
    for plan, modes in zip(MODE_PLANS, PLANS):
        expected_grads, expected_loss = hand_reference(plan)
        scale = max(float(g.abs().max()) for g in expected_grads)
        for layout in ["reference", *map(str, LAYOUTS)]:
            key = (layout, _mode_name(modes))
            grad_diff = max(float((g - e).abs().max()) for g, e in zip(report.grads[key], expected_grads)) / scale
            loss_diff = abs(report.losses[key] - expected_loss) / abs(expected_loss)
            worst = max(worst, grad_diff, loss_diff)
            assert grad_diff < 1e-12 and loss_diff < 1e-12, f"{plan} at {layout}: {grad_diff:.2e}, {loss_diff:.2e}"
    print(f"largest relative difference against the hand reference: {worst:.2e}")
    assert report.worst() < 1e-12


@pytest.mark.slow
def test_one_loss_all_reduce_per_step_at_every_layout(report):
    for layout in LAYOUTS:
        expected = 1 if layout.dp * layout.sp > 1 else 0  # one process issues no collective at all
        assert report.collectives_per_step[str(layout)] == expected, layout


class SumNotMeanVLM(torch.nn.Module):
    """A negative control: a model whose heads return the local SUM, not the contract's local mean."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = build_model()
        self.loss_keys = self.inner.loss_keys

    def forward(self, **batch):
        out = self.inner(**batch)
        counts = count_loss_token(batch)
        return {key: out[key] * counts[key.replace("_loss", "_tokens")] for key in self.loss_keys}


def build_broken_model() -> SumNotMeanVLM:
    return SumNotMeanVLM()


@pytest.mark.slow
def test_the_harness_flags_a_head_that_breaks_the_contract():
    result = check_split_invariance(build_broken_model, samples(), collate_samples, ["token-mean"], [Layout(1, 1, 1)])
    print(f"\nnegative control (local sums, not means):\n{result}")
    assert result.worst() > 1e-2


def _one_rank_faults(rank: int, world_size: int) -> dict[str, str]:
    """Rank 1 alone uses another mode (every rank must raise), then edits a step dict after its first use (rank 1
    must refuse it before any collective; rank 0 then fails in its next collective instead of waiting forever)."""
    init_parallel_state(world_size, 1)
    tokens = {"foundation_tokens": torch.tensor(3), "foundation_sequences": torch.tensor(1)}
    messages = {}
    mode = "seq-mean-token-sum" if rank == 1 else "seq-mean-token-mean"
    try:
        mean_global_loss(torch.tensor(1.0), tokens, dict(tokens), modes=mode)
        messages["mode"] = "returned a value"
    except LossKeyMismatchError as exc:
        messages["mode"] = str(exc)
    step = dict(tokens)
    mean_global_loss(torch.tensor(1.0), tokens, step)
    if rank == 1:
        step["foundation_tokens"] += 1  # in place, on this rank only
    start = time.monotonic()
    try:
        mean_global_loss(torch.tensor(1.0), tokens, step)
        dist.all_reduce(torch.zeros(1))  # the step's next collective (the grad norm in the trainer)
        messages["edit"] = "no error"
    except (LossMemoError, RuntimeError) as exc:
        messages["edit"] = f"{type(exc).__name__}: {exc}"
    messages["edit_s"] = f"{time.monotonic() - start:.1f}"
    if rank == 1:
        raise LossMemoError(messages["edit"])
    return messages


@pytest.mark.slow
def test_faults_on_one_rank_end_every_rank_with_an_error():
    outcomes = run_ranks(_one_rank_faults, 2, timeout_s=60, pg_timeout_s=20)
    status, messages = outcomes[0]
    assert status == "ok", messages
    assert "loss keys differ across ranks" in messages["mode"]
    assert "foundation:seq-mean-token-mean" in messages["mode"] and "foundation:seq-mean-token-sum" in messages["mode"]
    assert messages["edit"] != "no error" and float(messages["edit_s"]) < 25, messages
    status, error = outcomes[1]
    assert status == "error" and "edited after its first use" in error and "foundation_tokens" in error


# ---------------------------------------------------------------- the trainer, each --loss.mode, three layouts

TRAINER_STEPS = 3


def mode_config(mode: str, output_dir, **train):
    config = tiny_config("vlm", output_dir, max_steps=TRAINER_STEPS, seed=1, **train)
    config.loss.mode = mode
    config.loss.scale_factor = SCALE_FACTOR
    return config


def _mode_runs(rank: int, world_size: int, jobs) -> dict:
    results = {}
    for name, config in jobs:
        events = run_trainer("vlm", config)
        results[name] = (losses_by_step(events), losses_by_step(events, "train/grad_norm")) if rank == 0 else None
    return results


@pytest.mark.slow
def test_trainer_logs_the_same_loss_and_grad_norm_in_every_mode_at_1_process_dp2_and_sp2(tmp_path):
    single = {}
    for mode in LOSS_MODES:
        events = run_trainer("vlm", mode_config(mode, tmp_path / f"{mode}_single"))
        single[mode] = (losses_by_step(events), losses_by_step(events, "train/grad_norm"))
    jobs = []
    for mode in LOSS_MODES:
        jobs.append((f"{mode}/dp2", mode_config(mode, tmp_path / f"{mode}_dp2")))
        jobs.append((f"{mode}/sp2", mode_config(mode, tmp_path / f"{mode}_sp2", sp_size=2)))
    runs = run_distributed(_mode_runs, 2, jobs, timeout_s=600, pg_timeout_s=120)[0]
    for mode in LOSS_MODES:
        loss, grad_norm = single[mode]
        assert sorted(loss) == list(range(1, TRAINER_STEPS + 1))
        for layout in ("dp2", "sp2"):
            got_loss, got_norm = runs[f"{mode}/{layout}"]
            for step in loss:
                assert got_loss[step] == pytest.approx(loss[step], rel=1e-5), f"{mode} {layout} step {step}"
                assert got_norm[step] == pytest.approx(grad_norm[step], rel=1e-4), f"{mode} {layout} step {step}"
        if mode != "token-mean":  # the mode is really applied: its objective is another number
            assert loss[1] != pytest.approx(single["token-mean"][0][1], rel=1e-3), mode
