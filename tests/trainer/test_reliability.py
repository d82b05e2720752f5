"""Failure behaviour: bad data, non-finite values, layout errors, timeouts, corrupt checkpoints."""

from __future__ import annotations

import random
import re
import shutil
import time

import pytest
import torch

from examples.text_trainer import TextTrainer
from examples.vlm_trainer import VLMTrainer
from tests.dist_helpers import run_ranks
from tests.trainer.helpers import losses_by_step, read_events, run_trainer, tiny_config
from veomni_lite.config import replace
from veomni_lite.data.checks import DataError
from veomni_lite.distributed.collectives import CollectiveError, all_reduce
from veomni_lite.distributed.parallel_state import init_parallel_state
from veomni_lite.trainer.base import NonFiniteError
from veomni_lite.trainer.checkpoint import CheckpointError

# ---------------------------------------------------------------- non-finite values


def _nan_at_step_two(trainer) -> None:
    original = trainer.postforward

    def postforward(outputs, *args):
        if trainer.step == 1:
            outputs = {key: value * float("nan") for key, value in outputs.items()}
        return original(outputs, *args)

    trainer.postforward = postforward


def test_non_finite_step_fails_with_a_clear_message_by_default(tmp_path):
    trainer = TextTrainer(tiny_config("text", tmp_path, max_steps=4))
    _nan_at_step_two(trainer)
    message = r"rank 0, step 2: non-finite values: .*loss non-finite on rank\(s\) \[0\].*train.nonfinite=skip"
    with pytest.raises(NonFiniteError, match=message):
        trainer.train()
    events = read_events(tmp_path)
    assert [e["step"] for e in events] == [1, 2], "pending metrics are written, including the failing step's"


def test_non_finite_step_can_be_skipped_and_is_counted(tmp_path):
    trainer = TextTrainer(tiny_config("text", tmp_path, max_steps=4, nonfinite="skip"))
    _nan_at_step_two(trainer)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    events = read_events(tmp_path)
    assert sum(e.get("train/skipped_steps", 0) for e in events) == 1
    assert events[-1]["step"] == 4 and events[-1]["train/loss"] is not None
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))


# ---------------------------------------------------------------- bad data on one rank


def _corrupt_rank_one(rank: int, world_size: int, config, corruption: str) -> str:
    trainer = VLMTrainer(config)
    fetch = trainer.loader.next_step

    def next_step():
        micro_batches = fetch()
        if rank == 1 and trainer.step == 1:
            if corruption == "label_out_of_vocab":
                micro_batches[0]["labels"][0, 0] = 999
            elif corruption == "missing_labels":
                del micro_batches[1]["labels"]
            elif corruption == "float_labels":
                micro_batches[0]["labels"] = micro_batches[0]["labels"].float()
            elif corruption == "ends_early":
                micro_batches = micro_batches[:-1]
        return micro_batches

    trainer.loader.next_step = next_step
    try:
        trainer.train()
    except DataError as exc:
        return str(exc)
    finally:
        trainer.metrics.close()
    return "trained without an error"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("corruption", "rank1_message"),
    [
        ("label_out_of_vocab", r"step 2: rank 1: micro-batch 0: 'labels' holds 999, outside \[0, 25\)"),
        ("missing_labels", r"step 2: rank 1: micro-batch 1: missing key\(s\) \['labels'\]"),
        ("float_labels", r"step 2: rank 1: micro-batch 0: 'labels' must be an integer tensor"),
        (
            "ends_early",
            r"rank 1: ranks disagree on the number of micro-batches at step 2 \(this rank 1, min 1, max 2\)",
        ),
    ],
)
def test_bad_data_on_one_rank_is_a_clear_error_on_every_rank(tmp_path, corruption, rank1_message):
    config = tiny_config("vlm", tmp_path, max_steps=3)
    # A hang would end in the 30 s collective timeout with a CollectiveError, not the cause asserted below.
    outcomes = run_ranks(_corrupt_rank_one, 2, config, corruption, timeout_s=120, pg_timeout_s=30)
    messages = {rank: value for rank, (status, value) in outcomes.items()}
    assert all(status == "ok" for status, _ in outcomes.values()), messages
    assert re.search(rank1_message, messages[1]), messages[1]
    if corruption == "ends_early":
        assert "this rank 2, min 1, max 2" in messages[0]
    else:
        assert messages[0] == messages[1], "the same error on every rank"


# ---------------------------------------------------------------- layout and collectives


def _bad_layout(rank: int, world_size: int) -> str:
    try:
        init_parallel_state(3, 1)
    except ValueError as exc:
        return str(exc)
    return "no error"


def _one_rank_skips_a_collective(rank: int, world_size: int) -> str:
    if rank == 1:
        time.sleep(8)
        return "skipped"
    start = time.monotonic()
    try:
        all_reduce(torch.ones(3))
    except CollectiveError as exc:
        return f"{time.monotonic() - start:.1f}s {exc}"
    return "no error"


@pytest.mark.slow
def test_layout_that_does_not_fit_the_world_fails_before_any_collective():
    results = run_ranks(_bad_layout, 2, timeout_s=60)
    for _, message in results.values():
        assert "dp_size (3) x sp_size (1) = 3 != world_size (2)" in message


@pytest.mark.slow
def test_a_hang_becomes_an_error_naming_the_rank_and_collective():
    outcomes = run_ranks(_one_rank_skips_a_collective, 2, timeout_s=60, pg_timeout_s=3)
    status, message = outcomes[0]
    assert status == "ok", message
    seconds = float(message.split("s ", 1)[0])
    assert seconds < 7, message
    assert "rank 0: all_reduce(op=sum, shape=(3,), dtype=torch.float32) over a group of 2 ranks failed" in message


# ---------------------------------------------------------------- checkpoints


def test_corrupt_latest_checkpoint_falls_back_to_the_previous_one(tmp_path, caplog):
    full = run_trainer("text", tiny_config("text", tmp_path / "full", max_steps=6))
    run_dir = tmp_path / "run"
    run_trainer("text", tiny_config("text", run_dir, max_steps=6, save_interval=2), stop_after=4)
    checkpoints = run_dir / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_00000002", "step_00000004"]
    for data_file in (checkpoints / "step_00000004").glob("*.distcp"):
        data_file.write_bytes(data_file.read_bytes()[:10])  # torn shard
    shutil.copytree(checkpoints / "step_00000002", checkpoints / "step_00000005.tmp")  # a save that never finished
    resumed = run_trainer("text", tiny_config("text", run_dir, max_steps=6, save_interval=2, resume=True))
    assert f"checkpoint {checkpoints / 'step_00000004'} is unusable" in caplog.text
    assert [e["step"] for e in resumed] == [1, 2, 3, 4, 5, 6]
    for key in ("train/loss", "train/grad_norm"):
        expected = losses_by_step(full, key)
        got = losses_by_step(resumed, key)
        for step in expected:
            assert got[step] == pytest.approx(expected[step], rel=1e-6), (key, step)


def test_resume_with_only_unusable_checkpoints_is_an_error(tmp_path):
    run_trainer("text", tiny_config("text", tmp_path, max_steps=2))
    (tmp_path / "checkpoints" / "step_00000002" / ".metadata").unlink()
    with pytest.raises(Exception, match="no checkpoint under .* could be loaded"):
        TextTrainer(tiny_config("text", tmp_path, max_steps=4, resume=True))


def test_resume_with_another_model_is_an_error_naming_the_difference(tmp_path):
    run_trainer("text", tiny_config("text", tmp_path, max_steps=2))
    config = replace(tiny_config("text", tmp_path, max_steps=4, resume=True), model={"intermediate_size": 96})
    with pytest.raises(CheckpointError, match="does not fit this model") as error:
        TextTrainer(config)
    message = str(error.value)
    assert re.search(r"\S+ is \[64, 32\] there, \[96, 32\] here", message), message
    assert "model.intermediate_size: 64 there, 96 here" in message


class _FakeCuda:
    """torch.cuda as a rank sees it with `visible` GPUs, on device `current`: each device's RNG state is its index."""

    def __init__(self, visible: int, current: int) -> None:
        self.visible, self.current, self.restored = visible, current, []

    def install(self, monkeypatch) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: self.current)
        monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": torch.tensor([self.current]))
        monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [torch.tensor([i]) for i in range(self.visible)])
        monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device="cuda": self.restored.append(int(state)))


@pytest.mark.parametrize(("saved_on", "resumed_on"), [((8, 3), (1, 0)), ((1, 0), (8, 5)), ((2, 1), (4, 1))])
def test_a_cuda_rng_state_resumes_with_another_number_of_visible_gpus(monkeypatch, saved_on, resumed_on):
    """A rank saves its own device's CUDA RNG state only, and restores it on whatever device it runs on now."""
    from veomni_lite.trainer.checkpoint import rng_state, set_rng_state

    saving = _FakeCuda(*saved_on)
    saving.install(monkeypatch)
    state = rng_state()
    assert int(state["cuda"]) == saved_on[1], "one state: this rank's device's"
    resuming = _FakeCuda(*resumed_on)
    resuming.install(monkeypatch)
    set_rng_state(state)
    assert resuming.restored == [saved_on[1]]


def test_an_older_checkpoint_with_every_devices_cuda_rng_restores_this_devices(monkeypatch):
    from veomni_lite.trainer.checkpoint import set_rng_state

    resuming = _FakeCuda(visible=2, current=1)
    resuming.install(monkeypatch)
    set_rng_state({**_plain_rng(), "cuda": [torch.tensor([i]) for i in range(8)]})
    assert resuming.restored == [1]
    resuming.current, resuming.restored = 5, []
    set_rng_state({**_plain_rng(), "cuda": [torch.tensor([i]) for i in range(2)]})  # fewer saved than this device
    assert resuming.restored == [1]


def _plain_rng() -> dict[str, object]:
    return {"python": random.getstate(), "torch": torch.get_rng_state()}
