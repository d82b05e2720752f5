from __future__ import annotations

import json
import math

import pytest
import torch

from veomni_lite.metrics import MetricReporter, MetricSeries, MetricSpec

SPECS = [
    MetricSpec("loss", "mean"),
    MetricSpec("lr", "last", ".1e"),
    MetricSpec("tokens", "sum", ",.0f"),
]


def jsonl(output_dir) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def make_reporter(output_dir, lines: list[str] | None = None, **kwargs) -> MetricReporter:
    kwargs.setdefault("log_interval", 3)
    kwargs.setdefault("max_steps", 7)
    console_write = lines.append if lines is not None else lambda line: None
    return MetricReporter(SPECS, output_dir, is_main_rank=True, console_write=console_write, **kwargs)


def train_step(reporter: MetricReporter, step: int) -> None:
    """Two micro-batches with different token counts, as a trainer records them."""
    loss = 10.0 / step
    reporter.record("loss", torch.tensor(loss + 1.0), count=torch.tensor(1))
    reporter.record("loss", torch.tensor(loss - 1.0 / 9), count=torch.tensor(9))
    reporter.record("tokens", torch.tensor(10))
    reporter.record("lr", 1e-4 * step)


def run(reporter: MetricReporter, steps: range, epoch: int = 0) -> None:
    for step in steps:
        train_step(reporter, step)
        if reporter.should_log(step):
            reporter.log(step, epoch, {"grad_norm": torch.tensor(0.5)})


def test_final_step_is_always_logged(tmp_path):
    lines: list[str] = []
    reporter = make_reporter(tmp_path, lines)
    assert [s for s in range(1, 8) if reporter.should_log(s)] == [3, 6, 7]
    run(reporter, range(1, 8))
    reporter.close()
    events = jsonl(tmp_path)
    assert [e["step"] for e in events] == [3, 6, 7]
    assert events[-1]["train/tokens"] == 10.0  # the last window holds step 7 only
    assert events[0]["train/loss"] == pytest.approx(sum(10.0 / s for s in (1, 2, 3)) / 3)
    assert events[0]["train/lr"] == pytest.approx(3e-4)
    assert events[0]["train/grad_norm"] == 0.5
    assert lines[0].startswith("step 3/7 | epoch 0 | loss ")
    assert "| lr 3.0e-04 | tokens 30 | grad_norm 0.5000" in lines[0]
    assert (tmp_path / "loss_curve.png").exists()
    assert any((tmp_path / "tensorboard").iterdir())
    assert [p["step"] for p in reporter.series["train/loss"]] == [3, 6, 7]


def test_resume_continues_the_series_and_jsonl_without_duplicates_or_gaps(tmp_path):
    reference = make_reporter(tmp_path / "reference", log_interval=4, max_steps=10)
    run(reference, range(1, 11))
    reference.close()

    # Run A: checkpoint at step 6 (mid-window: steps 5-6 are recorded, not logged), crash after logging step 8.
    first = make_reporter(tmp_path / "run", log_interval=4, max_steps=10)
    run(first, range(1, 7))
    checkpoint = first.state_dict()
    run(first, range(7, 10))
    first.close()
    assert [e["step"] for e in jsonl(tmp_path / "run")] == [4, 8]

    # Run B resumes from step 6 in the same output dir.
    second = make_reporter(tmp_path / "run", log_interval=4, max_steps=10)
    second.load_state_dict(checkpoint)
    second.resume(6)
    assert [e["step"] for e in jsonl(tmp_path / "run")] == [4]
    run(second, range(7, 11))
    second.close()

    assert jsonl(tmp_path / "run") == jsonl(tmp_path / "reference")
    assert [e["step"] for e in jsonl(tmp_path / "run")] == [4, 8, 10]
    assert second.series.state_dict() == reference.series.state_dict()

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [4, 8, 10]


def test_resume_into_a_new_output_dir_rebuilds_jsonl_from_the_series(tmp_path):
    first = make_reporter(tmp_path / "a", log_interval=2, max_steps=6)
    run(first, range(1, 5))
    state = first.state_dict()
    second = make_reporter(tmp_path / "b", log_interval=2, max_steps=6)
    second.load_state_dict(state)
    second.resume(4)
    run(second, range(5, 7))
    second.close()
    assert [e["step"] for e in jsonl(tmp_path / "b")] == [2, 4, 6]


def test_eval_metrics_are_logged_under_eval(tmp_path):
    reporter = make_reporter(tmp_path)
    reporter.record_eval("loss", 2.0, count=3)
    reporter.record_eval("loss", torch.tensor(4.0), count=torch.tensor(1))
    out = reporter.log_eval(5, 0, {"perplexity": 12.0, "custom/metric": 1})
    assert out == {"eval/loss": 2.5, "eval/perplexity": 12.0, "custom/metric": 1}
    assert jsonl(tmp_path) == [{"step": 5, "epoch": 0, **out}]
    assert reporter.log_eval(6, 0) == {}  # an empty window writes nothing
    assert len(jsonl(tmp_path)) == 1


def test_non_scalar_extras_warn_once_and_never_crash_a_sink(tmp_path, caplog):
    reporter = make_reporter(tmp_path, [], log_interval=1)
    extra = {"hist": torch.randn(64), "table": [[1, 2]], "nested": {"a": {"b": 1}}, "none": None, "nan": math.nan}
    for step in (1, 2):
        train_step(reporter, step)
        out = reporter.log(step, 0, extra)
        assert math.isnan(out.pop("train/nan"))
        assert set(out) == {"train/loss", "train/lr", "train/tokens"}
    reporter.close()
    messages = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert sorted(m.split("'")[1] for m in messages) == ["train/hist", "train/nested", "train/none", "train/table"]
    assert jsonl(tmp_path)[1]["train/nan"] is None
    assert (tmp_path / "loss_curve.png").exists()


def test_non_main_rank_reduces_but_writes_nothing(tmp_path):
    reporter = MetricReporter(SPECS, tmp_path / "out", log_interval=1, is_main_rank=False)
    assert reporter.sinks == []
    reporter.record("loss", 1.0)
    assert reporter.log(1, 0) == {"train/loss": 1.0}
    assert reporter.series["train/loss"] == [{"step": 1, "epoch": 0, "value": 1.0}]
    assert not (tmp_path / "out").exists()


def test_steps_count_from_one(tmp_path):
    reporter = make_reporter(tmp_path)
    reporter.record("loss", 1.0)
    with pytest.raises(ValueError, match="steps count from 1"):
        reporter.log(0, 0)


def test_series_keeps_steps_increasing_and_truncates():
    series = MetricSeries()
    series.append(1, 0, {"a": 1.0})
    series.append(2, 0, {"a": 2.0, "b": 5})
    series.append(2, 0, {"a": 2.5})  # re-logged step replaces, never duplicates
    assert series["a"] == [{"step": 1, "epoch": 0, "value": 1.0}, {"step": 2, "epoch": 0, "value": 2.5}]
    assert series.last_step() == 2
    assert series.events() == [{"step": 1, "epoch": 0, "a": 1.0}, {"step": 2, "epoch": 0, "a": 2.5, "b": 5}]
    restored = MetricSeries()
    restored.load_state_dict(series.state_dict())
    restored.truncate(1)
    assert restored.keys() == ["a"] and restored.last_step() == 1
    assert series.last_step() == 2  # the state dict was a copy


def test_extra_or_derived_values_never_overwrite_a_reduced_metric(tmp_path):
    reporter = make_reporter(tmp_path)
    train_step(reporter, 1)
    with pytest.raises(ValueError, match="'train/loss' would overwrite the reduced metric"):
        reporter.log(1, 0, {"loss": 0.0})
    train_step(reporter, 1)
    with pytest.raises(ValueError, match="'train/tokens' would overwrite"):
        reporter.log(1, 0, derive=lambda reduced: {"train/tokens": 0.0})
    reporter.close()


def test_close_with_an_open_window_says_so(tmp_path, caplog):
    reporter = make_reporter(tmp_path)
    train_step(reporter, 1)
    reporter.close()
    assert "the open train window (loss, lr, tokens) was never logged" in caplog.text
    caplog.clear()
    reporter.log(1, 0)
    reporter.close()
    assert caplog.text == ""


def test_events_of_one_step_share_one_jsonl_line(tmp_path):
    reporter = make_reporter(tmp_path)
    run(reporter, range(1, 4))
    reporter.record_eval("loss", 2.0)
    reporter.log_eval(3, 0)
    reporter.close()
    events = jsonl(tmp_path)
    assert [e["step"] for e in events] == [3]
    assert events[0]["eval/loss"] == 2.0 and "train/loss" in events[0]
