"""RL prompts from the user's files, through the SFT data path (formats, columns, chat templates, images, row names).

Each row becomes a `Prompt`: the conversation without its last assistant turn, rendered with the generation prompt
(`ChatEncoder.encode_prompt`), its images through the model's image processor, the reference answer (the column
`data.columns.answer`, default `answer`, else the last assistant turn's text, else None) and every other column,
which the reward functions receive. For an engine that renders prompts itself (`keep_images`), a prompt with images
also keeps its messages and its decoded images as PNG (`chat_fields`). Rows are read whole into memory (prompt sets
are small next to SFT sets); a bad row is a DataError naming the file and the row (0-based, as every data error counts
rows).

Rollout batch k takes `prompts_per_step` prompts of the epoch's seeded permutation (epoch e = k // (n //
prompts_per_step), a trailing partial batch dropped), so the batches are the same on every layout.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from veomni_lite.data.checks import DataError
from veomni_lite.data.sft import ChatEncoder, Source, image_reference, open_image, row_name, to_conversation
from veomni_lite.data.sft_dataset import ImageProcessing

__all__ = ["Prompt", "PromptSet", "chat_fields", "read_prompts"]

ANSWER_COLUMN = "answer"


@dataclass
class Prompt:
    """One prompt: its token ids (image placeholders expanded), rendered text, images' model inputs, reference answer
    (or None), other columns and row name; kept for an engine that renders prompts itself, its messages (typed parts,
    as the chat template gets them) and its decoded images as PNG."""

    ids: list[int]
    text: str
    answer: str | None
    columns: dict[str, Any]
    where: str
    model_inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    messages: list[dict[str, Any]] = field(default_factory=list)
    images: list[bytes] = field(default_factory=list)


def _answer(row: Mapping[str, Any], conversation: Any, column: str) -> str | None:
    if row.get(column) is not None:
        return str(row[column])
    last = conversation.turns[-1] if conversation.turns else None
    if last is not None and last.role == "assistant" and None not in last.parts:
        return "".join(last.parts)
    return None


def encode_row(
    row: Mapping[str, Any],
    where: str,
    encoder: ChatEncoder,
    images: ImageProcessing | None,
    fmt: str,
    columns: Mapping[str, Any],
    media_dir: Path,
    keep_images: bool = False,
) -> Prompt:
    """One row as a `Prompt` (a DataError naming `where` when it cannot be); `keep_images`: with its messages and its
    decoded images as PNG (lossless: the pixels the image processor saw), for `chat_fields`."""
    answer_column = str(columns.get("answer", ANSWER_COLUMN))
    plain = {k: v for k, v in columns.items() if k != "answer"}
    if fmt == "prompt_completion" and row.get(plain.get("completion", "completion")) is None:
        row = {**row, plain.get("completion", "completion"): ""}  # a prompt-only row
    conversation = to_conversation(row, fmt, plain, where)
    model_inputs: dict[str, torch.Tensor] = {}
    lengths: list[int] = []
    decoded: list[Any] = []
    if conversation.images:
        if images is None:
            raise DataError(f"{where}: the row has images but the model takes none (not a vision-language model)")
        decoded = [open_image(image_reference(value, media_dir, where), where) for value in conversation.images]
        model_inputs = images(decoded)
        lengths = images.token_counts(model_inputs["image_grid_thw"])
    ids, text = encoder.encode_prompt(conversation, lengths, where)
    used = {answer_column, plain.get("images", "images")}
    other = {k: v for k, v in row.items() if k not in used}
    prompt = Prompt(ids, text, _answer(row, conversation, answer_column), other, where, model_inputs)
    if keep_images:  # (and an episode's turns render after its messages: `veomni_lite.rl.episodes`)
        prompt.messages = encoder.prompt_messages(conversation)
        prompt.images = [_png(image) for image in decoded]
    return prompt


def chat_fields(prompt: Prompt, chat_template: str | None = None, image_token: str = "") -> dict[str, Any]:
    """The fields of an OpenAI chat request that give `prompt` (read with `keep_images`) with the generation prompt, for
    an engine that renders prompts itself: `messages` with each image a PNG data URL of the pixels the trainer's image
    processor saw, and `chat_template` (with `image_token` for it) where the run overrides the model's."""
    if not prompt.messages:
        raise ValueError(f"{prompt.where}: no chat messages kept (the text format, or read without keep_images)")
    urls = iter("data:image/png;base64," + base64.b64encode(image).decode() for image in prompt.images)
    messages = []
    for message in prompt.messages:
        content = message["content"]
        if not isinstance(content, str):
            content = [{"type": "image_url", "image_url": {"url": next(urls)}} if part["type"] == "image" else part
                       for part in content]  # fmt: skip
        messages.append({**message, "content": content})
    fields: dict[str, Any] = {"messages": messages, "add_generation_prompt": True}
    if chat_template:
        fields |= {"chat_template": chat_template, "chat_template_kwargs": {"image_token": image_token}}
    return fields


def _png(image: Any) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


class PromptSet:
    """Prompts of one split, in file order; `batch(k, size, seed)` is rollout batch k's."""

    def __init__(self, prompts: Sequence[Prompt]) -> None:
        self.prompts = list(prompts)

    def __len__(self) -> int:
        return len(self.prompts)

    def batches_per_epoch(self, size: int) -> int:
        return len(self.prompts) // size

    def batch(self, k: int, size: int, seed: int) -> list[Prompt]:
        """Rollout batch `k`'s `size` prompts: block k of the epoch's permutation (seeded by seed + epoch)."""
        per_epoch = self.batches_per_epoch(size)
        epoch, j = divmod(k, per_epoch)
        order = torch.randperm(len(self.prompts), generator=torch.Generator().manual_seed(seed + epoch)).tolist()
        return [self.prompts[i] for i in order[j * size : (j + 1) * size]]


def read_prompts(
    sources: Sequence[Source],
    encoder: ChatEncoder,
    images: ImageProcessing | None,
    fmt: str,
    columns: Mapping[str, Any],
    media_dir: str | Path = "",
    max_prompt_len: int = 0,
    keep_images: bool = False,
) -> PromptSet:
    """Every row of `sources` as a `Prompt` (`encode_row`); a prompt over `max_prompt_len` tokens (0: no limit) is a
    DataError."""
    prompts = []
    for source in sources:
        base = Path(media_dir) if media_dir else source.path.parent
        for index, row in source.read(0, source.num_rows):
            where = row_name(source.path, index)
            prompt = encode_row(row, where, encoder, images, fmt, columns, base, keep_images)
            if max_prompt_len and len(prompt.ids) > max_prompt_len:
                raise DataError(
                    f"{where}: the prompt has {len(prompt.ids)} tokens, over data.max_seq_len - rl.max_new_tokens = "
                    f"{max_prompt_len}"
                )
            prompts.append(prompt)
    return PromptSet(prompts)
