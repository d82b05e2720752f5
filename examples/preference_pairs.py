"""Preference pairs written from our demo data, for the tests and `make train-dpo`.

`write_help_pairs`: the help pages' questions (`examples/sft_demo.py`) with the paragraph's opening as the chosen
answer and another topic's as the rejected one, in TRL's explicit (prompt / chosen / rejected) or implicit (two
conversations sharing their prompt) layout.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any


def help_pairs(count: int, seed: int = 0, chars: int = 48) -> list[dict[str, Any]]:
    """`count` explicit rows: a help topic's question, its paragraph's first `chars` characters, another's."""
    from pydoc_data.topics import topics

    names = sorted(topics)
    rng = random.Random(seed)
    rows = []
    for name in rng.sample(names, count):
        other = rng.choice([n for n in names if n != name])
        answer, wrong = (topics[n].strip().split("\n\n")[0][:chars] for n in (name, other))
        question = f"Show paragraph 1 of the Python help topic {name!r}."
        rows.append({"prompt": question, "chosen": answer, "rejected": wrong})
    return rows


def implicit(row: dict[str, Any]) -> dict[str, Any]:
    """An explicit row as TRL's implicit layout: two whole conversations sharing the prompt message."""
    return {
        side: [{"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": row[side]}]
        for side in ("chosen", "rejected")
    }


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def digit_pairs(digits_dir: Path, count: int) -> list[dict[str, Any]]:
    """`count` vision-language rows from the digits (`examples/sft_demo.py`): the image and question as the prompt
    messages, the right caption chosen, the next digit's word rejected, the image path absolute."""
    from examples.sft_demo import WORDS

    rows = [json.loads(line) for line in (digits_dir / "train.jsonl").read_text().splitlines()[:count]]
    out = []
    for row in rows:
        right = row["messages"][1]["content"]
        wrong = "a handwritten " + WORDS[(WORDS.index(right.split()[-1]) + 1) % len(WORDS)]
        images = [str(digits_dir / path) for path in row["images"]]
        out.append({"prompt": row["messages"][:1], "chosen": right, "rejected": wrong, "images": images})
    return out
