"""`data.format: preference`: TRL's explicit and implicit layouts encode alike, through the chat template, with
only the responses as targets; jsonl, json and parquet read alike; bad rows are DataErrors naming the file and row;
`data.overlength` truncates, drops or refuses a side."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from examples.preference_pairs import help_pairs, implicit, write_jsonl
from veomni_lite.data.checks import DataError
from veomni_lite.data.sft import ChatEncoder, read_sources
from veomni_lite.loss_keys import IGNORE_INDEX
from veomni_lite.models.pretrained import load_tokenizer
from veomni_lite.rl.preference_data import read_pairs


@pytest.fixture(scope="module")
def encoder(demo: Path) -> ChatEncoder:
    directory = demo / "models/qwen2_help"
    return ChatEncoder(load_tokenizer(directory), model_dir=directory)


def read(path: Path, encoder: ChatEncoder, **options):
    return read_pairs(read_sources(str(path), "data.train_path"), encoder, None, {}, **options)


def test_explicit_and_implicit_rows_encode_alike_with_only_the_responses_trained(encoder, tmp_path):
    rows = help_pairs(4)
    explicit, _ = read(write_jsonl(tmp_path / "explicit.jsonl", rows), encoder)
    implicit_set, _ = read(write_jsonl(tmp_path / "implicit.jsonl", [implicit(r) for r in rows]), encoder)
    assert len(explicit) == len(implicit_set) == 4
    tokenizer = encoder.tokenizer
    for a, b, row in zip(explicit.pairs, implicit_set.pairs, rows):
        assert (a.chosen, a.rejected) == (b.chosen, b.rejected)
        for side in ("chosen", "rejected"):
            ids, labels = getattr(a, side)
            trained = [t for t in labels if t != IGNORE_INDEX]
            assert tokenizer.decode(trained).startswith(row[side])  # the response (and its end of turn) only
            prompt = len(ids) - len(trained)
            assert row["prompt"] in tokenizer.decode(ids[:prompt])
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": row["prompt"]}], tokenize=False,
                                                 add_generation_prompt=True)  # fmt: skip
        prompt_ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
        assert a.chosen[0][: len(prompt_ids)] == a.rejected[0][: len(prompt_ids)] == prompt_ids  # one shared prompt


def test_jsonl_json_and_parquet_read_alike(encoder, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = help_pairs(3)
    (tmp_path / "rows.json").write_text(json.dumps(rows))
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "rows.parquet")
    sets = [read(path, encoder)[0] for path in (write_jsonl(tmp_path / "rows.jsonl", rows), tmp_path / "rows.json",
                                                tmp_path / "rows.parquet")]  # fmt: skip
    assert [p.chosen for p in sets[0].pairs] == [p.chosen for p in sets[1].pairs] == [p.chosen for p in sets[2].pairs]


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda row: row.pop("rejected"), "missing side: column 'rejected'"),
        (lambda row: row.update(chosen=""), "missing side: column 'chosen'"),
        (lambda row: row.update(rejected=row["chosen"]), "identical sides"),
    ],
)
def test_bad_explicit_rows_are_named(encoder, tmp_path, edit, message):
    rows = help_pairs(3)
    edit(rows[2])
    with pytest.raises(DataError, match=rf"bad.jsonl, row 2 \(0-based\): {message}"):
        read(write_jsonl(tmp_path / "bad.jsonl", rows), encoder)


def test_implicit_rows_without_a_shared_prefix_are_named(encoder, tmp_path):
    row = implicit(help_pairs(1)[0])
    row["rejected"][0]["content"] = "another question"
    with pytest.raises(DataError, match=r"row 0 \(0-based\): no shared prefix"):
        read(write_jsonl(tmp_path / "bad.jsonl", [row]), encoder)


def test_overlength_truncates_drops_or_refuses(encoder, tmp_path):
    rows = help_pairs(3, chars=48)
    rows[1]["chosen"] = rows[1]["chosen"] * 6
    path = write_jsonl(tmp_path / "long.jsonl", rows)
    whole, _ = read(path, encoder)
    limit = max(len(p.rejected[0]) for p in whole.pairs) + 2
    assert len(whole.pairs[1].chosen[0]) > limit
    truncated, dropped = read(path, encoder, max_seq_len=limit, overlength="truncate")
    assert dropped == 0 and len(truncated.pairs[1].chosen[0]) == limit
    kept, dropped = read(path, encoder, max_seq_len=limit, overlength="drop")
    assert dropped == 1 and len(kept) == 2
    with pytest.raises(DataError, match=r"long.jsonl, row 1 \(0-based\): the chosen side has \d+ tokens, over"):
        read(path, encoder, max_seq_len=limit, overlength="error")


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--data.format", "messages"], "data.format: preference training reads pairs"),
        (["--pref.loss", "kto"], "pref.loss"),
        (["--pref.loss", "hinge", "--pref.label_smoothing", "0.1"], "pref.label_smoothing: applies to sigmoid"),
        (["--pref.loss", "simpo", "--pref.precompute_reference", "true"], "pref.precompute_reference: .* simpo"),
        (["--pref.center_rewards", "0.01"], "pref.center_rewards"),
        (["--pref.loss", "bradley_terry", "--pref.rpo_alpha", "1"], "pref.rpo_alpha"),
        (["--loss.modes.pref", "token-mean"], "loss.modes.pref: the preference head is a mean over pairs"),
        (["--pref.beta", "0"], "pref.beta: must be > 0"),
        (["--data.streaming", "true"], "data.streaming: preference training reads data.train_path"),
    ],
)
def test_preference_configs_are_checked_before_any_process_group(demo, extra, message):
    from veomni_lite.config import ConfigError, load_config
    from veomni_lite.rl.preference import PrefConfig

    model = str(demo / "models/qwen2_help")
    args = ["--model.arch", "auto", "--model.pretrained_dir", model, "--data.format", "preference",
            "--data.train_path", "pairs.jsonl", *extra]  # fmt: skip
    with pytest.raises(ConfigError, match=message):
        load_config(None, args, world_size=1, sections={"pref": PrefConfig})
