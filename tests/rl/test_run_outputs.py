"""What a finished RL or preference run leaves for its user: the end-of-run listing names every file the run wrote
(reward_curve.png, rollouts.jsonl, accuracy_curve.png included) and nothing it did not; the RL figures draw the policy
loss alone, the KL and the entropy on axes of their own, the reward and the response length on theirs."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest

from tests.pref.test_train_preference import pairs, pref_args  # noqa: F401 - pairs: the module's fixture
from tests.rl.test_train_rl import rl_args, write_rollouts
from veomni_lite.metrics.logger import as_panels
from veomni_lite.metrics.sinks import LossCurveSink
from veomni_lite.preference.config import PrefConfig
from veomni_lite.preference.trainer import PreferenceTrainer
from veomni_lite.rl.config import RLConfig
from veomni_lite.rl.trainer import RLTrainer
from veomni_lite.trainer import launch


def run_listed(trainer: type, section: dict[str, type], args: list[str], tmp_path: Path, capsys) -> list[str]:
    """Run the entry point's body in this process; the names its end-of-run listing gives under the output dir."""
    config = tmp_path / "run.yaml"
    config.write_text("model: {arch: auto}\n")
    assert launch.main({"auto": trainer}, [str(config), *args], sections=section) == 0
    printed = capsys.readouterr().out.splitlines()
    start = next(i for i, line in enumerate(printed) if line.startswith("[veomni_lite] done:"))
    out = Path(args[args.index("--train.output_dir") + 1])
    return [line.strip()[len(str(out)) + 1 :] for line in printed[start + 1 :] if line.startswith("  ")]


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) in pixels from the PNG header."""
    return struct.unpack(">II", path.read_bytes()[16:24])


def series(out: Path) -> dict[str, list[dict]]:
    """metrics.jsonl as the logger's series."""
    points: dict[str, list[dict]] = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        event = json.loads(line)
        for key, value in event.items():
            if key not in ("step", "epoch"):
                points.setdefault(key, []).append({"step": event["step"], "epoch": event.get("epoch"), "value": value})
    return points


def test_an_rl_run_lists_what_it_wrote_and_plots_each_quantity_on_its_own_axes(demo, tmp_path, capsys):
    out = tmp_path / "rl"
    out.mkdir()
    (out / "before.json").write_text("{}\n")  # an earlier command's file in the same directory, left alone
    rollouts = write_rollouts(tmp_path / "rollouts.jsonl")
    args = rl_args(demo, rollouts, out, "--train.max_steps", "2", "--logging.plot", "true")
    listed = run_listed(RLTrainer, {"rl": RLConfig}, args, tmp_path, capsys)
    on_disk = sorted(p.name + ("/" if p.is_dir() else "") for p in out.iterdir() if p.name != "before.json")
    assert sorted(listed) == on_disk and "before.json" not in listed
    assert {"metrics.jsonl", "loss_curve.png", "reward_curve.png", "rollouts.jsonl", "config.yaml"} <= set(listed)
    assert "checkpoints/" in listed
    assert listed == sorted(n for n in listed if not n.endswith("/")) + sorted(n for n in listed if n.endswith("/"))

    # the figures: the policy loss alone (not under train/loss), the KL and the entropy each on its own axes
    logged = series(out)
    figures = {name: as_panels(name, spec) for name, spec in RLTrainer.plots.items()}
    loss = LossCurveSink(tmp_path / "a.png", logged, panels=figures["loss_curve.png"])
    expected = [("policy loss", ["train/policy_loss"]), ("KL", ["rl/kl"]), ("entropy", ["rl/entropy"])]
    assert loss.plot_panels() == expected and "train/loss" not in loss.plot_keys()
    reward = LossCurveSink(tmp_path / "b.png", logged, panels=figures["reward_curve.png"])
    assert [label for label, _ in reward.plot_panels()] == ["reward", "response tokens"]
    assert reward.plot_panels()[1][1] == ["rl/response_length/mean", "rl/response_length/max"]
    # the files the run drew have those axes: three stacked panels, two stacked panels (one panel is 800 x 450)
    assert png_size(out / "loss_curve.png") == (800, 840)
    assert png_size(out / "reward_curve.png") == (800, 600)


def test_a_preference_run_lists_its_accuracy_curve(demo, pairs, tmp_path, capsys):  # noqa: F811 - the fixture
    out = tmp_path / "dpo"
    args = pref_args(demo, pairs, out, "--train.max_steps", "2", "--logging.plot", "true")
    listed = run_listed(PreferenceTrainer, {"pref": PrefConfig}, args, tmp_path, capsys)
    assert {"metrics.jsonl", "loss_curve.png", "accuracy_curve.png", "config.yaml", "checkpoints/"} <= set(listed)
    assert sorted(listed) == sorted(p.name + ("/" if p.is_dir() else "") for p in out.iterdir())


def test_written_since_names_new_and_changed_entries_only(tmp_path):
    (tmp_path / "old.txt").write_text("kept")
    (tmp_path / "changed.txt").write_text("a")
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "one").write_text("1")
    before = launch.snapshot(tmp_path)
    later = before["changed.txt"] + 10**9
    (tmp_path / "changed.txt").write_text("b")
    os.utime(tmp_path / "changed.txt", ns=(later, later))
    (tmp_path / "new.png").write_bytes(b"png")
    (tmp_path / "ckpt" / "two").write_text("2")
    os.utime(tmp_path / "ckpt" / "two", ns=(later, later))
    assert launch.written_since(tmp_path, before) == ["changed.txt", "new.png", "ckpt/"]
    assert launch.written_since(tmp_path, launch.snapshot(tmp_path)) == []
    assert launch.snapshot(tmp_path / "absent") == {}
    with pytest.raises(AssertionError):  # negative control: the old fixed listing would miss new.png
        assert set(launch.written_since(tmp_path, before)) <= {"metrics.jsonl", "loss_curve.png", "ckpt/"}
