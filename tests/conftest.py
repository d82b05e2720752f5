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
