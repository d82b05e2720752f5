"""The loss-key naming convention, in one place (plain Python: importing it loads neither torch nor the loss state).

A loss head has a name. Its targets are the batch key `<name>_labels`, its valid-token count `<name>_tokens`, its loss
`<name>_loss`; the text head is named `foundation` and reads the plain `labels` key (VeOmni's convention). Targets equal
to `IGNORE_INDEX` are not counted and not trained on.

Sequences: the batch key `sequence_ids` marks which sequence (sample) each position belongs to (-1: none, the padding;
-2: a packed row's shared prefix, `veomni_lite.data.collator`), written by the collator before any SP slicing; without
it each row is one sequence. For the per-sequence loss modes, `mark_sequences` derives per head `<name>_seq_starts`
(True at the first valid target of each sequence, counted as `<name>_sequences`) and `<name>_loss_weights` (1 / the
sequence's valid targets, for `seq-mean-token-mean`).
"""

from __future__ import annotations

IGNORE_INDEX = -100
FOUNDATION = "foundation"
SEQUENCE_IDS = "sequence_ids"
ATTENTION_SEQUENCE_IDS = "attention_sequence_ids"  # packed rows: `sequence_ids` kept whole under SP, for attention

__all__ = [
    "ATTENTION_SEQUENCE_IDS",
    "FOUNDATION",
    "IGNORE_INDEX",
    "SEQUENCE_IDS",
    "is_labels_key",
    "labels_key",
    "loss_key",
    "loss_weights_key",
    "name_of_labels",
    "name_of_loss",
    "seq_starts_key",
    "sequences_key",
    "tokens_key",
]


def labels_key(name: str) -> str:
    """`foundation` -> `labels`, `<name>` -> `<name>_labels`."""
    return "labels" if name == FOUNDATION else f"{name}_labels"


def tokens_key(name: str) -> str:
    return f"{name}_tokens"


def loss_key(name: str) -> str:
    return f"{name}_loss"


def sequences_key(name: str) -> str:
    """The count of sequences with a valid target of head `name`."""
    return f"{name}_sequences"


def seq_starts_key(name: str) -> str:
    return f"{name}_seq_starts"


def loss_weights_key(name: str) -> str:
    return f"{name}_loss_weights"


def name_of_labels(batch_key: str) -> str | None:
    """`labels` -> `foundation`, `<name>_labels` -> `<name>`, any other batch key -> None."""
    if batch_key == "labels":
        return FOUNDATION
    if batch_key.endswith("_labels") and len(batch_key) > len("_labels"):
        return batch_key[: -len("_labels")]
    return None


def is_labels_key(batch_key: str) -> bool:
    return name_of_labels(batch_key) is not None


def name_of_loss(key: str) -> str:
    """`<name>_loss` -> `<name>`; any other key raises KeyError naming it."""
    if not isinstance(key, str) or not key.endswith("_loss") or key == "_loss":
        raise KeyError(f"loss key {key!r} must be named '<name>_loss'")
    return key[: -len("_loss")]
