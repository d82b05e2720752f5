"""Real images that ship offline: scikit-learn's handwritten digits (1,797 8x8 images, 17 intensity levels).

Two tasks per image, as the VL model's two heads:
- understanding (image -> caption): `<bos> <|vision_start|> <|image_pad|> x n <|vision_end|> a handwritten SEVEN
  <eos>`; text targets: the caption and `<eos>`;
- generation (caption -> image codes): `<bos> a handwritten SEVEN <boi> <code> x 64 <eos>`; text targets `<boi>`,
  `<eos>`; `image_decoder_labels`: the 64 pixel intensities (row-major, 0..16) at the code positions.
Sample i is image i // 2, understanding when i is even. A fixed permutation (seed 0) holds out `eval_fraction` of
the images. Pixels are standardized (mean 0.30, std 0.38 over the digits) and cut into Qwen2-VL's patch layout.
The tokenizer is word-level, trained here with `tokenizers` on the caption vocabulary (each digit word is one
token) and saved with the run.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from examples.tokenizer_file import load_or_train
from veomni_lite.loss_keys import IGNORE_INDEX

DIGIT_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
NUM_CODES = 17
IMAGE_SIDE = 8
PIXEL_MEAN, PIXEL_STD = 0.30, 0.38
SPECIAL_TOKENS = ("<pad>", "<unk>", "<bos>", "<eos>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<boi>")
CODE_TOKENS = tuple(f"<code_{level}>" for level in range(NUM_CODES))


def train_tokenizer() -> Tokenizer:
    """Word-level: the special tokens, the 17 code tokens, then the caption words (deterministic)."""
    tokenizer = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    trainer = trainers.WordLevelTrainer(special_tokens=[*SPECIAL_TOKENS, *CODE_TOKENS], min_frequency=1)
    tokenizer.train_from_iterator([f"a handwritten {word}" for word in DIGIT_WORDS], trainer=trainer)
    return tokenizer


def load_or_train_tokenizer(path: str | Path, save: bool = True) -> Tokenizer:
    """The tokenizer saved at `path` (a resumed run keeps its ids), else a new one, saved there when `save`."""
    return load_or_train(path, train_tokenizer, save)


def patchify(image: torch.Tensor, patch: int, temporal_patch: int, merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[C, H, W] -> (pixel_values [t*h*w, C*temporal_patch*patch^2], image_grid_thw [1, 3]) in Qwen2-VL's order:
    merge x merge blocks of patches row-major, the patches of a block row-major, features (C, t, p, p)."""
    channels, height, width = image.shape
    frames = image.unsqueeze(0).expand(temporal_patch, channels, height, width)
    gh, gw = height // patch, width // patch
    x = frames.reshape(1, temporal_patch, channels, gh // merge, merge, patch, gw // merge, merge, patch)
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return x.reshape(gh * gw, channels * temporal_patch * patch * patch), torch.tensor([[1, gh, gw]])


class DigitsDataset:
    """Split "train" or "eval" of the digits, both tasks per image (see the module docstring)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        split: str,
        patch: int = 2,
        temporal_patch: int = 1,
        merge: int = 2,
        eval_fraction: float = 0.2,
    ) -> None:
        from sklearn.datasets import load_digits

        if split not in ("train", "eval"):
            raise ValueError(f"DigitsDataset: split must be 'train' or 'eval', got {split!r}")
        digits = load_digits()
        order = torch.randperm(len(digits.target), generator=torch.Generator().manual_seed(0))
        held_out = int(len(order) * eval_fraction)
        chosen = order[:held_out] if split == "eval" else order[held_out:]
        self.images = torch.tensor(digits.images, dtype=torch.float32)[chosen]  # [N, 8, 8] in 0..16
        self.digits = torch.tensor(digits.target)[chosen]
        self.patch, self.temporal_patch, self.merge = patch, temporal_patch, merge
        vocab = tokenizer.get_vocab()
        self.vocab_size = tokenizer.get_vocab_size()
        self.token = {name: vocab[name] for name in SPECIAL_TOKENS}
        self.pad_id, self.image_token_id = self.token["<pad>"], self.token["<|image_pad|>"]
        self.word_ids = torch.tensor([vocab[word] for word in DIGIT_WORDS])
        self.prefix = [vocab["a"], vocab["handwritten"]]
        self.code_ids = torch.tensor([vocab[code] for code in CODE_TOKENS])
        self.image_tokens = (IMAGE_SIDE // patch) ** 2 // merge**2

    def __len__(self) -> int:
        return 2 * len(self.digits)

    def pixel_values(self, image_index: int) -> tuple[torch.Tensor, torch.Tensor]:
        image = (self.images[image_index] / (NUM_CODES - 1) - PIXEL_MEAN) / PIXEL_STD
        return patchify(image.unsqueeze(0), self.patch, self.temporal_patch, self.merge)

    def understanding(self, image_index: int) -> dict[str, torch.Tensor]:
        t = self.token
        prompt = [t["<bos>"], t["<|vision_start|>"], *[self.image_token_id] * self.image_tokens, t["<|vision_end|>"]]
        caption = [*self.prefix, int(self.word_ids[self.digits[image_index]]), t["<eos>"]]
        input_ids = torch.tensor(prompt + caption)
        labels = torch.tensor([IGNORE_INDEX] * len(prompt) + caption)
        pixel_values, grid = self.pixel_values(image_index)
        return {
            "input_ids": input_ids,
            "labels": labels,
            "image_decoder_labels": torch.full_like(input_ids, IGNORE_INDEX),
            "pixel_values": pixel_values,
            "image_grid_thw": grid,
        }

    def generation(self, image_index: int) -> dict[str, torch.Tensor]:
        t = self.token
        codes = self.images[image_index].reshape(-1).long()
        prompt = [t["<bos>"], *self.prefix, int(self.word_ids[self.digits[image_index]]), t["<boi>"]]
        input_ids = torch.cat([torch.tensor(prompt), self.code_ids[codes], torch.tensor([t["<eos>"]])])
        ignore = torch.full_like(codes, IGNORE_INDEX)
        labels = torch.cat([torch.tensor([IGNORE_INDEX] * 4 + [t["<boi>"]]), ignore, torch.tensor([t["<eos>"]])])
        image_labels = torch.cat([torch.full((5,), IGNORE_INDEX), codes, torch.tensor([IGNORE_INDEX])])
        return {"input_ids": input_ids, "labels": labels, "image_decoder_labels": image_labels}

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.understanding(index // 2) if index % 2 == 0 else self.generation(index // 2)

    def caption_query(self, image_index: int) -> tuple[dict[str, torch.Tensor], int, int]:
        """(understanding sample, position whose prediction is the digit word, the word's token id)."""
        sample = self.understanding(image_index)
        return sample, sample["input_ids"].numel() - 3, int(self.word_ids[self.digits[image_index]])
