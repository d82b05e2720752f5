"""Where log events go: console, metrics.jsonl, TensorBoard, loss_curve.png.

Contract of every sink: `write(step, epoch, values)` takes a mapping of key -> value; scalars are written and any
other value (tensor with several elements, list, dict, None, ...) is skipped with one warning per key, never an
exception. `resume(step, series)` makes the sink continue after `step` (drop what a crashed run wrote later).
Files and writers open lazily on first use, so `resume` can run after construction.
TensorBoard and matplotlib are imported only when their sink first writes.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from veomni_lite.metrics.scalars import Scalar, split_scalars
from veomni_lite.metrics.series import MetricSeries, SeriesPoint
from veomni_lite.metrics.spec import format_value

logger = logging.getLogger(__name__)

Epoch = int | float | None


class Sink:
    """Base sink: subclasses implement `write`; flush/close/resume default to no-ops."""

    def __init__(self) -> None:
        self._warned: set[str] = set()

    def scalars(self, values: Mapping[str, object]) -> dict[str, Scalar]:
        """The scalar part of `values`, warning once per skipped key for this sink."""
        return split_scalars(values, self._warned)

    def write(self, step: int, epoch: Epoch, values: Mapping[str, object]) -> None:
        raise NotImplementedError

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.flush()

    def resume(self, step: int, series: MetricSeries) -> None:
        pass


class ConsoleSink(Sink):
    """One line per event: `step 10/100 | epoch 0 | loss 2.3456 | lr 1.0e-04`.

    `formats` maps a key to its `format()` spec (unknown keys get a readable default); keys starting with
    `strip_prefix` are shown without it. `write_line` defaults to printing to stdout with a flush.
    """

    def __init__(
        self,
        formats: Mapping[str, str] | None = None,
        max_steps: int | None = None,
        strip_prefix: str = "train/",
        write_line: Callable[[str], None] | None = None,
    ) -> None:
        super().__init__()
        self.formats = dict(formats or {})
        self.max_steps = max_steps
        self.strip_prefix = strip_prefix
        self._write_line = write_line or (lambda line: print(line, file=sys.stdout, flush=True))

    def format_line(self, step: int, epoch: Epoch, values: Mapping[str, object]) -> str:
        parts = [f"step {step}/{self.max_steps}" if self.max_steps else f"step {step}"]
        if epoch is not None:
            parts.append(f"epoch {epoch}" if isinstance(epoch, int) else f"epoch {epoch:.2f}")
        for key, value in self.scalars(values).items():
            label = key[len(self.strip_prefix) :] if self.strip_prefix and key.startswith(self.strip_prefix) else key
            parts.append(f"{label} {format_value(value, self.formats.get(key))}")
        return " | ".join(parts)

    def write(self, step: int, epoch: Epoch, values: Mapping[str, object]) -> None:
        self._write_line(self.format_line(step, epoch, values))


def _json_number(value: Scalar) -> Scalar | None:
    # Strict JSON has no NaN/inf: they are written as null so any JSON reader can parse the file.
    return value if isinstance(value, int) or math.isfinite(value) else None


class JsonlSink(Sink):
    """Appends one JSON object per event, `{"step": s, "epoch": e, key: value, ...}`, flushed after each event.

    Non-finite floats are written as null. `resume(step)` rewrites the file keeping only events with
    step <= `step` (unparseable lines, e.g. a line torn by a crash, are dropped with a warning) and the series is
    reloaded from the kept lines: the file, appended to at every log, is the run's durable history, so checkpoints
    need not carry it. When the file does not exist it is rebuilt from the series, so a resumed run's file has no
    duplicates and no gaps either way.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        super().__init__()
        self.path = Path(path)
        self._file: IO[str] | None = None
        self._last: tuple[int, int, dict[str, Any]] | None = None  # (step, offset of its line, record)

    def write(self, step: int, epoch: Epoch, values: Mapping[str, object]) -> None:
        """Append one line; an event at the step of the previous line (e.g. eval after train) is merged into it, so
        every step has one line."""
        record: dict[str, Any] = {"step": step, "epoch": epoch}
        record.update({key: _json_number(value) for key, value in self.scalars(values).items()})
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - kept open across events
        if self._last is not None and self._last[0] == step:
            _, offset, previous = self._last
            record = {**previous, **record}
            self._file.truncate(offset)
        self._file.seek(0, os.SEEK_END)
        self._last = (step, self._file.tell(), record)
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def resume(self, step: int, series: MetricSeries) -> None:
        self.close()
        self._last = None
        if self.path.exists():
            lines, events = [], []
            for number, line in enumerate(self.path.read_text(encoding="utf-8").splitlines(), start=1):
                if not line.strip():
                    continue
                try:
                    event = json.loads(line)
                    event_step = int(event["step"])
                except (ValueError, KeyError, TypeError):
                    logger.warning("metrics: dropping unreadable line %d of %s", number, self.path)
                    continue
                if event_step <= step:
                    lines.append(line)
                    events.append(event)
            series.load_events(events)
        else:
            events = [e for e in series.events() if e["step"] <= step]
            lines = [json.dumps({k: _json_number(v) if k != "epoch" else v for k, v in e.items()}) for e in events]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
        os.replace(tmp, self.path)


class TensorBoardSink(Sink):
    """Scalars via `torch.utils.tensorboard.SummaryWriter` under `log_dir`.

    After `resume(step)` the writer opens with `purge_step=step + 1`, so TensorBoard discards the events a crashed
    run wrote after the checkpoint.
    """

    def __init__(self, log_dir: str | os.PathLike[str]) -> None:
        super().__init__()
        self.log_dir = Path(log_dir)
        self._writer: Any = None
        self._purge_step: int | None = None

    def write(self, step: int, epoch: Epoch, values: Mapping[str, object]) -> None:
        scalars = self.scalars(values)
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(self.log_dir), purge_step=self._purge_step)
            self._purge_step = None
        for key, value in scalars.items():
            self._writer.add_scalar(key, value, global_step=step)

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def resume(self, step: int, series: MetricSeries) -> None:
        self.close()
        self._purge_step = step + 1


class WandbSink(Sink):
    """Scalars to Weights & Biases (optional: `pip install -e .[wandb]`), offline unless configured otherwise.

    The run lives under `run_dir` (`WANDB_DIR` is not needed); the mode is `WANDB_MODE` when set, else "offline", so
    nothing leaves the machine unless the user asks (`wandb sync` uploads an offline run later). The run id is kept in
    `run_dir/run_id`, so a resumed training run continues the same W&B run; W&B keeps the points it already has, and
    steps at or before the checkpoint's are not written again.
    """

    def __init__(self, run_dir: str | os.PathLike[str], project: str, config: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        self.run_dir = Path(run_dir)
        self.project = project
        self.config = dict(config or {})
        self._run: Any = None
        self._min_step = 0

    def _start(self) -> Any:
        try:
            import wandb
        except ImportError as exc:
            raise ImportError("logging.wandb needs the wandb package: pip install -e .[wandb]") from exc
        self.run_dir.mkdir(parents=True, exist_ok=True)
        id_file = self.run_dir / "run_id"
        run_id = id_file.read_text().strip() if id_file.exists() else wandb.util.generate_id()
        id_file.write_text(run_id)
        return wandb.init(
            project=self.project,
            id=run_id,
            resume="allow",
            dir=str(self.run_dir),
            mode=os.environ.get("WANDB_MODE", "offline"),
            config=self.config,
        )

    def write(self, step: int, epoch: Epoch, values: Mapping[str, object]) -> None:
        scalars = self.scalars(values)
        if step <= self._min_step:
            return
        if self._run is None:
            self._run = self._start()
        self._run.log({**scalars, "epoch": epoch}, step=step)

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None

    def resume(self, step: int, series: MetricSeries) -> None:
        self.close()
        self._min_step = step


class LossCurveSink(Sink):
    """`loss_curve.png`: the chosen keys of a `MetricSeries` against step.

    Its cost per event stays flat however long the run: it redraws at most once per `min_interval_s` (and on flush,
    i.e. at checkpoints and at the end), each time from at most `max_points` evenly strided points per key (the last
    point always included). `keys=None` plots every key whose last path component ends with "loss" (train/loss,
    train/foundation_loss, eval/loss, ...). The sink reads the series it is given (the reporter appends to it before
    writing), so after a resume the curve includes the restored history. Drawn with matplotlib's object API and the
    Agg canvas (no pyplot global state), so it is safe off the main thread; the file is replaced atomically.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        series: MetricSeries,
        keys: Sequence[str] | None = None,
        max_points: int = 2000,
        min_interval_s: float = 30.0,
    ) -> None:
        super().__init__()
        self.path = Path(path)
        self.series = series
        self.keys = list(keys) if keys is not None else None
        self.max_points = max_points
        self.min_interval_s = min_interval_s
        self._dirty = False
        self._drawn_at = -math.inf

    def plot_keys(self) -> list[str]:
        if self.keys is not None:
            return [k for k in self.keys if k in self.series]
        return sorted(k for k in self.series if k.rsplit("/", 1)[-1].endswith("loss"))

    def write(self, step: int, epoch: Epoch, values: Mapping[str, object]) -> None:
        self._dirty = True
        if time.monotonic() - self._drawn_at >= self.min_interval_s:
            self.redraw()

    def flush(self) -> None:
        if self._dirty:
            self.redraw()

    def points(self, key: str) -> list[SeriesPoint]:
        """At most `max_points` of `key`'s points, evenly strided, ending with the newest."""
        points = self.series[key]
        stride = max(1, math.ceil(len(points) / self.max_points))
        return points[len(points) - 1 :: -stride][::-1]

    def resume(self, step: int, series: MetricSeries) -> None:
        self._dirty = True

    def redraw(self) -> None:
        keys = self.plot_keys()
        self._dirty = False
        if not keys:
            return
        self._drawn_at = time.monotonic()
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator

        figure = Figure(figsize=(8, 4.5), dpi=100)
        FigureCanvasAgg(figure)
        axes = figure.add_subplot()
        for key in keys:
            points = self.points(key)
            steps = [p["step"] for p in points]
            values = [float(p["value"]) if math.isfinite(float(p["value"])) else math.nan for p in points]
            axes.plot(steps, values, marker="." if len(points) < 50 else None, label=key)
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))
        axes.set_xlabel("step")
        axes.set_ylabel("loss")
        axes.grid(True, alpha=0.3)
        axes.legend()
        figure.tight_layout()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp.png")
        figure.savefig(tmp, format="png")
        os.replace(tmp, self.path)
