"""The SFT data path on files the tests write: every file kind and format, the exact label mask on a known template,
images through Qwen2-VL's real image processor, lengths, and each bad input with the file and row it names."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from examples.sft_demo import write_tokenizer
from veomni_lite.data.checks import DataError
from veomni_lite.data.sft import CHATML, ChatEncoder, override_template, read_sources, to_conversation
from veomni_lite.data.sft_dataset import ImageProcessing, RowEncoder, SFTDataset
from veomni_lite.loss_keys import IGNORE_INDEX
from veomni_lite.models.pretrained import PretrainedDirError, load_config

TEXTS = ["Hello there", "General Kenobi", "You are a bold one", "What digit is this?", "a handwritten seven"]
CONVERSATION = [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": "General Kenobi"}]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return write_tokenizer(tmp_path_factory.mktemp("tokenizer"), TEXTS * 20, vocab_size=300)


@pytest.fixture(scope="module")
def image_processing():
    from transformers import Qwen2VLImageProcessor

    processor = Qwen2VLImageProcessor(patch_size=2, temporal_patch_size=1, merge_size=2, min_pixels=64, max_pixels=4096)
    return ImageProcessing(processor)


def trained_runs(tokenizer, ids: list[int], labels: list[int]) -> list[str]:
    """The decoded runs of consecutive trained tokens."""
    runs, current = [], []
    for token, label in zip(ids, labels):
        if label != IGNORE_INDEX:
            assert label == token, "labels are aligned with input_ids (the collator shifts them)"
            current.append(token)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    if current:
        runs.append(tokenizer.decode(current))
    return runs


def encode(tokenizer, row, fmt, columns=None, **options):
    conversation = to_conversation(row, fmt, columns or {}, "data.jsonl, row 0")
    encoded = ChatEncoder(tokenizer, **options).encode(conversation, [], "data.jsonl, row 0")
    return encoded, trained_runs(tokenizer, encoded.input_ids, encoded.labels)


# ---------------------------------------------------------------- formats and the label mask


@pytest.mark.parametrize(
    ("fmt", "row", "columns"),
    [
        ("messages", {"messages": CONVERSATION}, None),
        (
            "messages",
            {
                "dialog": [
                    {"speaker": "user", "text": "Hello there"},
                    {"speaker": "assistant", "text": "General Kenobi"},
                ]
            },
            {"messages": "dialog", "role": "speaker", "content": "text"},
        ),
        (
            "sharegpt",
            {"conversations": [{"from": "human", "value": "Hello there"}, {"from": "gpt", "value": "General Kenobi"}]},
            None,
        ),
        (
            "sharegpt",
            {"conversations": [{"from": "user", "value": "Hello there"}, {"from": "bot", "value": "General Kenobi"}]},
            {"user_tag": "user", "assistant_tag": "bot"},
        ),
        ("alpaca", {"instruction": "Hello there", "output": "General Kenobi"}, None),
        ("prompt_completion", {"prompt": "Hello there", "completion": "General Kenobi"}, None),
        ("prompt_completion", {"prompt": [CONVERSATION[0]], "completion": [CONVERSATION[1]]}, None),
    ],
    ids=["messages", "messages-renamed", "sharegpt", "sharegpt-tags", "alpaca", "prompt-completion", "pc-messages"],
)
def test_each_format_trains_exactly_the_assistant_reply_and_its_end_of_turn_token(tokenizer, fmt, row, columns):
    encoded, runs = encode(tokenizer, row, fmt, columns)
    assert runs == ["General Kenobi<|im_end|>"]
    rendered = tokenizer.apply_chat_template(CONVERSATION, tokenize=False)
    assert tokenizer.decode(encoded.input_ids) == rendered, "the tokens are the template's rendering"


def test_alpaca_input_system_and_history(tokenizer):
    row = {
        "system": "S",
        "instruction": "Hello",
        "input": "there",
        "output": "General Kenobi",
        "history": [["Hi", "Yo"]],
    }
    encoded, runs = encode(tokenizer, row, "alpaca")
    assert runs == ["Yo<|im_end|>", "General Kenobi<|im_end|>"]
    text = tokenizer.decode(encoded.input_ids)
    assert text.startswith("<|im_start|>system\nS<|im_end|>") and "Hello\n\nthere" in text


def test_messages_with_train_false_or_loss_weight_0_do_not_train(tokenizer):
    turns = [*CONVERSATION, {"role": "user", "content": "You are"}, {"role": "assistant", "content": "a bold one"}]
    for flag in ({"train": False}, {"loss_weight": 0}):
        row = {"messages": [turns[0], {**turns[1], **flag}, turns[2], turns[3]]}
        assert encode(tokenizer, row, "messages")[1] == ["a bold one<|im_end|>"]


def test_train_on_prompt_trains_every_token_and_text_format_trains_the_text(tokenizer):
    encoded, runs = encode(tokenizer, {"messages": CONVERSATION}, "messages", train_on_prompt=True)
    assert runs == [tokenizer.decode(encoded.input_ids)]
    assert encode(tokenizer, {"text": "You are a bold one"}, "text")[1] == ["You are a bold one<|im_end|>"]


def test_chatml_for_a_tokenizer_without_a_template(tokenizer):
    encoded, runs = encode(tokenizer, {"messages": CONVERSATION}, "messages", chat_template="chatml")
    assert runs == ["General Kenobi<|im_end|>"]
    assert tokenizer.chat_template != CHATML
    saved = override_template("chatml", "<|image_pad|>")  # as the export writes it: renders images on its own
    image_turn = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Which?"}]}]
    assert tokenizer.apply_chat_template(image_turn, chat_template=saved, tokenize=False).startswith(
        "<|im_start|>user\n<|image_pad|>Which?"
    )
    assert override_template("") == "" and override_template("{{ 'mine' }}") == "{{ 'mine' }}"


def test_a_template_that_is_not_prefix_stable_is_an_error_naming_the_row(tokenizer):
    unstable = "{{ messages | length }}" + CHATML  # the count at the top changes with every message
    with pytest.raises(DataError, match=r"data.jsonl, row 0: the chat template is not prefix-stable at message 1"):
        encode(tokenizer, {"messages": CONVERSATION}, "messages", chat_template=unstable)


# ---------------------------------------------------------------- files


def write_rows(tmp_path: Path, kind: str, rows: list[dict]) -> Path:
    import datasets

    if kind == "jsonl":
        path = tmp_path / "data.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    elif kind == "json":
        path = tmp_path / "data.json"
        path.write_text(json.dumps(rows))
    elif kind == "parquet":
        path = tmp_path / "data.parquet"
        datasets.Dataset.from_list(rows).to_parquet(str(path))
    elif kind == "arrow":
        saved = tmp_path / "saved"
        datasets.Dataset.from_list(rows).save_to_disk(str(saved))
        path = tmp_path / "data.arrow"
        next(saved.glob("*.arrow")).rename(path)
    else:
        path = tmp_path / "saved_dataset"
        datasets.Dataset.from_list(rows).save_to_disk(str(path))
    return path


@pytest.mark.parametrize("kind", ["jsonl", "json", "parquet", "arrow", "save_to_disk"])
def test_every_file_kind_reads_the_same_rows(tmp_path, tokenizer, kind):
    rows = [{"messages": CONVERSATION}, {"messages": [CONVERSATION[0], {"role": "assistant", "content": "x"}]}]
    path = write_rows(tmp_path, kind, rows)
    (source,) = read_sources(str(path), "data.train_path")
    assert source.num_rows == 2
    dataset = SFTDataset(RowEncoder([source], ChatEncoder(tokenizer), "messages", {}, max_seq_len=0))
    assert trained_runs(tokenizer, dataset[0]["input_ids"].tolist(), dataset[0]["labels"].tolist()) == [
        "General Kenobi<|im_end|>"
    ]


def test_paths_lists_directories_and_globs(tmp_path):
    for name in ("a.jsonl", "b.jsonl", "sub/c.jsonl"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(json.dumps({"text": name}) + "\n")
    assert len(read_sources(str(tmp_path), "data.train_path")) == 3
    assert len(read_sources(str(tmp_path / "*.jsonl"), "data.train_path")) == 2
    assert len(read_sources([str(tmp_path / "a.jsonl"), str(tmp_path / "sub")], "data.train_path")) == 2
    with pytest.raises(DataError, match="matches no file"):
        read_sources(str(tmp_path / "*.parquet"), "data.train_path")
    with pytest.raises(DataError, match="does not exist"):
        read_sources(str(tmp_path / "missing.jsonl"), "data.eval_path")


# ---------------------------------------------------------------- images


def png_bytes(value: int = 128) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("L", (8, 8), color=value).save(buffer, format="PNG")
    return buffer.getvalue()


def image_row(images, content=None) -> dict:
    content = content or [{"type": "image"}, {"type": "text", "text": "What digit is this?"}]
    return {
        "messages": [{"role": "user", "content": content}, {"role": "assistant", "content": "a handwritten seven"}],
        "images": images,
    }


def check_image_samples(tokenizer, dataset, images_per_sample):
    image_id = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    for index, expected_images in enumerate(images_per_sample):
        sample = dataset[index]
        assert sample["image_grid_thw"].tolist() == [[1, 4, 4]] * expected_images
        assert sample["pixel_values"].shape == (16 * expected_images, 3 * 1 * 2 * 2)
        placeholders = sample["input_ids"] == image_id
        assert int(placeholders.sum()) == 4 * expected_images, "16 patches merged 2 x 2 per image"
        assert (sample["labels"][placeholders] == IGNORE_INDEX).all(), "image placeholders never train"
        assert trained_runs(tokenizer, sample["input_ids"].tolist(), sample["labels"].tolist()) == [
            "a handwritten seven<|im_end|>"
        ]


def test_images_as_bytes_and_path_dicts_in_parquet_go_through_the_real_image_processor(
    tmp_path, tokenizer, image_processing
):
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "a.png").write_bytes(png_bytes(10))
    two = [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "What digit is this?"}]
    rows = [  # parquet's image feature stores {"bytes", "path"}
        image_row([{"bytes": None, "path": "img/a.png"}]),
        image_row([{"bytes": png_bytes(20), "path": None}]),
        image_row([{"bytes": png_bytes(30), "path": None}, {"bytes": None, "path": str(tmp_path / "img/a.png")}], two),
    ]
    for row in rows:  # one type per parquet column: the answer as typed parts too
        row["messages"][1]["content"] = [{"type": "text", "text": "a handwritten seven"}]
    path = write_rows(tmp_path, "parquet", rows)
    encoder = ChatEncoder(tokenizer, image_token="<|image_pad|>")
    dataset = SFTDataset(
        RowEncoder(read_sources(str(path), "data.train_path"), encoder, "messages", {}, 0, images=image_processing)
    )
    check_image_samples(tokenizer, dataset, [1, 1, 2])


def test_an_image_feature_column_of_a_saved_dataset(tmp_path, tokenizer, image_processing):
    import datasets
    from PIL import Image

    rows = [image_row([Image.open(io.BytesIO(png_bytes(40)))])]
    rows[0]["messages"][1]["content"] = [{"type": "text", "text": "a handwritten seven"}]  # one type per column
    features = datasets.Dataset.from_list([{"messages": rows[0]["messages"]}]).features.copy()
    features["images"] = datasets.Sequence(datasets.Image())
    datasets.Dataset.from_list(rows, features=features).save_to_disk(str(tmp_path / "saved"))
    encoder = ChatEncoder(tokenizer, image_token="<|image_pad|>")
    sources = read_sources(str(tmp_path / "saved"), "data.train_path")
    dataset = SFTDataset(RowEncoder(sources, encoder, "messages", {}, 0, images=image_processing))
    check_image_samples(tokenizer, dataset, [1])


def test_image_paths_and_placeholders_in_jsonl_relative_to_the_file_or_media_dir(tmp_path, tokenizer, image_processing):
    (tmp_path / "media").mkdir()
    (tmp_path / "media" / "a.png").write_bytes(png_bytes(10))
    rows = [image_row(["a.png"], "<image>What digit is this?"), image_row(["a.png", "a.png"], "<image><image>Which?")]
    path = write_rows(tmp_path, "jsonl", rows)
    encoder = ChatEncoder(tokenizer, image_token="<|image_pad|>")
    sources = read_sources(str(path), "data.train_path")
    with pytest.raises(DataError, match="does not exist"):  # relative to the data file's directory by default
        SFTDataset(RowEncoder(sources, encoder, "messages", {}, 0, images=image_processing))
    dataset = SFTDataset(
        RowEncoder(sources, encoder, "messages", {}, 0, media_dir=str(tmp_path / "media"), images=image_processing)
    )
    check_image_samples(tokenizer, dataset, [1, 2])


# ---------------------------------------------------------------- lengths


def test_overlength_truncate_drop_and_error_count_or_name_the_row(tmp_path, tokenizer):
    limit = len(encode(tokenizer, {"messages": CONVERSATION}, "messages")[0].input_ids)  # the short row just fits
    long = {"messages": [CONVERSATION[0], {"role": "assistant", "content": "You are a bold one " * 10}]}
    path = write_rows(tmp_path, "jsonl", [{"messages": CONVERSATION}, long])
    sources = read_sources(str(path), "data.train_path")
    truncated = SFTDataset(RowEncoder(sources, ChatEncoder(tokenizer), "messages", {}, limit, "truncate"))
    assert (truncated.stats.truncated, truncated.stats.dropped, len(truncated)) == (1, 0, 2)
    assert len(truncated[0]["input_ids"]) == len(truncated[1]["input_ids"]) == limit
    dropped = SFTDataset(RowEncoder(sources, ChatEncoder(tokenizer), "messages", {}, limit, "drop"))
    assert (dropped.stats.truncated, dropped.stats.dropped, len(dropped)) == (0, 1, 1)
    with pytest.raises(DataError, match=rf"{path}, row 1 \(0-based\): \d+ tokens, over data.max_seq_len={limit}"):
        SFTDataset(RowEncoder(sources, ChatEncoder(tokenizer), "messages", {}, limit, "error"))


# ---------------------------------------------------------------- bad input: an error naming the file and the row


@pytest.mark.parametrize(
    ("cut", "where"),
    [  # where: the column, 1-based, from the malformed line
        (lambda line: line[:-1], lambda bad: f"column {len(bad) + 1} (the end of the line): Expecting ',' delimiter"),
        (
            lambda line: line.replace('"role"', "role", 1),
            lambda bad: f"column {bad.index('role') + 1}: Expecting property name enclosed in double quotes",
        ),
        (lambda line: line + " x", lambda bad: f"column {len(bad)}: Extra data"),
    ],
    ids=["no-closing-brace", "unquoted-key", "trailing-text"],
)
def test_a_malformed_json_line_names_its_row_and_the_column_where_the_text_breaks(tmp_path, cut, where):
    good = json.dumps({"messages": CONVERSATION})
    bad = cut(good)
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join([good] * 5 + [bad, good]) + "\n")
    (source,) = read_sources(str(path), "data.train_path")
    with pytest.raises(DataError) as raised:
        list(source.read(0, source.num_rows))
    assert str(raised.value) == f"{path}, row 5 (0-based): malformed JSON, {where(bad)}"
    path.write_text("\n".join([good] * 7) + "\n")  # the negative control: the same rows well-formed all read
    assert len(list(read_sources(str(path), "data.train_path")[0].read(0, 7))) == 7


@pytest.mark.parametrize(
    ("lines", "fmt", "message"),
    [
        (  # a blank line is no row but counts as a line of the file
            [json.dumps({"messages": CONVERSATION}), "", '{"messages": ['],
            "messages",
            r"row 2 \(0-based\): malformed JSON, column 15 \(the end of the line\): Expecting value",
        ),
        ([json.dumps({"conversations": []})], "messages", r"row 0 \(0-based\): missing column 'messages'"),
        ([json.dumps({"messages": CONVERSATION})], "sharegpt", r"row 0 \(0-based\): missing column 'conversations'"),
        (
            [json.dumps({"messages": [{"role": "robot", "content": "beep"}, CONVERSATION[1]]})],
            "messages",
            r"row 0 \(0-based\): message 0 has the unknown role 'robot'",
        ),
        (
            [json.dumps({"conversations": [{"from": "narrator", "value": "x"}]})],
            "sharegpt",
            r"row 0 \(0-based\): turn 0 has role 'narrator'",
        ),
        (
            [json.dumps({"messages": CONVERSATION}), json.dumps({"messages": [CONVERSATION[0]]})],
            "messages",
            r"row 1 \(0-based\): no assistant turn",
        ),
        (
            [json.dumps(image_row(["missing.png"]))],
            "messages",
            r"row 0 \(0-based\): image 'missing.png' does not exist",
        ),
        ([json.dumps(image_row(["bad.png"]))], "messages", r"row 0 \(0-based\): image .*bad.png' does not decode"),
        (
            [json.dumps(image_row(["ok.png", "ok.png"]))],
            "messages",
            r"row 0 \(0-based\): 1 image placeholder\(s\) but 2 image\(s\)",
        ),
        (
            [json.dumps(image_row([], "<image> twice <image>"))],
            "messages",
            r"row 0 \(0-based\): 2 image placeholder\(s\) but 0 image\(s\)",
        ),
    ],
    ids=[
        "malformed-json",
        "missing-column",
        "wrong-format",
        "unknown-role",
        "unknown-tag",
        "no-assistant",
        "missing-image",
        "bad-image",
        "more-images",
        "fewer-images",
    ],
)
def test_bad_rows_are_errors_naming_the_file_and_row(tmp_path, tokenizer, image_processing, lines, fmt, message):
    (tmp_path / "bad.png").write_bytes(b"not a png")
    (tmp_path / "ok.png").write_bytes(png_bytes())
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(lines) + "\n")
    encoder = ChatEncoder(tokenizer, image_token="<|image_pad|>")
    with pytest.raises(DataError, match=message) as raised:
        SFTDataset(RowEncoder(read_sources(str(path), "data.train_path"), encoder, fmt, {}, 0, images=image_processing))
    assert str(path) in str(raised.value)


def test_an_empty_file_and_an_image_over_the_decompression_bomb_limit(
    tmp_path, tokenizer, image_processing, monkeypatch
):
    from PIL import Image

    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(DataError, match=rf"{empty}: the file is empty"):
        read_sources(str(empty), "data.train_path")
    (tmp_path / "big.png").write_bytes(png_bytes())
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps(image_row(["big.png"])) + "\n")
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 30)  # an 8 x 8 image is then over the limit
    encoder = ChatEncoder(tokenizer, image_token="<|image_pad|>")
    with pytest.raises(
        DataError, match=rf"{path}, row 0 \(0-based\): image .*big.png' is over Pillow's decompression-bomb limit"
    ):
        SFTDataset(
            RowEncoder(read_sources(str(path), "data.train_path"), encoder, "messages", {}, 0, images=image_processing)
        )


def test_a_model_directory_that_needs_custom_code_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2", "auto_map": {"AutoModel": "evil.Model"}}))
    with pytest.raises(PretrainedDirError, match="needs custom code.*trust_remote_code=False"):
        load_config(tmp_path)
    with pytest.raises(PretrainedDirError, match="has no config.json"):
        load_config(tmp_path / "nowhere")


def test_images_for_a_text_model_are_an_error_naming_the_row(tokenizer):
    with pytest.raises(DataError, match="row 0: the row has images but the model takes none"):
        encode(tokenizer, image_row([png_bytes()]), "messages")
