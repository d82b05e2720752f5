"""KTO's unpaired rows (`pref.loss: kto`, {prompt, completion, label}): each is stored as a pair whose rejected side
is the prompt with the previous row's completion (cyclic, across files and blank lines), encoded exactly as the
explicit pair {prompt, chosen: completion, rejected: that completion} would be; the label rides in the margin column
and reaches the batch at the row's anchor; a non-boolean label or a missing completion is a named DataError."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from examples.preference_pairs import help_pairs, write_jsonl
from tests.pref.test_preference_data import encoder, read, sides  # noqa: F401 - the module fixture
from veomni_lite.data.checks import DataError
from veomni_lite.data.collator import collate
from veomni_lite.data.sft import read_sources
from veomni_lite.preference.losses import KTO_LABELS, PREF_STARTS
from veomni_lite.preference.pairs import PairDataset, PairEncoder, collate_pairs

LABELS = [True, False, False, True, True]


def kto_rows() -> list[dict]:
    return [{"prompt": r["prompt"], "completion": r["chosen"], "label": label}
            for r, label in zip(help_pairs(len(LABELS)), LABELS)]  # fmt: skip


def test_kto_rows_are_pairs_with_the_previous_rows_completion(encoder, tmp_path):  # noqa: F811
    rows = kto_rows()
    first = write_jsonl(tmp_path / "a.jsonl", rows[:2])
    second = tmp_path / "b.jsonl"  # a blank line: no row, skipped by the rotation
    second.write_text("".join(json.dumps(row) + "\n" for row in rows[2:3]) + "\n"
                      + "".join(json.dumps(row) + "\n" for row in rows[3:]))  # fmt: skip
    kto = PairDataset(PairEncoder(read_sources([str(first), str(second)], "data.train_path"), encoder, {}, kto=True))
    previous = [rows[(i - 1) % len(rows)]["completion"] for i in range(len(rows))]
    explicit = [{"prompt": r["prompt"], "chosen": r["completion"], "rejected": p} for r, p in zip(rows, previous)]
    pairs = read(write_jsonl(tmp_path / "explicit.jsonl", explicit), encoder)
    assert [s[:2] for s in sides(kto)] == [s[:2] for s in sides(pairs)]
    assert [kto.margin(i) for i in range(len(kto))] == [float(label) for label in LABELS]
    items = [kto[i] for i in range(len(kto))]
    assert [item["label"] for item in items] == LABELS and all("margin" not in item for item in items)
    for packing in (False, True):
        batch = collate_pairs(items, lambda s, p=packing: collate(s, packing=p))
        assert batch[KTO_LABELS][batch[PREF_STARTS]].tolist() == [float(label) for label in LABELS]
        assert batch[KTO_LABELS].sum() == sum(LABELS) and batch[KTO_LABELS].dtype == torch.float64


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"label": "yes"}, "column 'label' is 'yes', not true (desirable) or false (pref.loss kto)"),
        ({"completion": ""}, "missing completion: column 'completion' is absent or empty"),
        ({"prompt": None}, "missing prompt: column 'prompt' is absent or empty"),
    ],
)
def test_a_bad_kto_row_is_a_named_error(encoder, tmp_path: Path, change: dict, message: str):  # noqa: F811
    rows = kto_rows()
    rows[2].update(change)
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(DataError) as error:
        read(path, encoder, kto=True)
    assert str(error.value).startswith(f"{path}, row 2 (0-based): {message}"), str(error.value)
