"""MetricLogger: windows, the final step, resume, eval, non-scalars, ranks that write nothing, the step-end worker."""

from __future__ import annotations

import logging
import math
import sys
import threading
import traceback

import pytest
import torch

from tests.metrics.helpers import TIME_KEYS, jsonl, make_logger, record_step, train_step
from tests.metrics.test_sinks import FakeWandb, read_scalars
from veomni_lite.distributed.parallel_state import ParallelState
from veomni_lite.metrics import StepEndError
from veomni_lite.metrics.sinks import Sink, append_series


def run(logger, steps: range, epoch: int = 0) -> None:
    for step in steps:
        train_step(logger, step, epoch)


class RecordingSink(Sink):
    """Records (step, thread name) per write; raises at the steps in `fail_at`."""

    def __init__(self, fail_at: tuple[int, ...] = ()) -> None:
        self.writes: list[tuple[int, str]] = []
        self.fail_at = fail_at

    def write(self, step, epoch, values) -> None:
        if step in self.fail_at:
            raise ValueError(f"disk full at step {step}")
        self.writes.append((step, threading.current_thread().name))


def test_final_step_is_always_logged(tmp_path, capsys):
    logger = make_logger(tmp_path)
    assert [s for s in range(1, 8) if logger.should_log(s)] == [3, 6, 7]
    run(logger, range(1, 8))
    logger.close()
    events = jsonl(tmp_path)
    assert [e["step"] for e in events] == [3, 6, 7]
    assert events[-1]["train/tokens"] == 10.0  # the last window holds step 7 only
    assert events[0]["train/loss"] == pytest.approx(sum(10.0 / s for s in (1, 2, 3)) / 3)
    assert events[0]["train/foundation_loss"] == events[0]["train/loss"]  # one head: the objective is its loss
    assert events[0]["train/lr"] == pytest.approx(3e-4)
    assert events[0]["train/grad_norm"] == 0.5
    assert events[-1]["train/tokens_seen"] == 70.0 and events[0]["train/padding_ratio"] == 0.0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("step 3/7 | epoch 0 | foundation_loss ")
    assert "| grad_norm 0.5000 | lr 3.0e-04 |" in lines[0] and "| tokens 30 |" in lines[0]
    assert (tmp_path / "loss_curve.png").exists()
    assert any((tmp_path / "tensorboard").iterdir())
    assert [p["step"] for p in logger.series["train/loss"]] == [3, 6, 7]


def test_resume_continues_the_series_and_jsonl_without_duplicates_or_gaps(tmp_path):
    """A checkpoint at step 6 (mid-window: its save logs the window), a crash after logging step 8, a resume."""
    reference = make_logger(tmp_path / "reference", log_interval=4, max_steps=10)
    run(reference, range(1, 7))
    reference.checkpoint_state(6, 0)
    run(reference, range(7, 11))
    reference.close()

    first = make_logger(tmp_path / "run", log_interval=4, max_steps=10)
    run(first, range(1, 7))
    checkpoint = first.checkpoint_state(6, 0)
    run(first, range(7, 10))
    first.abort(9)
    first.close()
    assert [e["step"] for e in jsonl(tmp_path / "run")] == [4, 6, 8]

    second = make_logger(tmp_path / "run", log_interval=4, max_steps=10)
    second.load_state_dict(checkpoint, 6)
    assert [e["step"] for e in jsonl(tmp_path / "run")] == [4, 6]
    assert [p["step"] for p in second.series["train/loss"]] == [4, 6], "the series is read back from metrics.jsonl"
    run(second, range(7, 11))
    second.close()

    assert jsonl(tmp_path / "run", TIME_KEYS) == jsonl(tmp_path / "reference", TIME_KEYS)
    assert [e["step"] for e in jsonl(tmp_path / "run")] == [4, 6, 8, 10]
    timeless = {key: points for key, points in reference.series.items() if key not in TIME_KEYS}
    assert {key: second.series[key] for key in timeless} == timeless
    assert [step for step, _ in read_scalars(tmp_path / "run" / "tensorboard")["train/loss"]] == [4, 6, 8, 10]


def test_a_resume_reads_the_history_and_token_count_back(tmp_path):
    first = make_logger(tmp_path, log_interval=2, max_steps=6, tensorboard=False)
    run(first, range(1, 5))
    state = first.checkpoint_state(4, 0)
    run(first, range(5, 7))  # trained and logged after the checkpoint, then lost
    first.close()
    second = make_logger(tmp_path, log_interval=2, max_steps=6, tensorboard=False)
    second.load_state_dict(state, 4)
    assert state == {"tokens_seen": 40.0}, "the checkpoint holds the token count, no window, no history"
    assert [p["step"] for p in second.series["train/tokens"]] == [2, 4]
    run(second, range(5, 7))
    second.close()
    assert [(e["step"], e["train/tokens_seen"]) for e in jsonl(tmp_path)] == [(2, 20.0), (4, 40.0), (6, 60.0)]


def test_eval_metrics_are_logged_under_eval(tmp_path):
    logger = make_logger(tmp_path)
    out = logger.log_eval(5, 0, {"foundation_loss": torch.tensor(2.5)}, {"perplexity": 12.0, "custom/metric": 1})
    assert out == {"eval/loss": 2.5, "eval/foundation_loss": 2.5, "eval/perplexity": 12.0, "custom/metric": 1}
    assert jsonl(tmp_path) == [{"step": 5, "epoch": 0, **out}]
    assert logger.log_eval(6, 0, {}) == {}  # an empty window writes nothing
    assert len(jsonl(tmp_path)) == 1
    logger.close()


def test_non_scalars_warn_once_per_key_and_never_reach_a_sink(tmp_path, monkeypatch, caplog):
    """Every sink (console, JSONL, TensorBoard, PNG, W&B) gets the scalars only; each non-scalar key warns once."""
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    logger = make_logger(tmp_path, log_interval=1, wandb=True)
    extra = {"hist": torch.randn(64), "table": [[1, 2]], "nested": {"a": {"b": 1}}, "none": None, "nan": math.nan}
    for step in (1, 2):
        train_step(logger, step)
        out = logger.log_eval(step, 0, {"foundation_loss": torch.tensor(1.0 / step)}, extra)
        assert math.isnan(out.pop("eval/nan"))
        assert set(out) == {"eval/loss", "eval/foundation_loss"}
    logger.close()
    messages = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert sorted(m.split("'")[1] for m in messages) == ["eval/hist", "eval/nested", "eval/none", "eval/table"]
    assert jsonl(tmp_path)[1]["eval/nan"] is None
    assert (tmp_path / "loss_curve.png").read_bytes().startswith(b"\x89PNG")
    assert read_scalars(tmp_path / "tensorboard")["eval/loss"] == [(1, 1.0), (2, 0.5)]
    logged = {key for _, values in fake.logged for key in values}
    assert "eval/nan" in logged and not logged & {"eval/hist", "eval/table", "eval/nested", "eval/none"}


def test_non_main_rank_reduces_but_writes_nothing(tmp_path):
    logger = make_logger(tmp_path / "out", ParallelState(dp_size=2, dp_rank=1), log_interval=1)
    assert logger.sinks == []
    record_step(logger, [(1.0, 4)])
    logger.end_step(1, 0)
    assert logger.series["train/foundation_loss"] == [{"step": 1, "epoch": 0, "value": 1.0}]
    assert "train/skipped_steps" not in logger.series, "the main rank alone counts a skipped step"
    assert not (tmp_path / "out").exists()


def test_steps_count_from_one(tmp_path):
    logger = make_logger(tmp_path)
    record_step(logger, [(1.0, 4)])
    with pytest.raises(ValueError, match="steps count from 1"):
        logger.end_step(0, 0, force=True)


def test_the_series_keeps_steps_increasing():
    series: dict = {}
    append_series(series, 1, 0, {"a": 1.0})
    append_series(series, 2, 0, {"a": 2.0, "b": 5})
    append_series(series, 2, 0, {"a": 2.5})  # re-logged step replaces, never duplicates
    assert series["a"] == [{"step": 1, "epoch": 0, "value": 1.0}, {"step": 2, "epoch": 0, "value": 2.5}]
    assert series["b"] == [{"step": 2, "epoch": 0, "value": 5}]
    append_series(series, 1, 0, {"a": 0.5})  # a resumed step 1 drops the later points of that key
    assert series["a"] == [{"step": 1, "epoch": 0, "value": 0.5}] and len(series["b"]) == 1


def test_extra_values_never_overwrite_a_reduced_metric(tmp_path):
    logger = make_logger(tmp_path)
    with pytest.raises(ValueError, match="'eval/loss' would overwrite the reduced metric"):
        logger.log_eval(1, 0, {"foundation_loss": torch.tensor(1.0)}, {"loss": 0.0})
    with pytest.raises(ValueError, match="'eval/foundation_loss' would overwrite"):
        logger.log_eval(1, 0, {"foundation_loss": torch.tensor(1.0)}, {"eval/foundation_loss": 0.0})
    logger.close()


def test_close_with_an_open_window_says_so(tmp_path, caplog):
    logger = make_logger(tmp_path)
    record_step(logger, [(1.0, 4)])
    logger.close()
    assert "the open train window (bookkeeping_wait_s, flops, foundation_loss, grad_norm, lr," in caplog.text
    assert "was never logged" in caplog.text
    caplog.clear()
    logger = make_logger(tmp_path)
    record_step(logger, [(1.0, 4)])
    logger.finish(1, 0)
    logger.close()
    assert caplog.text == ""


def test_events_of_one_step_share_one_jsonl_line(tmp_path):
    logger = make_logger(tmp_path)
    run(logger, range(1, 4))
    logger.log_eval(3, 0, {"foundation_loss": torch.tensor(2.0)})
    logger.close()
    events = jsonl(tmp_path)
    assert [e["step"] for e in events] == [3]
    assert events[0]["eval/loss"] == 2.0 and "train/loss" in events[0]


def test_a_skipped_step_is_counted_once(tmp_path):
    logger = make_logger(tmp_path, log_interval=3)
    for step in (1, 2, 3):
        record_step(logger, [(1.0, 4)], skipped=step == 2)
        logger.end_step(step, 0)
    logger.close()
    assert jsonl(tmp_path)[0]["train/skipped_steps"] == 1.0


# ---------------------------------------------------------------- the step-end worker


def test_log_tasks_run_in_order_off_the_training_thread(tmp_path):
    logger = make_logger(tmp_path, log_interval=1, max_steps=5, async_step_end=True)
    sink = RecordingSink()
    logger.sinks.append(sink)
    for step in range(1, 6):
        record_step(logger, [(float(step), 2)])
        logger.end_step(step, 0)
    logger.wait_bookkeeping()
    assert [step for step, _ in sink.writes] == [1, 2, 3, 4, 5]
    assert all(name.startswith("step-end") for _, name in sink.writes)
    logger.close()


def test_a_failing_log_task_raises_in_the_caller_with_its_traceback(tmp_path):
    logger = make_logger(tmp_path, log_interval=1, async_step_end=True)
    sink = RecordingSink(fail_at=(1,))
    logger.sinks.append(sink)
    for step in (1, 2):  # step 2's task is queued behind the failure: skipped
        record_step(logger, [(1.0, 2)])
        logger.end_step(step, 0)
    with pytest.raises(StepEndError, match="disk full at step 1") as info:
        logger.wait_bookkeeping()
    cause = info.value.__cause__
    assert isinstance(cause, ValueError) and str(cause) == "disk full at step 1"
    assert "write" in [frame.name for frame in traceback.extract_tb(cause.__traceback__)]
    assert sink.writes == [] and [e["step"] for e in jsonl(tmp_path)] == [1]
    record_step(logger, [(1.0, 2)])  # reported once; the worker keeps serving
    logger.end_step(3, 0)
    logger.close()
    assert [step for step, _ in sink.writes] == [3]


def test_a_failure_is_raised_by_close_once(tmp_path):
    logger = make_logger(tmp_path, log_interval=1, async_step_end=True)
    logger.sinks.append(RecordingSink(fail_at=(1,)))
    record_step(logger, [(1.0, 2)])
    logger.end_step(1, 0)
    with pytest.raises(StepEndError, match="disk full at step 1"):
        logger.close()
    logger.close()  # idempotent


def test_close_drains_and_rejects_new_work(tmp_path):
    logger = make_logger(tmp_path, log_interval=1, max_steps=20, async_step_end=True, tensorboard=False, plot=False)
    for step in range(1, 21):
        record_step(logger, [(1.0, 2)])
        logger.end_step(step, 0)
    logger.close()
    assert [e["step"] for e in jsonl(tmp_path)] == list(range(1, 21))
    with pytest.raises(RuntimeError, match="after shutdown"):
        logger.end_step(21, 0, force=True)


def test_abort_drains_without_masking_the_original_error(tmp_path, caplog):
    logger = make_logger(tmp_path, log_interval=1, async_step_end=True)
    logger.sinks.append(RecordingSink(fail_at=(2,)))
    for step in (1, 2):
        record_step(logger, [(1.0, 2)])
        logger.end_step(step, 0)
    record_step(logger, [(1.0, 2)])  # step 3: trained, never logged
    with caplog.at_level(logging.WARNING):
        logger.abort(3)  # an exception is already propagating: nothing raised here
    assert "step-end bookkeeping also failed: ValueError('disk full at step 2')" in caplog.text
    assert "steps 3-3 were trained but not logged" in caplog.text
    assert [e["step"] for e in jsonl(tmp_path)] == [1, 2]


def test_inline_bookkeeping_runs_on_the_calling_thread(tmp_path):
    logger = make_logger(tmp_path, log_interval=1)
    sink = RecordingSink(fail_at=(2,))
    logger.sinks.append(sink)
    train_step(logger, 1)
    assert sink.writes == [(1, threading.current_thread().name)]
    record_step(logger, [(1.0, 2)])
    with pytest.raises(ValueError, match="disk full"):
        logger.end_step(2, 0)
    logger.close()


def test_logging_on_the_worker_while_the_next_step_records(tmp_path):
    logger = make_logger(tmp_path, log_interval=2, max_steps=6, async_step_end=True)
    for step in range(1, 7):
        logger.wait_bookkeeping()  # before the optimizer update: the previous step's bookkeeping is done
        record_step(logger, [(float(step), 3)])
        logger.end_step(step, 0)
    logger.wait_bookkeeping()
    assert [(p["step"], p["value"]) for p in logger.series["train/loss"]] == [(2, 1.5), (4, 3.5), (6, 5.5)]
    logger.close()


def test_a_difference_of_two_means_is_logged_only_when_both_have_a_count(tmp_path):
    """`differences` (KTO's `rewards/margins`): a - b of the window's two means, each over its own count; a window
    where one of them has no count logs no difference (never a - 0)."""
    from veomni_lite.config import LoggingConfig
    from veomni_lite.metrics import MetricLogger, MetricSpec

    specs = [MetricSpec("r/a", "mean"), MetricSpec("r/b", "mean")]
    settings = LoggingConfig(log_interval=1, progress_bar=False, async_step_end=False)
    kwargs = {"loss_names": ["foundation_loss"], "output_dir": tmp_path, "max_steps": 2, "device": torch.device("cpu"),
              "flops_per_token": lambda n: 6.0 * n, "extra_specs": specs}  # fmt: skip
    with pytest.raises(ValueError, match="'r/d' = \\('r/a', 'r/x'\\) needs two declared metrics"):
        MetricLogger(settings, ParallelState(), differences={"r/d": ("r/a", "r/x")}, **kwargs)
    logger = MetricLogger(settings, ParallelState(), differences={"r/d": ("r/a", "r/b")}, **kwargs)
    batch = {"input_ids": torch.ones(1, 3, dtype=torch.long)}
    for step, metrics in ((1, {"r/a": (6.0, 3.0), "r/b": (1.0, 4.0)}), (2, {"r/a": (1.0, 1.0), "r/b": (0.0, 0.0)})):
        for _ in range(2):  # two micro-batches: the means pool their totals and counts
            outputs = {"foundation_loss": torch.tensor(1.0), "metrics": metrics}
            logger.record_micro_batch(outputs, {"foundation_tokens": torch.tensor(3)}, batch)
        logger.record_step(torch.tensor(0.5), lr=1e-4, skipped=False, step_time=0.1, bookkeeping_wait=0.0)
        logger.end_step(step, 0)
    logger.close()
    rows = jsonl(tmp_path)
    assert (rows[0]["r/a"], rows[0]["r/b"], rows[0]["r/d"]) == (2.0, 0.25, 1.75)
    assert rows[1]["r/a"] == 1.0 and "r/b" not in rows[1] and "r/d" not in rows[1]
