from __future__ import annotations

import json
import math
import sys
import types

import pytest

from veomni_lite.metrics.sinks import ConsoleSink, JsonlSink, LossCurveSink, TensorBoardSink, WandbSink, append_series

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


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
    sink = JsonlSink(path, {})
    sink.write(1, 0, {"train/loss": 2.0, "train/nan": math.nan})
    assert json.loads(path.read_text()) == {"step": 1, "epoch": 0, "train/loss": 2.0, "train/nan": None}
    sink.write(2, 0.5, {"train/loss": 1.5})
    sink.close()
    sink.write(3, 1, {"train/loss": 1.0})  # reopened after a close: continues
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3]
    JsonlSink(path, {}).write(1, 0, {"train/loss": 3.0})  # a new run that did not resume: its own history only
    assert [json.loads(line)["train/loss"] for line in path.read_text().splitlines()] == [3.0]


def test_jsonl_resume_truncates_and_reads_the_history_back(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    sink = JsonlSink(path, {})
    for step in (2, 4, 6, 8):
        sink.write(step, 0, {"train/loss": float(step), "train/nan_loss": math.nan})
    sink.close()
    with path.open("a") as f:
        f.write('{"step": 10, "train/lo')  # a line torn by a crash
    series: dict = {}
    resumed = JsonlSink(path, series)
    resumed.resume(4)
    assert "unreadable line 5" in caplog.text
    assert series == {"train/loss": [{"step": 2, "epoch": 0, "value": 2.0}, {"step": 4, "epoch": 0, "value": 4.0}]}
    resumed.write(6, 0, {"train/loss": 6.5})
    resumed.close()
    assert [json.loads(line) for line in path.read_text().splitlines()] == [
        {"step": 2, "epoch": 0, "train/loss": 2.0, "train/nan_loss": None},
        {"step": 4, "epoch": 0, "train/loss": 4.0, "train/nan_loss": None},
        {"step": 6, "epoch": 0, "train/loss": 6.5},
    ]
    # Without a file (nothing was logged before the checkpoint) the history is empty and the file starts empty.
    fresh_series: dict = {}
    fresh = JsonlSink(tmp_path / "new" / "metrics.jsonl", fresh_series)
    fresh.resume(4)
    assert fresh.path.read_text() == "" and fresh_series == {}


def test_tensorboard_resume_purges_later_steps(tmp_path):
    sink = TensorBoardSink(tmp_path)
    for step in range(1, 7):
        sink.write(step, 0, {"train/loss": float(step)})
    sink.close()
    sink.resume(3)
    for step in range(4, 6):
        sink.write(step, 0, {"train/loss": step + 0.5})
    sink.close()
    assert read_scalars(tmp_path)["train/loss"] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.5), (5, 5.5)]


def test_loss_curve_plots_loss_keys(tmp_path):
    series: dict = {}
    path = tmp_path / "loss_curve.png"
    sink = LossCurveSink(path, series)
    sink.write(1, 0, {})
    assert not path.exists()  # nothing to plot yet
    append_series(
        series, 1, 0, {"train/loss": 2.0, "train/foundation_loss": 1.5, "train/lr": 1e-4, "eval/loss": math.inf}
    )
    append_series(series, 2, 0, {"train/loss": 1.0, "train/foundation_loss": 0.5})
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
    sink.write(1, 0, {"train/loss": 2.0})
    sink.write(2, 0, {"train/loss": 1.5})
    sink.close()
    assert fake.inits[0]["mode"] == "offline" and fake.inits[0]["project"] == "proj"
    assert fake.inits[0]["config"] == {"train": {"max_steps": 4}}
    assert fake.logged == [(1, {"train/loss": 2.0, "epoch": 0}), (2, {"train/loss": 1.5, "epoch": 0})]
    resumed = WandbSink(tmp_path / "wandb", "proj")
    resumed.resume(1)
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
    series: dict = {}
    for step in range(1, 100_001):
        append_series(series, step, 0, {"train/loss": 1.0 / step})
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


def test_panels_give_each_quantity_its_own_axes_and_leave_out_the_empty_ones(tmp_path):
    series: dict = {}
    path = tmp_path / "loss_curve.png"
    panels = [("policy loss", ["train/policy_loss"]), ("KL", ["rl/kl"]), ("entropy", ["rl/entropy", "eval/entropy"])]
    sink = LossCurveSink(path, series, panels=panels)
    assert sink.figure() is None and sink.plot_panels() == []
    for step in (1, 2, 3):
        append_series(series, step, 0, {"train/policy_loss": 1e-3 * step, "rl/entropy": 2.0 - 0.1 * step})
    assert sink.plot_panels() == [("policy loss", ["train/policy_loss"]), ("entropy", ["rl/entropy"])]
    figure = sink.figure()
    assert [axes.get_ylabel() for axes in figure.axes] == ["policy loss", "entropy"]  # no KL logged: no KL axes
    assert [[line.get_label() for line in axes.get_lines()] for axes in figure.axes] == [
        ["train/policy_loss"],
        ["rl/entropy"],
    ]
    assert list(figure.axes[1].get_lines()[0].get_ydata()) == pytest.approx([1.9, 1.8, 1.7])
    sink.flush()
    assert not path.exists(), "nothing was written yet: flush draws only what is pending"
    sink.write(3, 0, {})
    assert path.read_bytes().startswith(PNG_MAGIC)
    # one list of keys is one axes named by `ylabel`, as before
    assert [axes.get_ylabel() for axes in LossCurveSink(path, series, keys=["rl/entropy"]).figure().axes] == ["loss"]
