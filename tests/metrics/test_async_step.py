from __future__ import annotations

import threading
import time
import traceback

import pytest

from veomni_lite.metrics import MetricReporter, MetricSpec, StepEndError, StepEndWorker


def failing_bookkeeping(step: int) -> None:
    raise ValueError(f"disk full at step {step}")


def test_tasks_run_in_order_off_the_calling_thread():
    done: list[tuple[int, str]] = []
    with StepEndWorker() as worker:
        for step in range(5):
            worker.submit(lambda s: (time.sleep(0.002), done.append((s, threading.current_thread().name))), step)
        worker.wait()
        assert [s for s, _ in done] == list(range(5))
        assert {name for _, name in done} == {"step-end-worker"}


def test_a_failing_task_raises_in_the_caller_with_its_traceback():
    ran: list[int] = []
    worker = StepEndWorker()
    worker.submit(failing_bookkeeping, 7)
    worker.submit(ran.append, 1)  # queued behind the failure: skipped
    with pytest.raises(StepEndError, match="failing_bookkeeping failed") as info:
        worker.wait()
    cause = info.value.__cause__
    assert isinstance(cause, ValueError) and str(cause) == "disk full at step 7"
    assert "failing_bookkeeping" in [frame.name for frame in traceback.extract_tb(cause.__traceback__)]
    assert ran == []
    worker.submit(ran.append, 2)  # reported once; the worker keeps serving
    worker.close()
    assert ran == [2]


def test_failure_is_raised_at_the_next_submit_or_close():
    worker = StepEndWorker()
    worker.submit(failing_bookkeeping, 1)
    time.sleep(0.05)
    with pytest.raises(StepEndError):
        worker.submit(print, "never")
    worker.close()

    worker = StepEndWorker()
    worker.submit(failing_bookkeeping, 2)
    with pytest.raises(StepEndError, match="disk full at step 2"):
        worker.close()
    worker.close()  # idempotent


def test_close_drains_and_rejects_new_work():
    done: list[int] = []
    worker = StepEndWorker()
    for step in range(20):
        worker.submit(lambda s: (time.sleep(0.001), done.append(s)), step)
    worker.close()
    assert done == list(range(20))
    with pytest.raises(RuntimeError, match="after close"):
        worker.submit(done.append, 0)


def test_exit_with_an_exception_drains_without_masking_it():
    done: list[int] = []
    with pytest.raises(KeyError, match="original"), StepEndWorker() as worker:
        worker.submit(done.append, 1)
        worker.submit(failing_bookkeeping, 3)
        raise KeyError("original")
    assert done == [1]


def test_disabled_worker_runs_inline():
    worker = StepEndWorker(enabled=False)
    done: list[str] = []
    worker.submit(lambda: done.append(threading.current_thread().name))
    assert done == [threading.current_thread().name]
    with pytest.raises(ValueError, match="disk full"):
        worker.submit(failing_bookkeeping, 1)
    worker.close()


def test_logging_on_the_worker_while_the_next_step_records(tmp_path):
    reporter = MetricReporter([MetricSpec("loss", "mean")], tmp_path, log_interval=2, is_main_rank=True, console=False)
    with StepEndWorker() as worker:
        for step in range(1, 7):
            worker.wait()  # before the optimizer update: the previous step's bookkeeping is done
            reporter.record("loss", float(step))
            if reporter.should_log(step):
                worker.submit(reporter.log, step, 0, None, reporter.take_window())
        worker.wait()
        assert [(p["step"], p["value"]) for p in reporter.series["train/loss"]] == [(2, 1.5), (4, 3.5), (6, 5.5)]
    reporter.close()
