"""Preference pairs from the user's files (`data.format: preference`), through the SFT data path.

Rows, in TRL's column layouts (names changeable with `data.columns`: `prompt`, `chosen`, `rejected`, `images`,
`margin`, and the SFT message keys):
  explicit  {"prompt": text | messages, "chosen": text | messages, "rejected": text | messages}: a text prompt is a
            user turn and a text response an assistant turn (as SFT's prompt_completion);
  implicit  {"chosen": messages, "rejected": messages}: whole conversations; the prompt is their longest shared
            prefix of messages and each side's response the rest, which must start with an assistant turn;
plus optional `images` (one image set per pair, both sides see it) and, for reward models, a numeric `margin`.
Each side is the prompt then its response, rendered by the chat template (`ChatEncoder`: the model's, or
`data.chat_template`), its response tokens the head's targets (`pref_labels`; the prompt's own assistant turns do not
train). Bad rows are a DataError naming the file and the row (0-based): a missing side, identical sides, no shared
prefix, a side over `data.max_seq_len` (`data.overlength`: truncate the side's end, drop the pair, or error; a
truncated side keeps at least one response token, else it is an error).

Rows are encoded in memory (pair sets are small next to SFT sets), each rank a share (row i of the split by rank
i mod world) and gathered in file order, so a bad row met by one rank is the same named DataError on every rank.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from veomni_lite.data.checks import DataError
from veomni_lite.data.sft import (
    ChatEncoder,
    Conversation,
    Source,
    Turn,
    load_image,
    row_name,
    to_conversation,
)
from veomni_lite.data.sft_dataset import ImageProcessing
from veomni_lite.distributed.collectives import agree, all_gather_objects
from veomni_lite.loss_keys import IGNORE_INDEX
from veomni_lite.rl.preference import PREF_LABELS

__all__ = ["Pair", "PairSet", "encode_pair", "read_pairs"]

SIDES = ("chosen", "rejected")


@dataclass
class Pair:
    """One encoded pair: each side's token ids and (unshifted) response targets, the images' model inputs, the
    reference's per-target log-probabilities once computed, a reward margin, the row's name."""

    chosen: tuple[list[int], list[int]]
    rejected: tuple[list[int], list[int]]
    where: str
    model_inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    margin: float | None = None
    ref: tuple[list[float], list[float]] | None = None

    def side(self, which: str) -> dict[str, torch.Tensor]:
        ids, labels = getattr(self, which)
        return {"input_ids": torch.tensor(ids), PREF_LABELS: torch.tensor(labels), **self.model_inputs}

    def item(self) -> dict[str, Any]:
        """What `collate_pairs` takes."""
        out: dict[str, Any] = {which: self.side(which) for which in SIDES}
        if self.ref is not None:
            out["ref_chosen"], out["ref_rejected"] = self.ref
        if self.margin is not None:
            out["margin"] = self.margin
        return out


class PairSet:
    """The pairs of one split, in file order; `length(i)`: pair i's token cost in a micro-batch (the two sides'
    tokens packed, else two rows of the longer side)."""

    def __init__(self, pairs: Sequence[Pair], packing: bool) -> None:
        self.pairs, self.packing = list(pairs), packing

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.pairs[index].item()

    def length(self, index: int) -> int:
        c, r = (len(getattr(self.pairs[index], which)[0]) for which in SIDES)
        return c + r if self.packing else 2 * max(c, r)

    @property
    def stats(self) -> str:
        tokens = [self.length(i) for i in range(len(self))]
        return f"{len(self)} pairs, {sum(tokens)} tokens (max {max(tokens, default=0)} per pair)"


def _turns(value: Any, role: str, columns: Mapping[str, Any], where: str, what: str) -> list[Turn]:
    """A text (one `role` turn; `<image>` placeholders as SFT reads them) or a list of messages, as turns."""
    if isinstance(value, list):
        return to_conversation({columns.get("messages", "messages"): value}, "messages", columns, where).turns
    return [Turn(role, to_conversation({"text": value}, "text", {}, f"{where}: {what}").turns[0].parts)]


def _missing(value: Any) -> bool:
    return value is None or value == "" or value == []


def to_pair_turns(row: Mapping[str, Any], columns: Mapping[str, Any], where: str) -> tuple[list, list, list, list]:
    """(prompt turns, chosen response turns, rejected response turns, images) of a row (see the module docstring)."""
    c = {"prompt": "prompt", "chosen": "chosen", "rejected": "rejected", "images": "images", **columns}
    for which in SIDES:
        if _missing(row.get(c[which])):
            raise DataError(
                f"{where}: missing side: column {c[which]!r} is absent or empty (the row has {sorted(row)})"
            )
    images = row.get(c["images"]) or []
    images = images if isinstance(images, list) else [images]
    if not _missing(row.get(c["prompt"])):
        prompt = _turns(row[c["prompt"]], "user", columns, where, c["prompt"])
        chosen = _turns(row[c["chosen"]], "assistant", columns, where, c["chosen"])
        rejected = _turns(row[c["rejected"]], "assistant", columns, where, c["rejected"])
    else:
        whole = {which: _turns(row[c[which]], "assistant", columns, where, c[which]) for which in SIDES}
        shared = 0
        for a, b in zip(whole["chosen"], whole["rejected"]):
            if (a.role, a.parts) != (b.role, b.parts):
                break
            shared += 1
        if shared == 0:
            raise DataError(
                f"{where}: no shared prefix: the implicit chosen and rejected conversations must start with the same "
                f"prompt messages (or give a {c['prompt']!r} column)"
            )
        prompt, chosen, rejected = whole["chosen"][:shared], whole["chosen"][shared:], whole["rejected"][shared:]
    for which, turns in (("chosen", chosen), ("rejected", rejected)):
        if not turns or turns[0].role != "assistant":
            raise DataError(f"{where}: the {which} response must start with an assistant turn after the prompt")
    if [(t.role, t.parts) for t in chosen] == [(t.role, t.parts) for t in rejected]:
        raise DataError(f"{where}: identical sides: chosen and rejected are the same response")
    return prompt, chosen, rejected, images


def _fit(ids: list[int], labels: list[int], max_len: int, overlength: str, where: str, which: str) -> tuple | None:
    if max_len <= 0 or len(ids) <= max_len:
        return ids, labels
    if overlength == "error":
        raise DataError(f"{where}: the {which} side has {len(ids)} tokens, over data.max_seq_len={max_len} "
                        "(data.overlength: error)")  # fmt: skip
    if overlength == "drop":
        return None
    if all(label == IGNORE_INDEX for label in labels[:max_len]):
        raise DataError(f"{where}: the prompt alone fills data.max_seq_len={max_len}; the {which} side has no "
                        "response token left after truncation")  # fmt: skip
    return ids[:max_len], labels[:max_len]


def encode_pair(
    row: Mapping[str, Any],
    where: str,
    encoder: ChatEncoder,
    images: ImageProcessing | None,
    columns: Mapping[str, Any],
    media_dir: Path,
    max_seq_len: int = 0,
    overlength: str = "truncate",
) -> Pair | None:
    """One row as a `Pair` (None: dropped by `data.overlength: drop`), or a DataError naming `where`."""
    prompt, chosen, rejected, image_values = to_pair_turns(row, columns, where)
    model_inputs: dict[str, torch.Tensor] = {}
    lengths: list[int] = []
    if image_values:
        if images is None:
            raise DataError(f"{where}: the row has images but the model takes none (not a vision-language model)")
        model_inputs = images([load_image(value, media_dir, where) for value in image_values])
        lengths = images.token_counts(model_inputs["image_grid_thw"])
    frozen = [Turn(t.role, t.parts, train=False) for t in prompt]
    sides = {}
    for which, response in (("chosen", chosen), ("rejected", rejected)):
        encoded = encoder.encode(Conversation(frozen + response, list(image_values)), lengths, where)
        if all(label == IGNORE_INDEX for label in encoded.labels):
            raise DataError(f"{where}: the {which} response has no token to train on")
        fitted = _fit(encoded.input_ids, encoded.labels, max_seq_len, overlength, where, which)
        if fitted is None:
            return None
        sides[which] = fitted
    margin_column = columns.get("margin", "margin")
    margin = row.get(margin_column)
    if margin is not None and not isinstance(margin, (int, float)):
        raise DataError(f"{where}: column {margin_column!r} is {margin!r}, not a number")
    return Pair(sides["chosen"], sides["rejected"], where, model_inputs, None if margin is None else float(margin))


def read_pairs(
    sources: Sequence[Source],
    encoder: ChatEncoder,
    images: ImageProcessing | None,
    columns: Mapping[str, Any],
    media_dir: str | Path = "",
    max_seq_len: int = 0,
    overlength: str = "truncate",
    packing: bool = False,
    rank: int = 0,
    world: int = 1,
    group: Any = None,
    what: str = "data.train_path",
) -> tuple[PairSet, int]:
    """(every row of `sources` as pairs, in file order; the number dropped by `data.overlength`). Collective over
    `group` when `world` > 1: each rank encodes its share and a bad row is the same DataError on every rank."""
    mine: dict[int, Pair | None] = {}
    problem: DataError | None = None
    counter = 0
    try:
        for source in sources:
            base = Path(media_dir) if media_dir else source.path.parent
            for index, row in source.read(0, source.num_rows):
                if counter % world == rank:
                    where = row_name(source.path, index)
                    mine[counter] = encode_pair(row, where, encoder, images, columns, base, max_seq_len, overlength)
                counter += 1
    except DataError as exc:
        problem = exc
    agree(problem, DataError, group, where=f"{what}: ")
    merged: dict[int, Pair | None] = {}
    for part in all_gather_objects(mine, group) if world > 1 else [mine]:
        merged.update(part)
    pairs = [merged[i] for i in sorted(merged)]
    kept = [pair for pair in pairs if pair is not None]
    return PairSet(kept, packing), len(pairs) - len(kept)
