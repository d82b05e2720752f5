from __future__ import annotations

import pytest
import yaml

from tests.trainer.helpers import REPO
from veomni_lite.config import ConfigError, load_config, parse_overrides


def test_yaml_and_dotted_overrides(tmp_path):
    config = load_config(
        REPO / "configs" / "vlm_tiny.yaml",
        ["--train.max_steps", "7", "--train.resume=true", "--train.lr", "1e-3", "--model.num_heads", "2"],
        world_size=2,
    )
    assert config.train.max_steps == 7
    assert config.train.resume is True
    assert config.train.lr == pytest.approx(1e-3)
    assert config.model.num_heads == 2
    config.save(tmp_path / "config.yaml")
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert saved["train"]["max_steps"] == 7
    assert load_config(tmp_path / "config.yaml", world_size=2).to_dict() == config.to_dict()


@pytest.mark.parametrize(
    ("overrides", "world_size", "message"),
    [
        (["--train.max_step", "7"], 1, "unknown config key 'train.max_step'"),
        (["--trian.max_steps", "7"], 1, "unknown config key 'trian.max_steps'"),
        (["--train.max_steps", "seven"], 1, "train.max_steps: expected int, got 'seven'"),
        (["--train.resume", "maybe"], 1, "train.resume: expected bool"),
        (["--train.global_batch_size", "30"], 2, r"train.global_batch_size \(30\) is not divisible"),
        (["--train.sp_size", "3"], 3, r"train.sp_size \(3\) does not divide model.num_heads \(4\)"),
        (["--train.sp_size", "2"], 3, r"train.sp_size \(2\) does not divide the world size \(3\)"),
        (["--train.nonfinite", "ignore"], 1, "train.nonfinite: 'ignore' is not one of"),
        (["--train.max_steps", "0"], 1, "train.max_steps: must be >= 1"),
        (["--train.max_steps"], 1, "needs a value"),
        (["train.max_steps", "3"], 1, "expected --section.key VALUE"),
    ],
)
def test_bad_config_names_the_key(overrides, world_size, message):
    with pytest.raises(ConfigError, match=message):
        load_config(REPO / "configs" / "vlm_tiny.yaml", overrides, world_size=world_size)


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  max_steps: [1, 2]\n")
    with pytest.raises(ConfigError, match=rf"{bad}: .*train.max_steps: expected int"):
        load_config(bad)
    bad.write_text("optim:\n  lr: 1\n")
    with pytest.raises(ConfigError, match="unknown config section 'optim'"):
        load_config(bad)


def test_parse_overrides():
    assert parse_overrides(["--a.b", "1", "--c.d=x"]) == [("a.b", "1"), ("c.d", "x")]
