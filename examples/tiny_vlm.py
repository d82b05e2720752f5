"""A tiny vision-language model: patch encoder -> projector -> TinyCausalLM decoder, plus an image-decoder head.

Contract:
- `input_ids`, `position_ids`, `labels`, `image_decoder_labels` may be a contiguous SLICE of each sequence (sequence
  parallelism); `pixel_values` [B, C, H, W] always holds the whole images. An `image_token_id` placeholder at GLOBAL
  position p takes patch `p - image_start_position` of its sample's image, so any slice gets the same embeddings as
  the matching slice of the full sequence.
- `forward` returns both `foundation_loss` (LM head over `labels`) and `image_decoder_loss` (image head over
  `image_decoder_labels`, patch codes) on every call: each the mean over this call's valid labels, an exact
  graph-keeping 0 when there are none. Labels are already shifted. No host syncs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn

from examples.tiny_lm import (
    TinyCausalLM,
    TinyLMConfig,
    init_linear_and_embedding,
)
from veomni_lite.models.contract import TrainableModel
from veomni_lite.models.heads import decoder_flops_per_token, masked_mean_cross_entropy

__all__ = ["ImageDecoderHead", "PatchEncoder", "TinyVLM", "TinyVLMConfig"]


@dataclass
class TinyVLMConfig:
    lm: TinyLMConfig = field(default_factory=TinyLMConfig)
    image_size: int = 16
    patch_size: int = 4
    channels: int = 3
    num_image_codes: int = 9
    vision_hidden_size: int = 64
    image_token_id: int = 3
    image_start_position: int = 1  # the first placeholder sits right after BOS

    def __post_init__(self) -> None:
        if isinstance(self.lm, dict):  # built from YAML
            self.lm = TinyLMConfig(**self.lm)
        if self.image_size % self.patch_size != 0:
            raise ValueError(f"image_size ({self.image_size}) must be divisible by patch_size ({self.patch_size})")

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


class PatchEncoder(nn.Module):
    """[B, C, H, W] -> [B, P, vision_hidden]: linear patch embedding + learned patch positions + a residual MLP."""

    def __init__(self, config: TinyVLMConfig) -> None:
        super().__init__()
        self.patch_size = config.patch_size
        patch_dim = config.channels * config.patch_size**2
        self.patch_embed = nn.Linear(patch_dim, config.vision_hidden_size)
        self.pos_embed = nn.Parameter(torch.zeros(config.num_patches, config.vision_hidden_size))
        self.norm = nn.RMSNorm(config.vision_hidden_size, eps=config.lm.rms_norm_eps)
        self.mlp = nn.Sequential(
            nn.Linear(config.vision_hidden_size, 2 * config.vision_hidden_size),
            nn.GELU(),
            nn.Linear(2 * config.vision_hidden_size, config.vision_hidden_size),
        )

    def forward(self, pixel_values: Tensor) -> Tensor:
        p = self.patch_size
        patches = rearrange(pixel_values, "b c (h p1) (w p2) -> b (h w) (c p1 p2)", p1=p, p2=p)
        x = self.patch_embed(patches) + self.pos_embed
        return x + self.mlp(self.norm(x))


class ImageDecoderHead(nn.Module):
    """[.., hidden] -> [.., num_image_codes] logits of the next image patch's code."""

    def __init__(self, config: TinyVLMConfig) -> None:
        super().__init__()
        self.proj = nn.Linear(config.lm.hidden_size, config.lm.hidden_size)
        self.out = nn.Linear(config.lm.hidden_size, config.num_image_codes)

    def forward(self, hidden: Tensor) -> Tensor:
        return self.out(F.gelu(self.proj(hidden)))


class TinyVLM(TrainableModel):
    """Vision encoder + projector feed image placeholders of the `decoder`; two heads: LM and image codes."""

    def __init__(self, config: TinyVLMConfig) -> None:
        super().__init__()
        self.config = config
        self.vision = PatchEncoder(config)
        self.projector = nn.Sequential(
            nn.Linear(config.vision_hidden_size, config.lm.hidden_size),
            nn.GELU(),
            nn.Linear(config.lm.hidden_size, config.lm.hidden_size),
        )
        self.decoder = TinyCausalLM(config.lm)
        self.image_head = ImageDecoderHead(config)
        self.init_weights()

    def init_weights(self) -> None:
        init_linear_and_embedding(self, self.config.lm.initializer_range)
        nn.init.normal_(self.vision.pos_embed, mean=0.0, std=self.config.lm.initializer_range)

    @property
    def layers(self) -> nn.ModuleList:
        """The decoder blocks (what FSDP shards one by one)."""
        return self.decoder.layers

    @property
    def loss_keys(self) -> tuple[str, ...]:
        return ("foundation_loss", "image_decoder_loss")

    def enable_sequence_parallel(self, sp_group: dist.ProcessGroup) -> None:
        """Ulysses attention over `sp_group` in the decoder (the vision encoder sees whole images on every rank)."""
        self.decoder.enable_sequence_parallel(sp_group)

    def image_features(self, pixel_values: Tensor) -> Tensor:
        """[B, C, H, W] -> [B, P, lm hidden]."""
        return self.projector(self.vision(pixel_values))

    def embed(self, input_ids: Tensor, position_ids: Tensor, pixel_values: Tensor | None) -> Tensor:
        """Token embeddings with every image placeholder replaced by its patch feature, found by GLOBAL position."""
        embeds = self.decoder.embed(input_ids)
        if pixel_values is None:
            return embeds
        features = self.image_features(pixel_values.to(embeds.dtype))
        num_patches = features.shape[1]
        # Non-placeholder positions gather an arbitrary (clamped) patch that torch.where then discards.
        patch_index = (position_ids - self.config.image_start_position).clamp(0, num_patches - 1)
        gathered = torch.gather(features, 1, patch_index.unsqueeze(-1).expand(-1, -1, features.shape[-1]))
        is_image = (input_ids == self.config.image_token_id).unsqueeze(-1)
        return torch.where(is_image, gathered.to(embeds.dtype), embeds)

    def forward(
        self,
        input_ids: Tensor,
        position_ids: Tensor,
        pixel_values: Tensor | None = None,
        labels: Tensor | None = None,
        image_decoder_labels: Tensor | None = None,
        foundation_loss_weights: Tensor | None = None,
        image_decoder_loss_weights: Tensor | None = None,
        **unused: Any,
    ) -> dict[str, Tensor]:
        """Both losses when any labels are given (a missing one counts as all-ignored), else both logits."""
        hidden = self.decoder.forward_hidden(self.embed(input_ids, position_ids, pixel_values), position_ids)
        logits = self.decoder.lm_head(hidden)
        image_logits = self.image_head(hidden)
        if labels is None and image_decoder_labels is None:
            return {"logits": logits, "image_logits": image_logits}
        return {
            "foundation_loss": _loss_or_zero(logits, labels, foundation_loss_weights),
            "image_decoder_loss": _loss_or_zero(image_logits, image_decoder_labels, image_decoder_loss_weights),
        }

    def flops_per_token(self, seq_len: int) -> float:
        """6 x matmul params (all but the token embedding, vision counted per token: an upper bound) + attention."""
        lm = self.config.lm
        return decoder_flops_per_token(
            self, lm.num_layers, lm.hidden_size, seq_len, exclude=(self.decoder.embed_tokens.weight,)
        )


def _loss_or_zero(logits: Tensor, labels: Tensor | None, weights: Tensor | None) -> Tensor:
    if labels is None:
        return logits.sum() * 0.0  # keeps the graph so every rank returns the same keys with grads
    return masked_mean_cross_entropy(logits, labels, weights)
