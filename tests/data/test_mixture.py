"""Weighted sources and input workers at the loader: each epoch's draw per source against the documented rule written
out by hand, the same global batches on every layout and worker count, exact resume across layouts, changed sources
refused, and worker batches equal to in-process ones (text, images, a token budget, a jump by load_state_dict)."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from examples.sft_demo import write_tokenizer
from veomni_lite.config import ConfigError, load_config
from veomni_lite.data.collator import collate
from veomni_lite.data.loader import MicroBatchLoader
from veomni_lite.data.mixture import WeightedMixture, hold_out
from veomni_lite.data.sft import ChatEncoder, read_sources
from veomni_lite.data.sft_dataset import RowEncoder, SFTDataset


class Tagged:
    """Samples that say which source and row they are: input_ids [source, row]."""

    def __init__(self, source: int, size: int) -> None:
        self.source, self.size = source, size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < self.size:
            raise IndexError(index)
        return {"input_ids": torch.tensor([self.source, index])}


def identities(loader: MicroBatchLoader, steps: int) -> list[list[tuple[int, int]]]:
    return [[tuple(row.tolist()) for mb in loader.next_step() for row in mb["input_ids"]] for _ in range(steps)]


def stack(samples):
    return {"input_ids": torch.stack([s["input_ids"] for s in samples])}


def mixture() -> WeightedMixture:
    return WeightedMixture([Tagged(0, 10), Tagged(1, 7), Tagged(2, 3)], [0.5, 1.0, 2.5], ["a", "b", "c"])


def test_each_epoch_draws_round_weight_x_size_per_source_by_the_documented_rule():
    mix = mixture()
    assert mix.samples_per_epoch == 5 + 7 + 8 and len(mix) == 20
    loader = MicroBatchLoader(mix, stack, global_batch_size=4, micro_batch_size=2, seed=3)
    assert loader.steps_per_epoch == 5
    epochs = [sum(identities(loader, 5), []) for _ in range(3)]
    for epoch in epochs:
        per_source = Counter(source for source, _ in epoch)
        assert per_source == {0: 5, 1: 7, 2: 8}
        rows = {s: Counter(r for source, r in epoch if source == s) for s in range(3)}
        assert max(rows[0].values()) == 1, "weight 0.5: drawn without replacement"
        assert sorted(rows[1]) == list(range(7)) and max(rows[1].values()) == 1, "weight 1: every sample once"
        assert sorted(rows[2].values()) == [2, 3, 3], "weight 2.5: twice each, plus half of them once more"
    assert len({tuple(sorted(e)) for e in epochs}) > 1, "another subset each epoch"
    again = MicroBatchLoader(mixture(), stack, global_batch_size=4, micro_batch_size=2, seed=3)
    assert sum(identities(again, 5), []) == epochs[0], "deterministic from the seed"


def run(steps: int, *args, state: dict | None = None, **kwargs) -> tuple[list, dict]:
    """(identities of `steps` steps, the state after) of one loader, closed after (one set of workers at a time)."""
    loader = MicroBatchLoader(mixture(), stack, *args, **kwargs)
    try:
        if state is not None:
            identities(loader, 2)  # it ran (and fetched ahead) before the state arrives
            loader.load_state_dict(state)
        return identities(loader, steps), loader.state_dict()
    finally:
        loader.close()


@pytest.mark.parametrize("workers", [0, 2])
def test_the_global_batches_are_the_same_on_every_layout_and_worker_count_and_resume_exactly(workers):
    reference = run(12, 4, 1, seed=5)[0]  # dp 1, 3 epochs
    for dp in (2, 4) if not workers else (2,):
        per_rank = [run(12, 4, 1, dp, r, seed=5, num_workers=workers)[0] for r in range(dp)]
        assert [sum((rank[s] for rank in per_rank), []) for s in range(12)] == reference
    assert run(12, 4, 1, seed=6)[0] != reference, "negative control: the comparison sees another draw"
    _, state = run(7, 4, 2, 2, 0, seed=5, num_workers=workers)
    resumed, _ = run(5, 4, 1, seed=5, num_workers=workers, prefetch_steps=1, state=state)
    assert resumed == reference[7:], "resumed on another layout: the same samples"


def test_a_resume_on_changed_sources_is_refused():
    state = MicroBatchLoader(mixture(), stack, 4, 2).state_dict()
    changed = WeightedMixture([Tagged(0, 10), Tagged(1, 7), Tagged(2, 3)], [0.52, 1.0, 2.5], ["a", "b", "c"])
    with pytest.raises(ValueError, match="checkpoint mixture=.*resuming would replay different global batches"):
        MicroBatchLoader(changed, stack, 4, 2).load_state_dict(state)
    with pytest.raises(ValueError, match="checkpoint samples_per_epoch=20"):
        MicroBatchLoader(Tagged(0, 21), stack, 4, 2).load_state_dict(state)


def test_hold_out_takes_the_share_of_every_source():
    train, evaluation = hold_out(mixture(), 0.2, seed=0)
    assert [len(d) for d in train.datasets] == [8, 6, 3] and train.weights == [0.5, 1.0, 2.5]
    assert [len(d) for d in evaluation.datasets] == [2, 1] and evaluation.samples_per_epoch == 3
    held = {tuple(evaluation[i]["input_ids"].tolist()) for i in range(len(evaluation))}
    trained = {tuple(train[i]["input_ids"].tolist()) for i in range(len(train))}
    assert not held & trained and len(held | trained) == 20


# ---------------------------------------------------------------- workers on real samples


@pytest.fixture(scope="module")
def text_dataset(tmp_path_factory) -> SFTDataset:
    root = tmp_path_factory.mktemp("workers")
    tokenizer = write_tokenizer(root / "tok", ["Hello there", "General Kenobi"] * 20, vocab_size=300)
    rows = [{"messages": [{"role": "user", "content": "Hello " * (i % 7)}, {"role": "assistant", "content": "Yo"}]}
            for i in range(40)]  # fmt: skip
    (root / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return SFTDataset(
        RowEncoder(read_sources(str(root / "data.jsonl"), "k"), ChatEncoder(tokenizer), "messages", {}, 0)
    )


@pytest.mark.parametrize("budget", [0, 48])
def test_worker_batches_equal_the_in_process_batches(text_dataset, budget):
    def loader(workers: int, prefetch: int = 0) -> MicroBatchLoader:
        mix = WeightedMixture([text_dataset], [1.5], ["text"])
        return MicroBatchLoader(
            mix, collate, 8, 2, dp_size=2, dp_rank=1, seed=1, max_tokens=budget, packing=bool(budget),
            num_workers=workers, prefetch_steps=prefetch,
        )  # fmt: skip

    def steps(source: MicroBatchLoader, count: int) -> list[list[dict[str, list]]]:
        return [[{k: v.tolist() for k, v in mb.items()} for mb in source.next_step()] for _ in range(count)]

    plain, workers, both = loader(0), loader(2), loader(2, prefetch=2)
    expected = steps(plain, 9)  # past the epoch boundary (7 steps of 60 samples)
    assert steps(workers, 9) == expected and steps(both, 9) == expected
    workers.load_state_dict({"step": 3})
    assert steps(workers, 2) == expected[3:5], "the workers follow a jump"
    for source in (plain, workers, both):
        source.close()


def test_data_sources_config_keys(tmp_path):
    sources = "[{path: a.jsonl, weight: 0.5}, {path: [b.jsonl, c/*.parquet], format: sharegpt, columns: {x: y}}]"
    config = load_config(None, ["--data.sources", sources], world_size=1)
    assert config.data.sources[1]["path"] == ["b.jsonl", "c/*.parquet"] and config.data.sources[0]["weight"] == 0.5
    bad = {
        "--data.train_path a.jsonl": "data.sources and data.train_path are both set",
        "--data.format text": None,
    }
    for extra, message in bad.items():
        args = ["--data.sources", sources, *extra.split()]
        if message is None:
            assert load_config(None, args, world_size=1).data.format == "text"
        else:
            with pytest.raises(ConfigError, match=message):
                load_config(None, args, world_size=1)
    for entry, message in (
        ("[{path: a.jsonl, weight: 0}]", r"data.sources\[0\].weight: expected a number > 0"),
        ("[{path: a.jsonl, format: csv}]", r"data.sources\[0\].format: 'csv' is not one of"),
        ("[{file: a.jsonl}]", r"data.sources\[0\]: unknown key\(s\) \['file'\]"),
        ("[{weight: 1}]", r"data.sources\[0\].path: expected a path"),
        ("a.jsonl", "data.sources: expected a list of mappings"),
    ):
        with pytest.raises(ConfigError, match=message):
            load_config(None, ["--data.sources", entry], world_size=1)
    with pytest.raises(ConfigError, match="data.num_workers: must be >= 0"):
        load_config(None, ["--data.num_workers", "-1"], world_size=1)
