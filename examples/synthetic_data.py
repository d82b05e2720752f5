"""Synthetic, deterministic datasets: a copy/reverse/sort text language and a shapes-and-colours VLM corpus.

Contract: `dataset[i]` depends only on (seed, i) and is a dict of CPU tensors with UNSHIFTED targets (the collator
shifts once): `input_ids` [S] int64 and `labels` [S] int64 (the token itself where it is a text target, IGNORE_INDEX
elsewhere). The VLM dataset adds `image_decoder_labels` [S] (the patch code at image-code positions, IGNORE_INDEX
elsewhere) and `pixel_values` [C, H, W] float32 in [0, 1] (zeros on generation samples).

Shared special ids: PAD 0, BOS 1, EOS 2.
Text vocabulary: SEP 3, task tokens COPY 4, REVERSE 5, SORT 6, then `num_symbols` symbols.
    [BOS, task, x_1..x_n, SEP, y_1..y_n, EOS]; targets are y_1..y_n and EOS (plus the prompt if `loss_on_prompt`).
VLM vocabulary: IMG 3 (input patch placeholder), BOI 4 (begin of image to generate), the caption words, then
`num_image_codes` image-code tokens (code c has id `code_offset + c`).
    understanding: [BOS, IMG x P, caption, EOS]          targets: caption and EOS
    generation:    [BOS, caption, BOI, code x P, EOS]    targets: BOI and EOS (text); the P codes (image decoder)
A caption is `[dark] colour shape`. Each image holds one shape drawn on the grid of patches, so a patch's code, the
palette index covering most of it (0 = background, 1 + 2 * colour + dark), is exactly its cell colour.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch
from torch import Tensor
from torch.utils.data import Dataset

from veomni_lite.loss_keys import IGNORE_INDEX

__all__ = [
    "BOI_ID",
    "BOS_ID",
    "COLORS",
    "EOS_ID",
    "IMG_ID",
    "PAD_ID",
    "SEP_ID",
    "SHAPES",
    "SyntheticTextDataset",
    "SyntheticVLMDataset",
    "patch_codes",
    "sample_generator",
]

PAD_ID = 0
BOS_ID = 1
EOS_ID = 2
SEP_ID = 3  # text
IMG_ID = 3  # VLM
BOI_ID = 4  # VLM

TEXT_TASKS = ("copy", "reverse", "sort")
_TASK_OFFSET = 4

COLORS: dict[str, tuple[float, float, float]] = {
    "red": (1.0, 0.0, 0.0),
    "green": (0.0, 1.0, 0.0),
    "blue": (0.0, 0.0, 1.0),
    "yellow": (1.0, 1.0, 0.0),
}
_DARK_FACTOR = 0.5

# Footprints in template cells; each cell is `scale` x `scale` patches, scale = max(1, grid // 4).
SHAPES: dict[str, tuple[str, ...]] = {
    "square": ("##", "##"),
    "bar": ("###",),
    "column": ("#", "#", "#"),
    "cross": (".#.", "###", ".#."),
    "frame": ("###", "#.#", "###"),
    "dot": ("#",),
}


def sample_generator(seed: int, index: int) -> torch.Generator:
    """A CPU generator seeded from a hash of (seed, index): samples are independent of access order."""
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)


def _randint(generator: torch.Generator, low: int, high: int) -> int:
    """Uniform in [low, high)."""
    return int(torch.randint(low, high, (1,), generator=generator))


def _check_index(index: int, length: int) -> int:
    if index < 0:
        index += length
    if not 0 <= index < length:
        raise IndexError(f"index {index} out of range for a dataset of {length} samples")
    return index


class SyntheticTextDataset(Dataset):
    """Copy / reverse / sort over `num_symbols` symbols, lengths n in [min_len, max_len]; a sample has 2n + 4 tokens."""

    def __init__(
        self,
        num_samples: int = 4096,
        num_symbols: int = 16,
        min_len: int = 2,
        max_len: int = 12,
        tasks: Sequence[str] = TEXT_TASKS,
        loss_on_prompt: bool = False,
        seed: int = 0,
    ) -> None:
        unknown = sorted(set(tasks) - set(TEXT_TASKS))
        if unknown or not tasks:
            raise ValueError(f"tasks {list(tasks)} must be a non-empty subset of {list(TEXT_TASKS)}")
        if not 1 <= min_len <= max_len:
            raise ValueError(f"need 1 <= min_len ({min_len}) <= max_len ({max_len})")
        self.num_samples = num_samples
        self.num_symbols = num_symbols
        self.min_len = min_len
        self.max_len = max_len
        self.tasks = tuple(tasks)
        self.loss_on_prompt = loss_on_prompt
        self.seed = seed
        self.symbol_offset = _TASK_OFFSET + len(TEXT_TASKS)

    @property
    def vocab_size(self) -> int:
        return self.symbol_offset + self.num_symbols

    @property
    def max_seq_len(self) -> int:
        return 2 * self.max_len + 4

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        generator = sample_generator(self.seed, _check_index(index, self.num_samples))
        task = self.tasks[_randint(generator, 0, len(self.tasks))]
        n = _randint(generator, self.min_len, self.max_len + 1)
        xs = torch.randint(0, self.num_symbols, (n,), generator=generator) + self.symbol_offset
        ys = {"copy": xs, "reverse": xs.flip(0), "sort": xs.sort().values}[task]
        task_id = _TASK_OFFSET + TEXT_TASKS.index(task)
        input_ids = torch.cat([torch.tensor([BOS_ID, task_id]), xs, torch.tensor([SEP_ID]), ys, torch.tensor([EOS_ID])])
        labels = input_ids.clone()
        labels[0] = IGNORE_INDEX
        if not self.loss_on_prompt:
            labels[: n + 3] = IGNORE_INDEX  # BOS, task, xs, SEP
        return {"input_ids": input_ids, "labels": labels}

    def decode(self, ids: Sequence[int] | Tensor) -> str:
        names = {PAD_ID: "<pad>", BOS_ID: "<bos>", EOS_ID: "<eos>", SEP_ID: "="}
        names.update({_TASK_OFFSET + i: f"<{t}>" for i, t in enumerate(TEXT_TASKS)})
        return " ".join(names.get(i, f"s{i - self.symbol_offset}") for i in torch.as_tensor(ids).tolist())


def patch_codes(index_map: Tensor, patch_size: int, num_codes: int) -> Tensor:
    """[H, W] palette indices -> [P] codes in row-major patch order: the index covering most of each patch.

    Ties go to the lower index (background first). Matches the `(h w)` patch order of the model's patchify.
    """
    h, w = index_map.shape
    patches = index_map.reshape(h // patch_size, patch_size, w // patch_size, patch_size).permute(0, 2, 1, 3)
    one_hot = torch.nn.functional.one_hot(patches.reshape(-1, patch_size * patch_size), num_codes)
    return one_hot.sum(dim=1).argmax(dim=-1)  # argmax returns the first maximum


class SyntheticVLMDataset(Dataset):
    """One coloured shape per image; understanding (image -> caption) and generation (caption -> codes) samples."""

    def __init__(
        self,
        num_samples: int = 4096,
        image_size: int = 16,
        patch_size: int = 4,
        generation_ratio: float = 0.5,
        seed: int = 0,
    ) -> None:
        if image_size % patch_size != 0:
            raise ValueError(f"image_size ({image_size}) must be divisible by patch_size ({patch_size})")
        self.grid = image_size // patch_size
        if self.grid < 3:
            raise ValueError(f"image_size / patch_size = {self.grid}; need at least 3 patches per side for the shapes")
        if not 0.0 <= generation_ratio <= 1.0:
            raise ValueError(f"generation_ratio ({generation_ratio}) must be in [0, 1]")
        self.num_samples = num_samples
        self.image_size = image_size
        self.patch_size = patch_size
        self.channels = 3
        self.generation_ratio = generation_ratio
        self.seed = seed
        self.words = ("dark", *COLORS, *SHAPES)
        self.word_offset = BOI_ID + 1
        self.code_offset = self.word_offset + len(self.words)
        base = torch.tensor([(0.0, 0.0, 0.0)] + [c for rgb in COLORS.values() for c in (rgb, rgb)])
        self.palette = base * torch.tensor([1.0] + [1.0, _DARK_FACTOR] * len(COLORS)).unsqueeze(-1)  # [codes, 3]

    @property
    def num_patches(self) -> int:
        return self.grid * self.grid

    @property
    def num_image_codes(self) -> int:
        return 1 + 2 * len(COLORS)

    @property
    def image_token_id(self) -> int:
        return IMG_ID

    @property
    def vocab_size(self) -> int:
        return self.code_offset + self.num_image_codes

    @property
    def max_seq_len(self) -> int:
        return self.num_patches + 6

    def __len__(self) -> int:
        return self.num_samples

    def word_id(self, word: str) -> int:
        return self.word_offset + self.words.index(word)

    def render(self, shape: str, color: str, dark: bool, top: int, left: int) -> tuple[Tensor, Tensor]:
        """(pixel_values [3, H, W], palette index map [H, W]) of one shape whose top-left is patch (top, left)."""
        scale = max(1, self.grid // 4)
        template = torch.tensor([[ch == "#" for ch in row] for row in SHAPES[shape]])
        cells = template.repeat_interleave(scale, 0).repeat_interleave(scale, 1)
        grid = torch.zeros(self.grid, self.grid, dtype=torch.long)
        code = 1 + 2 * list(COLORS).index(color) + int(dark)
        grid[top : top + cells.shape[0], left : left + cells.shape[1]][cells] = code
        index_map = grid.repeat_interleave(self.patch_size, 0).repeat_interleave(self.patch_size, 1)
        return self.palette[index_map].permute(2, 0, 1).contiguous(), index_map

    def shape_extent(self, shape: str) -> tuple[int, int]:
        """(rows, cols) in patches that `shape` covers."""
        scale = max(1, self.grid // 4)
        rows = SHAPES[shape]
        return len(rows) * scale, len(rows[0]) * scale

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        generator = sample_generator(self.seed, _check_index(index, self.num_samples))
        shape = list(SHAPES)[_randint(generator, 0, len(SHAPES))]
        color = list(COLORS)[_randint(generator, 0, len(COLORS))]
        dark = bool(_randint(generator, 0, 2))
        rows, cols = self.shape_extent(shape)
        top = _randint(generator, 0, self.grid - rows + 1)
        left = _randint(generator, 0, self.grid - cols + 1)
        generation = bool(torch.rand((), generator=generator) < self.generation_ratio)

        image, index_map = self.render(shape, color, dark, top, left)
        caption = torch.tensor([self.word_id(w) for w in (["dark"] if dark else []) + [color, shape]])
        ignore_caption = torch.full_like(caption, IGNORE_INDEX)
        bos, eos = torch.tensor([BOS_ID]), torch.tensor([EOS_ID])
        ignore = torch.tensor([IGNORE_INDEX])
        no_codes = torch.full((self.num_patches,), IGNORE_INDEX)
        if generation:
            codes = patch_codes(index_map, self.patch_size, self.num_image_codes)
            boi = torch.tensor([BOI_ID])
            input_ids = torch.cat([bos, caption, boi, codes + self.code_offset, eos])
            labels = torch.cat([ignore, ignore_caption, boi, no_codes, eos])
            image_decoder_labels = torch.cat([ignore, ignore_caption, ignore, codes, ignore])
            pixel_values = torch.zeros_like(image)
        else:
            input_ids = torch.cat([bos, torch.full((self.num_patches,), IMG_ID), caption, eos])
            labels = torch.cat([ignore, no_codes, caption, eos])
            image_decoder_labels = torch.full_like(input_ids, IGNORE_INDEX)
            pixel_values = image
        return {
            "input_ids": input_ids,
            "labels": labels,
            "image_decoder_labels": image_decoder_labels,
            "pixel_values": pixel_values,
        }

    def decode(self, ids: Sequence[int] | Tensor) -> str:
        names = {PAD_ID: "<pad>", BOS_ID: "<bos>", EOS_ID: "<eos>", IMG_ID: "<img>", BOI_ID: "<boi>"}
        names.update({self.word_offset + i: w for i, w in enumerate(self.words)})
        names.update({self.code_offset + c: f"<c{c}>" for c in range(self.num_image_codes)})
        return " ".join(names.get(i, f"<unk{i}>") for i in torch.as_tensor(ids).tolist())
