"""`MetricReporter`: declared metrics -> windowed cross-rank reduction -> series + sinks.

Per micro-batch/step, every rank calls `record(...)` (local). When `should_log(step)`, EVERY rank calls
`log(step, epoch, extra)` (it reduces across ranks); every rank appends the same reduced values to its series, and
only the main rank writes sinks. Eval metrics have their own window (`record_eval` / `log_eval`) and are logged
under `eval/`. Output files under `output_dir`: metrics.jsonl, tensorboard/, loss_curve.png.

`state_dict()` is the series and this rank's open windows as plain data, for a caller of its own; the trainer's
checkpoints hold neither (`TrainMetrics.checkpoint_state` logs the open window first, and a resume reads the series
back from metrics.jsonl). Resume: `load_state_dict(state)` then `resume(step)`.
`flush()` and `close()` never communicate, so they are safe in exception and SIGTERM paths.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch.distributed as dist

from veomni_lite.distributed.parallel_state import get_parallel_state
from veomni_lite.metrics.accumulator import MetricAccumulator, MetricWindow, Value
from veomni_lite.metrics.scalars import Scalar, split_scalars
from veomni_lite.metrics.series import MetricSeries
from veomni_lite.metrics.sinks import ConsoleSink, Epoch, JsonlSink, LossCurveSink, Sink, TensorBoardSink, WandbSink
from veomni_lite.metrics.spec import MetricSpec

logger = logging.getLogger(__name__)

TRAIN_PREFIX = "train/"
EVAL_PREFIX = "eval/"


def new_metrics_group() -> dist.ProcessGroup | None:
    """A gloo group over all ranks reserved for metric reductions (None without a process group).

    Collective: every rank must call it, in the same order as its other group creations. Use it when logging runs
    on a `StepEndWorker` thread, so metric all-reduces never interleave with the training thread's collectives on
    the same communicator (which can pair mismatched collectives across ranks). Its buffers live on the CPU; its
    timeout is the parallel state's `timeout_s`.
    """
    return get_parallel_state().new_group("gloo")


class MetricReporter:
    """Ties specs, the train/eval windows, the series and the sinks together (see the module docstring).

    `sinks=None` builds the default sinks on the main rank from the flags (console, JSONL, TensorBoard, PNG under
    `output_dir`, plus W&B under `output_dir/wandb` when `wandb_project` is given, with `run_config` as the run's
    config; `console_write` replaces the console's print, e.g. `tqdm.write` or a logger); non-main ranks
    never write, whatever `sinks` says. `is_main_rank=None` means global rank 0. `eval_specs=None` reuses
    `specs` for eval. `group`/`sp_rank` are passed to the accumulators (see `MetricAccumulator`).
    """

    def __init__(
        self,
        specs: Iterable[MetricSpec],
        output_dir: str | os.PathLike[str] | None = None,
        *,
        log_interval: int = 1,
        max_steps: int | None = None,
        is_main_rank: bool | None = None,
        eval_specs: Iterable[MetricSpec] | None = None,
        sinks: Sequence[Sink] | None = None,
        console: bool = True,
        jsonl: bool = True,
        tensorboard: bool = True,
        loss_curve: bool = True,
        wandb_project: str | None = None,
        run_config: Mapping[str, Any] | None = None,
        plot_keys: Sequence[str] | None = None,
        console_write: Callable[[str], None] | None = None,
        group: dist.ProcessGroup | None = None,
        sp_rank: int | None = None,
        extra_formats: Mapping[str, str] | None = None,
    ) -> None:
        if log_interval < 1:
            raise ValueError(f"MetricReporter: log_interval must be >= 1; got {log_interval}")
        specs = list(specs)
        eval_specs = specs if eval_specs is None else list(eval_specs)
        self.log_interval = log_interval
        self.max_steps = max_steps
        if is_main_rank is None:
            is_main_rank = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
        self.is_main_rank = is_main_rank
        self.output_dir = Path(output_dir) if output_dir is not None else None
        self.train = MetricAccumulator(specs, group=group, sp_rank=sp_rank)
        self.eval = MetricAccumulator(eval_specs, group=group, sp_rank=sp_rank)
        self.series = MetricSeries()
        self.formats = {TRAIN_PREFIX + s.name: s.fmt for s in specs} | {EVAL_PREFIX + s.name: s.fmt for s in eval_specs}
        self.formats.update(extra_formats or {})
        self._warned: set[str] = set()
        if sinks is not None:
            self.sinks = list(sinks) if is_main_rank else []
        elif is_main_rank:
            self.sinks = self._default_sinks(console, jsonl, tensorboard, loss_curve, plot_keys, console_write)
            if wandb_project is not None:
                if self.output_dir is None:
                    raise ValueError("MetricReporter: output_dir is required for the wandb sink")
                self.sinks.append(WandbSink(self.output_dir / "wandb", wandb_project, run_config))
        else:
            self.sinks = []

    def _default_sinks(
        self,
        console: bool,
        jsonl: bool,
        tensorboard: bool,
        loss_curve: bool,
        plot_keys: Sequence[str] | None,
        console_write: Callable[[str], None] | None,
    ) -> list[Sink]:
        sinks: list[Sink] = []
        if console:
            sinks.append(ConsoleSink(self.formats, self.max_steps, write_line=console_write))
        if self.output_dir is None:
            if jsonl or tensorboard or loss_curve:
                raise ValueError("MetricReporter: output_dir is required for the jsonl/tensorboard/loss_curve sinks")
            return sinks
        if jsonl:
            sinks.append(JsonlSink(self.output_dir / "metrics.jsonl"))
        if tensorboard:
            sinks.append(TensorBoardSink(self.output_dir / "tensorboard"))
        if loss_curve:
            sinks.append(LossCurveSink(self.output_dir / "loss_curve.png", self.series, plot_keys))
        return sinks

    # ---- recording (local) ----

    def record(self, name: str, value: Value, count: Value | None = None) -> None:
        """Record a train metric into the open window (no collective, no host read; see `MetricAccumulator`)."""
        self.train.record(name, value, count)

    def record_total(self, name: str, total: Value, count: Value) -> None:
        """Record a count-weighted total of a `mean` train metric (see `MetricAccumulator.record_total`)."""
        self.train.record_total(name, total, count)

    def record_eval(self, name: str, value: Value, count: Value | None = None) -> None:
        """Record an eval metric into the open eval window."""
        self.eval.record(name, value, count)

    def should_log(self, step: int) -> bool:
        """True on every `log_interval`-th step and on the final step (`max_steps`)."""
        return step % self.log_interval == 0 or (self.max_steps is not None and step == self.max_steps)

    def take_window(self) -> MetricWindow:
        """Hand the open train window over for an asynchronous `log(..., window=...)`; a new window opens."""
        return self.train.take_window()

    # ---- log events (collective: every rank calls them) ----

    def log(
        self,
        step: int,
        epoch: Epoch,
        extra: Mapping[str, object] | None = None,
        window: MetricWindow | None = None,
        derive: Callable[[Mapping[str, float]], Mapping[str, object]] | None = None,
    ) -> dict[str, Scalar]:
        """Reduce the train window across ranks and report it at `step`; returns the logged scalars.

        `extra` adds values measured outside the window (a bare key gets the "train/" prefix, "a/b" is kept);
        `derive(reduced)` adds values computed from the reduced ones (e.g. a total or a rate), keyed the same way.
        `window=None` reduces the open window (reset after success); pass the result of `take_window()` when
        this runs on another thread. Non-scalar values are skipped with one warning per key.
        """
        reduced = self.train.reduce(window)
        if derive is not None and reduced:
            extra = {**(extra or {}), **derive(reduced)}
        return self._report(step, epoch, TRAIN_PREFIX, reduced, extra)

    def log_eval(self, step: int, epoch: Epoch, extra: Mapping[str, object] | None = None) -> dict[str, Scalar]:
        """Reduce the eval window across ranks and report it under "eval/" at `step`."""
        return self._report(step, epoch, EVAL_PREFIX, self.eval.reduce(), extra)

    def _report(
        self, step: int, epoch: Epoch, prefix: str, reduced: Mapping[str, float], extra: Mapping[str, object] | None
    ) -> dict[str, Scalar]:
        if step < 1:
            raise ValueError(f"MetricReporter: steps count from 1; got step {step}")
        values: dict[str, object] = {prefix + name: value for name, value in reduced.items()}
        for key, value in (extra or {}).items():
            full_key = key if "/" in key else prefix + key
            if full_key in values:
                raise ValueError(
                    f"MetricReporter: extra or derived value {full_key!r} would overwrite the reduced metric of that "
                    f"name at step {step}; give it a distinct name"
                )
            values[full_key] = value
        scalars = split_scalars(values, self._warned if self.is_main_rank else None)
        if not scalars:
            return scalars
        self.series.append(step, epoch, scalars)
        for sink in self.sinks:
            sink.write(step, epoch, scalars)
        return scalars

    # ---- lifecycle (local: never communicates) ----

    def flush(self) -> None:
        """Push everything written so far to disk (JSONL is already flushed per event)."""
        for sink in self.sinks:
            sink.flush()

    def close(self) -> None:
        """Flush and close every sink; a later log reopens them (appending).

        An open window cannot be logged here (its reduction is a collective, and close is local), so a non-empty one
        is reported with a warning naming its metrics, never dropped silently; call `log()` first to keep it.
        """
        for name, accumulator in (("train", self.train), ("eval", self.eval)):
            if not accumulator.is_empty:
                logger.warning(
                    "MetricReporter.close(): the open %s window (%s) was never logged: its cross-rank reduction is a "
                    "collective and close() is local; call log()/log_eval() on every rank before close()",
                    name,
                    ", ".join(sorted(accumulator.recorded_names())),
                )
        for sink in self.sinks:
            sink.close()

    def __enter__(self) -> MetricReporter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ---- checkpoint / resume ----

    def state_dict(self) -> dict[str, Any]:
        """{"series": ..., "train_window": ..., "eval_window": ...} as plain Python data; windows are rank-local."""
        return {
            "series": self.series.state_dict(),
            "train_window": self.train.state_dict(),
            "eval_window": self.eval.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the series and this rank's open windows (missing parts restore as empty)."""
        self.series.load_state_dict(state.get("series", {}))
        self.train.load_state_dict(state.get("train_window", {}))
        self.eval.load_state_dict(state.get("eval_window", {}))

    def resume(self, step: int) -> None:
        """Continue after checkpoint `step`: drop later series points; the main rank truncates metrics.jsonl to
        step <= `step` and TensorBoard purges later steps when it reopens. Local, no collective."""
        self.series.truncate(step)
        for sink in self.sinks:
            sink.resume(step, self.series)
