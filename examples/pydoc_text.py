"""Real English text that ships with Python: the `pydoc_data.topics` help pages (~65k words), tokenized with a
byte-level BPE tokenizer trained here with `tokenizers` (nothing is downloaded).

`train_tokenizer(vocab_size)` is deterministic for a given vocabulary size. `PydocTextDataset` cuts the token stream
into fixed-length samples (`<bos>` + `seq_len - 1` tokens); the last `eval_fraction` of the stream is the held-out
split. A sample's `labels` equal its `input_ids` except `<bos>`, unshifted (the collator shifts once).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from examples.tokenizer_file import load_or_train
from veomni_lite.loss_keys import IGNORE_INDEX

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
SPECIAL_TOKENS = (PAD, BOS, EOS)

__all__ = ["PydocTextDataset", "corpus_documents", "load_or_train_tokenizer", "train_bpe", "train_tokenizer"]


def corpus_documents() -> list[str]:
    """Every help topic of `pydoc_data.topics`, in sorted topic order."""
    from pydoc_data.topics import topics

    return [topics[name] for name in sorted(topics)]


def train_bpe(texts: list[str], vocab_size: int, special_tokens: Sequence[str]) -> Tokenizer:
    """A byte-level BPE tokenizer trained on `texts` (deterministic); the special tokens take the first ids."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def train_tokenizer(vocab_size: int) -> Tokenizer:
    """A byte-level BPE tokenizer trained on the corpus; ids 0, 1, 2 are `<pad>`, `<bos>`, `<eos>`."""
    return train_bpe(corpus_documents(), vocab_size, SPECIAL_TOKENS)


def load_or_train_tokenizer(path: str | Path, vocab_size: int, save: bool = True) -> Tokenizer:
    """The tokenizer saved at `path` (a resumed run keeps its tokenizer), else a new one, saved there when `save`
    (training is deterministic, so every rank builds the same one and only rank 0 writes it)."""
    tokenizer = load_or_train(path, lambda: train_tokenizer(vocab_size), save)
    if tokenizer.get_vocab_size() != vocab_size:
        raise ValueError(
            f"{path} has a vocabulary of {tokenizer.get_vocab_size()} tokens, the config asks for {vocab_size}; "
            "delete it or use another train.output_dir"
        )
    return tokenizer


class PydocTextDataset:
    """Fixed-length samples of the tokenized corpus: split "train" (the first part) or "eval" (the held-out tail)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        seq_len: int,
        split: str,
        eval_fraction: float = 0.05,
        special_ids: tuple[int, int, int] | None = None,
    ) -> None:
        """`special_ids`: (pad, bos, eos) of a tokenizer that does not name them `<pad>`, `<bos>`, `<eos>`."""
        if split not in ("train", "eval"):
            raise ValueError(f"PydocTextDataset: split must be 'train' or 'eval', got {split!r}")
        if seq_len < 2:
            raise ValueError(f"PydocTextDataset: seq_len must be >= 2, got {seq_len}")
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.get_vocab_size()
        self.pad_id, self.bos_id, self.eos_id = special_ids or tuple(tokenizer.token_to_id(t) for t in SPECIAL_TOKENS)
        eos = [self.eos_id]
        stream = [i for doc in tokenizer.encode_batch(corpus_documents()) for i in doc.ids + eos]
        body = seq_len - 1
        chunks = torch.tensor(stream[: len(stream) // body * body]).view(-1, body)
        held_out = max(1, int(len(chunks) * eval_fraction))
        self.chunks = chunks[-held_out:] if split == "eval" else chunks[:-held_out]

    def __len__(self) -> int:
        return len(self.chunks)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        input_ids = torch.cat([torch.tensor([self.bos_id]), self.chunks[index]])
        labels = input_ids.clone()
        labels[0] = IGNORE_INDEX
        return {"input_ids": input_ids, "labels": labels}

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)
