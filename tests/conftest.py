"""Fixtures shared by the test files."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`examples/sft_demo.py`'s files, written once per session: the digits (messages JSONL + PNGs), the help pages
    (sharegpt JSONL) and the tiny Qwen2-VL and Qwen2 directories (a file may override it with a variant)."""
    from examples.sft_demo import write_demo

    return write_demo(tmp_path_factory.mktemp("sft_demo"))


@pytest.fixture(scope="session")
def families_demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The digits on disk and a tiny directory of each vision-language family under `models/<family>` (Qwen2-VL,
    Qwen2.5-VL, Qwen3-VL), written once per session."""
    from examples.sft_demo import PROMPT, WORDS, write_digits, write_vl_model

    out = tmp_path_factory.mktemp("families")
    texts = write_digits(out / "digits")
    assert texts == [PROMPT, *(f"a handwritten {word}" for word in WORDS)]
    for family in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl"):
        write_vl_model(out / "models" / family, texts, family)
    return out
