"""`StepEndWorker`: one thread that runs step-end bookkeeping (log reduction, sink writes, gc) off the critical path.

Ordering. Tasks run one at a time in submission (FIFO) order, so log lines and JSONL events stay in step order,
but a task's output can appear after what the training thread printed for later steps. `wait()` is the barrier:
call it before the next optimizer update, before a checkpoint reads the reporter's state, and before eval logs.

Collectives. Every rank submits the same tasks in the same order and the worker runs them one at a time, so the
collectives issued from this thread are issued in the same order on every rank. They must not share a
communicator with the training thread's collectives (whose relative timing differs per rank): reduce metrics over a
dedicated group (`veomni_lite.metrics.reporter.new_metrics_group()`).

Errors. An exception in a task is stored, the tasks queued behind it are skipped, and the caller gets a
`StepEndError` (its `__cause__` is the task's own exception with its traceback) at the next `submit()`, `wait()`
or `close()`. `enabled=False` runs tasks inline in `submit()`, for debugging.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

import torch

logger = logging.getLogger(__name__)

_Task = tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any], int | None]


def _current_cuda_device() -> int | None:
    # The current CUDA device is per thread: a task runs on the device its submitter had selected.
    return torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None


class StepEndError(RuntimeError):
    """A step-end task failed; `__cause__` is the original exception."""


class StepEndWorker:
    """One FIFO worker thread for step-end bookkeeping (see the module docstring)."""

    def __init__(self, *, enabled: bool = True, name: str = "step-end-worker") -> None:
        self.enabled = enabled
        self._queue: queue.Queue[_Task | None] = queue.Queue()
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._failed_task = ""
        self._closed = False
        self._thread: threading.Thread | None = None
        if enabled:
            self._thread = threading.Thread(target=self._run, name=name, daemon=True)
            self._thread.start()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> None:
        """Queue `fn(*args, **kwargs)`; first re-raises a pending task failure."""
        self._raise_pending()
        if self._closed:
            raise RuntimeError("StepEndWorker.submit after close()")
        if not self.enabled:
            fn(*args, **kwargs)
            return
        self._queue.put((fn, args, kwargs, _current_cuda_device()))

    def wait(self) -> None:
        """Block until every submitted task has run; re-raise a task failure."""
        if self.enabled and not self._closed:
            self._queue.join()
        self._raise_pending()

    def close(self) -> None:
        """Run what is queued, stop the thread, and re-raise a task failure. Idempotent."""
        if not self._closed:
            self._closed = True
            if self._thread is not None:
                self._queue.put(None)
                self._thread.join()
        self._raise_pending()

    def __enter__(self) -> StepEndWorker:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        if exc_type is None:
            self.close()
            return
        try:  # an exception is already propagating: drain, but do not mask it
            self.close()
        except StepEndError:
            logger.exception("step-end task failed while handling another exception")

    def _raise_pending(self) -> None:
        with self._lock:
            error, self._error = self._error, None
            name = self._failed_task
        if error is not None:
            raise StepEndError(f"step-end task {name} failed: {error!r}") from error

    def _run(self) -> None:
        while True:
            task = self._queue.get()
            try:
                if task is None:
                    return
                fn, args, kwargs, cuda_device = task
                with self._lock:
                    skip = self._error is not None
                if not skip:
                    if cuda_device is not None and torch.cuda.current_device() != cuda_device:
                        torch.cuda.set_device(cuda_device)
                    fn(*args, **kwargs)
            except BaseException as exc:  # noqa: BLE001 - any failure must reach the training thread
                with self._lock:
                    self._error = exc
                    self._failed_task = getattr(fn, "__qualname__", repr(fn))
            finally:
                self._queue.task_done()
