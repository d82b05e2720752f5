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
    ExampleConfig,
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
    assert config.example.num_heads == 2, "the old name model.num_heads still works"
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
        assert old.partition(".")[2] == name and hasattr(getattr(config, section), name)
        assert old.startswith("train.") or (section == "example" and old.split(".")[0] in ("model", "data"))


def test_every_field_is_documented_where_it_is_declared():
    """Each field is followed by its docstring in the source (torchtitan style)."""
    source = inspect.getsource(config_sections)
    sections = (ModelConfig, DataConfig, ExampleConfig, TrainConfig, ParallelConfig, OptimConfig, CheckpointConfig)
    for section in (*sections, LoggingConfig):
        for f in fields(section):
            assert re.search(rf"\n    {f.name}: [^\n]+\n    \"\"\"[^\n]+", source), f"{section.__name__}.{f.name}"


def _rl_config(tmp_path, yaml_text: str, overrides: list[str] = ()):  # type: ignore[assignment]
    from veomni_lite.rl.config import RLConfig

    path = tmp_path / "rl.yaml"
    path.write_text(yaml_text)
    rewards = ["--rl.rewards", "[{name: c, function: exact_match}]"]
    return load_config(path, [*rewards, *overrides], world_size=1, sections={"rl": RLConfig})


@pytest.mark.parametrize(
    ("yaml_text", "overrides", "message"),
    [
        ("", ["--rl.critic.lrr", "1e-6"], "unknown config key 'rl.critic.lrr' (did you mean `rl.critic.lr`?)"),
        ("rl:\n  critic: {value_haed: true}\n", [], "'rl.critic.value_haed' (did you mean `rl.critic.value_head`?)"),
        ("rl:\n  vllm:\n    reqest_timeout_s: 3\n", [], "(did you mean `rl.vllm.request_timeout_s`?)"),
        ("", ["--rl.temprature", "0.5"], "unknown config key 'rl.temprature' (did you mean `rl.temperature`?)"),
        ("", ["--rl.critic.lr", "fast"], "rl.critic.lr: expected float, got 'fast' (str)"),
        ("rl:\n  critic: {warmup_steps: [1]}\n", [], "rl.critic.warmup_steps: expected int, got [1] (list)"),
        ("rl:\n  vllm: {launch: many}\n", [], "rl.vllm.launch: expected bool or int, got 'many' (str)"),
        ("rl:\n  critic: 3\n", [], "rl.critic: expected a mapping (value_head, pretrained_dir, lr"),
        ("", ["--rl.critic.lr.x", "1"], "unknown config key 'rl.critic.lr.x'; rl.critic.lr has no fields"),
    ],
)
def test_nested_sections_name_the_key_and_the_closest_known_one_at_every_depth(tmp_path, yaml_text, overrides, message):
    with pytest.raises(ConfigError) as raised:
        _rl_config(tmp_path, yaml_text, overrides)
    assert message in str(raised.value)


def test_nested_sections_are_typed_dataclasses_read_from_yaml_and_the_command_line(tmp_path):
    from veomni_lite.engines.vllm.settings import VLLMSettings
    from veomni_lite.rl.config import RLConfig
    from veomni_lite.rl.critic import CriticSettings

    config = _rl_config(
        tmp_path,
        "rl:\n  engine: vllm\n  vllm: {url: 'http://127.0.0.1:8000'}\n  advantage: gae\n  critic: {value_head: true}\n",
        ["--rl.critic.lr", "1e-6", "--rl.vllm.launch", "false"],
    )
    assert [f.name for f in fields(config)][-1] == "rl" and type(config.rl) is RLConfig  # a field, not __getattr__
    assert config.rl.critic == CriticSettings(value_head=True, lr=1e-6)
    assert isinstance(config.rl.vllm, VLLMSettings) and config.rl.vllm.url == "http://127.0.0.1:8000"
    assert config.rl.vllm.launch == 0 and config.rl.vllm.request_timeout_s == 600.0
    assert load_config(None, ["--rl.rewards", "[{name: c, function: exact_match}]"], world_size=1,
                       sections={"rl": RLConfig}).rl.critic is None  # fmt: skip
    config.save(tmp_path / "saved.yaml")  # and back, nested sections included
    again = load_config(tmp_path / "saved.yaml", world_size=1, sections={"rl": RLConfig})
    assert again.to_dict() == config.to_dict() and again.rl.critic == config.rl.critic
    assert not hasattr(load_config(None, world_size=1), "rl")  # a run without the section has none


def test_a_config_with_its_entry_points_sections_copies_and_pickles_as_itself(tmp_path):
    import copy
    import pickle

    from veomni_lite.config import replace

    config = _rl_config(tmp_path, "", ["--rl.temperature", "0.5"])
    for twin in (copy.deepcopy(config), pickle.loads(pickle.dumps(config)), replace(config, train={"seed": 1})):
        assert type(twin) is type(config) and twin.rl == config.rl
