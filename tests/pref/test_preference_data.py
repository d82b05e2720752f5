"""`data.format: preference`: TRL's explicit and implicit layouts encode alike, through the chat template, with
only the responses as targets; jsonl, json and parquet read alike; bad rows are DataErrors naming the file and row;
`data.overlength` truncates, drops or refuses a side, and a pair over the token budget. The pairs go through the SFT
Arrow cache: a second build reads it without encoding a row, every changed input is a new cache, two gloo ranks
share the rows and a bad pair in one share is the same error on both, a VL pair's images are referenced, not decoded,
at build time, and a tool-calling prompt keeps its calls, results and the row's tools."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from examples.preference_pairs import digit_pairs, help_pairs, implicit, write_jsonl
from tests.dist_helpers import run_distributed, run_ranks
from veomni_lite.data.checks import DataError
from veomni_lite.data.sft import ChatEncoder, read_sources
from veomni_lite.loss_keys import IGNORE_INDEX
from veomni_lite.models.pretrained import load_tokenizer
from veomni_lite.preference.losses import PREF_LABELS
from veomni_lite.preference.pairs import SIDES, PairDataset, PairEncoder


@pytest.fixture(scope="module")
def encoder(demo: Path) -> ChatEncoder:
    directory = demo / "models/qwen2_help"
    return ChatEncoder(load_tokenizer(directory), model_dir=directory)


def read(path: Path, encoder: ChatEncoder, cache_dir: Path | None = None, **options) -> PairDataset:
    """The pairs of `path` (a private cache unless `cache_dir`)."""
    rows = PairEncoder(read_sources(str(path), "data.train_path"), encoder, options.pop("columns", {}), **options)
    return PairDataset(rows, cache_dir)


def sides(pairs: PairDataset) -> list[tuple]:
    """Every pair's ((chosen ids, labels), (rejected ids, labels), margin, name) as lists."""
    out = []
    for index in range(len(pairs)):
        tokens = tuple(tuple(part.tolist() for part in pairs.side(index, which)) for which in ("chosen", "rejected"))
        out.append((*tokens, pairs.margin(index), pairs.where(index)))
    return out


def test_explicit_and_implicit_rows_encode_alike_with_only_the_responses_trained(encoder, tmp_path):
    rows = help_pairs(4)
    explicit = read(write_jsonl(tmp_path / "explicit.jsonl", rows), encoder)
    implicit_set = read(write_jsonl(tmp_path / "implicit.jsonl", [implicit(r) for r in rows]), encoder)
    assert len(explicit) == len(implicit_set) == 4
    tokenizer = encoder.tokenizer
    for a, b, row in zip(sides(explicit), sides(implicit_set), rows):
        assert a[:2] == b[:2]
        for (ids, labels), side in zip(a[:2], ("chosen", "rejected")):
            trained = [t for t in labels if t != IGNORE_INDEX]
            assert tokenizer.decode(trained).startswith(row[side])  # the response (and its end of turn) only
            prompt = len(ids) - len(trained)
            assert row["prompt"] in tokenizer.decode(ids[:prompt])
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": row["prompt"]}], tokenize=False,
                                                 add_generation_prompt=True)  # fmt: skip
        prompt_ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
        assert a[0][0][: len(prompt_ids)] == a[1][0][: len(prompt_ids)] == prompt_ids  # one shared prompt
    item = explicit[0]  # what collate_pairs takes: int64 sides, no margin in these rows
    assert sorted(item) == ["chosen", "rejected"] and sorted(item["chosen"]) == ["input_ids", PREF_LABELS]
    assert item["chosen"]["input_ids"].tolist() == sides(explicit)[0][0][0]
    assert item["chosen"]["input_ids"].dtype == item["chosen"][PREF_LABELS].dtype == torch.int64
    assert explicit.length(0) == 2 * max(len(explicit.side(0, w)[0]) for w in ("chosen", "rejected"))


def test_jsonl_json_and_parquet_read_alike(encoder, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = help_pairs(3)
    (tmp_path / "rows.json").write_text(json.dumps(rows))
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "rows.parquet")
    sets = [read(path, encoder) for path in (write_jsonl(tmp_path / "rows.jsonl", rows), tmp_path / "rows.json",
                                             tmp_path / "rows.parquet")]  # fmt: skip
    assert [s[:2] for s in sides(sets[0])] == [s[:2] for s in sides(sets[1])] == [s[:2] for s in sides(sets[2])]


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda row: row.pop("rejected"), "missing side: column 'rejected'"),
        (lambda row: row.update(chosen=""), "missing side: column 'chosen'"),
        (lambda row: row.update(rejected=row["chosen"]), "identical sides"),
        (lambda row: row.update(margin="big"), "column 'margin' is 'big', not a number"),
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
    whole = read(path, encoder)
    limit = max(len(whole.side(i, "rejected")[0]) for i in range(3)) + 2
    assert len(whole.side(1, "chosen")[0]) > limit
    truncated = read(path, encoder, max_seq_len=limit, overlength="truncate")
    assert truncated.stats.dropped == 0 and truncated.stats.truncated == 1
    assert len(truncated.side(1, "chosen")[0]) == limit
    kept = read(path, encoder, max_seq_len=limit, overlength="drop")
    assert kept.stats.dropped == 1 and len(kept) == 2
    assert [kept.where(i) for i in range(2)] == [f"{path}, row {r} (0-based)" for r in (0, 2)]
    with pytest.raises(DataError, match=r"long.jsonl, row 1 \(0-based\): the chosen side has \d+ tokens, over"):
        read(path, encoder, max_seq_len=limit, overlength="error")
    prompt = int((whole.side(0, "chosen")[1] == IGNORE_INDEX).sum())
    with pytest.raises(
        DataError, match=rf"row \d \(0-based\): the prompt alone fills data.max_seq_len={prompt}; the chosen side"
    ):
        read(path, encoder, max_seq_len=prompt, overlength="truncate")


# ---------------------------------------------------------------- the token budget


@pytest.mark.parametrize("packing", [True, False])
def test_a_pair_over_the_token_budget_follows_overlength(encoder, tmp_path, packing):
    """The pair's cost (packed: both sides; padded: two rows of the longer) against data.max_tokens_per_micro_batch:
    error names the row, drop leaves it out (counted), truncate cuts the sides until the pair fits."""
    rows = help_pairs(3, chars=48)
    rows[1]["chosen"] = rows[1]["chosen"] * 6
    path = write_jsonl(tmp_path / "long.jsonl", rows)
    whole = read(path, encoder, packing=packing)
    costs = [whole.length(i) for i in range(3)]
    budget = max(costs[0], costs[2], 2 * len(whole.side(1, "rejected")[0])) + 1  # only pair 1 is over
    assert costs[1] > budget
    options = {"max_tokens": budget, "packing": packing}
    with pytest.raises(DataError, match=rf"long.jsonl, row 1 \(0-based\): the pair takes {costs[1]} tokens \("
                                        rf"{'packed' if packing else 'padded'}.*max_tokens_per_micro_batch={budget} "
                                        r"\(data.overlength: error\)"):  # fmt: skip
        read(path, encoder, overlength="error", **options)
    dropped = read(path, encoder, overlength="drop", **options)
    assert len(dropped) == 2 and dropped.stats.dropped == 1
    fitted = read(path, encoder, overlength="truncate", **options)
    assert fitted.stats.truncated == 1 and len(fitted) == 3
    assert fitted.length(1) <= budget and [fitted.length(i) for i in (0, 2)] == [costs[0], costs[2]]
    for which in ("chosen", "rejected"):
        ids, labels = fitted.side(1, which)
        assert (labels != IGNORE_INDEX).any(), "each side keeps a response token"
        assert ids.tolist() == whole.side(1, which)[0][: len(ids)].tolist(), "cut at the end"
    if packing:  # the longer side is cut first: the shorter stays whole while it fits
        assert fitted.side(1, "rejected")[0].tolist() == whole.side(1, "rejected")[0].tolist()
    prompt = int((whole.side(0, "chosen")[1] == IGNORE_INDEX).sum())
    with pytest.raises(DataError, match=r"row \d \(0-based\): the prompt alone fills the \d+ tokens a side keeps "
                                        r"under data.max_tokens_per_micro_batch"):  # fmt: skip
        read(path, encoder, overlength="truncate", max_tokens=prompt + 1, packing=packing)


# ---------------------------------------------------------------- the cache


def test_a_second_build_reads_the_cache_without_encoding_a_row(encoder, tmp_path, monkeypatch):
    rows = help_pairs(6)
    rows[1]["margin"] = 0.5
    path = write_jsonl(tmp_path / "pairs.jsonl", rows[:3] + [implicit(r) for r in rows[3:]])
    first = read(path, encoder, tmp_path / "cache")
    assert not first.found and sides(first)[1][2] == 0.5 and sides(first)[0][2] is None
    calls = []
    original = PairEncoder.__call__
    monkeypatch.setattr(PairEncoder, "__call__", lambda *args: calls.append(1) or original(*args))
    again = read(path, encoder, tmp_path / "cache")
    assert again.found and again.directory == first.directory and calls == []
    assert sides(again) == sides(first)
    assert sides(read(path, encoder)) == sides(first) and len(calls) == 6, "a private build encodes every row"
    assert again[1]["margin"] == 0.5 and "margin" not in again[0]
    shard = again.directory / "shard-00000.arrow"
    assert sorted(p.name for p in again.directory.iterdir()) == ["meta.json", shard.name]


def longest_side(pairs: PairDataset) -> int:
    return max(len(pairs.side(i, which)[0]) for i in range(len(pairs)) for which in ("chosen", "rejected"))


def _append(path: Path) -> None:
    path.write_text(path.read_text() + json.dumps(help_pairs(5)[4]) + "\n")


CHANGES = {  # (path, options, the pairs before) -> the change
    "file": lambda path, options, old: _append(path),
    "columns": lambda path, options, old: options.update(columns={"chosen": "rejected", "rejected": "chosen"}),
    "max_seq_len": lambda path, options, old: options.update(max_seq_len=longest_side(old) - 1),
    "overlength": lambda path, options, old: options.update(overlength="drop"),
    "budget": lambda path, options, old: options.update(max_tokens=options["max_tokens"] - 1),
    "packing": lambda path, options, old: options.update(packing=True),  # another cost rule: only the key changes
}


@pytest.mark.parametrize("change", CHANGES)
def test_each_changed_input_is_a_new_cache(encoder, tmp_path, change):
    path = write_jsonl(tmp_path / "pairs.jsonl", help_pairs(4))
    whole = read(path, encoder)
    options = {"max_tokens": max(whole.length(i) for i in range(4))}
    if change == "overlength":
        options["max_seq_len"] = longest_side(whole) - 1  # a side truncated, then its pair dropped
    old = read(path, encoder, tmp_path / "cache", **options)
    CHANGES[change](path, options, old)
    new = read(path, encoder, tmp_path / "cache", **options)
    assert not new.found and new.directory != old.directory
    assert sides(new) == sides(read(path, encoder, **options))
    if change != "packing":
        assert sides(new) != sides(old), "the change changes the pairs, so a stale read would show"


def test_negative_control_a_key_without_the_budget_reads_a_stale_cache(encoder, tmp_path, monkeypatch):
    """Shows the test above would catch a key that misses an input."""
    path = write_jsonl(tmp_path / "pairs.jsonl", help_pairs(4))
    original = PairEncoder.key
    monkeypatch.setattr(PairEncoder, "key", lambda self: {**original(self), "max_tokens": 0, "packing": None})
    old = read(path, encoder, tmp_path / "cache")
    tight = max(old.length(i) for i in range(4)) - 1
    stale = read(path, encoder, tmp_path / "cache", max_tokens=tight)
    assert stale.found and max(stale.length(i) for i in range(4)) > tight


def _two_ranks(rank: int, world_size: int, tmp: Path, model_dir: Path, bad_row: int) -> object:
    import torch.distributed as dist

    rows = help_pairs(8)
    if bad_row >= 0:
        rows[bad_row]["rejected"] = rows[bad_row]["chosen"]
    path = tmp / f"pairs{bad_row}.jsonl"
    if rank == 0 and not path.exists():
        write_jsonl(path, rows)
    dist.barrier()
    try:
        pairs = read(path, ChatEncoder(load_tokenizer(model_dir), model_dir=model_dir), tmp / "cache")
    except DataError as exc:
        return str(exc)
    return {
        "found": pairs.found,
        "pairs": sides(pairs),
        "meta": json.loads((pairs.directory / "meta.json").read_text()),
    }


@pytest.mark.slow
def test_two_ranks_share_the_rows_and_a_bad_pair_in_one_share_is_the_same_error_on_both(demo, encoder, tmp_path):
    model = demo / "models/qwen2_help"
    first, second = run_distributed(_two_ranks, 2, tmp_path, model, -1, timeout_s=120)
    assert first["pairs"] == second["pairs"] == sides(read(tmp_path / "pairs-1.jsonl", encoder))
    assert not first["found"] and [s["samples"] for s in first["meta"]["shards"]] == [4, 4], "each rank its share"
    assert all(r["found"] for r in run_distributed(_two_ranks, 2, tmp_path, model, -1, timeout_s=120))
    outcomes = run_ranks(_two_ranks, 2, tmp_path, model, 6, timeout_s=120)  # row 6: in rank 1's share only
    assert all(status == "ok" for status, _ in outcomes.values()), outcomes
    messages = [outcomes[rank][1] for rank in (0, 1)]
    assert messages[0] == messages[1] == f"{tmp_path / 'pairs6.jsonl'}, row 6 (0-based): identical sides: chosen and " \
        "rejected are the same response"  # fmt: skip
    assert not [p for p in (tmp_path / "cache").iterdir() if p.name.startswith(".tmp-")], "a failed build cleans up"


# ---------------------------------------------------------------- tool calling


@pytest.mark.parametrize("layout", ["explicit", "implicit"])
def test_a_tool_calling_prompt_keeps_its_calls_results_and_tools_in_both_sides(tmp_path, layout):
    """A prompt in the standard tool-calling shape (assistant `tool_calls`, `tool` turns, the row's `tools`) renders
    as the model's template renders it with `tools=`, in both layouts; only the final answers train."""
    from tests.data.test_sft_tools import QWEN25, TOOLS, tool_row, tool_tokenizer

    tokenizer = tool_tokenizer(tmp_path / "model", QWEN25)
    prompt = tool_row()["messages"][:-1]  # system, user, the calls, their two results
    answers = {"chosen": "General Kenobi 37", "rejected": "General Kenobi 36"}
    row = {"prompt": prompt, "tools": TOOLS}
    row |= {side: [{"role": "assistant", "content": text}] for side, text in answers.items()}
    if layout == "implicit":
        row = {"tools": TOOLS, **{side: prompt + row[side] for side in answers}}
    pairs = read(write_jsonl(tmp_path / "pairs.jsonl", [row]), ChatEncoder(tokenizer), tmp_path / "cache")
    reference = tool_row(arguments_as_text=False)["messages"][:-1]  # the template's shape: dict arguments
    reference[2]["content"] = ""  # OpenAI's null content, as the encoder hands it to the template
    for which, text in answers.items():
        ids, labels = (part.tolist() for part in pairs.side(0, which))
        messages = reference + [{"role": "assistant", "content": text}]
        assert tokenizer.decode(ids) == tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False)
        assert tokenizer.decode([t for t in labels if t != IGNORE_INDEX]) == text + "<|im_end|>"
    # negative control: the prompt without its tool fields and tools renders otherwise (what was lost before)
    bare = [{"role": m["role"], "content": m["content"] or ""} for m in reference]
    plain = tokenizer.apply_chat_template(bare + [{"role": "assistant", "content": answers["chosen"]}], tokenize=False)
    assert tokenizer.decode(pairs.side(0, "chosen")[0].tolist()) != plain


def test_implicit_conversations_differing_only_in_a_tool_call_share_no_more_than_before_it(tmp_path):
    """The shared prompt of the implicit layout compares tool fields too: two conversations whose assistant turns
    differ only in their call's arguments have that turn in their responses, not in the prompt."""
    from tests.data.test_sft_tools import QWEN25, TOOLS, tool_row, tool_tokenizer

    tokenizer = tool_tokenizer(tmp_path / "model", QWEN25)
    chosen = tool_row()["messages"][:3]  # system, user, the calls
    rejected = json.loads(json.dumps(chosen))
    rejected[2]["tool_calls"][0]["function"]["arguments"] = json.dumps({"a": 1, "b": 3})
    row = {"tools": TOOLS, "chosen": chosen, "rejected": rejected}
    pairs = read(write_jsonl(tmp_path / "pairs.jsonl", [row]), ChatEncoder(tokenizer), tmp_path / "cache")
    trained = {w: tokenizer.decode([t for t in pairs.side(0, w)[1].tolist() if t != IGNORE_INDEX]) for w in SIDES}
    assert '"b": 2' in trained["chosen"] and '"b": 3' in trained["rejected"]


# ---------------------------------------------------------------- images


def test_vision_language_pair_images_are_referenced_not_decoded_at_build_time(demo, tmp_path, monkeypatch):
    from PIL import ImageFile

    from veomni_lite.data.sft_dataset import ImageProcessing
    from veomni_lite.models.pretrained import load_config, load_image_processor
    from veomni_lite.trainer.sft import image_token

    directory = demo / "models/qwen2_vl_digits"
    tokenizer = load_tokenizer(directory)
    placeholder = image_token(tokenizer, load_config(directory), str(directory))
    images = ImageProcessing(load_image_processor(directory))
    vl = ChatEncoder(tokenizer, "", False, placeholder, directory)
    path = write_jsonl(tmp_path / "vl.jsonl", digit_pairs(demo / "digits", 3))
    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda self: pytest.fail("the build decodes no image"))
    pairs = read(path, vl, tmp_path / "cache", images=images)
    references, tokens = pairs.image_references(0)
    assert references[0]["path"] == str(demo / "digits" / json.loads(path.read_text().splitlines()[0])["images"][0])
    monkeypatch.undo()
    item = pairs[0]
    assert item["chosen"]["pixel_values"] is item["rejected"]["pixel_values"], "decoded once, both sides see it"
    assert images.token_counts(item["chosen"]["image_grid_thw"]) == tokens
    placeholders = int((item["chosen"]["input_ids"] == vl.image_token_id).sum())
    assert placeholders == sum(tokens) == int((item["rejected"]["input_ids"] == vl.image_token_id).sum())


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--data.format", "messages"], "data.format: preference training reads pairs"),
        (["--pref.loss", "nca"], "pref.loss"),
        (["--pref.desirable_weight", "2"], "pref.desirable_weight: a weight > 0 of pref.loss kto"),
        (["--pref.loss", "kto", "--pref.undesirable_weight", "0"], "pref.undesirable_weight: a weight > 0"),
        (["--pref.loss", "kto", "--pref.orpo_lambda", "0.5"], "pref.orpo_lambda: a weight >= 0 of pref.loss orpo"),
        (["--pref.loss", "orpo", "--pref.rpo_alpha", "1"], "pref.rpo_alpha"),
        (["--pref.loss", "orpo", "--pref.precompute_reference", "true"], "pref.precompute_reference: .* orpo"),
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
    from veomni_lite.preference.config import PrefConfig

    model = str(demo / "models/qwen2_help")
    args = ["--model.arch", "auto", "--model.pretrained_dir", model, "--data.format", "preference",
            "--data.train_path", "pairs.jsonl", *extra]  # fmt: skip
    with pytest.raises(ConfigError, match=message):
        load_config(None, args, world_size=1, sections={"pref": PrefConfig})
