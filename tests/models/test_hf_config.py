"""Config and entry points of the transformers runs: nested `model.hf` overrides, the head check under SP before any
process group, and which entry point trains which `model.arch`."""

from __future__ import annotations

import re

import pytest

from tests.models.small_hf import CONFIGS
from veomni_lite.config import ConfigError, load_config

VL, TEXT = str(CONFIGS["vl"]), str(CONFIGS["text"])


def test_a_whole_mapping_from_the_command_line_replaces_the_field():
    config = load_config(
        TEXT, ["--model.hf", "{model_type: qwen2, hidden_size: 32, num_attention_heads: 2}"], world_size=1
    )
    assert config.model.hf == {"model_type": "qwen2", "hidden_size": 32, "num_attention_heads": 2}
    with pytest.raises(ConfigError, match=re.escape("model.hf.num_attention_heads (2)")):
        load_config(
            TEXT, ["--model.hf", "{model_type: qwen2, num_attention_heads: 2}", "--parallel.sp_size", "4"], world_size=4
        )
