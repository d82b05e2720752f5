"""Weighted sources and the input pipeline through the real trainer on 2 gloo ranks: a run interrupted and resumed
on another world size (and with input workers) trains on exactly the samples of the uninterrupted run, step by step,
read back from the micro-batches' tokens; an image that does not decode stops every rank at the same step."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from tests.data.test_sft_training import REPO
from tests.dist_helpers import run_distributed, run_ranks
from veomni_lite.config import load_config
from veomni_lite.data.checks import DataError
from veomni_lite.trainer.sft import SFTTrainer

TAG = re.compile(r"source (\d+) row (\d+)\b")


class Recording(SFTTrainer):
    """Records, per trained step, the (source, row) of every sample in this rank's micro-batches, from their tokens
    (`tag`: the pattern that writes them in each row's text)."""

    tag = TAG

    def train_step(self, micro_batches):
        self.seen = getattr(self, "seen", [])
        step = []
        for micro_batch in micro_batches:
            for ids in micro_batch["input_ids"]:
                text = self.tokenizer.decode(ids.tolist(), skip_special_tokens=True)
                step += [(int(s), int(r)) for s, r in self.tag.findall(text)]
        self.seen.append(step)
        super().train_step(micro_batches)


def write_sources(root: Path) -> list[Path]:
    paths = []
    for source, rows in enumerate((24, 10)):
        path = root / f"source{source}.jsonl"
        turns = [{"role": "user", "content": f"source {source} row {{}}"}, {"role": "assistant", "content": "ok"}]
        lines = [{"messages": [{**turns[0], "content": turns[0]["content"].format(r)}, turns[1]]} for r in range(rows)]
        path.write_text("".join(json.dumps(line) + "\n" for line in lines))
        paths.append(path)
    return paths


def _run(rank: int, world_size: int, demo: Path, paths: list[Path], out: Path, steps: int, *extra: str) -> dict:
    sources = f"[{{path: {paths[0]}, weight: 0.5}}, {{path: {paths[1]}, weight: 2.0}}]"
    args = [
        "--model.pretrained_dir", str(demo / "models" / "qwen2_help"), "--data.train_path", "[]",
        "--data.sources", sources, "--data.format", "messages", "--train.output_dir", str(out),
        "--train.micro_batch_size", "2", "--train.global_batch_size", "8", "--train.max_steps", str(steps),
        "--train.eval_batches", "0", "--checkpoint.save_interval", "0", "--logging.progress_bar", "false",
        "--logging.tensorboard", "false", "--logging.plot", "false", *extra,
    ]  # fmt: skip
    trainer = Recording(load_config(REPO / "configs" / "sft_help.yaml", args, world_size=world_size))
    try:
        trainer.train()
    finally:
        trainer.loader.close()  # the process group stays: run_ranks tears it down
        trainer.metrics.close()
    found = [part.found for part in trainer.train_dataset.datasets]
    return {"seen": trainer.seen, "found": found, "per_epoch": trainer.loader.samples_per_epoch}


def whole_steps(ranks: list[dict]) -> list[list[tuple[int, int]]]:
    """Each step's global batch: the ranks' blocks in rank order."""
    return [sum((rank["seen"][step] for rank in ranks), []) for step in range(len(ranks[0]["seen"]))]


@pytest.mark.slow
def test_a_run_resumed_on_another_world_size_trains_on_the_samples_of_the_uninterrupted_run(demo, tmp_path):
    paths = write_sources(tmp_path)
    whole = whole_steps(run_distributed(_run, 2, demo, paths, tmp_path / "whole", 6, timeout_s=300))
    assert len(whole) == 6 and all(len(step) == 8 for step in whole)
    first_epoch = sum(whole[:4], [])  # 12 + 20 samples per epoch = 4 steps of 8
    assert sum(s == 0 for s, _ in first_epoch) == 12 and len({r for s, r in first_epoch if s == 0}) == 12
    assert sorted(r for s, r in first_epoch if s == 1) == sorted(list(range(10)) * 2), "weight 2: every row twice"

    interrupted = whole_steps(run_distributed(_run, 2, demo, paths, tmp_path / "cut", 3, timeout_s=300))
    assert interrupted == whole[:3]
    (resumed,) = run_distributed(
        _run, 1, demo, paths, tmp_path / "cut", 6, "--checkpoint.resume", "true", "--data.num_workers", "1",
        timeout_s=300,
    )  # fmt: skip
    assert resumed["found"] == [True, True], "a resume reads the cache"
    assert resumed["seen"] == whole[3:], "world 1 with a worker process continues the 2-rank run exactly"


def _bad_image(rank: int, world_size: int, demo: Path, data: Path, out: Path) -> str:
    args = [
        "--model.pretrained_dir", str(demo / "models" / "qwen2_vl_digits"), "--data.train_path", str(data),
        "--data.eval_path", "[]", "--train.output_dir", str(out), "--train.micro_batch_size", "4",
        "--train.global_batch_size", "16", "--train.max_steps", "2", "--train.eval_batches", "0",
        "--checkpoint.save_interval", "0", "--logging.progress_bar", "false", "--logging.tensorboard", "false",
        "--logging.plot", "false",
    ]  # fmt: skip
    trainer = SFTTrainer(load_config(REPO / "configs" / "sft_digits.yaml", args, world_size=world_size))
    try:
        trainer.train()
        return "trained"
    except DataError as exc:
        return str(exc)
    finally:
        trainer.loader.close()  # the process group stays: run_ranks tears it down
        trainer.metrics.close()


@pytest.mark.slow
def test_an_image_that_does_not_decode_stops_every_rank_at_the_same_step(demo, tmp_path):
    lines = (demo / "digits" / "train.jsonl").read_text().splitlines()[:32]
    (tmp_path / "images").mkdir()
    for line in lines:
        name = json.loads(line)["images"][0]
        shutil.copy(demo / "digits" / name, tmp_path / name)
    bad = tmp_path / json.loads(lines[5])["images"][0]
    bad.write_bytes(bad.read_bytes()[:45])  # the header intact (so the pre-pass measures it), the pixels cut off
    (tmp_path / "train.jsonl").write_text("\n".join(lines) + "\n")
    outcomes = run_ranks(_bad_image, 2, demo, tmp_path / "train.jsonl", tmp_path / "out", timeout_s=300)
    assert all(status == "ok" for status, _ in outcomes.values()), outcomes
    messages = sorted((value for _, value in outcomes.values()), key=lambda m: "does not decode" in m)
    step = re.search(r"step (\d+)", messages[1]).group(1)
    assert re.match(
        rf"step {step}: rank \d: .*train.jsonl, row 5 \(0-based\): image .* does not decode", messages[1]
    ), messages
    assert messages[0] == messages[1], "the same error on every rank"
