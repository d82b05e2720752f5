"""Where logged scalars go: the console, metrics.jsonl, TensorBoard, loss_curve.png and (optionally) W&B.

A sink gets `write(step, epoch, scalars)` with Python numbers only, `flush()`, `close()` (a later write reopens,
appending) and `resume(step)` (continue after checkpoint `step`, dropping what a crashed run wrote later). Files,
writers and optional packages open on first use.
"""

from __future__ import annotations

import json
import logging
import math
import numbers
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import torch

logger = logging.getLogger(__name__)

Scalar = int | float
Epoch = int | float | None
Series = dict[str, list[dict[str, Any]]]  # key -> [{"step", "epoch", "value"}], steps increasing
Panel = tuple[str, Sequence[str]]  # one axes of a figure: its y label and the series keys drawn on it


def as_scalar(value: object) -> Scalar | None:
    """`value` as a Python int/float (bool as int; a one-element tensor or array read to the host), else None."""
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    one = isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex()
    if one or (not isinstance(value, torch.Tensor) and getattr(value, "size", None) == 1 and hasattr(value, "item")):
        return as_scalar(value.item())  # type: ignore[union-attr]
    return None


def scalars(values: Mapping[str, object], warned: set[str] | None) -> dict[str, Scalar]:
    """The scalar entries of `values`, in order; a key's first drop warns naming it (`warned` None: silently)."""
    out = {key: as_scalar(value) for key, value in values.items()}
    for key in [key for key, value in out.items() if value is None]:
        if warned is not None and key not in warned:
            warned.add(key)
            kind = type(values[key]).__name__
            logger.warning("metrics: skipping %r: a %s is not a scalar (later values are skipped silently)", key, kind)
    return {key: value for key, value in out.items() if value is not None}


def format_value(value: Scalar, fmt: str | None = None) -> str:
    """`value` with `fmt`; without one (or when it does not apply) a default that never shows 1e-4 as 0.0000."""
    try:
        return format(value, fmt) if fmt is not None else _default(value)
    except (ValueError, TypeError):
        return _default(value)


def _default(value: Scalar) -> str:
    if isinstance(value, int) or not math.isfinite(value) or value == 0.0:
        return str(value)
    return f"{value:.4f}" if 1e-3 <= abs(value) < 1e5 else f"{value:.3e}"


def append_series(series: Series, step: int, epoch: Epoch, values: Mapping[str, Scalar]) -> None:
    """Add one event; a key's earlier points at step >= `step` are dropped, so a step never appears twice."""
    if step < 1:
        raise ValueError(f"metrics: steps count from 1; got step {step}")
    for key, value in values.items():
        points = series.setdefault(key, [])
        while points and points[-1]["step"] >= step:
            points.pop()
        points.append({"step": step, "epoch": epoch, "value": value})


class Sink:
    """`write` scalars at a step; `flush`; `close` (a later write reopens, appending); `resume` after a step."""

    def write(self, step: int, epoch: Epoch, values: Mapping[str, Scalar]) -> None: ...
    def flush(self) -> None: ...
    def close(self) -> None: ...
    def resume(self, step: int) -> None: ...


class ConsoleSink(Sink):
    """One line per event, `step 10/100 | epoch 0 | loss 2.3456 | lr 1.0e-04`, the "train/" prefix left out."""

    def __init__(self, formats: Mapping[str, str], max_steps: int | None, write_line: Callable[[str], None] = print):
        self.formats, self.max_steps, self.write_line = formats, max_steps, write_line

    def write(self, step: int, epoch: Epoch, values: Mapping[str, Scalar]) -> None:
        parts = [f"step {step}/{self.max_steps}" if self.max_steps else f"step {step}"]
        if epoch is not None:
            parts.append(f"epoch {epoch}" if isinstance(epoch, int) else f"epoch {epoch:.2f}")
        parts += [f"{k.removeprefix('train/')} {format_value(v, self.formats.get(k))}" for k, v in values.items()]
        self.write_line(" | ".join(parts))


class JsonlSink(Sink):
    """One JSON object per step, `{"step", "epoch", key: value, ...}` (non-finite as null), flushed at once; a second
    event at the same step (eval after train) is merged into its line. It is the run's durable history: `resume(step)`
    keeps the lines up to `step` (a torn line is dropped with a warning) and reads them back into the series; a run
    that did not resume starts the file anew (an earlier run's lines in the same output directory are not its own)."""

    def __init__(self, path: str | os.PathLike[str], series: Series) -> None:
        self.path, self.series = Path(path), series
        self._resumed = False
        self._file: IO[str] | None = None
        self._last: tuple[int, int, dict[str, Any]] | None = None  # (step, offset of its line, record)

    def write(self, step: int, epoch: Epoch, values: Mapping[str, Scalar]) -> None:
        finite = {k: v if isinstance(v, int) or math.isfinite(v) else None for k, v in values.items()}
        record = {"step": step, "epoch": epoch, **finite}
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            mode = "a" if self._resumed else "w"
            self._file = open(self.path, mode, encoding="utf-8")  # noqa: SIM115 - kept open across events
            self._resumed = True  # later opens (after a close) continue the file
        if self._last is not None and self._last[0] == step:
            record = {**self._last[2], **record}
            self._file.truncate(self._last[1])
        self._file.seek(0, os.SEEK_END)
        self._last = (step, self._file.tell(), record)
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def resume(self, step: int) -> None:
        self.close()
        self._resumed = True
        self._last, kept = None, []
        text = self.path.read_text(encoding="utf-8") if self.path.exists() else ""
        for number, line in enumerate(text.splitlines(), start=1):
            try:
                event = json.loads(line)
                event_step = int(event["step"])
            except (ValueError, KeyError, TypeError):
                if line.strip():
                    logger.warning("metrics: dropping unreadable line %d of %s", number, self.path)
                continue
            if event_step <= step:
                kept.append(line + "\n")
                values = {k: v for k, v in event.items() if k not in ("step", "epoch") and v is not None}
                append_series(self.series, event_step, event.get("epoch"), values)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(kept), encoding="utf-8")
        os.replace(tmp, self.path)


class TensorBoardSink(Sink):
    """Scalars through `SummaryWriter(log_dir)`; after `resume(step)` it reopens with `purge_step=step + 1`, so
    TensorBoard drops what a crashed run wrote after the checkpoint."""

    def __init__(self, log_dir: str | os.PathLike[str]) -> None:
        self.log_dir = Path(log_dir)
        self._writer: Any = None
        self._purge_step: int | None = None

    def _open(self) -> Any:
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(self.log_dir), purge_step=self._purge_step)
            self._purge_step = None
        return self._writer

    def write(self, step: int, epoch: Epoch, values: Mapping[str, Scalar]) -> None:
        writer = self._open()
        for key, value in values.items():
            writer.add_scalar(key, value, global_step=step)

    def write_text(self, step: int, tag: str, text: str) -> None:
        """Text (markdown) under `tag` in TensorBoard's text tab."""
        self._open().add_text(tag, text, global_step=step)

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def resume(self, step: int) -> None:
        self.close()
        self._purge_step = step + 1


class WandbSink(Sink):
    """Weights & Biases (`pip install -e .[wandb]`) under `run_dir`, offline unless `WANDB_MODE` says otherwise. The
    run id is kept in `run_dir/run_id`, so a resumed run continues the same W&B run and skips steps <= the
    checkpoint's."""

    def __init__(self, run_dir: str | os.PathLike[str], project: str, config: Mapping[str, Any] | None = None):
        self.run_dir, self.project, self.config = Path(run_dir), project, dict(config or {})
        self._run: Any = None
        self._min_step = 0

    def write(self, step: int, epoch: Epoch, values: Mapping[str, Scalar]) -> None:
        if step <= self._min_step:
            return
        if self._run is None:
            try:
                import wandb
            except ImportError as exc:
                raise ImportError("logging.wandb needs the wandb package: pip install -e .[wandb]") from exc
            self.run_dir.mkdir(parents=True, exist_ok=True)
            id_file = self.run_dir / "run_id"
            run_id = id_file.read_text().strip() if id_file.exists() else wandb.util.generate_id()
            id_file.write_text(run_id)
            mode = os.environ.get("WANDB_MODE", "offline")
            self._run = wandb.init(
                project=self.project, id=run_id, resume="allow", dir=str(self.run_dir), mode=mode, config=self.config
            )
        self._run.log({**values, "epoch": epoch}, step=step)

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None

    def resume(self, step: int) -> None:
        self.close()
        self._min_step = step


class LossCurveSink(Sink):
    """`loss_curve.png` of the series' `keys` (default: every key whose last part ends with "loss") against step, at
    a cost flat in the run's length: redrawn at most once per `min_interval_s` (and on flush: checkpoints, the end),
    from at most `max_points` evenly strided points per key, the newest included. Drawn on matplotlib's Agg canvas (no
    pyplot state, safe off the main thread); the file is replaced atomically. `panels`, in place of `keys` and
    `ylabel`: one axes per (y label, keys), stacked over a shared step axis, so quantities of different scales each
    get their own; a panel none of whose keys has a point yet is left out."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        series: Series,
        keys: Sequence[str] | None = None,
        max_points: int = 2000,
        min_interval_s: float = 30.0,
        ylabel: str = "loss",
        panels: Sequence[Panel] | None = None,
    ):
        self.path, self.series, self.keys, self.ylabel = Path(path), series, keys, ylabel
        self.panels = [(label, list(keys)) for label, keys in panels] if panels is not None else None
        self.max_points, self.min_interval_s = max_points, min_interval_s
        self._dirty, self._drawn_at = False, -math.inf

    def plot_keys(self) -> list[str]:
        """Every key the figure draws now (over its panels)."""
        if self.panels is not None:
            return [key for _, keys in self.plot_panels() for key in keys]
        if self.keys is not None:
            return [k for k in self.keys if k in self.series]
        return sorted(k for k in self.series if k.rsplit("/", 1)[-1].endswith("loss"))

    def plot_panels(self) -> list[tuple[str, list[str]]]:
        """The figure's axes now: (y label, the keys with points), the empty ones left out."""
        if self.panels is None:
            keys = self.plot_keys()
            return [(self.ylabel, keys)] if keys else []
        drawn = [(label, [k for k in keys if k in self.series]) for label, keys in self.panels]
        return [(label, keys) for label, keys in drawn if keys]

    def points(self, key: str) -> list[dict[str, Any]]:
        points = self.series[key]
        return points[len(points) - 1 :: -max(1, math.ceil(len(points) / self.max_points))][::-1]

    def write(self, step: int, epoch: Epoch, values: Mapping[str, Scalar]) -> None:
        self._dirty = True
        if time.monotonic() - self._drawn_at >= self.min_interval_s:
            self.redraw()

    def flush(self) -> None:
        if self._dirty:
            self.redraw()

    close = flush

    def resume(self, step: int) -> None:
        self._dirty = True

    def figure(self) -> Any | None:
        """The figure as it would be drawn now (a matplotlib `Figure`, one axes per panel); None: nothing to draw."""
        panels = self.plot_panels()
        if not panels:
            return None
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator

        figure = Figure(figsize=(8, 4.5 if len(panels) == 1 else 1.2 + 2.4 * len(panels)), dpi=100)
        FigureCanvasAgg(figure)
        all_axes = figure.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
        for axes, (label, keys) in zip(all_axes, panels):
            for key in keys:
                points = self.points(key)
                values = [float(p["value"]) if math.isfinite(float(p["value"])) else math.nan for p in points]
                axes.plot([p["step"] for p in points], values, marker="." if len(points) < 50 else None, label=key)
            axes.xaxis.set_major_locator(MaxNLocator(integer=True))
            axes.set(ylabel=label)
            axes.ticklabel_format(axis="y", useOffset=False)  # values as they are, not as offsets from one
            axes.grid(True, alpha=0.3)
            axes.legend()
        all_axes[-1].set(xlabel="step")
        figure.tight_layout()
        return figure

    def redraw(self) -> None:
        self._dirty = False
        figure = self.figure()
        if figure is None:
            return
        self._drawn_at = time.monotonic()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp.png")
        figure.savefig(tmp, format="png")
        os.replace(tmp, self.path)
