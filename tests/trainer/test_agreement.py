"""Every rank decides alike: non-finite values seen on ONE rank, and every process group's collective timeout."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
import torch

from examples.text_trainer import TextTrainer
from tests.dist_helpers import run_ranks
from tests.trainer.helpers import read_events, tiny_config, train_outcome
from veomni_lite.distributed.collectives import CollectiveError, all_reduce
from veomni_lite.distributed.parallel_state import destroy_parallel_state, init_parallel_state
from veomni_lite.metrics import new_metrics_group
from veomni_lite.trainer.base import NonFiniteError

# ---------------------------------------------------------------- a non-finite loss on one rank


def _nan_loss_on_rank_one(rank: int, world_size: int, config) -> dict:
    """Rank 1's step-2 loss gets a detached NaN term: its loss is NaN while every gradient stays finite."""
    trainer = TextTrainer(config)
    original = trainer.postforward

    def postforward(outputs, *args):
        loss, scaled = original(outputs, *args)
        if rank == 1 and trainer.step == 1:
            loss = loss + torch.tensor(float("nan"))
        return loss, scaled

    trainer.postforward = postforward
    outcome = "trained"
    try:
        trainer.train()
    except NonFiniteError as exc:
        outcome = str(exc)
    finally:
        trainer.metrics.close()
    return {
        "outcome": outcome,
        "scheduler_steps": trainer.scheduler.last_epoch,
        "params": [p.full_tensor().clone() for p in trainer.model.parameters()],
        "events": read_events(config.train.output_dir) if rank == 0 else None,
    }


@pytest.mark.slow
def test_non_finite_loss_on_one_rank_is_skipped_on_every_rank(tmp_path):
    config = tiny_config("text", tmp_path, max_steps=4, nonfinite="skip")
    outcomes = run_ranks(_nan_loss_on_rank_one, 2, config, timeout_s=120, pg_timeout_s=30)
    results = {rank: value for rank, (status, value) in outcomes.items()}
    assert all(status == "ok" for status, _ in outcomes.values()), results
    assert results[0]["outcome"] == results[1]["outcome"] == "trained"
    assert results[0]["scheduler_steps"] == results[1]["scheduler_steps"] == 3, "4 steps, one skipped on every rank"
    for a, b in zip(results[0]["params"], results[1]["params"]):
        assert torch.equal(a, b), "the replicas stay identical"
    events = results[0]["events"]
    assert [e.get("train/skipped_steps") for e in events] == [0, 1, 0, 0], "counted once, at the skipped step"


@pytest.mark.slow
def test_non_finite_loss_on_one_rank_raises_on_every_rank_naming_it(tmp_path):
    config = tiny_config("text", tmp_path, max_steps=4)
    # A hang would end in the 30 s collective timeout with a CollectiveError, not the errors asserted below.
    outcomes = run_ranks(_nan_loss_on_rank_one, 2, config, timeout_s=120, pg_timeout_s=30)
    results = {rank: value for rank, (status, value) in outcomes.items()}
    assert all(status == "ok" for status, _ in outcomes.values()), results
    for rank in (0, 1):
        message = results[rank]["outcome"]
        assert re.search(rf"rank {rank}, step 2: non-finite values: .*loss non-finite on rank\(s\) \[1\]", message)
        assert results[rank]["scheduler_steps"] == 1, "neither rank stepped at step 2"


# ---------------------------------------------------------------- a loader error on one rank


def _budget_error_on_rank_one(rank: int, world_size: int, config) -> dict:
    """Rank 1's loader raises what `plan_micro_batches` raises for a sample over the token budget, at step 2."""
    from veomni_lite.data.checks import DataError

    trainer = TextTrainer(config)
    next_step = trainer.loader.next_step

    def failing_next_step():
        if rank == 1 and trainer.step == 1:
            raise DataError("sample 7 has 40 tokens, over data.max_tokens_per_micro_batch=32")
        return next_step()

    trainer.loader.next_step = failing_next_step
    return {"outcome": train_outcome(trainer), "step": trainer.step}


@pytest.mark.slow
def test_a_loader_error_on_one_rank_is_the_same_data_error_on_every_rank_within_seconds(tmp_path):
    """Before, rank 1 went on to the metrics' closing collective alone while rank 0 waited in the control
    all-reduce: both stalled until the collective timeout with a CollectiveError hiding the cause."""
    config = tiny_config("text", tmp_path, max_steps=4)
    outcomes = run_ranks(_budget_error_on_rank_one, 2, config, timeout_s=120, pg_timeout_s=30)
    results = {rank: value for rank, (status, value) in outcomes.items()}
    assert all(status == "ok" for status, _ in outcomes.values()), results
    assert results[1]["outcome"].startswith("DataError: step 2: rank 1: sample 7 has 40 tokens"), results[1]
    assert results[0]["outcome"] == results[1]["outcome"], "the same error, naming the rank and the cause"
    assert results[0]["step"] == results[1]["step"] == 1


# ---------------------------------------------------------------- an eval collate error on one rank


def _eval_collate_error_on_rank_one(rank: int, world_size: int, config, agreed: bool = True) -> dict:
    """Rank 1's collate fails on the eval set only (a row only its share holds). `agreed=False`: the negative control,
    evaluation reading its micro-batches as before, without the agreement; rank 1 then lingers past the collective
    timeout before exiting (as a process busy elsewhere, or one whose exit its launcher has not seen yet)."""
    from veomni_lite.trainer.base import BaseTrainer

    trainer = TextTrainer(config)
    collate, evaluating = trainer.collate, []

    def failing_collate(samples):
        if rank == 1 and evaluating:
            raise ValueError("eval row 3: 'input_ids' is not a list of token ids")
        return collate(samples)

    def evaluate():
        evaluating.append(1)
        return BaseTrainer.evaluate(trainer)

    trainer.collate, trainer.evaluate = failing_collate, evaluate
    if not agreed:
        trainer.eval_micro_batches = lambda loader, number: [trainer.shard(mb) for mb in loader.next_step()]
    outcome = train_outcome(trainer)
    if not agreed and rank == 1:
        time.sleep(config.parallel.collective_timeout_s + 0.5)
    return {"outcome": outcome, "step": trainer.step}


def _eval_config(tmp_path: Path, timeout_s: float = 4.0):
    from veomni_lite.config import replace

    config = tiny_config("text", tmp_path, {"eval_samples": 16}, max_steps=2, eval_interval=1, eval_batches=1)
    return replace(config, parallel={"collective_timeout_s": timeout_s})


@pytest.mark.slow
def test_an_eval_collate_error_on_one_rank_is_the_same_data_error_on_every_rank_before_any_forward(tmp_path):
    """Issue 48: evaluation agrees its micro-batches (one all-reduce per eval batch) before the first forward. With a
    4 s collective timeout a rank left in a forward would fail with a timeout instead of the agreed error."""
    outcomes = run_ranks(_eval_collate_error_on_rank_one, 2, _eval_config(tmp_path), timeout_s=120, pg_timeout_s=4)
    results = {rank: value for rank, (status, value) in outcomes.items()}
    assert all(status == "ok" for status, _ in outcomes.values()), results
    expected = "DataError: evaluation at step 1, eval batch 1: rank 1: ValueError: eval row 3: 'input_ids' is not"
    assert results[1]["outcome"].startswith(expected), results[1]
    assert results[0]["outcome"] == results[1]["outcome"], "the same error, naming the rank and the cause"
    assert results[0]["step"] == results[1]["step"] == 1


@pytest.mark.slow
def test_without_the_eval_agreement_the_other_rank_waits_in_a_forward_until_the_timeout(tmp_path):
    """The negative control: rank 1 raises its own ValueError, rank 0 waits in the eval forward's collectives until
    the collective timeout (2 s), never told why: what the test above would see if the agreement regressed."""
    config = _eval_config(tmp_path, timeout_s=2.0)
    outcomes = run_ranks(_eval_collate_error_on_rank_one, 2, config, False, timeout_s=120, pg_timeout_s=2)
    results = {rank: value for rank, (status, value) in outcomes.items()}
    assert results[1]["outcome"].startswith("ValueError: eval row 3"), results
    assert "eval row 3" not in results[0]["outcome"] and "DataError" not in results[0]["outcome"], results
    assert "timed out" in results[0]["outcome"].lower() or "timeout" in results[0]["outcome"].lower(), results


# ---------------------------------------------------------------- a stop signal on one rank, just after the agreement


def _signal_after_the_control_all_reduce_on_rank_zero(rank: int, world_size: int, config) -> dict:
    """Rank 0's SIGTERM lands between its step-2 control all-reduce (which said "go on") and the stop check."""
    trainer = TextTrainer(config)
    original = trainer._agree

    def agree(micro_batches, failed=None):
        agreed_stop = original(micro_batches, failed)
        if rank == 0 and trainer.step == 1:
            trainer._stop_signal = 15
        return agreed_stop

    trainer._agree = agree
    outcome = "trained"
    try:
        trainer.train()
    except SystemExit as exc:
        outcome = f"exit {exc.code}"
    finally:
        trainer.metrics.close()
    checkpoints = sorted(p.name for p in (Path(config.train.output_dir) / "checkpoints").iterdir())
    return {"outcome": outcome, "step": trainer.step, "checkpoints": checkpoints}


@pytest.mark.slow
def test_a_stop_signal_on_one_rank_after_the_agreement_stops_every_rank_at_the_next_step(tmp_path):
    config = tiny_config("text", tmp_path, max_steps=6, save_interval=0)
    outcomes = run_ranks(_signal_after_the_control_all_reduce_on_rank_zero, 2, config, timeout_s=120, pg_timeout_s=20)
    results = {rank: value for rank, (status, value) in outcomes.items()}
    assert all(status == "ok" for status, _ in outcomes.values()), results
    for rank in (0, 1):
        assert results[rank]["outcome"] == "exit 143", results
        assert results[rank]["step"] == 2, "step 2 was agreed on before the signal: both train it, then stop"
    assert results[0]["checkpoints"] == ["step_00000002"]


# ---------------------------------------------------------------- every group honours the timeout

TIMEOUT_S = 1.5


def _hang_each_group(rank: int, world_size: int, dp_size: int, sp_size: int) -> dict[str, str]:
    """Rank 1 never joins one collective per group; rank 0 must fail within the timeout on each. With dp > 1 the
    layout is HSDP (dp_replicate = dp), so its replicate group is checked too."""
    state = init_parallel_state(dp_size, sp_size, timeout_s=TIMEOUT_S, dp_replicate=dp_size)
    groups = {
        "dp" if dp_size > 1 else "sp": state.dp_group if dp_size > 1 else state.sp_group,
        "control": state.new_group("gloo"),
        "metrics": new_metrics_group(),
    }
    if state.hsdp_mesh is not None:
        groups["replicate"] = state.hsdp_mesh.get_group("replicate")
    results = {}
    for name, group in groups.items():
        if rank == 0:
            start = time.monotonic()
            try:
                all_reduce(torch.ones(2), group=group)
                results[name] = "no error"
            except CollectiveError as exc:
                results[name] = f"{time.monotonic() - start:.2f}s {exc}"
        else:
            time.sleep(TIMEOUT_S + 1.5)
        torch.distributed.barrier()  # the default group is untouched by the hung collectives
    destroy_parallel_state()
    return results


@pytest.mark.slow
@pytest.mark.parametrize(("dp_size", "sp_size"), [(2, 1), (1, 2)])
def test_every_group_fails_within_the_collective_timeout(dp_size, sp_size):
    outcomes = run_ranks(_hang_each_group, 2, dp_size, sp_size, timeout_s=120, pg_timeout_s=30)
    status, results = outcomes[0]
    assert status == "ok", results
    assert len(results) == (4 if dp_size > 1 else 3)
    for name, message in results.items():
        assert message != "no error", name
        seconds = float(message.split("s ", 1)[0])
        assert TIMEOUT_S - 0.1 <= seconds < TIMEOUT_S + 3, (name, message)
        assert "rank 0: all_reduce(op=sum" in message, message
