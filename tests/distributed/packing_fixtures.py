"""Fixtures of the packing tests, importable by spawned processes: float64 Qwen2 and Qwen2-VL (with the image head)
from configs, also on flash-attention's CPU stand-in, samples of varied lengths, and their padded and packed
collates."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from tests.models import varlen_reference
from tests.models.test_hf_models import IMAGE, PAD, image_sample, make_lm, make_vl, text_sample
from veomni_lite.data.collator import collate
from veomni_lite.loss_keys import IGNORE_INDEX
from veomni_lite.models.qwen2_vl import collate_qwen2_vl

NUM_SAMPLES = 8


def text_samples() -> list[dict[str, torch.Tensor]]:
    """Lengths 3 to 21; sample 0 has no target at all, sample 5 only a few."""
    out = []
    for i, n in enumerate((9, 3, 21, 6, 14, 11, 4, 17)):
        sample = {k: v for k, v in text_sample(n, seed=10 + i).items() if k != "image_decoder_labels"}
        if i == 0:
            sample["labels"] = torch.full_like(sample["labels"], IGNORE_INDEX)
        if i == 5:
            sample["labels"][:-3] = IGNORE_INDEX
        out.append(sample)
    return out


def vl_samples() -> list[dict[str, torch.Tensor]]:
    """Images in most samples (two in some), caption samples without image-decoder targets, text-only ones."""
    out = [
        image_sample([(1, 4, 4)], [3, 2], seed=1),
        text_sample(7, seed=2),
        image_sample([(1, 4, 8), (1, 4, 4)], [1, 2, 3], seed=3),
        image_sample([(1, 2, 2)], [0, 4], seed=4),
        text_sample(12, seed=5),
        image_sample([(1, 4, 4)], [6, 1], seed=6),
        image_sample([(1, 2, 4), (1, 2, 2)], [2, 2, 2], seed=7),
        text_sample(4, seed=8),
    ]
    return [{**s, **({"pixel_values": s["pixel_values"].double()} if "pixel_values" in s else {})} for s in out]


def build_text() -> torch.nn.Module:
    return make_lm(seed=3).double()


def build_vl() -> torch.nn.Module:
    return make_vl(seed=3).double()


def build_qwen2_5_vl() -> torch.nn.Module:
    return make_vl(seed=3, family="qwen2_5_vl").double()


def build_qwen3_vl() -> torch.nn.Module:
    return make_vl(seed=3, family="qwen3_vl").double()


def build_qwen3_vl_no_deepstack_on_sp() -> torch.nn.Module:
    """The negative control: Qwen3-VL that drops its deepstack features once sequence parallel is on."""
    model = build_qwen3_vl()
    enable = model.enable_sequence_parallel

    def enable_and_drop(group: object) -> None:
        enable(group)
        model.vlm.model.language_model._deepstack_process = lambda hidden, _mask, _features: hidden

    model.enable_sequence_parallel = enable_and_drop
    return model


def build_text_varlen(use_boundaries: bool = True) -> torch.nn.Module:
    """`build_text` on `VarlenReference`, flash-attention's stand-in (registered in this process)."""
    varlen_reference.register(use_boundaries)
    model = build_text()
    model.config._attn_implementation = varlen_reference.VarlenReference.name
    return model


def build_text_varlen_leaky() -> torch.nn.Module:
    """The negative control: `VarlenReference` ignoring the boundaries."""
    return build_text_varlen(use_boundaries=False)


def build_vl_varlen() -> torch.nn.Module:
    varlen_reference.register()
    model = build_vl()
    model.config.text_config._attn_implementation = varlen_reference.VarlenReference.name
    return model


def collate_text(samples: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return collate(samples, pad_id=PAD)


def pack_text(samples: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return collate(samples, pad_id=PAD, packing=True)


def collate_vl(samples: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return collate_qwen2_vl(samples, IMAGE, 2, PAD)


def pack_vl(samples: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return collate_qwen2_vl(samples, IMAGE, 2, PAD, packing=True)
