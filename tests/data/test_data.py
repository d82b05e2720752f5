from __future__ import annotations

from collections import Counter
from functools import partial

import pytest
import torch
from einops import rearrange

from examples.synthetic_data import (
    BOI_ID,
    BOS_ID,
    EOS_ID,
    IMG_ID,
    PAD_ID,
    SHAPES,
    SyntheticTextDataset,
    SyntheticVLMDataset,
    patch_codes,
)
from veomni_lite.data import MicroBatchLoader, collate
from veomni_lite.loss_keys import IGNORE_INDEX


def same_sample(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("cls", [SyntheticTextDataset, SyntheticVLMDataset])
def test_datasets_are_deterministic_by_seed_and_index(cls: type) -> None:
    a, b, other = cls(num_samples=32, seed=3), cls(num_samples=32, seed=3), cls(num_samples=32, seed=4)
    assert len(a) == 32
    assert all(same_sample(a[i], b[i]) for i in (5, 0, 31, -1))  # access order does not matter
    assert not all(same_sample(a[i], other[i]) for i in range(8))
    with pytest.raises(IndexError):
        a[32]


def test_text_samples_follow_the_task() -> None:
    dataset = SyntheticTextDataset(num_samples=64, min_len=2, max_len=6)
    lengths = set()
    for i in range(64):
        ids, labels = dataset[i]["input_ids"], dataset[i]["labels"]
        n = (ids.numel() - 4) // 2
        lengths.add(ids.numel())
        assert ids[0] == BOS_ID and ids[-1] == EOS_ID and ids.numel() == 2 * n + 4
        xs, ys = ids[2 : 2 + n], ids[3 + n : 3 + 2 * n]
        task = ["copy", "reverse", "sort"][int(ids[1]) - 4]
        assert torch.equal(ys, {"copy": xs, "reverse": xs.flip(0), "sort": xs.sort().values}[task])
        assert (labels[: n + 3] == IGNORE_INDEX).all() and torch.equal(labels[n + 3 :], ids[n + 3 :])
        assert int(ids.max()) < dataset.vocab_size
    assert len(lengths) > 1 and max(lengths) <= dataset.max_seq_len


def test_collate_shifts_once_and_pads() -> None:
    dataset = SyntheticTextDataset(num_samples=8, loss_on_prompt=True)
    samples = [dataset[i] for i in range(4)]
    batch = collate(samples, pad_to_multiple_of=8)
    longest = max(s["input_ids"].numel() for s in samples)
    length = batch["input_ids"].shape[1]
    assert length % 8 == 0 and longest <= length < longest + 8
    assert torch.equal(batch["position_ids"], torch.arange(length).expand(4, length))
    for row, sample in enumerate(samples):
        n = sample["input_ids"].numel()
        assert torch.equal(batch["input_ids"][row, :n], sample["input_ids"])
        assert (batch["input_ids"][row, n:] == PAD_ID).all()
        # label t is the token at t + 1; the last real position and the padding are ignored
        assert torch.equal(batch["labels"][row, : n - 1], sample["input_ids"][1:])
        assert (batch["labels"][row, n - 1 :] == IGNORE_INDEX).all()
        # each sample's positions carry its row, the padding -1 (the sequences the loss modes read)
        assert (batch["sequence_ids"][row, :n] == row).all() and (batch["sequence_ids"][row, n:] == -1).all()
    assert torch.equal(samples[0]["labels"], dataset[0]["labels"])  # inputs are not modified


def test_collate_vlm_keys_and_errors() -> None:
    dataset = SyntheticVLMDataset(num_samples=8)
    samples = [dataset[i] for i in range(3)]
    batch = collate(samples)
    assert set(batch) == {"input_ids", "labels", "image_decoder_labels", "position_ids", "sequence_ids", "pixel_values"}
    assert batch["pixel_values"].shape == (3, 3, 16, 16)
    for row, sample in enumerate(samples):
        unshifted = sample["image_decoder_labels"]
        assert torch.equal(batch["image_decoder_labels"][row, : unshifted.numel() - 1], unshifted[1:])
    with pytest.raises(KeyError, match="sample 1"):
        collate([samples[0], {"input_ids": samples[1]["input_ids"]}])
    with pytest.raises(KeyError, match="extra"):
        collate([{"input_ids": torch.tensor([1]), "extra": torch.tensor([1])}])


def step_samples(loader: MicroBatchLoader) -> list[tuple[int, ...]]:
    return [tuple(row[row != PAD_ID].tolist()) for mb in loader.next_step() for row in mb["input_ids"]]


@pytest.mark.parametrize("cls", [SyntheticTextDataset, SyntheticVLMDataset])
def test_global_batches_do_not_depend_on_the_layout(cls: type) -> None:
    dataset = cls(num_samples=40)
    layouts = [(1, 8), (1, 2), (2, 4), (2, 1), (4, 2), (8, 1)]  # (dp_size, micro_batch_size)
    per_layout = []
    for dp_size, mbs in layouts:
        steps: list[Counter] = [Counter(), Counter()]
        for rank in range(dp_size):
            loader = MicroBatchLoader(dataset, collate, 8, mbs, dp_size, rank, seed=7)
            assert loader.grad_accum == 8 // (mbs * dp_size)
            for step in steps:
                batches = step_samples(loader)
                assert len(batches) == 8 // dp_size
                step.update(batches)
        per_layout.append(steps)
    assert all(steps == per_layout[0] for steps in per_layout)
    assert per_layout[0][0] != per_layout[0][1]


def test_micro_batch_shape_and_rank_blocks() -> None:
    dataset = SyntheticVLMDataset(num_samples=40)
    loader = MicroBatchLoader(dataset, partial(collate, pad_to_multiple_of=4), 8, 2, 2, 1, seed=0)
    micro_batches = loader.next_step()
    assert len(micro_batches) == 2 and micro_batches[0]["input_ids"].shape[0] == 2
    assert micro_batches[0]["input_ids"].shape[1] % 4 == 0
    assert sum(loader.rank_indices(0), []) == loader.global_indices(0)[4:8]


def test_epochs_reshuffle_and_iterate() -> None:
    dataset = SyntheticTextDataset(num_samples=20)
    loader = MicroBatchLoader(dataset, collate, 4, 2, seed=1)
    assert loader.steps_per_epoch == 5 and loader.epoch == 0
    seen = [loader.global_indices(s) for s in range(5)]
    assert sorted(sum(seen, [])) == list(range(20))
    assert loader.global_indices(5) != seen[0]
    for _, _ in zip(range(6), loader):
        pass
    assert loader.step == 6 and loader.epoch == 1


def test_resume_continues_exactly_even_with_another_layout() -> None:
    dataset = SyntheticTextDataset(num_samples=24)
    loader = MicroBatchLoader(dataset, collate, 4, 2, seed=5)
    for _ in range(7):  # crosses an epoch boundary (6 steps per epoch)
        loader.next_step()
    state = loader.state_dict()
    expected = [step_samples(loader) for _ in range(3)]

    resumed = MicroBatchLoader(dataset, collate, 4, 2, seed=5)
    resumed.load_state_dict(state)
    assert [step_samples(resumed) for _ in range(3)] == expected

    ranks = [MicroBatchLoader(dataset, collate, 4, 1, 2, r, seed=5) for r in range(2)]
    for r in ranks:
        r.load_state_dict(state)
    assert [step_samples(ranks[0]) + step_samples(ranks[1]) for _ in range(3)] == expected

    with pytest.raises(ValueError, match="seed=5"):
        MicroBatchLoader(dataset, collate, 4, 2, seed=6).load_state_dict(state)


def test_loader_errors_name_the_numbers() -> None:
    dataset = SyntheticTextDataset(num_samples=64)
    with pytest.raises(ValueError, match=r"global_batch_size \(12\).*micro_batch_size \(2\).*dp_size \(4\)"):
        MicroBatchLoader(dataset, collate, 12, 2, 4, 0)
    with pytest.raises(ValueError, match="dp_rank"):
        MicroBatchLoader(dataset, collate, 8, 2, 2, 2)
    with pytest.raises(ValueError, match="fewer than global_batch_size"):
        MicroBatchLoader(SyntheticTextDataset(num_samples=4), collate, 8, 2)


def test_vlm_sample_layout() -> None:
    dataset = SyntheticVLMDataset(num_samples=64)
    p = dataset.num_patches
    kinds, lengths = Counter(), set()
    for i in range(64):
        s = dataset[i]
        ids, labels, codes = s["input_ids"], s["labels"], s["image_decoder_labels"]
        lengths.add(ids.numel())
        assert ids[0] == BOS_ID and ids[-1] == EOS_ID and ids.numel() <= dataset.max_seq_len
        assert int(ids.max()) < dataset.vocab_size
        if (ids == BOI_ID).any():
            kinds["generation"] += 1
            boi = int((ids == BOI_ID).nonzero())
            assert torch.equal(ids[boi + 1 : boi + 1 + p] - dataset.code_offset, codes[boi + 1 : boi + 1 + p])
            assert (codes[: boi + 1] == IGNORE_INDEX).all() and codes[-1] == IGNORE_INDEX
            assert labels[boi] == BOI_ID and labels[-1] == EOS_ID
            assert ((labels != IGNORE_INDEX).sum()) == 2
            assert not s["pixel_values"].any()
        else:
            kinds["understanding"] += 1
            assert (ids[1 : 1 + p] == IMG_ID).all() and (ids == IMG_ID).sum() == p
            assert (labels[: 1 + p] == IGNORE_INDEX).all() and torch.equal(labels[1 + p :], ids[1 + p :])
            assert (codes == IGNORE_INDEX).all()
            assert s["pixel_values"].shape == (3, 16, 16) and s["pixel_values"].any()
    assert kinds["generation"] > 10 and kinds["understanding"] > 10
    assert lengths == {p + 4, p + 5, p + 6}
    assert all(SyntheticVLMDataset(num_samples=4, generation_ratio=1.0)[i]["pixel_values"].sum() == 0 for i in range(4))


def test_vlm_codes_follow_the_image() -> None:
    dataset = SyntheticVLMDataset(num_samples=8, image_size=24, patch_size=4)  # 6x6 patches
    for shape in SHAPES:
        pixels, index_map = dataset.render(shape, "blue", True, 1, 0)
        again, _ = dataset.render(shape, "blue", True, 1, 0)
        assert torch.equal(pixels, again)
        codes = patch_codes(index_map, dataset.patch_size, dataset.num_image_codes)
        assert codes.shape == (dataset.num_patches,)
        assert set(codes.tolist()) == {0, 1 + 2 * 2 + 1}  # background and dark blue
        # The codes are in the model's patch order: each patch's pixels are its code's palette colour.
        patches = rearrange(pixels, "c (h p1) (w p2) -> (h w) (p1 p2) c", p1=4, p2=4)
        torch.testing.assert_close(patches, dataset.palette[codes].unsqueeze(1).expand_as(patches))
    square, _ = dataset.render("square", "red", False, 0, 0)
    assert not torch.equal(square, dataset.render("square", "red", True, 0, 0)[0])
    # Majority rule, ties to background.
    index_map = torch.zeros(4, 4, dtype=torch.long)
    index_map[:2, :1] = 3  # 2 of 4 pixels of patch 0
    index_map[2:, 2:] = 5
    index_map[3, 3] = 0  # 3 of 4 pixels of patch 3
    assert patch_codes(index_map, 2, 9).tolist() == [0, 0, 0, 5]
