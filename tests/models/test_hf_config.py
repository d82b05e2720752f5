"""Config and entry points of the transformers runs: nested `model.hf` overrides, the head check under SP before any
process group, and which entry point trains which `model.arch`."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch.distributed as dist

from examples.qwen2_pydoc_text import PydocLMTrainer
from examples.qwen2_vl_digits import DigitsVLTrainer
from examples.text_trainer import TextTrainer
from examples.vlm_trainer import VLMTrainer
from tests.models.small_hf import CONFIGS, REPO
from veomni_lite.config import ConfigError, load_config
from veomni_lite.trainer import launch

VL, TEXT = str(CONFIGS["vl"]), str(CONFIGS["text"])


def test_nested_overrides_set_one_field_and_keep_the_rest():
    config = load_config(
        VL,
        [
            "--model.hf.text_config.hidden_size", "32",
            "--model.hf.text_config.rope_parameters.mrope_section", "[2, 1, 1]",
            "--model.hf.vision_config.depth", "2",
            "--model.hf.vision_config.new_field", "yes",
            "--model.hf.rope_scaling_note", "{a: 1}",
        ],
        world_size=1,
    )  # fmt: skip
    text, vision = config.model.hf["text_config"], config.model.hf["vision_config"]
    assert text["hidden_size"] == 32 and text["num_attention_heads"] == 4 and text["intermediate_size"] == 128
    assert text["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]}
    assert vision["depth"] == 2 and vision["new_field"] is True and vision["embed_dim"] == 32
    assert config.model.hf["rope_scaling_note"] == {"a": 1}
    fresh = load_config(VL, world_size=1)
    assert fresh.model.hf["text_config"]["hidden_size"] == 64, "an override never leaks into the next load"
    assert fresh.model.hf["text_config"]["rope_parameters"]["mrope_section"] == [4, 2, 2]

    text_config = load_config(TEXT, ["--model.hf.hidden_size", "32", "--model.hf.model_type", "llama"], world_size=1)
    assert text_config.model.hf["hidden_size"] == 32 and text_config.model.hf["model_type"] == "llama"


def test_a_whole_mapping_from_the_command_line_replaces_the_field():
    config = load_config(
        TEXT, ["--model.hf", "{model_type: qwen2, hidden_size: 32, num_attention_heads: 2}"], world_size=1
    )
    assert config.model.hf == {"model_type": "qwen2", "hidden_size": 32, "num_attention_heads": 2}
    with pytest.raises(ConfigError, match=re.escape("model.hf.num_attention_heads (2)")):
        load_config(
            TEXT, ["--model.hf", "{model_type: qwen2, num_attention_heads: 2}", "--parallel.sp_size", "4"], world_size=4
        )


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (["--model.hidden_size.width", "3"], "unknown config key 'model.hidden_size.width'; model.hidden_size has no"),
        (["--train.max_steps.x", "3"], "unknown config key 'train.max_steps.x'; train.max_steps has no fields"),
        (["--model.hf.text_config.hidden_size.x", "1"], "model.hf.text_config.hidden_size.x: 'hidden_size' holds 64"),
        (["--model.nope.x", "1"], "unknown config key 'model.nope.x'"),
        (["--model.hf.text_config.hidden_size", "[1"], "model.hf.text_config.hidden_size: cannot parse '[1'"),
        (["--model.hf", "3"], "model.hf: expected a mapping, got 3 (int)"),
        (["--model.hf", "[1"], "model.hf: cannot parse '[1'"),
    ],
)
def test_bad_nested_overrides_are_config_errors_naming_the_key(override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(VL, override, world_size=1)


@pytest.mark.parametrize(
    ("path", "sp", "key", "heads"),
    [
        (VL, 3, "model.hf.text_config.num_attention_heads", 4),
        (VL, 4, "model.hf.text_config.num_key_value_heads", 2),
        (TEXT, 3, "model.hf.num_attention_heads", 4),
        (TEXT, 4, "model.hf.num_key_value_heads", 2),
    ],
)
def test_sp_size_that_does_not_split_the_heads_is_a_config_error(path, sp, key, heads):
    message = f"parallel.sp_size ({sp}) does not divide {key} ({heads})"
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(path, ["--parallel.sp_size", str(sp)], world_size=sp)
    assert not dist.is_initialized()
    load_config(path, ["--parallel.sp_size", "2"], world_size=2)  # divides both


TEXT_ENTRY = {"tiny": TextTrainer, "*": PydocLMTrainer}  # trainers/train_text.py
VLM_ENTRY = {"qwen2_vl": DigitsVLTrainer, "tiny": VLMTrainer}  # trainers/train_vlm.py


class NeverBuilt:
    def __init__(self, *_args, **_kwargs) -> None:
        raise AssertionError("a trainer was built after a config error")


def test_entry_points_match_the_shipped_trainers():
    for entry, mapping in (("train_text.py", TEXT_ENTRY), ("train_vlm.py", VLM_ENTRY)):
        source = (REPO / "trainers" / entry).read_text()
        expected = ", ".join(f'"{arch}": {cls.__name__}' for arch, cls in mapping.items())
        assert f"main({{{expected}}})" in source, entry


@pytest.mark.parametrize(
    ("mapping", "config", "arch"),
    [(TEXT_ENTRY, VL, "qwen2_vl"), (VLM_ENTRY, TEXT, "qwen2"), (TEXT_ENTRY, str(REPO / "configs/vlm_tiny.yaml"), "")],
)
def test_launch_refuses_an_arch_the_entry_does_not_train(capsys, mapping, config, arch):
    never = dict.fromkeys(mapping, NeverBuilt)
    if arch:
        assert launch.main(never, [config]) == 2
        err = capsys.readouterr().err
        assert err.startswith("config error: model.arch: ")
        names = sorted(name if name != "*" else "any causal LM (qwen2, llama, ...)" for name in mapping)
        assert f"trains {names}, not {arch!r}" in err
    else:  # vlm_tiny.yaml is arch tiny: the text entry accepts it (and builds its trainer)
        with pytest.raises(AssertionError, match="a trainer was built"):
            launch.main(never, [config])
    assert not dist.is_initialized()


def test_launch_config_error_from_the_heads_exits_2_before_any_process_group(capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert launch.main(dict.fromkeys(VLM_ENTRY, NeverBuilt), [VL, "--parallel.sp_size", "3"]) == 2
    assert "model.hf.text_config.num_attention_heads (4)" in capsys.readouterr().err
    assert not dist.is_initialized()


@pytest.mark.slow
def test_train_text_entry_refuses_the_vl_config():
    result = subprocess.run(
        [sys.executable, "trainers/train_text.py", "configs/qwen2_vl_digits.yaml"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 2, result.stderr[-3000:]
    expected = "trains ['any causal LM (qwen2, llama, ...)', 'tiny'], not 'qwen2_vl'"
    assert f"config error: model.arch: trainers/train_text.py {expected}" in result.stderr
