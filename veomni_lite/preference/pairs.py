"""Preference pairs from the user's files (`data.format: preference`), through the SFT data path and its cache.

Rows, in TRL's column layouts (names changeable with `data.columns`: `prompt`, `chosen`, `rejected`, `images`,
`margin`, and the SFT message keys):
  explicit  {"prompt": text | messages, "chosen": text | messages, "rejected": text | messages}: a text prompt is a
            user turn and a text response an assistant turn (as SFT's prompt_completion);
  implicit  {"chosen": messages, "rejected": messages}: whole conversations; the prompt is their longest shared
            prefix of messages and each side's response the rest, which must start with an assistant turn;
plus optional `images` (one image set per pair, both sides see it) and, for reward models, a numeric `margin`.
Messages take SFT's tool-calling shape (an assistant turn's `tool_calls`, `tool` turns with `name` / `tool_call_id`)
and a row's `tools` column (JSON schemas) reaches both sides' chat template (`tools=`), as in SFT.
  kto       {"prompt": text | messages, "completion": text | messages, "label": bool} (TRL's unpaired layout; true =
            desirable; columns `prompt`, `completion`, `label`): stored as a pair whose chosen side is prompt +
            completion and whose rejected side is prompt + a MISMATCHED completion, that of the row before it in
            file order (the first row takes the last row's; blank lines skipped), as TRL's KTOTrainer rotates the
            completions by one (TRL: within chunks of per_device_train_batch_size; here over the whole split, so the
            mismatch does not depend on the layout). The label is kept in the `margin` column (1.0 / 0.0).
Each side is the prompt then its response, rendered by the chat template (`ChatEncoder`: the model's, or
`data.chat_template`), its response tokens the head's targets (`pref_labels`; the prompt's own assistant turns do not
train). Bad rows are a DataError naming the file and the row (0-based): a missing side, identical sides, no shared
prefix, a side over `data.max_seq_len`, or a pair over the token budget `data.max_tokens_per_micro_batch` (its cost
in a micro-batch: packed, the two sides' tokens; padded, two rows of the longer side). `data.overlength` says what
a long side or pair gets: `truncate` cuts each side's end (a pair over the budget: the longer side first, so that
the pair fits), `drop` leaves the pair out (counted), `error` refuses it; a truncated side keeps at least one
response token and all of the pair's image tokens, else it is an error.

Preprocessed once into the SFT Arrow cache (`PairEncoder` with `CachedSamples`: `veomni_lite.data.sft_cache`, in
`data.cache_dir`): every rank encodes a contiguous share of the rows, the first bad row is the same DataError on
every rank, and a later run or a resume reads the cache without encoding a row. The key holds everything that
changes a pair (the files, format and columns, tokenizer, template, image processor, max_seq_len, overlength, the
token budget, and this code). Per pair the cache holds `source` and `row`, each side's `<side>_ids` and
`<side>_labels` (int32, unshifted), the image references with their token counts (measured from the headers; the
pixels are decoded in `__getitem__`, in the input pipeline) and the `margin` (null where the row has none).
`PairDataset` reads them memory-mapped: no rank holds the pairs in its heap. The reference log-probabilities of
`pref.precompute_reference` are a second Arrow cache inside the pair cache's directory (`reference/<fingerprint>/`,
written by `PreferenceTrainer`), which `attach_reference` maps beside the pairs.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy
import torch

from veomni_lite.data import sft_cache
from veomni_lite.data.checks import DataError
from veomni_lite.data.sft import ChatEncoder, Conversation, Source, Turn, row_name, to_conversation
from veomni_lite.data.sft_dataset import REMEDY, CachedSamples, ImageProcessing, RowEncoder, token_tensors
from veomni_lite.loss_keys import IGNORE_INDEX, SEQUENCE_IDS
from veomni_lite.preference.losses import KTO_LABELS, MARGINS, PREF_LABELS, PREF_STARTS, REF_LOGPROBS

__all__ = ["PairDataset", "PairEncoder", "collate_pairs", "pair_cost", "to_kto_turns", "to_pair_turns"]

SIDES = ("chosen", "rejected")


def pair_cost(chosen: Any, rejected: Any, packing: bool) -> Any:
    """A pair's tokens in a micro-batch from its sides' lengths (ints or arrays): packed, both sides; padded, two rows
    of the longer side."""
    return chosen + rejected if packing else 2 * numpy.maximum(chosen, rejected)


def _side_limit(chosen: int, rejected: int, budget: int, packing: bool) -> int:
    """The longest a side may be for the pair to cost at most `budget`: packed, the longer side is cut first (the
    shorter kept whole while it fits half the budget); padded, half the budget."""
    shorter = min(chosen, rejected)
    return budget - shorter if packing and shorter <= budget - shorter else budget // 2


def _turns(value: Any, role: str, columns: Mapping[str, Any], where: str, what: str) -> list[Turn]:
    """A text (one `role` turn; `<image>` placeholders as SFT reads them) or a list of messages, as turns."""
    if isinstance(value, list):
        return to_conversation({columns.get("messages", "messages"): value}, "messages", columns, where).turns
    return [Turn(role, to_conversation({"text": value}, "text", {}, f"{where}: {what}").turns[0].parts)]


def _missing(value: Any) -> bool:
    return value is None or value == "" or value == []


def _same(a: Sequence[Turn], b: Sequence[Turn]) -> bool:
    """The turns say the same: roles, text and tool fields (`tool_calls`, `name`, `tool_call_id`)."""
    return [(t.role, t.parts, t.extra) for t in a] == [(t.role, t.parts, t.extra) for t in b]


def row_tools(row: Mapping[str, Any], columns: Mapping[str, Any], where: str) -> list[dict[str, Any]] | None:
    """The row's tool schemas (column `tools`, renamed by `data.columns`), read and checked as the SFT data path reads
    them (`to_conversation`); both sides render with them (`tools=` of the chat template). None without any."""
    column = columns.get("tools", "tools")
    if _missing(row.get(column)):
        return None
    return to_conversation({"messages": [], column: row[column]}, "messages", {"tools": column}, where).tools


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
            if not _same([a], [b]):
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
    if _same(chosen, rejected):
        raise DataError(f"{where}: identical sides: chosen and rejected are the same response")
    return prompt, chosen, rejected, images


def to_kto_turns(row: Mapping[str, Any], columns: Mapping[str, Any], where: str) -> tuple[list, list, bool, list]:
    """(prompt turns, completion turns, label, images) of an unpaired KTO row (see the module docstring)."""
    c = {"prompt": "prompt", "completion": "completion", "label": "label", "images": "images", **columns}
    for which in ("prompt", "completion"):
        if _missing(row.get(c[which])):
            raise DataError(f"{where}: missing {which}: column {c[which]!r} is absent or empty (the row has "
                            f"{sorted(row)})")  # fmt: skip
    label = row.get(c["label"])
    if not isinstance(label, bool):
        raise DataError(f"{where}: column {c['label']!r} is {label!r}, not true (desirable) or false (pref.loss kto)")
    images = row.get(c["images"]) or []
    images = images if isinstance(images, list) else [images]
    prompt = _turns(row[c["prompt"]], "user", columns, where, c["prompt"])
    completion = _turns(row[c["completion"]], "assistant", columns, where, c["completion"])
    if not completion or completion[0].role != "assistant":
        raise DataError(f"{where}: the completion must start with an assistant turn after the prompt")
    return prompt, completion, label, images


def _fit(ids: list[int], labels: list[int], max_len: int, image_id: int | None, where: str, which: str,
         limit: str) -> tuple[list[int], list[int]]:  # fmt: skip
    """A side cut to `max_len` tokens (`limit` names the rule); it must keep a response token and every image token."""
    if all(label == IGNORE_INDEX for label in labels[:max_len]):
        raise DataError(f"{where}: the prompt alone fills {limit}; the {which} side has no response token left after "
                        "truncation")  # fmt: skip
    if image_id is not None and ids[max_len:].count(image_id):
        raise DataError(f"{where}: the {which} side's image tokens do not fit in {limit}; a pair's images are never "
                        "cut")  # fmt: skip
    return ids[:max_len], labels[:max_len]


class PairEncoder(RowEncoder):
    """The rows of `sources` to their pairs (see the module docstring), as the pair cache's columns. `max_tokens`:
    the token budget a pair must fit (`data.max_tokens_per_micro_batch`, 0: none), costed as `packing` says."""

    def __init__(
        self,
        sources: Sequence[Source],
        encoder: ChatEncoder,
        columns: Mapping[str, Any],
        max_seq_len: int = 0,
        overlength: str = "truncate",
        media_dir: str | Path = "",
        images: ImageProcessing | None = None,
        max_tokens: int = 0,
        packing: bool = False,
        kto: bool = False,
    ) -> None:
        super().__init__(sources, encoder, "preference", columns, max_seq_len, overlength, str(media_dir), images)
        self.max_tokens, self.packing, self.kto = max_tokens, packing, kto
        self._previous: tuple[int, Any] | None = None  # (position, completion) of the row encoded last (kto)

    def key(self) -> dict[str, Any]:
        return {
            **super().key(),
            "pair_code": hashlib.sha256(Path(__file__).read_bytes()).hexdigest(),
            "max_tokens": self.max_tokens,
            "packing": self.packing if self.max_tokens else None,  # how a pair is costed against the budget
            "kto": self.kto,
        }

    def _mismatched(self, index: int, row_index: int, row: Mapping[str, Any]) -> Any:
        """kto: the completion of the row before this one in the split (cyclic; blank lines skipped): the one encoded
        last when it is that row, else read back from the files."""
        column = self.columns.get("completion", "completion")
        offsets = numpy.cumsum([0] + [source.num_rows for source in self.sources])
        position, total = int(offsets[index]) + row_index, int(offsets[-1])
        previous, self._previous = self._previous, (position, row.get(column))
        if previous is not None and previous[0] == position - 1:
            return previous[1]
        for back in range(1, total + 1):
            at = (position - back) % total
            source = int(numpy.searchsorted(offsets, at, side="right")) - 1
            for _, found in self.sources[source].read(at - int(offsets[source]), at - int(offsets[source]) + 1):
                return found.get(column)
        return row.get(column)

    def schema(self) -> Any:
        import pyarrow as pa

        tokens = pa.large_list(pa.int32())
        image = pa.struct([("path", pa.string()), ("bytes", pa.large_binary())])
        return pa.schema(
            [("source", pa.int32()), ("row", pa.int64()), ("chosen_ids", tokens), ("chosen_labels", tokens),
             ("rejected_ids", tokens), ("rejected_labels", tokens), ("images", pa.list_(image)),
             ("image_tokens", pa.list_(pa.int32())), ("margin", pa.float64())]
        )  # fmt: skip

    def __call__(self, index: int, row_index: int, row: Mapping[str, Any], counts: dict[str, int]) -> tuple | None:
        """Row `row_index` of file `index` as the cache's columns (`schema`), or None where `data.overlength: drop`
        leaves it out; `counts` (rows, truncated, dropped, samples) are updated."""
        where = row_name(self.files[index], row_index)
        label = None
        if self.kto:
            prompt, chosen, label, values = to_kto_turns(row, self.columns, where)
            other = self._mismatched(index, row_index, row)
            if _missing(other):
                raise DataError(f"{where}: the mismatched completion (the previous row's) is missing")
            rejected = _turns(other, "assistant", self.columns, where, "the mismatched completion")
        else:
            prompt, chosen, rejected, values = to_pair_turns(row, self.columns, where)
        references, lengths = self.measure_images(index, values, where)
        frozen = [dataclasses.replace(t, train=False) for t in prompt]  # its tool fields kept
        tools = row_tools(row, self.columns, where)
        sides = []
        for which, response in (("chosen", chosen), ("rejected", rejected)):
            encoded = self.encoder.encode(Conversation(frozen + response, list(values), tools=tools), lengths, where)
            if all(label == IGNORE_INDEX for label in encoded.labels):
                raise DataError(f"{where}: the {which} response has no token to train on")
            sides.append((encoded.input_ids, encoded.labels))
        margin_column = self.columns.get("margin", "margin")
        margin = None if self.kto else row.get(margin_column)
        if margin is not None and not isinstance(margin, (int, float)):
            raise DataError(f"{where}: column {margin_column!r} is {margin!r}, not a number")
        counts["rows"] += 1
        fitted = self._fit_pair(sides, where)
        if fitted is None:
            counts["dropped"] += 1
            return None
        counts["truncated"] += fitted != sides
        counts["samples"] += 1
        (c_ids, c_labels), (r_ids, r_labels) = fitted
        margin = None if margin is None else float(margin)
        if label is not None:
            margin = 1.0 if label else 0.0
        return index, row_index, c_ids, c_labels, r_ids, r_labels, references, lengths, margin

    def _fit_pair(self, sides: list[tuple[list[int], list[int]]], where: str) -> list | None:
        """The sides within `max_seq_len` each and the pair within the token budget, by `overlength` (None:
        dropped)."""
        image_id, max_len, sides = self.encoder.image_token_id, self.max_seq_len, list(sides)
        for number, (which, (ids, labels)) in enumerate(zip(SIDES, sides)):
            if max_len <= 0 or len(ids) <= max_len:
                continue
            if self.overlength == "error":
                raise DataError(f"{where}: the {which} side has {len(ids)} tokens, over data.max_seq_len={max_len} "
                                "(data.overlength: error)")  # fmt: skip
            if self.overlength == "drop":
                return None
            sides[number] = _fit(ids, labels, max_len, image_id, where, which, f"data.max_seq_len={max_len}")
        budget, (chosen, rejected) = self.max_tokens, (len(ids) for ids, _ in sides)
        cost = int(pair_cost(chosen, rejected, self.packing))
        if budget <= 0 or cost <= budget:
            return sides
        if self.overlength == "error":
            how = "packed: both sides" if self.packing else "padded: two rows of the longer side"
            raise DataError(f"{where}: the pair takes {cost} tokens ({how}; chosen {chosen}, rejected {rejected}), "
                            f"over data.max_tokens_per_micro_batch={budget} (data.overlength: error)")  # fmt: skip
        if self.overlength == "drop":
            return None
        limit = _side_limit(chosen, rejected, budget, self.packing)
        rule = f"the {limit} tokens a side keeps under data.max_tokens_per_micro_batch={budget}"
        return [
            _fit(ids, labels, limit, image_id, where, which, rule) if len(ids) > limit else (ids, labels)
            for which, (ids, labels) in zip(SIDES, sides)
        ]


class PairDataset(CachedSamples):
    """The pairs of one split, in file order, memory-mapped (see the module docstring); `length(i)`: pair i's token
    cost in a micro-batch (`pair_cost`); `__getitem__`: what `collate_pairs` takes, with the precomputed reference
    once `attach_reference` mapped it. `stats` (rows, truncated, dropped) says what `data.overlength` did."""

    LISTS = ("chosen_ids", "chosen_labels", "rejected_ids", "rejected_labels")
    SCALARS = ("source", "row")

    def __init__(
        self, rows: PairEncoder, cache_dir: str | Path | None = None, group: Any = None, what: str = "data.train_path"
    ) -> None:
        super().__init__(rows, cache_dir, group, what)
        self.packing, self.kto = rows.packing, rows.kto
        self.reference: sft_cache.MappedRows | None = None

    def side(self, index: int, which: str) -> tuple[numpy.ndarray, numpy.ndarray]:
        """(input_ids, labels) of pair `index`'s side `which`: int32 views of the memory-mapped cache."""
        return self.samples.list(index, f"{which}_ids"), self.samples.list(index, f"{which}_labels")

    def length(self, index: int) -> int:
        chosen, rejected = (len(self.samples.list(index, f"{which}_ids")) for which in SIDES)
        return int(pair_cost(chosen, rejected, self.packing))

    def lengths(self) -> numpy.ndarray:
        """Every pair's `length`, from the cache's offsets alone."""
        return pair_cost(*(self.samples.list_lengths(f"{which}_ids") for which in SIDES), self.packing)

    def margin(self, index: int) -> float | None:
        return self.samples.value(index, "margin")

    def reference_logprobs(self, index: int) -> tuple[numpy.ndarray, numpy.ndarray] | None:
        """The reference's log-probability of each response target of pair `index`'s sides (float64 views), once
        attached."""
        if self.reference is None:
            return None
        return self.reference.list(index, "ref_chosen"), self.reference.list(index, "ref_rejected")

    def attach_reference(self, directory: Path) -> None:
        """Map the precomputed reference (an `sft_cache` directory of `ref_chosen` / `ref_rejected` rows, one per
        pair, in order)."""
        _, tables = sft_cache.open_shards(directory)
        reference = sft_cache.MappedRows(tables, ("ref_chosen", "ref_rejected"))
        if len(reference) != len(self):
            raise DataError(f"{directory}: {len(reference)} reference rows for {len(self)} pairs{REMEDY}")
        self.reference = reference

    def __getitem__(self, index: int) -> dict[str, Any]:
        images = self.decoded_images(index)  # once: both sides see them
        out: dict[str, Any] = {}
        for which in SIDES:
            out[which] = {**token_tensors(*self.side(index, which), labels_key=PREF_LABELS), **images}
        reference = self.reference_logprobs(index)
        if reference is not None:
            out["ref_chosen"], out["ref_rejected"] = (torch.from_numpy(values.copy()) for values in reference)
        margin = self.margin(index)
        if self.kto:
            out["label"] = bool(margin)
        elif margin is not None:
            out["margin"] = margin
        return out

    def summary(self) -> str:
        tokens = self.lengths()
        return f"{len(self)} pairs from {self.stats}, {int(tokens.sum())} tokens (max {int(tokens.max())} per pair)"


def _side_positions(ids: torch.Tensor, valid: torch.Tensor, side: int) -> torch.Tensor:
    """[N, 2] (row, column) of side `side`'s valid entries, in order."""
    return torch.nonzero((ids == side) & valid)


def collate_pairs(
    pairs: Sequence[Mapping[str, Any]],
    collate_sides: Callable[[Sequence[Mapping[str, torch.Tensor]]], dict[str, torch.Tensor]],
    reward_model: bool = False,
) -> dict[str, torch.Tensor]:
    """Pairs ({"chosen": side, "rejected": side, optional "ref_chosen"/"ref_rejected": [response targets] float64
    tensors, optional "margin", kto's "label" bool}; a side: `input_ids`, unshifted `pref_labels`, optional
    `pixel_values`) -> one micro-batch of 2P sequences, side 2p chosen and 2p + 1 rejected (`collate_sides`: the
    model's padded or packed collate, which numbers the sequences in order), with the head's keys (see the module
    docstring)."""
    sides = [pair[which] for pair in pairs for which in ("chosen", "rejected")]
    # the model's collate shifts and pads `labels` (a vision-language collate knows no other labels key)
    batch = collate_sides([{("labels" if k == PREF_LABELS else k): v for k, v in side.items()} for side in sides])
    batch[PREF_LABELS] = batch.pop("labels")
    ids = batch[SEQUENCE_IDS]
    if reward_model:  # one entry at each side's last token: the score is read there
        labels = torch.full_like(ids, IGNORE_INDEX)
        for side in range(len(sides)):
            where = torch.nonzero(ids == side)[-1]
            labels[where[0], where[1]] = 0
        batch[PREF_LABELS] = labels
    valid = batch[PREF_LABELS] != IGNORE_INDEX
    anchors = []  # each pair's (row, column): a shared-prefix row need not hold the pairs in order (`pack`)
    for index in range(len(pairs)):
        found = _side_positions(ids, valid, 2 * index)
        if not len(found):
            raise ValueError(f"collate_pairs: pair {index}'s chosen side has no response target")
        anchors.append(found[0])
    rows, columns = torch.stack(anchors).unbind(1)
    starts = torch.zeros_like(ids, dtype=torch.bool)
    starts[rows, columns] = True
    batch[PREF_STARTS] = starts
    if any("ref_chosen" in pair for pair in pairs):
        ref = torch.zeros_like(ids, dtype=torch.float64)
        for index, pair in enumerate(pairs):
            for offset, which in enumerate(("ref_chosen", "ref_rejected")):
                found = _side_positions(ids, valid, 2 * index + offset)
                ref[found[:, 0], found[:, 1]] = torch.as_tensor(pair[which], dtype=torch.float64)
        batch[REF_LOGPROBS] = ref
    if any("margin" in pair for pair in pairs):
        margins = torch.zeros_like(ids, dtype=torch.float64)
        margins[rows, columns] = torch.tensor([float(pair.get("margin", 0.0)) for pair in pairs], dtype=torch.float64)
        batch[MARGINS] = margins
    if any("label" in pair for pair in pairs):  # kto: the row's label at its anchor (1.0 desirable)
        labels = torch.zeros_like(ids, dtype=torch.float64)
        labels[rows, columns] = torch.tensor([float(bool(pair.get("label"))) for pair in pairs], dtype=torch.float64)
        batch[KTO_LABELS] = labels
    return batch
