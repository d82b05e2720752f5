"""A run's tokenizer file: read back when it exists (a resumed run keeps its ids), else trained and written once."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from tokenizers import Tokenizer


def load_or_train(path: str | Path, train: Callable[[], Tokenizer], save: bool) -> Tokenizer:
    """The tokenizer at `path`, else `train()`, written there atomically when `save` (training is deterministic, so
    every rank builds the same one and only rank 0 writes it)."""
    path = Path(path)
    if path.is_file():
        return Tokenizer.from_file(str(path))
    tokenizer = train()
    if save:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tokenizer.save(str(tmp))
        tmp.replace(path)
    return tokenizer
