"""Qwen2-VL (transformers) with an optional second loss head, behind the trainer's model contract and shard-able
under SP.

Heads, each this rank's mean over its valid targets (an exact 0 without targets):
- `foundation_loss`: the language-model head over `labels`;
- `image_decoder_loss` (when the config has `image_decoder_classes`): an MLP on the backbone's last hidden states
  over `image_decoder_labels` (image codes). A `from_pretrained` directory without it trains the LM head only.

Inputs (`collate_qwen2_vl` builds them on the FULL sequence, before any SP slicing): `input_ids`, the two label keys
(shifted once), `position_ids` [B, S, 3] (multimodal rotary positions, sequence on dim 1 so the SP slicer cuts it),
`image_feature_index` [B, S] (the row of the vision tower's output that fills each image placeholder, -1 elsewhere),
`sequence_ids` [B, S] (the row of each sample's positions, -1 on padding),
and, whole on every rank, `pixel_values` [patches, C * temporal_patch * patch^2] with `image_grid_thw` [images, 3]
in Qwen2-VL's own layout. A sequence shard therefore embeds its tokens, runs the vision tower on all images, and
places each feature by its global index, with no look at the rest of the sequence. Every rank runs the vision tower
on every micro-batch (on one zero block when it has no image), because FSDP2 shards the tower and a rank that skipped
its forward would leave the others waiting in its all-gather.

Packed (`packing=True`): one row of the samples, `position_ids` [1, S, 4] (a text row restarting per sample, then each
sample's own M-RoPE rows), `sequence_ids` numbering the samples and `attention_sequence_ids` (the same, whole under
SP): the decoder gets the block-diagonal causal mask built from it, so no sample attends to another; images of
several samples sit in one row, each feature placed by its index as above.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from veomni_lite.data.collator import packed_positions, sequence_ids, shift_labels
from veomni_lite.loss_keys import ATTENTION_SEQUENCE_IDS, IGNORE_INDEX, SEQUENCE_IDS
from veomni_lite.models.contract import TrainableModel, on_host
from veomni_lite.models.heads import (
    LogprobRequest,
    decoder_flops_per_token,
    lm_head_logprobs,
    lm_head_loss,
    masked_mean_cross_entropy,
)
from veomni_lite.models.hf_attention import decoder_attention_inputs, enable_ulysses
from veomni_lite.models.pretrained import load_config, save_config
from veomni_lite.models.registry import dtype_of, family_of

IMAGE_HEAD_FILE = "image_decoder_head.safetensors"
_LABEL_KEYS = ("labels", "image_decoder_labels")


def mrope_positions(is_image: Sequence[bool], grids: Sequence[Sequence[int]], merge: int) -> Tensor:
    """[3, S] multimodal rotary positions of one unpadded sequence (what Qwen2-VL's `get_rope_index` computes, without
    its host reads): text counts up on all three axes; an image of grid (t, h, w) patches gets its (t, h/merge,
    w/merge) grid coordinates offset by the running position, which then advances by max(h, w) / merge."""
    pieces, position, start, grid_iter = [], 0, 0, iter(grids)
    while start < len(is_image):
        end = start
        while end < len(is_image) and is_image[end] == is_image[start]:
            end += 1
        if not is_image[start]:
            pieces.append(torch.arange(position, position + end - start).expand(3, -1))
            position += end - start
        else:
            t, h, w = next(grid_iter)
            h, w = h // merge, w // merge
            grid = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
            pieces.append(torch.stack(grid).reshape(3, -1) + position)
            position += max(h, w)
        start = end
    return torch.cat(pieces, dim=1)


def collate_qwen2_vl(
    samples: Sequence[Mapping[str, Tensor]],
    image_token_id: int,
    merge: int,
    pad_id: int,
    pad_to_multiple_of: int = 1,
    packing: bool = False,
) -> dict[str, Tensor]:
    """Samples (1-D `input_ids`, unshifted `labels` / `image_decoder_labels`, optional `pixel_values` and
    `image_grid_thw` for the images in order of their placeholders) -> one micro-batch (see the module docstring).
    `packing`: the samples concatenated into one row, each with its own M-RoPE positions and a text row in front
    ([1, S, 4], as transformers reads packed Qwen2-VL positions), and `attention_sequence_ids` (`data.packing`)."""
    rows: list[dict[str, Tensor]] = []
    pixel_values, grids, offset = [], [], 0
    for sample in samples:
        ids = sample["input_ids"]
        row = {"input_ids": ids, **{k: shift_labels(sample[k]) for k in _LABEL_KEYS if k in sample}}
        sample_grids = sample["image_grid_thw"].tolist() if "image_grid_thw" in sample else []
        row["position_ids"] = mrope_positions((ids == image_token_id).tolist(), sample_grids, merge).T  # [n, 3]
        if packing:
            row["position_ids"] = torch.cat([torch.arange(ids.numel())[:, None], row["position_ids"]], dim=1)
        row["image_feature_index"] = torch.full_like(ids, -1)
        if sample_grids:
            placeholders = torch.nonzero(ids == image_token_id).squeeze(-1)
            row["image_feature_index"][placeholders] = torch.arange(offset, offset + placeholders.numel())
            offset += placeholders.numel()
            pixel_values.append(sample["pixel_values"])
            grids.append(sample["image_grid_thw"])
        rows.append(row)
    lengths = [row["input_ids"].numel() for row in rows]
    if packing:
        rows = [{key: torch.cat([row[key] for row in rows]) for key in rows[0]}]
    longest = max(row["input_ids"].numel() for row in rows)
    length = -(-longest // pad_to_multiple_of) * pad_to_multiple_of
    batch = {key: _pad_rows([row[key] for row in rows], length, key, pad_id) for key in rows[0]}
    if packing:
        _, ids = packed_positions(lengths, length)
        batch[SEQUENCE_IDS] = batch[ATTENTION_SEQUENCE_IDS] = ids[None]
    else:
        batch[SEQUENCE_IDS] = sequence_ids(lengths, length)
    if pixel_values:
        batch["pixel_values"] = torch.cat(pixel_values)
        batch["image_grid_thw"] = torch.cat(grids)
    return batch


def collate_vl(
    samples: Sequence[Mapping[str, Tensor]],
    image_token_id: int,
    images: Any,
    pad_id: int,
    pad_to_multiple_of: int = 1,
    packing: bool = False,
) -> dict[str, Tensor]:
    """The Qwen-VL families' collate as the registry calls it (`Vision.collate`): `collate_qwen2_vl` with the merge
    size of `images`, the run's `ImageProcessing`."""
    return collate_qwen2_vl(samples, image_token_id, images.merge, pad_id, pad_to_multiple_of, packing)


def _pad_rows(values: list[Tensor], length: int, key: str, pad_id: int) -> Tensor:
    """[B, length, ...]: each row right-padded; positions keep counting past the row's largest."""
    out = []
    for value in values:
        extra = length - value.shape[0]
        if key == "position_ids":
            tail = (value.max() + 1 + torch.arange(extra)).unsqueeze(-1).expand(extra, value.shape[1])
        else:
            tail = value.new_full(
                (extra,), pad_id if key == "input_ids" else -1 if key == "image_feature_index" else IGNORE_INDEX
            )
        out.append(torch.cat([value, tail]))
    return torch.stack(out)


class QwenVLWithImageHead(TrainableModel):
    """A Qwen VL family's `...ForConditionalGeneration` (as `vlm`: Qwen2-VL, Qwen2.5-VL or Qwen3-VL, see
    `veomni_lite.models.registry`) plus `image_head`; see the module docstring."""

    def __init__(self, config: Any, vlm: nn.Module | None = None) -> None:
        super().__init__()
        self.family = family_of(config)
        if self.family.vision is None:
            raise ValueError(f"{type(self).__name__} takes a Qwen VL config; got model_type {config.model_type!r}")
        self.vlm = self.family.hf_class()(config) if vlm is None else vlm
        self.export_dtype = dtype_of(config)  # what `veomni_lite.export` writes by default
        classes = getattr(config, "image_decoder_classes", None)
        hidden = config.text_config.hidden_size
        self.image_head = (
            nn.Sequential(nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, classes)) if classes else None
        )
        if self.family.vision.deepstack:  # features arrive placed on every token (see `embed`)
            text_model = self.vlm.model.language_model
            text_model._deepstack_process = functools.partial(_add_placed_features, text_model._deepstack_process)

    @classmethod
    def from_config(cls, config: Any, dtype: torch.dtype = torch.float32) -> QwenVLWithImageHead:
        """`config`: the family's config, optionally with `image_decoder_classes` (the image head's number of codes)."""
        config.text_config._attn_implementation = "sdpa"
        config.vision_config._attn_implementation = "sdpa"
        return cls(config).to(dtype)

    @classmethod
    def from_pretrained(cls, directory: str | Path, dtype: torch.dtype = torch.float32) -> QwenVLWithImageHead:
        """The directory's model (local files only, no remote code), its weights cast to `dtype`; without
        `image_decoder_classes` in its config it has only the language-model head."""
        config = load_config(directory)
        vlm = (
            family_of(config)
            .hf_class()
            .from_pretrained(
                str(directory), attn_implementation="sdpa", dtype=dtype, trust_remote_code=False, local_files_only=True
            )
        )
        model = cls(vlm.config, vlm)
        model.export_dtype = dtype_of(config)
        return model.to(dtype)

    @property
    def config(self) -> Any:
        return self.vlm.config

    @property
    def loss_keys(self) -> tuple[str, ...]:
        return ("foundation_loss", "image_decoder_loss") if self.image_head is not None else ("foundation_loss",)

    @property
    def layers(self) -> list[nn.Module]:
        """What FSDP shards one by one: the decoder layers, then the whole vision tower."""
        return [*self.vlm.model.language_model.layers, self.vlm.model.visual]

    # The trainer leaves these on the host: see `_vision_inputs` and `decoder_attention_inputs`.
    host_inputs = ("image_grid_thw", ATTENTION_SEQUENCE_IDS)
    fused_lm_head = True  # `model.fused_lm_head`: the loss without the whole logits (see `lm_head_loss`)

    def set_attn_implementation(self, name: str) -> None:
        """The text decoder's attention (`model.attn_implementation`); the vision tower keeps sdpa (it is given
        host boundaries for it, see `_vision_inputs`)."""
        if name not in self.family.attention:
            raise ValueError(f"{self.family.name} decoders run {list(self.family.attention)}, not {name!r}")
        self.vlm.set_attn_implementation({"text_config": name, "vision_config": "sdpa"})

    def _vision_inputs(self, grid: Tensor, device: torch.device) -> dict[str, Any]:
        """The vision tower's inputs from a host `grid`: every boundary, window and position table it would
        otherwise compute with reads of a device tensor (`tolist`) is computed here on the host; what stays on the
        host (the SDPA path only splits by them) is left there, the rest is copied without blocking."""
        from transformers import vision_utils

        if grid.device.type != "cpu":
            raise ValueError(f"image_grid_thw must stay on the host (a model host input); got it on {grid.device}")
        visual, vision = self.vlm.model.visual, self.family.vision
        merge = visual.spatial_merge_size
        on_device = {"position_ids": vision_utils.get_vision_position_ids(grid, merge)}
        inputs: dict[str, Any] = {"cu_seqlens": vision_utils.get_vision_cu_seqlens(grid)}
        if vision.window_attention:
            window_index, inputs["cu_window_seqlens"] = vision_utils.get_vision_window_index(
                grid, merge, visual.window_size, visual.patch_size
            )
            on_device["window_index"] = window_index
        if vision.interpolated_position_embedding:
            on_device["interp_indices"], on_device["interp_weights"] = (
                vision_utils.get_vision_interpolation_indices_and_weights(
                    grid,
                    num_grid_per_side=visual.num_grid_per_side,
                    mode=visual.interpolation_mode,
                    align_corners=visual.interpolation_align_corners,
                    spatial_merge_size=merge,
                )
            )
        moved = {key: value.to(device, non_blocking=True) for key, value in {"grid_thw": grid, **on_device}.items()}
        return {**inputs, **moved}

    def embed(
        self, input_ids: Tensor, image_feature_index: Tensor, pixel_values: Tensor | None, grid: Tensor | None
    ) -> tuple[Tensor, list[Tensor] | None]:
        """(input embeddings with each image token's feature in place, Qwen3-VL's deepstack features placed the same
        way or None). Without images the tower runs on one zero block that adds exactly 0 (see the module doc)."""
        model = self.vlm.model
        embeds = model.get_input_embeddings()(input_ids)
        visual = model.visual
        if pixel_values is None:
            vision = visual.config
            merge = vision.spatial_merge_size
            width = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
            dummy = embeds.new_zeros(merge * merge, width)
            out = visual(dummy, **self._vision_inputs(torch.tensor([[1, merge, merge]]), embeds.device))
            unused = out.pooler_output.sum() + sum(f.sum() for f in getattr(out, "deepstack_features", None) or ())
            return embeds + 0.0 * unused, None
        out = visual(pixel_values.to(embeds.dtype), **self._vision_inputs(grid, embeds.device))
        is_image = (image_feature_index >= 0).unsqueeze(-1)
        at = image_feature_index.clamp(min=0)
        embeds = torch.where(is_image, out.pooler_output[at].to(embeds.dtype), embeds)
        if not self.deepstack:
            return embeds, None
        return embeds, [torch.where(is_image, f[at].to(embeds.dtype), 0.0) for f in out.deepstack_features]

    @property
    def deepstack(self) -> bool:
        return self.family.vision.deepstack

    def hidden_states(
        self,
        input_ids: Tensor,
        position_ids: Tensor,
        image_feature_index: Tensor,
        pixel_values: Tensor | None = None,
        image_grid_thw: Tensor | None = None,
        attention_sequence_ids: Tensor | None = None,
    ) -> Tensor:
        embeds, deepstack = self.embed(input_ids, image_feature_index, pixel_values, on_host(image_grid_thw))
        attention = decoder_attention_inputs(self.config.text_config, attention_sequence_ids, embeds.device)
        extra = {"deepstack_visual_embeds": deepstack} if deepstack is not None else {}
        out = self.vlm.model.language_model(
            inputs_embeds=embeds, position_ids=position_ids.permute(2, 0, 1), use_cache=False, **attention, **extra
        )
        return out.last_hidden_state

    def forward(
        self,
        input_ids: Tensor,
        position_ids: Tensor,
        image_feature_index: Tensor,
        labels: Tensor | None = None,
        image_decoder_labels: Tensor | None = None,
        pixel_values: Tensor | None = None,
        image_grid_thw: Tensor | None = None,
        foundation_loss_weights: Tensor | None = None,
        image_decoder_loss_weights: Tensor | None = None,
        attention_sequence_ids: Tensor | None = None,
        logprobs: LogprobRequest | None = None,
        **_: Any,
    ) -> dict[str, Tensor]:
        hidden = self.hidden_states(
            input_ids, position_ids, image_feature_index, pixel_values, image_grid_thw, attention_sequence_ids
        )
        if logprobs is not None:  # the policy and preference heads' inputs (see `lm_head_logprobs`)
            return lm_head_logprobs(self.vlm.lm_head, hidden, logprobs, self.fused_lm_head)
        head = self.image_head
        if labels is None:
            logits = self.vlm.lm_head(hidden)
            return {"logits": logits} if head is None else {"logits": logits, "image_logits": head(hidden)}
        foundation = lm_head_loss(self.vlm.lm_head, hidden, labels, foundation_loss_weights, self.fused_lm_head)
        losses = {"foundation_loss": foundation}
        if head is not None:
            losses["image_decoder_loss"] = masked_mean_cross_entropy(
                head(hidden), image_decoder_labels, image_decoder_loss_weights
            )
        return losses

    def flops_per_token(self, seq_len: int) -> float:
        text = self.config.text_config
        embed = self.vlm.get_input_embeddings().weight
        return decoder_flops_per_token(self, text.num_hidden_layers, text.hidden_size, seq_len, exclude=(embed,))

    def enable_sequence_parallel(self, sp_group: dist.ProcessGroup) -> None:
        """Ulysses in the decoder only: the vision tower keeps SDPA over whole images."""
        layers = self.vlm.model.language_model.layers
        enable_ulysses(self.config.text_config, (layer.self_attn for layer in layers), sp_group)

    def save_config(self, directory: str | Path) -> None:
        """`directory/config.json`: the transformers config this model is rebuilt from (see `veomni_lite.export`),
        with the dtype the export writes by default (the source directory's)."""
        save_config(self.config, directory, self.export_dtype)

    def save_pretrained(self, directory: str | Path) -> list[str]:
        """The family's `from_pretrained(directory)` loads the backbone and LM head; the image head (no transformers
        class has it) goes to `image_decoder_head.safetensors`. Returns the files written."""
        from safetensors.torch import save_file

        self.config.text_config._attn_implementation = "sdpa"
        self.vlm.save_pretrained(str(directory), safe_serialization=True)
        if self.image_head is not None:
            head = {key: value.detach().contiguous().cpu() for key, value in self.image_head.state_dict().items()}
            save_file(head, str(Path(directory) / IMAGE_HEAD_FILE), metadata={"layout": "Linear-GELU-Linear"})
        return sorted(p.name for p in Path(directory).iterdir())


def _add_placed_features(
    transformers_step: Callable[..., Tensor], hidden_states: Tensor, visual_pos_masks: Any, features: Tensor
) -> Tensor:
    """Qwen3-VL's deepstack step. Features already placed on every token (0 off the images, as `embed` gives them)
    are added; transformers' own step, which scatters image-token features by a boolean mask (a device read of the
    mask), still serves its own forward."""
    if features.shape[:-1] != hidden_states.shape[:-1]:
        return transformers_step(hidden_states, visual_pos_masks, features)
    return hidden_states + features.to(hidden_states.dtype)
