"""The durable series: each window logged once whenever an interrupt lands; each value labelled with its step."""

from __future__ import annotations

import logging

import pytest

from examples.text_trainer import TextTrainer
from tests.trainer.helpers import read_events, run_trainer, tiny_config
from veomni_lite.config import replace

SETTINGS = {"max_steps": 7, "log_interval": 3, "save_interval": 2, "eval_interval": 2, "eval_batches": 1}
SAME = ("train/loss", "train/grad_norm", "train/lr", "train/tokens")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> list[dict]:
    return run_trainer("text", tiny_config("text", tmp_path_factory.mktemp("full"), **SETTINGS))


def windows(events: list[dict]) -> dict[tuple[int, int], dict]:
    """{(first step, last step) of each train window: its row}."""
    rows, previous = {}, 0
    for event in events:
        if "train/tokens" in event:
            rows[(previous + 1, event["step"])] = event
            previous = event["step"]
    return rows


def assert_counted_once(events: list[dict], reference: list[dict]) -> None:
    steps = [e["step"] for e in events]
    assert steps == sorted(set(steps)), f"steps must be strictly increasing and unique: {steps}"
    assert steps[-1] == reference[-1]["step"]
    assert sum(e.get("train/tokens", 0) for e in events) == sum(e.get("train/tokens", 0) for e in reference)
    assert events[-1]["train/tokens_seen"] == reference[-1]["train/tokens_seen"]
    got, expected = windows(events), windows(reference)
    same = set(got) & set(expected)
    assert len(same) >= len(expected) - 2, f"an interrupt changes at most the window it lands in: {sorted(got)}"
    for window in same:
        for key in SAME:
            assert got[window][key] == pytest.approx(expected[window][key], rel=1e-5), (window, key)
    evals = {e["step"]: e["eval/loss"] for e in events if "eval/loss" in e}
    assert evals == pytest.approx({e["step"]: e["eval/loss"] for e in reference if "eval/loss" in e}, rel=1e-5)


@pytest.mark.parametrize("stop_after", range(1, 7))
def test_each_window_counts_once_whenever_the_interrupt_lands(tmp_path, uninterrupted, stop_after):
    """Stop after every step in turn: before/after a save (2, 4, 6), after a log (3, 6), after an eval (2, 4, 6)."""
    run_trainer("text", tiny_config("text", tmp_path, **SETTINGS), stop_after=stop_after)
    resumed = run_trainer("text", tiny_config("text", tmp_path, **SETTINGS, resume=True))
    assert_counted_once(resumed, uninterrupted)


def test_tensorboard_steps_are_unique_after_a_resume(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_trainer("text", tiny_config("text", tmp_path, **SETTINGS, tensorboard=True), stop_after=4)
    run_trainer("text", tiny_config("text", tmp_path, **SETTINGS, tensorboard=True, resume=True))
    board = EventAccumulator(str(tmp_path / "tensorboard"))
    board.Reload()
    for tag in ("train/loss", "train/tokens", "eval/loss"):
        steps = [event.step for event in board.Scalars(tag)]
        assert steps == sorted(set(steps)), (tag, steps)
    assert [event.step for event in board.Scalars("train/loss")] == [2, 3, 4, 6, 7]


def test_an_unexpected_exception_names_the_unlogged_steps_and_resume_logs_them(tmp_path, uninterrupted, caplog):
    trainer = TextTrainer(tiny_config("text", tmp_path, **SETTINGS))
    original = trainer.train_step

    def train_step(micro_batches):
        if trainer.step == 5:
            raise RuntimeError("disk on fire")
        original(micro_batches)

    trainer.train_step = train_step
    with pytest.raises(RuntimeError, match="disk on fire"), caplog.at_level(logging.WARNING):
        trainer.train()
    trainer.metrics.close()
    assert "steps 5-5 were trained but not logged" in caplog.text
    assert [e["step"] for e in read_events(tmp_path)] == [2, 3, 4]
    resumed = run_trainer("text", tiny_config("text", tmp_path, **SETTINGS, resume=True))
    assert_counted_once(resumed, uninterrupted)


def test_lr_is_the_rate_the_step_trained_with(tmp_path):
    events = run_trainer("text", tiny_config("text", tmp_path, max_steps=3, lr=3e-3, warmup_steps=20))
    assert [e["train/lr"] for e in events] == pytest.approx([1.5e-4, 3.0e-4, 4.5e-4])


def test_interrupt_flush_carries_the_epoch_of_the_last_trained_step(tmp_path):
    """4 steps per epoch: stopping after step 4 has already fetched step 5's batch (epoch 1)."""
    config = replace(tiny_config("text", tmp_path, max_steps=8, log_interval=10), data={"num_samples": 32})
    events = run_trainer("text", config, stop_after=4)
    assert [(e["step"], e["epoch"]) for e in events] == [(4, 0)]


def test_step_time_excludes_the_wait_for_the_previous_steps_bookkeeping(tmp_path, monkeypatch):
    """On the train loop's clock, waiting for the previous step's bookkeeping takes 100 s from step 2 on (the
    worker has a window to write) and everything else takes 1 ms a reading: the wait is logged as such and is not in
    the step time. No wall clock is compared."""
    from types import SimpleNamespace

    from veomni_lite.trainer import base

    clock = [0.0]

    def perf_counter() -> float:
        clock[0] += 0.001
        return clock[0]

    monkeypatch.setattr(base, "time", SimpleNamespace(perf_counter=perf_counter))
    trainer = TextTrainer(tiny_config("text", tmp_path, max_steps=3, log_interval=1))
    wait = trainer.metrics.wait_bookkeeping
    waits = []

    def slow_wait() -> None:
        wait()
        clock[0] += 100.0 if waits else 0.0
        waits.append(1)

    trainer.metrics.wait_bookkeeping = slow_wait
    trainer.train()
    trainer.metrics.close()
    events = read_events(tmp_path)
    assert [e["step"] for e in events] == [1, 2, 3]
    assert events[0]["train/bookkeeping_wait_s"] == pytest.approx(0.001), "nothing to wait for at step 1"
    for event in events[1:]:
        assert event["train/bookkeeping_wait_s"] == pytest.approx(100.001)
        assert event["train/step_time_s"] == pytest.approx(0.002), "the step's own readings, not the wait"


def test_checkpoints_stay_the_same_size_as_the_run_grows_and_a_resume_reads_the_history_back(tmp_path):
    """The logged history lives in metrics.jsonl: trainer_state.pt does not grow with the steps already run, and a
    resumed run's series (what the loss curve draws) is read back from the file."""
    config = tiny_config("text", tmp_path, max_steps=12, save_interval=4, keep_checkpoints=3)
    run_trainer("text", config, stop_after=9)
    sizes = {s: (tmp_path / "checkpoints" / f"step_{s:08d}" / "trainer_state.pt").stat().st_size for s in (4, 8, 9)}
    assert len(set(sizes.values())) == 1, sizes
    trainers = []
    run_trainer("text", replace(config, checkpoint={"resume": True}), setup=trainers.append)
    series = trainers[0].metrics.series
    assert [point["step"] for point in series["train/loss"]] == list(range(1, 13))
    assert [e["step"] for e in read_events(tmp_path)] == list(range(1, 13))
