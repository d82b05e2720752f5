"""The handwritten-digits example: split, token layout, the collator's one shift, Qwen2-VL's patch layout, the saved
tokenizer, and `eval/caption_accuracy` (`caption_hits` and `DigitsVLTrainer.extra_eval_metrics`) on cases whose
answer is known exactly."""

from __future__ import annotations

import dataclasses
import math
from collections import Counter

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from examples import digits as digits_module
from examples import qwen2_vl_digits
from examples.digits import (
    CODE_TOKENS,
    DIGIT_WORDS,
    NUM_CODES,
    SPECIAL_TOKENS,
    DigitsDataset,
    load_or_train_tokenizer,
    patchify,
    train_tokenizer,
)
from examples.qwen2_vl_digits import DigitsVLTrainer, caption_hits
from tests.models.small_hf import small_config
from veomni_lite.loss_keys import IGNORE_INDEX
from veomni_lite.models.qwen2_vl import collate_qwen2_vl
from veomni_lite.trainer.model import TrainableModel


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer()


@pytest.fixture(scope="module")
def splits(tokenizer):
    return DigitsDataset(tokenizer, "train"), DigitsDataset(tokenizer, "eval")


def image_keys(dataset: DigitsDataset) -> Counter:
    return Counter(
        (tuple(image.flatten().tolist()), int(digit)) for image, digit in zip(dataset.images, dataset.digits)
    )


def test_split_sizes_and_a_deterministic_disjoint_partition(tokenizer, splits):
    from sklearn.datasets import load_digits

    train, held_out = splits
    assert (len(train.digits), len(held_out.digits)) == (1438, 359)
    assert (len(train), len(held_out)) == (2 * 1438, 2 * 359)
    again = DigitsDataset(train_tokenizer(), "eval")
    assert torch.equal(again.images, held_out.images) and torch.equal(again.digits, held_out.digits)
    every = load_digits()
    everything = Counter((tuple(image.flatten().tolist()), int(d)) for image, d in zip(every.images, every.target))
    assert image_keys(train) + image_keys(held_out) == everything
    assert len(DigitsDataset(tokenizer, "eval", eval_fraction=0.1).digits) == 179
    with pytest.raises(ValueError, match="split must be 'train' or 'eval'"):
        DigitsDataset(tokenizer, "test")


def test_understanding_sample_and_the_caption_query_position(tokenizer, splits):
    _, data = splits
    vocab = tokenizer.get_vocab()
    image = 3
    sample = data.understanding(image)
    word = vocab[DIGIT_WORDS[int(data.digits[image])]]
    t = data.token
    expected = [t["<bos>"], t["<|vision_start|>"], *[t["<|image_pad|>"]] * 4, t["<|vision_end|>"]]
    expected += [vocab["a"], vocab["handwritten"], word, t["<eos>"]]
    assert sample["input_ids"].tolist() == expected
    assert sample["labels"].tolist() == [IGNORE_INDEX] * 7 + expected[7:], "unshifted: the collator shifts"
    assert (sample["image_decoder_labels"] == IGNORE_INDEX).all()
    assert sample["pixel_values"].shape == (16, 4) and sample["image_grid_thw"].tolist() == [[1, 4, 4]]

    query, position, gold = data.caption_query(image)
    assert torch.equal(query["input_ids"], sample["input_ids"]) and gold == word
    assert position == len(expected) - 3 and expected[position] == vocab["handwritten"]
    assert expected[position + 1] == gold
    batch = collate_qwen2_vl([query], data.image_token_id, data.merge, data.pad_id)
    assert batch["labels"][0, position].item() == gold, "the prediction at 'handwritten' is the digit word"


def test_generation_sample_codes_and_one_shift(tokenizer, splits):
    _, data = splits
    vocab = tokenizer.get_vocab()
    image = 5
    sample = data[2 * image + 1]
    codes = data.images[image].reshape(-1).long()
    assert sample["input_ids"].numel() == 70
    assert sample["input_ids"][5:69].tolist() == [vocab[CODE_TOKENS[c]] for c in codes.tolist()]
    targets = sample["image_decoder_labels"][sample["image_decoder_labels"] != IGNORE_INDEX]
    assert torch.equal(targets, codes) and targets.min() >= 0 and targets.max() < NUM_CODES

    understanding = data[2 * image]
    batch = collate_qwen2_vl([understanding, sample], data.image_token_id, data.merge, data.pad_id)
    labels, image_labels = batch["labels"][1], batch["image_decoder_labels"][1]
    assert torch.equal(image_labels[4:68], codes), "the prediction at <boi> is the first code, each code the next"
    assert (image_labels[68:] == IGNORE_INDEX).all() and (image_labels[:4] == IGNORE_INDEX).all()
    assert labels[3].item() == data.token["<boi>"] and labels[68].item() == data.token["<eos>"]
    assert (labels != IGNORE_INDEX).sum().item() == 2
    assert torch.equal(batch["labels"][0, :10], understanding["labels"][1:])
    assert (batch["labels"][0, 10:] == IGNORE_INDEX).all()
    coded = torch.cat([data[i]["image_decoder_labels"] for i in range(1, 200, 2)])
    coded = coded[coded != IGNORE_INDEX]
    assert coded.min() >= 0 and coded.max() < NUM_CODES and coded.numel() == 100 * 64


@pytest.mark.parametrize(("shape", "temporal_patch"), [((1, 8, 8), 1), ((3, 8, 12), 2)])
def test_patchify_matches_qwen2_vl_image_processor(splits, shape, temporal_patch):
    from transformers import Qwen2VLImageProcessor  # falls back to the PIL processor without torchvision

    processor = Qwen2VLImageProcessor(
        do_resize=False,
        do_rescale=False,
        do_normalize=False,
        do_convert_rgb=False,
        patch_size=2,
        temporal_patch_size=temporal_patch,
        merge_size=2,
    )
    if shape == (1, 8, 8):  # a real digit, as the dataset standardizes it
        _, data = splits
        image = ((data.images[7] / 16 - 0.30) / 0.38).unsqueeze(0)
        assert torch.equal(patchify(image, 2, 1, 2)[0], data.pixel_values(7)[0])
    else:
        image = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    out = processor(images=[image.numpy().astype(np.float32)], return_tensors="pt", input_data_format="channels_first")
    pixel_values, grid = patchify(image, 2, temporal_patch, 2)
    assert torch.equal(grid, out["image_grid_thw"])
    assert torch.equal(pixel_values, out["pixel_values"].to(pixel_values.dtype))


def test_tokenizer_is_deterministic_and_reloaded_from_disk(tmp_path, monkeypatch):
    first, second = train_tokenizer(), train_tokenizer()
    assert first.to_str() == second.to_str()
    vocab = first.get_vocab()
    assert [vocab[name] for name in (*SPECIAL_TOKENS, *CODE_TOKENS)] == list(range(len(SPECIAL_TOKENS) + NUM_CODES))
    assert all(len(first.encode(f"a handwritten {word}").ids) == 3 for word in DIGIT_WORDS)

    path = tmp_path / "run" / "tokenizer.json"
    assert load_or_train_tokenizer(path, save=False).to_str() == first.to_str() and not path.exists()
    load_or_train_tokenizer(path)
    saved = path.read_text()

    def no_training():
        raise AssertionError("trained again although the run has a tokenizer")

    monkeypatch.setattr(digits_module, "train_tokenizer", no_training)
    assert load_or_train_tokenizer(path).get_vocab() == vocab
    assert path.read_text() == saved


def test_caption_hits_counts_exactly():
    vocab = 6
    logits = torch.zeros(5, 4, vocab)
    positions = torch.tensor([2, 3, -2, 7, 1])
    gold = torch.tensor([3, 1, 4, 5, 2])
    valid = torch.tensor([True, True, False, False, False])
    logits[0, 2, 3] = 1.0  # correct
    logits[1, 3, 2] = 1.0  # wrong
    logits[2, 0, 4] = 1.0  # would be right at the clamped position, but the query lies in another shard
    logits[3, 3, 5] = 1.0  # likewise, past this shard's end
    logits[4, 1, 2] = 1.0  # right, but a padding row
    hits = caption_hits(logits, positions, gold, valid)
    assert hits.tolist() == [1, 2] and hits.dtype == torch.long
    assert caption_hits(logits, positions, gold, torch.ones(5, dtype=torch.bool)).tolist() == [4, 5]
    assert caption_hits(logits, positions, gold, torch.zeros(5, dtype=torch.bool)).tolist() == [0, 0]


class NextTokenOracle(TrainableModel):
    """Predicts each position's next token of its own (shard of the) sequence, except that it names the word of
    `(d + 1) % 10` where the next token is the word of a digit `d` in `wrong`."""

    def __init__(self, vocab_size: int, word_ids: torch.Tensor, wrong: set[int]) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.swap = {int(word_ids[d]): int(word_ids[(d + 1) % 10]) for d in wrong}
        self.calls = 0

    def forward(self, input_ids: torch.Tensor, **_) -> dict[str, torch.Tensor]:
        self.calls += 1
        following = torch.roll(input_ids, -1, dims=1)
        for word, other in self.swap.items():
            following = torch.where(following == word, other, following)
        return {"logits": F.one_hot(following, self.vocab_size).float()}


@pytest.fixture(scope="module")
def vl_trainer(tmp_path_factory):
    trainer = DigitsVLTrainer(small_config("vl", tmp_path_factory.mktemp("digits") / "run"))
    yield trainer
    trainer.close()


@pytest.mark.parametrize(("dp", "sp"), [(1, 1), (2, 1), (1, 2), (2, 2), (3, 1)])
def test_caption_accuracy_is_exactly_k_over_n(vl_trainer, monkeypatch, dp, sp):
    """An oracle that is right for exactly the held-out images whose digit is not 3 or 7. Each simulated (dp, sp)
    rank evaluates its share (its images, its sequence shard); the (correct, counted) pairs that would be summed by
    the all-reduce add up to exactly (k, 359)."""
    data = vl_trainer.eval_dataset
    wrong = {3, 7}
    k = sum(int(d) not in wrong for d in data.digits)
    assert 0 < k < len(data.digits) == 359
    oracle = NextTokenOracle(data.vocab_size, data.word_ids, wrong)
    sent = []

    def all_reduce(values, op, group):
        assert op == "sum"
        sent.append(tuple(values))
        return values

    monkeypatch.setattr(qwen2_vl_digits, "all_reduce", all_reduce)
    monkeypatch.setattr(vl_trainer, "model", oracle)
    single = vl_trainer.parallel
    results = []
    for dp_rank in range(dp):
        for sp_rank in range(sp):
            state = dataclasses.replace(single, dp_size=dp, sp_size=sp, dp_rank=dp_rank, sp_rank=sp_rank)
            monkeypatch.setattr(vl_trainer, "parallel", state)
            results.append(vl_trainer.extra_eval_metrics())
    assert [sum(column) for column in zip(*sent)] == [k, 359]
    if sp == 2:  # 11 tokens padded to 12: the query position 8 is in the second shard
        assert all(counted == 0 for _, counted in sent[0::2]) and all(counted > 0 for _, counted in sent[1::2])
    if dp == sp == 1:
        assert results == [{"caption_accuracy": k / 359}]
    per_batch = vl_trainer.config.train.micro_batch_size
    assert oracle.calls == dp * sp * math.ceil(math.ceil(359 / dp) / per_batch), "as many forwards on every rank"


def test_caption_accuracy_ranks_with_fewer_images_run_filler_batches_that_count_nothing(vl_trainer, monkeypatch):
    """5 held-out images over 4 dp ranks, 1 per micro-batch: rank 0 has 2 images, the others 1, yet every rank runs
    2 forwards (collectives inside the model must line up); the filler batch counts nothing."""
    data = DigitsDataset(vl_trainer.tokenizer, "eval", eval_fraction=5 / 1797 + 1e-9)
    assert len(data.digits) == 5
    oracle = NextTokenOracle(data.vocab_size, data.word_ids, set())
    sent = []
    monkeypatch.setattr(qwen2_vl_digits, "all_reduce", lambda values, op, group: sent.append(values) or values)
    monkeypatch.setattr(vl_trainer, "model", oracle)
    monkeypatch.setattr(vl_trainer, "eval_dataset", data)
    config = vl_trainer.config
    monkeypatch.setattr(
        vl_trainer, "config", dataclasses.replace(config, train=dataclasses.replace(config.train, micro_batch_size=1))
    )
    for dp_rank in range(4):
        monkeypatch.setattr(
            vl_trainer, "parallel", dataclasses.replace(vl_trainer.parallel, dp_size=4, dp_rank=dp_rank)
        )
        vl_trainer.extra_eval_metrics()
    assert sent == [[2, 2], [1, 1], [1, 1], [1, 1]]
    assert oracle.calls == 8


def test_caption_accuracy_of_an_always_right_and_a_shifted_oracle(vl_trainer, monkeypatch):
    data = vl_trainer.eval_dataset
    monkeypatch.setattr(vl_trainer, "model", NextTokenOracle(data.vocab_size, data.word_ids, set()))
    assert vl_trainer.extra_eval_metrics() == {"caption_accuracy": 1.0}

    class CopyOracle(NextTokenOracle):  # predicts the current token: right only if the metric read position n-2
        def forward(self, input_ids, **_):
            return {"logits": F.one_hot(input_ids, self.vocab_size).float()}

    monkeypatch.setattr(vl_trainer, "model", CopyOracle(data.vocab_size, data.word_ids, set()))
    assert vl_trainer.extra_eval_metrics() == {"caption_accuracy": 0.0}


def test_trainer_reads_its_tokenizer_back_on_resume(vl_trainer, monkeypatch):
    saved = vl_trainer.output_dir / "tokenizer.json"
    assert saved.is_file()

    def no_training():
        raise AssertionError("trained again although the run has a tokenizer")

    monkeypatch.setattr(digits_module, "train_tokenizer", no_training)
    resumed = DigitsVLTrainer(
        dataclasses.replace(
            vl_trainer.config, checkpoint=dataclasses.replace(vl_trainer.config.checkpoint, resume=True)
        )
    )
    try:
        assert resumed.tokenizer.get_vocab() == vl_trainer.tokenizer.get_vocab()
        assert resumed.train_dataset.image_token_id == vl_trainer.train_dataset.image_token_id
    finally:
        resumed.close()


def test_a_caption_batch_that_cannot_be_built_is_an_agreed_data_error_before_its_forward(vl_trainer, monkeypatch):
    """Issue 48: the caption loop builds each batch through `agreed_micro_batches`, so a rank that cannot build one
    says so on every rank (the agreement itself is tested on 2 gloo ranks in tests/trainer/test_agreement.py)."""
    from veomni_lite.data.checks import DataError

    def failing(*args, **kwargs):
        raise ValueError("image 12: no pixels")

    oracle = NextTokenOracle(vl_trainer.eval_dataset.vocab_size, vl_trainer.eval_dataset.word_ids, set())
    monkeypatch.setattr(vl_trainer, "model", oracle)
    monkeypatch.setattr(qwen2_vl_digits, "collate_qwen2_vl", failing)
    with pytest.raises(DataError, match=r"caption accuracy at step 0, batch 1: rank 0: ValueError: image 12: no pix"):
        vl_trainer.extra_eval_metrics()
    assert oracle.calls == 0
