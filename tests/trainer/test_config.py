from __future__ import annotations

import inspect
import re
from dataclasses import fields

import pytest
import yaml

import veomni_lite.config_sections as config_sections
from tests.trainer.helpers import REPO
from veomni_lite.config import (
    ALIASES,
    CheckpointConfig,
    ConfigError,
    DataConfig,
    LoggingConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    TrainConfig,
    load_config,
    parse_overrides,
)


def test_yaml_and_dotted_overrides(tmp_path):
    config = load_config(
        REPO / "configs" / "vlm_tiny.yaml",
        ["--train.max_steps", "7", "--train.resume=true", "--train.lr", "1e-3", "--model.num_heads", "2"],
        world_size=2,
    )
    assert config.train.max_steps == 7
    assert config.checkpoint.resume is True, "the old flat name train.resume still works"
    assert config.optim.lr == pytest.approx(1e-3)
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
        (["--train.resume", "maybe"], 1, "checkpoint.resume: expected bool"),
        (["--train.global_batch_size", "30"], 2, r"train.global_batch_size \(30\) is not divisible"),
        (["--train.sp_size", "3"], 3, r"parallel.sp_size \(3\) does not divide model.num_heads \(4\)"),
        (["--parallel.sp_size", "2"], 3, r"parallel.sp_size \(2\) does not divide the world size \(3\)"),
        (["--parallel.mixed_precision", "fp8"], 1, r"parallel.mixed_precision: 'fp8' is not one of \['auto'"),
        (["--optim.lr", "0"], 1, "optim.lr: must be > 0"),
        (["--train.nonfinite", "ignore"], 1, "train.nonfinite: 'ignore' is not one of"),
        (["--train.max_steps", "0"], 1, "train.max_steps: must be >= 1"),
        (["--train.max_steps"], 1, "needs a value"),
        (["train.max_steps", "3"], 1, "expected --section.key VALUE"),
        (["--loss.mode", "seq-mean-token-sum-norm"], 1, "loss.scale_factor must be set for seq-mean-token-sum-norm"),
        (["--loss.modes.image_decoder", "seq-mean-token-sum-norm"], 1, "loss.scale_factor must be set"),
        (["--loss.modes.image_decoder", "mean"], 1, "loss.modes.image_decoder: unknown loss mode 'mean'"),
        (["--loss.mode", "mean"], 1, "loss.mode: 'mean' is not one of"),
        (["--loss.mode", "seq-mean-token-sum-norm", "--loss.scale_factor", "-2"], 1, "loss.scale_factor must be > 0"),
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
    bad.write_text("optimizer:\n  lr: 1\n")
    with pytest.raises(ConfigError, match="unknown config section 'optimizer'"):
        load_config(bad)


@pytest.mark.parametrize(
    ("yaml_text", "overrides", "message"),
    [
        ("", ["--train.max_step", "7"], "unknown config key 'train.max_step' (did you mean `train.max_steps`?)"),
        ("", ["--trian.max_steps", "7"], "unknown config key 'trian.max_steps' (did you mean `train.max_steps`?)"),
        ("", ["--data.max_steps", "7"], "unknown config key 'data.max_steps' (did you mean `train.max_steps`?)"),
        (
            "train:\n  log_intreval: 5\n",
            [],
            "unknown config key 'train.log_intreval' (did you mean `train.log_interval`?)",
        ),
        ("optimizer:\n  lr: 1\n", [], "unknown config section 'optimizer' (did you mean `optim`?)"),
        ("data:\n  sources: [{pth: a.jsonl}]\n", [], "data.sources[0]: unknown key(s) ['pth'] (did you mean `path`?)"),
    ],
)
def test_a_mistyped_key_names_the_closest_known_one(tmp_path, yaml_text, overrides, message):
    path = tmp_path / "config.yaml"
    path.write_text(yaml_text)
    with pytest.raises(ConfigError) as raised:
        load_config(path, overrides, world_size=1)
    assert message in str(raised.value)


@pytest.mark.parametrize("key", ["train.zzz", "model.nope", "qqq.zzz"])
def test_a_key_like_no_known_one_gets_no_guess(key):
    """The negative control: a name close to nothing is listed against the valid keys, without a guess."""
    with pytest.raises(ConfigError, match=f"unknown config key '{key}'; ") as raised:
        load_config(REPO / "configs" / "vlm_tiny.yaml", [f"--{key}", "1"], world_size=1)
    assert "did you mean" not in str(raised.value)


def test_parse_overrides():
    assert parse_overrides(["--a.b", "1", "--c.d=x"]) == [("a.b", "1"), ("c.d", "x")]


def test_every_old_flat_train_name_still_works_and_lands_in_its_section(tmp_path):
    old_yaml = tmp_path / "old.yaml"
    old_yaml.write_text("train:\n  lr: 0.01\n  sp_size: 2\n  log_interval: 5\n  save_interval: 4\n")
    config = load_config(old_yaml, ["--train.keep_checkpoints", "3", "--train.tensorboard", "false"], world_size=2)
    assert (config.optim.lr, config.parallel.sp_size, config.logging.log_interval) == (0.01, 2, 5)
    assert (config.checkpoint.save_interval, config.checkpoint.keep_checkpoints) == (4, 3)
    assert config.logging.tensorboard is False
    for old, new in ALIASES.items():
        section, name = new.split(".")
        assert old == f"train.{name}" and hasattr(getattr(config, section), name)


def test_every_field_is_documented_where_it_is_declared():
    """Each field is followed by its docstring in the source (torchtitan style)."""
    source = inspect.getsource(config_sections)
    for section in (ModelConfig, DataConfig, TrainConfig, ParallelConfig, OptimConfig, CheckpointConfig, LoggingConfig):
        for f in fields(section):
            assert re.search(rf"\n    {f.name}: [^\n]+\n    \"\"\"[^\n]+", source), f"{section.__name__}.{f.name}"
