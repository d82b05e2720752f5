"""`make train-lora`'s rows (examples/lora_demo.py): the digits' rows, answered with the numeral."""

from __future__ import annotations

import json
import shutil

from examples.lora_demo import write_numerals
from examples.sft_demo import WORDS


def test_the_numeral_rows_are_the_digits_rows_answered_with_the_digit(demo, tmp_path):
    (tmp_path / "digits").mkdir()
    for split in ("train", "eval"):
        shutil.copyfile(demo / "digits" / f"{split}.jsonl", tmp_path / "digits" / f"{split}.jsonl")
    assert write_numerals(tmp_path) == tmp_path / "digits"
    for split in ("train", "eval"):
        words = [json.loads(line) for line in (tmp_path / "digits" / f"{split}.jsonl").read_text().splitlines()]
        numerals = [
            json.loads(line) for line in (tmp_path / "digits" / f"numeral_{split}.jsonl").read_text().splitlines()
        ]
        assert len(numerals) == len(words) > 300
        for word, numeral in zip(words, numerals):
            expected = str(WORDS.index(word["messages"][-1]["content"].removeprefix("a handwritten ")))
            assert numeral["messages"][-1] == {"role": "assistant", "content": expected}
            assert numeral["messages"][:-1] == word["messages"][:-1] and numeral["images"] == word["images"]
