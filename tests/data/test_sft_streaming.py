"""Streaming (`data.streaming`): the stream's order against its documented rule written out by hand, samples equal to
the cache's, the same global batches on every dp layout (token budget and packing too), resume by position (after
reading ahead, across a pass), a resume on changed data refused, bad rows named alike, the config refusing what a
stream cannot do, and, through the real trainer on gloo ranks, a run interrupted and resumed on another world size
training on exactly the samples of the uninterrupted run, step by step."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from examples.sft_demo import write_text_model
from tests.data.test_sft_sources import Recording as SourcesRecording
from tests.dist_helpers import run_distributed, run_ranks
from veomni_lite.config import ConfigError, load_config
from veomni_lite.data.checks import DataError
from veomni_lite.data.collator import collate
from veomni_lite.data.mixture import seeded_generator
from veomni_lite.data.sft import ChatEncoder, read_sources
from veomni_lite.data.sft_dataset import RowEncoder, SFTDataset
from veomni_lite.data.streaming import SampleStream, StreamingLoader
from veomni_lite.models.pretrained import load_tokenizer

REPO = Path(__file__).resolve().parents[2]
TAG = re.compile(r"file (\d) row (\d+)\b")
LINES = (14, 8)  # lines of file 0 (its line 5 blank: 13 rows) and file 1
WINDOW = 3  # the loader tests' window: 8 samples a step end mid-window


def row(file: int, line: int) -> dict:
    """The row on line `line` of file `file` says so; its length varies (for the token budget)."""
    user = {"role": "user", "content": f"file {file} row {line} " + "go " * (line % 5)}
    return {"messages": [user, {"role": "assistant", "content": "ok"}]}


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> tuple[Path, list[Path]]:
    """A tiny Qwen2 directory and two JSON Lines files (file 0 with a blank line 5: a file's rows are its lines)."""
    root = tmp_path_factory.mktemp("streaming")
    paths = []
    for file, count in enumerate(LINES):
        lines = ["" if (file, line) == (0, 5) else json.dumps(row(file, line)) for line in range(count)]
        (root / f"part{file}.jsonl").write_text("\n".join(lines) + "\n")
        paths.append(root / f"part{file}.jsonl")
    texts = [m["content"] for f, n in enumerate(LINES) for line in range(n) for m in row(f, line)["messages"]]
    write_text_model(root / "model", texts * 4)
    return root / "model", paths


def stream(files, window: int, seed: int = 3, paths=None) -> SampleStream:
    model, default = files
    tokenizer = load_tokenizer(model)
    sources = read_sources([str(p) for p in paths or default], "data.train_path")
    return SampleStream(RowEncoder(sources, ChatEncoder(tokenizer), "messages", {}, 0), window=window, seed=seed)


def tag(where: str) -> tuple[int, int]:
    """(file, line-row) of a sample from its `where` ("...partF.jsonl, row N (0-based)")."""
    match = re.search(r"part(\d)\.jsonl, row (\d+) ", where)
    return int(match.group(1)), int(match.group(2))


def expected_pass(window: int, seed: int, epoch: int) -> list[tuple[int, int]]:
    """The rule, by hand: the rows in file order (file 0's row 5 is its blank line), cut into windows of `window`
    rows; a window starts after the last row of the one before (the first at file 0, row 0) and is permuted by
    torch.randperm with seeded_generator(seed, epoch, its file, its row)."""
    rows = [(0, r) for r in range(LINES[0]) if r != 5] + [(1, r) for r in range(LINES[1])]
    out, start = [], (0, 0)
    for first in range(0, len(rows), window):
        chunk = rows[first : first + window]
        order = torch.randperm(len(chunk), generator=seeded_generator(seed, epoch, *start)).tolist()
        out += [chunk[i] for i in order] if window > 1 else chunk
        start = (chunk[-1][0], chunk[-1][1] + 1)
    return out


def test_each_pass_is_every_row_once_in_windows_by_the_documented_rule(files):
    data = stream(files, window=4)
    taken = [data.take(7) for _ in range(6)]  # 21 rows a pass: 3 batches of 7, then the next pass
    assert [epoch for epoch, _ in taken] == [0, 0, 0, 1, 1, 1]
    passes = [[tag(s.where) for _, batch in taken[e * 3 : e * 3 + 3] for s in batch] for e in (0, 1)]
    assert passes == [expected_pass(4, 3, 0), expected_pass(4, 3, 1)]
    assert sorted(passes[0]) == sorted(passes[1]) and passes[0] != passes[1], "every row once, another order"
    in_order = stream(files, window=1)
    assert [tag(s.where) for s in in_order.take(21)[1]] == sorted(passes[0]), "window 1: file order"
    other = stream(files, window=4, seed=4)
    assert [tag(s.where) for s in other.take(21)[1]] != passes[0], "negative control: the seed changes the order"


def test_the_samples_are_the_caches_and_a_pass_drops_its_partial_batch(files):
    model, paths = files
    cached = SFTDataset(
        RowEncoder(read_sources([str(p) for p in paths], "k"), ChatEncoder(load_tokenizer(model)), "messages", {}, 0)
    )
    by_row = {tag(cached.where(i)): [a.tolist() for a in cached.tokens(i)] for i in range(len(cached))}
    data = stream(files, window=5)
    epoch, batch = data.take(16)
    assert epoch == 0 and len(batch) == 16
    assert all([s.input_ids.tolist(), s.labels.tolist()] == by_row[tag(s.where)] for s in batch)
    epoch, batch = data.take(16)  # 5 left in pass 0: dropped
    assert epoch == 1 and [tag(s.where) for s in batch] == expected_pass(5, 3, 1)[:16]
    with pytest.raises(DataError, match=r"data.train_path: a whole pass over the files gives fewer than 22 samples"):
        stream(files, window=5).take(22)


@pytest.mark.parametrize("overlength", ["truncate", "drop"])
def test_overlength_cuts_and_drops_as_the_cache_does(files, overlength):
    model, paths = files
    options = {"max_seq_len": 28, "overlength": overlength}
    encoder = ChatEncoder(load_tokenizer(model))
    cached = SFTDataset(RowEncoder(read_sources([str(p) for p in paths], "k"), encoder, "messages", {}, **options))
    assert cached.stats.truncated + cached.stats.dropped > 3, "the limit cuts some rows"
    expected = {tag(cached.where(i)): [a.tolist() for a in cached.tokens(i)] for i in range(len(cached))}
    data = SampleStream(
        RowEncoder(read_sources([str(p) for p in paths], "k"), encoder, "messages", {}, **options), window=21
    )  # one window: the pass
    _, batch = data.take(len(cached))
    assert {tag(s.where): [s.input_ids.tolist(), s.labels.tolist()] for s in batch} == expected
    assert data.counts == {"rows": 21, "truncated": cached.stats.truncated, "dropped": cached.stats.dropped,
                           "samples": len(cached)}  # fmt: skip


def test_images_are_measured_by_the_stream_and_decoded_as_the_cache_does(tmp_path):
    from transformers import Qwen2VLImageProcessor

    from examples.sft_demo import write_tokenizer
    from tests.data.test_sft import TEXTS, image_row, png_bytes
    from veomni_lite.data.sft_dataset import ImageProcessing

    tokenizer = write_tokenizer(tmp_path / "tok", TEXTS * 20, vocab_size=300)
    processor = Qwen2VLImageProcessor(patch_size=2, temporal_patch_size=1, merge_size=2, min_pixels=64, max_pixels=4096)
    for value in range(3):
        (tmp_path / f"{value}.png").write_bytes(png_bytes(40 * value))
    rows = [image_row([f"{r % 3}.png"], "<image>What digit is this?") for r in range(6)]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    options = {"images": ImageProcessing(processor)}
    encoder = ChatEncoder(tokenizer, image_token="<|image_pad|>")
    cached = SFTDataset(
        RowEncoder(read_sources(str(tmp_path / "data.jsonl"), "k"), encoder, "messages", {}, 0, **options)
    )
    data = SampleStream(
        RowEncoder(read_sources(str(tmp_path / "data.jsonl"), "k"), encoder, "messages", {}, 0, **options)
    )
    by_row = {tag_row(cached.where(i)): cached[i] for i in range(len(cached))}
    _, batch = data.take(6)
    for sample in batch:
        got, expected = data.tensors(sample), by_row[tag_row(sample.where)]
        assert sorted(got) == ["image_grid_thw", "input_ids", "labels", "pixel_values"]
        for key, value in expected.items():
            assert torch.equal(got[key], value), key


def tag_row(where: str) -> int:
    return int(re.search(r"row (\d+) ", where).group(1))


def steps(loader: StreamingLoader, count: int) -> list[list[tuple[int, int]]]:
    """Per step, the (file, row) of every sample of this rank's micro-batches, read back from the tokens."""
    tokenizer = loader.tokenizer
    out = []
    for _ in range(count):
        step = []
        for micro_batch in loader.next_step():
            for ids in micro_batch["input_ids"]:
                step += [(int(f), int(r)) for f, r in TAG.findall(tokenizer.decode(ids.tolist()))]
        out.append(step)
    return out


def make_loader(files, dp: int = 1, rank: int = 0, seed: int = 3, budget: int = 0, **options) -> StreamingLoader:
    loader = StreamingLoader(
        stream(files, window=WINDOW, seed=seed), collate, 8, 2, dp, rank, max_tokens=budget, packing=bool(budget),
        **options,
    )  # fmt: skip
    loader.tokenizer = load_tokenizer(files[0])
    return loader


def whole(files, dp: int, count: int, **options) -> list[list[tuple[int, int]]]:
    """The global batches of `count` steps: the dp ranks' blocks in rank order."""
    per_rank = [steps(make_loader(files, dp, rank, **options), count) for rank in range(dp)]
    return [sum((rank[s] for rank in per_rank), []) for s in range(count)]


@pytest.mark.parametrize("budget", [0, 64], ids=["micro-batches", "token-budget-packed"])  # 2 samples of ~29
def test_the_global_batches_are_the_same_on_every_dp_layout(files, budget):
    def samples(steps: list[list]) -> list[list]:  # a token budget plans a rank's samples into other micro-batches
        return [sorted(step) for step in steps] if budget else steps

    reference = samples(whole(files, 1, 5, budget=budget))  # 2 steps a pass (21 samples, 8 a batch): 2.5 passes
    flat = sum((expected_pass(WINDOW, 3, epoch)[:16] for epoch in range(3)), [])[:40]
    assert reference == samples([flat[i : i + 8] for i in range(0, 40, 8)]), "the stream's batches, in order"
    for dp in (2, 4):
        assert samples(whole(files, dp, 5, budget=budget)) == reference
    assert samples(whole(files, 2, 5, seed=4, budget=budget)) != reference, "negative control: other batches"


def test_a_resume_by_position_continues_exactly_after_reading_ahead_and_across_a_pass(files):
    reference = whole(files, 1, 7)
    loader = make_loader(files, 2, 0, prefetch_steps=2)
    steps(loader, 3)  # read ahead to step 5
    state = {**loader.state_dict(), "step": 2}  # the trainer trained 2 steps: the loader is ahead
    loader.close()
    assert [step for step, _ in state["marks"]][:4] == [0, 1, 2, 3], "the steps read ahead have theirs too"
    json.dumps(state)  # plain data
    resumed = []
    for rank in range(4):  # on another layout
        fresh = make_loader(files, 4, rank, prefetch_steps=1)
        steps(fresh, 1)  # it ran before the state arrives
        fresh.load_state_dict(state)
        assert fresh.epoch == 0
        resumed.append(steps(fresh, 5))
        fresh.close()
    assert [sum((rank[s] for rank in resumed), []) for s in range(5)] == reference[2:]
    mid = make_loader(files, 1, 0)
    steps(mid, 5)
    again = make_loader(files, 1, 0)
    again.load_state_dict(mid.state_dict())  # mid-window, in pass 2
    assert again.stream.position()["taken"] not in (0, WINDOW)
    assert again.epoch == 2 and steps(again, 2) == reference[5:7]


def test_a_resume_on_changed_data_or_without_its_position_is_refused(files, tmp_path):
    state = make_loader(files).state_dict()
    for changed, key in (
        (StreamingLoader(stream(files, window=5), collate, 8, 2), "streaming"),
        (StreamingLoader(stream(files, window=WINDOW, seed=9), collate, 8, 2), "streaming"),
        (StreamingLoader(stream(files, window=WINDOW), collate, 16, 2), "global_batch_size"),
        (StreamingLoader(stream(files, window=WINDOW, paths=files[1][:1]), collate, 8, 2), "streaming"),
    ):
        with pytest.raises(ValueError, match=f"checkpoint {key}=.*resuming would replay different global batches"):
            changed.load_state_dict(state)
    with pytest.raises(ValueError, match=r"no stream position for step 7 \(has \[0\]\)"):
        make_loader(files).load_state_dict({**state, "step": 7})


def test_a_bad_row_is_a_data_error_naming_the_file_and_row_at_the_step_that_reads_it(files, tmp_path):
    lines = files[1][1].read_text().splitlines()
    lines[1] = json.dumps({"messages": [{"role": "user", "content": "no answer"}]})
    (tmp_path / "part1.jsonl").write_text("\n".join(lines) + "\n")
    paths = [files[1][0], tmp_path / "part1.jsonl"]
    loader = StreamingLoader(stream(files, window=4, paths=paths), collate, 8, 2)
    loader.next_step()  # windows 1 and 2: file 0's rows 0-8; step 2 reads windows 3 and 4, to file 1's row 2
    with pytest.raises(DataError, match=rf"{tmp_path / 'part1.jsonl'}, row 1 \(0-based\): no assistant turn"):
        loader.next_step()


def test_the_config_refuses_what_a_stream_cannot_do():
    base = ["--data.streaming", "true", "--data.train_path", "a.jsonl", "--train.max_steps", "10"]
    assert load_config(None, base, world_size=1).data.shuffle_window == 1000
    for extra, message in (
        (["--data.train_path", "[]", "--data.sources", "[{path: a.jsonl}]"], r"data.sources: weighted sources draw"),
        (["--train.max_steps", "0", "--train.epochs", "2"], r"train.epochs \(2\) needs the epoch's length"),
        (["--data.num_workers", "2"], r"data.num_workers \(2\): data.streaming reads in the trainer's process"),
        (["--train.eval_interval", "5"], r"data.eval_path: evaluation .* under data.streaming needs it"),
        (["--data.shuffle_window", "0"], r"data.shuffle_window: must be >= 1"),
    ):
        with pytest.raises(ConfigError, match=message):
            load_config(None, [*base, *extra], world_size=1)
    evaluating = ["--train.eval_interval", "5", "--data.eval_path", "b.jsonl"]
    assert load_config(None, [*base, *evaluating], world_size=1).data.eval_path == ["b.jsonl"]


# ---------------------------------------------------------------- through the real trainer on gloo ranks


class Recording(SourcesRecording):
    tag = TAG  # (file, row) of every sample


def _run(rank: int, world_size: int, model: Path, paths: list[Path], out: Path, steps: int, *extra: str) -> dict:
    args = [
        "--model.pretrained_dir", str(model), "--data.train_path", json.dumps([str(p) for p in paths]),
        "--data.streaming", "true", "--data.shuffle_window", "4", "--data.format", "messages",
        "--train.output_dir", str(out), "--train.micro_batch_size", "2", "--train.global_batch_size", "8",
        "--train.max_steps", str(steps), "--train.eval_batches", "0", "--checkpoint.save_interval", "0",
        "--logging.progress_bar", "false", "--logging.tensorboard", "false", "--logging.plot", "false", *extra,
    ]  # fmt: skip
    trainer = Recording(load_config(REPO / "configs" / "sft_help.yaml", args, world_size=world_size))
    try:
        trainer.train()
        evaluated = "eval/" in (out / "metrics.jsonl").read_text()
        return {"seen": trainer.seen, "cache": (out / "data_cache").exists(), "evaluated": evaluated}
    except DataError as exc:
        return {"error": str(exc)}
    finally:
        trainer.loader.close()  # the process group stays: run_ranks tears it down
        trainer.metrics.close()


def global_steps(ranks: list[dict]) -> list[list[tuple[int, int]]]:
    return [sum((rank["seen"][step] for rank in ranks), []) for step in range(len(ranks[0]["seen"]))]


@pytest.mark.slow
def test_a_streamed_run_resumed_on_another_world_size_trains_on_the_samples_of_the_uninterrupted_run(files, tmp_path):
    model, paths = files
    uninterrupted = run_distributed(_run, 2, model, paths, tmp_path / "whole", 5, timeout_s=300)
    whole_run = global_steps(uninterrupted)
    flat = expected_pass(4, 42, 0)[:16] + expected_pass(4, 42, 1)[:16] + expected_pass(4, 42, 2)[:8]
    assert sum(whole_run, []) == flat, "the stream's samples, seeded by train.seed (42), across passes"
    assert not uninterrupted[0]["cache"], "no cache is written"
    cut = run_distributed(_run, 2, model, paths, tmp_path / "cut", 2, "--data.prefetch_steps", "2", timeout_s=300)
    assert global_steps(cut) == whole_run[:2]
    evaluating = ["--data.eval_path", str(paths[1]), "--train.eval_interval", "3", "--train.eval_batches", "1"]
    (resumed,) = run_distributed(
        _run, 1, model, paths, tmp_path / "cut", 5, "--checkpoint.resume", "true", *evaluating, timeout_s=300
    )
    assert resumed["seen"] == whole_run[2:], "world 1 continues the 2-rank run exactly, from the stream's position"
    assert resumed["evaluated"] and resumed["cache"], "the eval set of data.eval_path goes through the cache"


@pytest.mark.slow
def test_a_bad_row_in_the_stream_stops_every_rank_alike_naming_it(files, tmp_path):
    model, paths = files
    lines = paths[1].read_text().splitlines()
    lines[1] = "{not json"  # read at step 2 (see the test above)
    (tmp_path / "part1.jsonl").write_text("\n".join(lines) + "\n")
    outcomes = run_ranks(_run, 2, model, [paths[0], tmp_path / "part1.jsonl"], tmp_path / "out", 4, timeout_s=300)
    messages = {rank: value.get("error") for rank, (status, value) in outcomes.items() if status == "ok"}
    assert len(messages) == 2, outcomes
    assert messages[0] == messages[1], "the same error on every rank"
    assert re.fullmatch(
        rf"step 2: ranks 0, 1: {tmp_path / 'part1.jsonl'}, row 1 \(0-based\): malformed JSON, column 2: .*", messages[0]
    ), messages[0]
