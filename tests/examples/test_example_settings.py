"""The `example` section: the examples' settings under their own section, the old flat names (`model.hidden_size`,
`data.num_samples`) still working in YAML and on the command line, and the checks only the examples need run by the
examples (before any process group), not by every run's config."""

from __future__ import annotations

import pytest

from examples.settings import check_example
from examples.text_trainer import TextTrainer
from examples.vlm_trainer import VLMTrainer
from tests.trainer.helpers import REPO
from veomni_lite.config import ConfigError, load_config

VLM = REPO / "configs" / "vlm_tiny.yaml"


def test_the_old_flat_names_land_in_the_example_section(tmp_path):
    config = load_config(VLM, ["--model.hidden_size", "32", "--data.num_samples", "40"], world_size=1)
    assert (config.example.hidden_size, config.example.num_samples) == (32, 40)
    assert config.example.image_size == 16 and config.example.generation_ratio == 0.5  # vlm_tiny.yaml's model / data
    new = load_config(VLM, ["--example.hidden_size", "32", "--example.num_samples", "40"], world_size=1)
    assert new.to_dict() == config.to_dict()
    assert not hasattr(config.model, "hidden_size") and not hasattr(config.data, "num_samples")
    old_yaml = tmp_path / "old.yaml"
    old_yaml.write_text("model:\n  num_heads: 2\n  arch: tiny\ndata:\n  seq_len: 64\n")
    loaded = load_config(old_yaml, world_size=1)
    assert (loaded.example.num_heads, loaded.example.seq_len, loaded.model.arch) == (2, 64, "tiny")
    config.save(tmp_path / "config.yaml")  # written under `example`, read back the same
    assert load_config(tmp_path / "config.yaml", world_size=1).to_dict() == config.to_dict()


@pytest.mark.parametrize(
    ("overrides", "world_size", "message"),
    [
        (["--train.sp_size", "3"], 3, r"parallel.sp_size \(3\) does not divide model.num_heads \(4\)"),
        (["--model.hidden_size", "30"], 1, r"model.hidden_size \(30\) is not divisible by model.num_heads \(4\)"),
        (["--model.image_size", "18"], 1, r"model.image_size \(18\) is not divisible by model.patch_size \(4\)"),
        (["--model.num_layers", "0"], 1, "model.num_layers: must be >= 1, got 0"),
        (["--data.num_samples", "0"], 1, "data.num_samples: must be >= 1, got 0"),
    ],
)
def test_the_examples_check_their_settings_before_any_process_group(overrides, world_size, message):
    config = load_config(VLM, overrides, world_size=world_size)  # the library's checks leave them to the examples
    with pytest.raises(ConfigError, match=message):
        check_example(config, tiny=True)
    for trainer in (TextTrainer, VLMTrainer):  # raised in __init__ before init_distributed
        with pytest.raises(ConfigError, match=message):
            trainer(config)


def test_a_valid_example_config_passes_the_examples_check():
    """The negative control: the shipped tiny configs pass."""
    for name in ("vlm_tiny.yaml", "text_tiny.yaml"):
        check_example(load_config(REPO / "configs" / name, world_size=1), tiny=True)
