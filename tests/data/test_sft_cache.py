"""The SFT cache: a hit reads the same samples without encoding a row, every changed input is a miss (never a stale
read), a half-written cache is never read, two gloo ranks share the rows and a bad row in one rank's share is the
same error on both, image token counts from the header equal the processor's grid, and the cache is Arrow + JSON."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch

from examples.sft_demo import write_tokenizer
from tests.dist_helpers import run_distributed, run_ranks
from veomni_lite.data import sft_cache
from veomni_lite.data.checks import DataError
from veomni_lite.data.sft import ChatEncoder, image_reference, open_image, read_sources
from veomni_lite.data.sft_dataset import ImageProcessing, RowEncoder, SFTDataset

TEXTS = ["Hello there", "General Kenobi", "You are a bold one", "What digit is this?", "a handwritten seven"]
IMAGE_TOKEN = "<|image_pad|>"


def png(size: tuple[int, int] = (8, 8), value: int = 128) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("L", size, color=value).save(buffer, format="PNG")
    return buffer.getvalue()


def processing(**settings: int) -> ImageProcessing:
    from transformers import Qwen2VLImageProcessor

    options = {"patch_size": 2, "temporal_patch_size": 1, "merge_size": 2, "min_pixels": 64, "max_pixels": 4096}
    return ImageProcessing(Qwen2VLImageProcessor(**{**options, **settings}))


def row(index: int) -> dict:
    """A row every format and column choice of `CHANGES` reads: messages, a renamed messages column, sharegpt."""
    turns = [
        {"role": "user", "content": f"<image>Hello there{' one' * index}"},
        {"role": "assistant", "content": "Kenobi"},
    ]
    return {
        "messages": turns,
        "dialog": [{"role": "user", "content": "<image>You are"}, {"role": "assistant", "content": "a bold one"}],
        "conversations": [{"from": "human", "value": "<image>Hello"}, {"from": "gpt", "value": "General Kenobi"}],
        "images": ["a.png"],
    }


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("tokenizers")
    return {
        "base": write_tokenizer(root / "base", TEXTS * 20, vocab_size=300),
        "other": write_tokenizer(root / "other", TEXTS * 20, vocab_size=280),
    }


def inputs(tmp_path: Path, tokenizers: dict) -> dict:
    (tmp_path / "a.png").write_bytes(png((8, 8)))
    (tmp_path / "media").mkdir(exist_ok=True)
    (tmp_path / "media" / "a.png").write_bytes(png((16, 12)))
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(row(i)) + "\n" for i in range(6)))
    return {
        "path": data,
        "tokenizer": tokenizers["base"],
        "chat_template": "",
        "train_on_prompt": False,
        "fmt": "messages",
        "columns": {},
        "max_seq_len": 0,
        "overlength": "truncate",
        "media_dir": "",
        "images": processing(),
    }


def build(settings: dict, cache_dir: Path | None) -> SFTDataset:
    encoder = ChatEncoder(
        settings["tokenizer"], settings["chat_template"], settings["train_on_prompt"], image_token=IMAGE_TOKEN
    )
    options = {k: settings[k] for k in ("fmt", "columns", "max_seq_len", "overlength", "media_dir", "images")}
    return SFTDataset(
        RowEncoder(read_sources(str(settings["path"]), "data.train_path"), encoder, **options), cache_dir=cache_dir
    )


def contents(dataset: SFTDataset) -> list[tuple]:
    out = []
    for index in range(len(dataset)):
        sample = dataset[index]
        grid = sample.get("image_grid_thw", torch.zeros(0)).tolist()
        out.append((dataset.where(index), sample["input_ids"].tolist(), sample["labels"].tolist(), grid))
    return out


def test_a_second_build_reads_the_cache_without_encoding_a_row(tmp_path, tokenizers, monkeypatch):
    settings = inputs(tmp_path, tokenizers)
    first = build(settings, tmp_path / "cache")
    assert not first.found
    monkeypatch.setattr(ChatEncoder, "encode", lambda *args: pytest.fail("a cache hit encodes no row"))
    again = build(settings, tmp_path / "cache")
    assert again.found and again.directory == first.directory
    assert contents(again) == contents(first)
    monkeypatch.undo()
    assert contents(first) == contents(build(settings, None)), "the cache holds what a private build holds"
    assert first[0]["input_ids"].dtype == torch.int64 and first.length(0) == len(first[0]["input_ids"])


def _edit(settings: dict, tmp_path: Path, old: SFTDataset) -> None:
    settings["path"].write_text(settings["path"].read_text() + json.dumps(row(6)) + "\n")


CHANGES = {
    "file": _edit,
    "format": lambda s, *_: s.update(fmt="sharegpt"),
    "columns": lambda s, *_: s.update(columns={"messages": "dialog"}),
    "media_dir": lambda s, tmp, _: s.update(media_dir=str(tmp / "media")),
    "tokenizer": lambda s, *_: s.update(tokenizer=s["other_tokenizer"]),
    "chat_template": lambda s, *_: s.update(chat_template="chatml"),
    "image_processor": lambda s, *_: s.update(images=processing(min_pixels=256)),
    "max_seq_len": lambda s, _, old: s.update(max_seq_len=old.length(2)),
    "overlength": lambda s, *_: s.update(overlength="drop"),
    "train_on_prompt": lambda s, *_: s.update(train_on_prompt=True),
}


@pytest.mark.parametrize("change", [*CHANGES, "code_version"])
def test_each_changed_input_is_a_new_cache_and_never_a_stale_read(tmp_path, tokenizers, monkeypatch, change):
    settings = inputs(tmp_path, tokenizers)
    settings["other_tokenizer"] = tokenizers["other"]
    if change == "overlength":
        settings["max_seq_len"] = build(settings, None).length(2)  # so that overlength is what changes
    old = build(settings, tmp_path / "cache")
    if change == "code_version":
        monkeypatch.setattr(sft_cache, "CACHE_VERSION", sft_cache.CACHE_VERSION + 1)
    else:
        CHANGES[change](settings, tmp_path, old)
    new = build(settings, tmp_path / "cache")
    assert not new.found and new.directory != old.directory
    expected = contents(build(settings, None))
    assert contents(new) == expected
    if change != "code_version":
        assert contents(old) != expected, "the change changes the samples, so a stale read would show"


def test_negative_control_a_key_without_max_seq_len_reads_a_stale_cache(tmp_path, tokenizers, monkeypatch):
    """Shows the test above would catch a key that misses an input."""
    settings = inputs(tmp_path, tokenizers)
    original = sft_cache.fingerprint
    monkeypatch.setattr(sft_cache, "fingerprint", lambda key: original({**key, "max_seq_len": None}))
    old = build(settings, tmp_path / "cache")
    settings["max_seq_len"] = old.length(2)
    stale = build(settings, tmp_path / "cache")
    assert stale.found and contents(stale) != contents(build(settings, None))


def test_a_half_written_cache_is_never_read(tmp_path, tokenizers, monkeypatch):
    settings = inputs(tmp_path, tokenizers)
    calls = []

    def crash_after_two(self, *args):
        calls.append(1)
        if len(calls) > 2:
            raise KeyboardInterrupt  # killed mid-write: nothing catches it
        return original(self, *args)

    original = RowEncoder.__call__
    monkeypatch.setattr(RowEncoder, "__call__", crash_after_two)
    with pytest.raises(KeyboardInterrupt):
        build(settings, tmp_path / "cache")
    monkeypatch.undo()
    leftovers = list((tmp_path / "cache").iterdir())
    assert [p.name.startswith(".tmp-") for p in leftovers] == [True], "only a temporary directory is left"
    whole = build(settings, tmp_path / "cache")
    assert not whole.found and len(whole) == 6
    (whole.directory / "shard-00000.arrow").unlink()  # a directory that lost a shard (by hand) is not complete
    rebuilt = build(settings, tmp_path / "cache")
    assert not rebuilt.found and contents(rebuilt) == contents(build(settings, None))


def test_the_cache_is_arrow_and_json_only(tmp_path, tokenizers):
    import datasets

    dataset = build(inputs(tmp_path, tokenizers), tmp_path / "cache")
    assert sorted(p.name for p in dataset.directory.iterdir()) == ["meta.json", "shard-00000.arrow"]
    meta = json.loads((dataset.directory / "meta.json").read_text())
    assert meta["counts"] == {"rows": 6, "truncated": 0, "dropped": 0, "samples": 6}
    shard = datasets.Dataset.from_file(str(dataset.directory / "shard-00000.arrow"))
    assert shard.features["input_ids"].feature.dtype == "int32" and len(shard) == 6
    assert shard[0]["images"][0]["path"] == str((tmp_path / "a.png").resolve())
    assert shard[0]["image_tokens"] == [4]


# ---------------------------------------------------------------- images from their header


@pytest.mark.parametrize(
    "settings",
    [
        {},
        {"patch_size": 14, "merge_size": 2, "min_pixels": 56 * 56, "max_pixels": 28 * 28 * 1280},
        {"min_pixels": 1024, "max_pixels": 2048},
    ],
)
def test_image_token_counts_from_the_header_equal_the_processed_grid(settings):
    images = processing(**settings)
    for size in [(8, 8), (7, 13), (64, 9), (300, 2), (100, 100), (640, 480), (37, 1100)]:
        reference = image_reference(png(size), Path("."), "row 0")
        header_only = open_image(reference, "row 0", decode=False)
        grid = images([open_image(reference, "row 0")])["image_grid_thw"]
        assert images.token_count(header_only) == images.token_counts(grid)[0], (settings, size)


def test_the_pre_pass_decodes_no_image_and_a_bad_one_is_an_error_naming_the_row_when_read(
    tmp_path, tokenizers, monkeypatch
):
    from PIL import ImageFile

    settings = inputs(tmp_path, tokenizers)
    (tmp_path / "a.png").write_bytes(png((8, 8))[:45])  # the header intact, the pixels cut off
    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda self: pytest.fail("the pre-pass decodes no image"))
    dataset = build(settings, tmp_path / "cache")
    assert dataset.length(0) == len(dataset.tokens(0)[0])
    monkeypatch.undo()
    with pytest.raises(DataError, match=rf"{settings['path']}, row 3 \(0-based\): image .*a.png' does not decode"):
        dataset[3]


# ---------------------------------------------------------------- two ranks


def _two_ranks(rank: int, world_size: int, tmp: Path, tokenizer_dir: Path, bad_row: int) -> object:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    rows = [json.dumps({"messages": [{"role": "user", "content": f"Hi {i}"}, {"role": "assistant", "content": "Yo"}]})
            for i in range(10)]  # fmt: skip
    if bad_row >= 0:
        rows[bad_row] = json.dumps({"conversations": []})
    path = tmp / f"data{bad_row}.jsonl"
    if rank == 0 and not path.exists():  # the same file (and time) for a second run
        path.write_text("\n".join(rows) + "\n")
    torch.distributed.barrier()
    try:
        dataset = SFTDataset(
            RowEncoder(read_sources(str(path), "k"), ChatEncoder(tokenizer), "messages", {}, 0), cache_dir=tmp / "c"
        )
    except DataError as exc:
        return str(exc)
    return {"found": dataset.found, "where": [dataset.where(i) for i in range(len(dataset))],
            "ids": [dataset[i]["input_ids"].tolist() for i in range(len(dataset))],
            "meta": json.loads((dataset.directory / "meta.json").read_text())}  # fmt: skip


@pytest.mark.slow
def test_two_ranks_share_the_rows_and_a_bad_row_in_one_share_is_the_same_error_on_both(tmp_path, tokenizers):
    tokenizer_dir = tmp_path / "tokenizer"
    tokenizers["base"].save_pretrained(str(tokenizer_dir))
    first, second = run_distributed(_two_ranks, 2, tmp_path, tokenizer_dir, -1, timeout_s=120)
    assert first["where"] == second["where"] == [f"{tmp_path / 'data-1.jsonl'}, row {i} (0-based)" for i in range(10)]
    assert first["ids"] == second["ids"] and not first["found"]
    assert [s["samples"] for s in first["meta"]["shards"]] == [5, 5], "each rank wrote its share"
    again = run_distributed(_two_ranks, 2, tmp_path, tokenizer_dir, -1, timeout_s=120)
    assert all(r["found"] and r["ids"] == first["ids"] for r in again)
    for bad_row in (1, 8):  # in rank 0's share, then in rank 1's
        outcomes = run_ranks(_two_ranks, 2, tmp_path, tokenizer_dir, bad_row, timeout_s=120)
        messages = [value for _, value in outcomes.values()]
        assert all(status == "ok" for status, _ in outcomes.values()), outcomes
        assert messages[0] == messages[1], "the same error on both ranks"
        assert messages[0].startswith(f"{tmp_path / f'data{bad_row}.jsonl'}, row {bad_row} (0-based): missing column")
    assert not [p for p in (tmp_path / "c").iterdir() if p.name.startswith(".tmp-")], "a failed build cleans up"
