from __future__ import annotations

import json
import math
import sys
import types

import pytest
import torch

from veomni_lite.metrics import ConsoleSink, JsonlSink, LossCurveSink, MetricSeries, TensorBoardSink, WandbSink

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
NON_SCALARS = {
    "train/hist": torch.randn(32),
    "train/table": [["a", 1], ["b", 2]],
    "train/nested": {"x": {"y": 1}},
    "train/none": None,
}


def read_scalars(log_dir) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_console_line():
    lines: list[str] = []
    sink = ConsoleSink({"train/loss": ".4f", "train/lr": ".1e"}, max_steps=100, write_line=lines.append)
    sink.write(10, 0, {"train/loss": 2.34564, "train/lr": 1e-4, "eval/loss": 3.0, "train/tokens": 4096})
    assert lines == ["step 10/100 | epoch 0 | loss 2.3456 | lr 1.0e-04 | eval/loss 3.0000 | tokens 4096"]


def test_jsonl_appends_and_flushes_each_event(tmp_path):
    path = tmp_path / "out" / "metrics.jsonl"
    sink = JsonlSink(path)
    sink.write(1, 0, {"train/loss": 2.0, "train/nan": math.nan})
    assert json.loads(path.read_text()) == {"step": 1, "epoch": 0, "train/loss": 2.0, "train/nan": None}
    sink.write(2, 0.5, {"train/loss": torch.tensor(1.5)})
    sink.close()
    JsonlSink(path).write(3, 1, {"train/loss": 1.0})  # a new sink appends
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3]


@pytest.mark.parametrize("kind", ["console", "jsonl", "tensorboard", "png"])
def test_non_scalars_never_crash_a_sink_and_warn_once_per_key(tmp_path, kind, caplog):
    series = MetricSeries()
    sink = {
        "console": lambda: ConsoleSink(write_line=lambda line: None),
        "jsonl": lambda: JsonlSink(tmp_path / "metrics.jsonl"),
        "tensorboard": lambda: TensorBoardSink(tmp_path / "tb"),
        "png": lambda: LossCurveSink(tmp_path / "loss_curve.png", series),
    }[kind]()
    for step in (1, 2):
        values = {"train/loss": 1.0 / step, "train/nan_loss": math.nan, **NON_SCALARS}
        series.append(step, 0, {"train/loss": 1.0 / step, "train/nan_loss": math.nan})
        sink.write(step, 0, values)
    sink.close()
    messages = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    if kind == "png":  # plots the series it was given (scalars only), so it never looks at the values
        assert messages == []
        assert (tmp_path / "loss_curve.png").read_bytes().startswith(PNG_MAGIC)
        return
    assert len(messages) == len(NON_SCALARS)
    for key in NON_SCALARS:
        assert sum(f"'{key}'" in m for m in messages) == 1
    if kind == "jsonl":
        lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
        assert lines[1] == {"step": 2, "epoch": 0, "train/loss": 0.5, "train/nan_loss": None}
    if kind == "tensorboard":
        scalars = read_scalars(tmp_path / "tb")
        assert scalars["train/loss"] == [(1, 1.0), (2, 0.5)]
        assert set(scalars) == {"train/loss", "train/nan_loss"}


def test_jsonl_resume_truncates_and_rebuilds(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    sink = JsonlSink(path)
    for step in (2, 4, 6, 8):
        sink.write(step, 0, {"train/loss": float(step)})
    sink.close()
    with path.open("a") as f:
        f.write('{"step": 10, "train/lo')  # a line torn by a crash
    series = MetricSeries()
    sink.resume(4, series)
    assert "unreadable line 5" in caplog.text
    sink.write(6, 0, {"train/loss": 6.5})
    sink.close()
    assert [json.loads(line) for line in path.read_text().splitlines()] == [
        {"step": 2, "epoch": 0, "train/loss": 2.0},
        {"step": 4, "epoch": 0, "train/loss": 4.0},
        {"step": 6, "epoch": 0, "train/loss": 6.5},
    ]
    # Without the file (a new output dir) the series is the source.
    series.append(2, 0, {"train/loss": 2.0, "train/lr": 1e-4})
    series.append(4, 1, {"train/loss": 4.0})
    series.append(6, 1, {"train/loss": 6.0})
    fresh = JsonlSink(tmp_path / "new" / "metrics.jsonl")
    fresh.resume(4, series)
    assert [json.loads(line) for line in fresh.path.read_text().splitlines()] == [
        {"step": 2, "epoch": 0, "train/loss": 2.0, "train/lr": 1e-4},
        {"step": 4, "epoch": 1, "train/loss": 4.0},
    ]


def test_tensorboard_resume_purges_later_steps(tmp_path):
    sink = TensorBoardSink(tmp_path)
    for step in range(1, 7):
        sink.write(step, 0, {"train/loss": float(step)})
    sink.close()
    sink.resume(3, MetricSeries())
    for step in range(4, 6):
        sink.write(step, 0, {"train/loss": step + 0.5})
    sink.close()
    assert read_scalars(tmp_path)["train/loss"] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.5), (5, 5.5)]


def test_loss_curve_plots_loss_keys(tmp_path):
    series = MetricSeries()
    path = tmp_path / "loss_curve.png"
    sink = LossCurveSink(path, series)
    sink.write(1, 0, {})
    assert not path.exists()  # nothing to plot yet
    series.append(1, 0, {"train/loss": 2.0, "train/foundation_loss": 1.5, "train/lr": 1e-4, "eval/loss": math.inf})
    series.append(2, 0, {"train/loss": 1.0, "train/foundation_loss": 0.5})
    assert sink.plot_keys() == ["eval/loss", "train/foundation_loss", "train/loss"]
    sink.write(2, 0, {})
    assert path.read_bytes().startswith(PNG_MAGIC)
    assert LossCurveSink(path, series, keys=["train/loss", "missing"]).plot_keys() == ["train/loss"]


class FakeWandb:
    """Stands in for the `wandb` package: records init arguments and logged points."""

    def __init__(self) -> None:
        self.inits: list[dict] = []
        self.logged: list[tuple[int, dict]] = []
        self.util = types.SimpleNamespace(generate_id=lambda: "run123")

    def init(self, **kwargs):
        self.inits.append(kwargs)
        fake = self

        class Run:
            def log(self, values, step):
                fake.logged.append((step, values))

            def finish(self):
                pass

        return Run()


def test_wandb_sink_is_offline_by_default_and_resumes_the_same_run(tmp_path, monkeypatch):
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    sink = WandbSink(tmp_path / "wandb", "proj", {"train": {"max_steps": 4}})
    sink.write(1, 0, {"train/loss": 2.0, "train/hist": torch.ones(3)})
    sink.write(2, 0, {"train/loss": 1.5})
    sink.close()
    assert fake.inits[0]["mode"] == "offline" and fake.inits[0]["project"] == "proj"
    assert fake.inits[0]["config"] == {"train": {"max_steps": 4}}
    assert fake.logged == [(1, {"train/loss": 2.0, "epoch": 0}), (2, {"train/loss": 1.5, "epoch": 0})]
    resumed = WandbSink(tmp_path / "wandb", "proj")
    resumed.resume(1, MetricSeries())
    resumed.write(2, 0, {"train/loss": 1.4})
    assert fake.inits[1]["id"] == fake.inits[0]["id"] == "run123" and fake.inits[1]["resume"] == "allow"
    monkeypatch.setenv("WANDB_MODE", "online")
    WandbSink(tmp_path / "other", "proj").write(1, 0, {"train/loss": 1.0})
    assert fake.inits[-1]["mode"] == "online"


def test_wandb_sink_without_the_package_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ImportError, match=r"pip install -e .\[wandb\]"):
        WandbSink(tmp_path, "proj").write(1, 0, {"train/loss": 1.0})


def test_the_trainer_logs_to_wandb_with_train_wandb_true(tmp_path, monkeypatch):
    from tests.trainer.helpers import run_trainer, tiny_config

    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    run_trainer("text", tiny_config("text", tmp_path, max_steps=2, wandb=True))
    assert [step for step, _ in fake.logged] == [1, 2]
    assert fake.inits[0]["dir"] == str(tmp_path / "wandb")
    assert fake.inits[0]["config"]["logging"]["wandb"] is True


def test_the_loss_curve_costs_the_same_however_long_the_run(tmp_path, monkeypatch):
    series = MetricSeries()
    for step in range(1, 100_001):
        series.append(step, 0, {"train/loss": 1.0 / step})
    sink = LossCurveSink(tmp_path / "loss_curve.png", series, max_points=500, min_interval_s=60.0)
    points = sink.points("train/loss")
    assert len(points) <= 500 and points[-1]["step"] == 100_000
    steps = [p["step"] for p in points]
    assert steps == sorted(steps) and steps[1] - steps[0] == steps[-1] - steps[-2], "evenly strided"
    draws = []
    monkeypatch.setattr(sink, "redraw", lambda original=sink.redraw: (draws.append(1), original()))
    sink.write(1, 0, {})
    sink.write(2, 0, {})  # within min_interval_s of the last draw: not redrawn
    assert len(draws) == 1
    sink.flush()  # a checkpoint or the end of the run draws what is pending
    assert len(draws) == 2 and (tmp_path / "loss_curve.png").read_bytes().startswith(PNG_MAGIC)
