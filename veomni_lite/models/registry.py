"""The model families veomni_lite trains from transformers: the one place an architecture is named.

A `Family` says, for the `model_type`s it covers: which transformers class loads and exports its directories, which
wrapper puts it behind the model contract (`veomni_lite.models.contract.TrainableModel`), whether it takes images and
how (`Vision`: the placeholder token is the config's `image_token_id`, pixels go through the directory's own image
processor, the family's `image_tokens` counts an image's placeholders and its `collate` lays out a micro-batch, e.g.
Qwen-VL's M-RoPE positions; the vision tower's boundaries are computed on the host), which attention implementations,
packing and Ulysses SP it supports, and whether its weights load straight into FSDP2 shards. Any other causal LM
transformers ships (Llama, Qwen3, Mistral, Gemma, ...) is `CAUSAL_LM`. The trainers ask `family_of(config)` and never
name a family.

Adding a family is one entry in `FAMILIES` (or `register_family`) plus its wrapper and tests. Everything here runs no
code from a model directory.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
VARLEN_KERNELS = ("flash_attention_2", "flash_attention_3", "flash_attention_4")


def resolve(target: str) -> Any:
    """The object a `module:name` string names (imported on first use, so the registry loads no model code)."""
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


@dataclass(frozen=True)
class Vision:
    """How a vision-language family takes its images: how many placeholder tokens an image takes, how a micro-batch is
    laid out, and the flags its wrapper reads (the Qwen-VL wrapper's: each input computed on the host from the image
    grid)."""

    collate: str = "veomni_lite.models.qwen2_vl:collate_vl"
    """`module:function(samples, image_token_id, images, pad_id, pad_to_multiple_of, packing)` -> one micro-batch,
    `images` the run's `veomni_lite.data.sft_dataset.ImageProcessing` (Qwen-VL: M-RoPE positions, image features'
    places)."""
    image_tokens: str = "veomni_lite.data.sft_dataset:merged_patches"
    """`module:function(patches, processor)` -> the placeholder tokens of an image the directory's image processor cuts
    into `patches` patches (Qwen-VL: its merger joins merge_size x merge_size patches into one token)."""

    window_attention: bool = False
    """Qwen2.5-VL: windowed blocks (`window_index`, `cu_window_seqlens`) besides the full-attention ones."""
    interpolated_position_embedding: bool = False
    """Qwen3-VL: a learned position grid resampled to each image (`interp_indices`, `interp_weights`)."""
    deepstack: bool = False
    """Qwen3-VL: features of early vision blocks are added to the first decoder layers' image tokens."""
    tower: str = "model.visual"
    """The vision tower's module path in the transformers model (`model.lora` leaves it out unless named)."""


@dataclass(frozen=True)
class Family:
    """One model family (see the module docstring)."""

    name: str
    model_types: tuple[str, ...]
    """The config `model_type`s it covers; empty: any causal LM transformers ships."""
    transformers_class: str
    """The class that loads its directories and that its export loads (`from_pretrained`)."""
    wrapper: str
    """`module:Class` of the trainer-contract wrapper (`from_config(config, dtype)`, `from_pretrained(dir, dtype)`)."""
    vision: Vision | None = None
    attention: tuple[str, ...] = ("sdpa", *VARLEN_KERNELS)
    """Decoder attention implementations (`model.attn_implementation`); vision towers always run SDPA."""
    packing: bool = True
    sequence_parallel: bool = True
    sharded_load: bool = True
    """Weights read straight into each rank's shards (`model.load_sharded`); else rank 0 loads and scatters."""

    @property
    def wrapper_class(self) -> type:
        return resolve(self.wrapper)

    def collate(
        self,
        samples: Sequence[Mapping[str, torch.Tensor]],
        image_token_id: int,
        images: Any,
        pad_id: int,
        pad_to_multiple_of: int = 1,
        packing: bool = False,
    ) -> dict[str, torch.Tensor]:
        """A vision-language family's micro-batch of `samples` (`Vision.collate`)."""
        if self.vision is None:
            raise TypeError(f"{self.name} takes no images: its micro-batches are the text collate's")
        return resolve(self.vision.collate)(samples, image_token_id, images, pad_id, pad_to_multiple_of, packing)

    def image_tokens(self) -> Callable[[int, Any], int]:
        """`Vision.image_tokens`: (patches, processor) -> an image's placeholder tokens."""
        if self.vision is None:
            raise TypeError(f"{self.name} takes no images")
        return resolve(self.vision.image_tokens)

    def hf_class(self) -> type:
        import transformers

        return getattr(transformers, self.transformers_class)

    def build(self, config: Any, dtype: torch.dtype = torch.float32) -> Any:
        """The wrapper around a randomly initialized model of `config`, parameters in `dtype`."""
        return self.wrapper_class.from_config(config, dtype=dtype)

    def load(self, directory: str | Path, dtype: torch.dtype = torch.float32) -> Any:
        """The wrapper around the directory's weights, cast to `dtype` (whatever dtype the files hold)."""
        return self.wrapper_class.from_pretrained(directory, dtype=dtype)


_VL_WRAPPER = "veomni_lite.models.qwen2_vl:QwenVLWithImageHead"
_CAUSAL_LM_WRAPPER = "veomni_lite.models.hf_causal_lm:HFCausalLM"
FAMILIES: list[Family] = [
    Family("qwen2_vl", ("qwen2_vl",), "Qwen2VLForConditionalGeneration", _VL_WRAPPER, Vision()),
    Family(
        "qwen2_5_vl", ("qwen2_5_vl",), "Qwen2_5_VLForConditionalGeneration", _VL_WRAPPER, Vision(window_attention=True)
    ),
    Family(
        "qwen3_vl",
        ("qwen3_vl",),
        "Qwen3VLForConditionalGeneration",
        _VL_WRAPPER,
        Vision(interpolated_position_embedding=True, deepstack=True),
    ),
    # mixtures of experts (routed experts as fused 3-D tensors; see models/routing.py); any other MoE causal LM
    # transformers ships (Mixtral, OLMoE, DeepSeek-V3, ...) is CAUSAL_LM
    Family("qwen3_moe", ("qwen3_moe",), "Qwen3MoeForCausalLM", _CAUSAL_LM_WRAPPER),
    Family(
        "qwen3_vl_moe",
        ("qwen3_vl_moe",),
        "Qwen3VLMoeForConditionalGeneration",
        _VL_WRAPPER,
        Vision(interpolated_position_embedding=True, deepstack=True),
    ),
]
CAUSAL_LM = Family("causal_lm", (), "AutoModelForCausalLM", _CAUSAL_LM_WRAPPER)
# A causal LM's decoder with one score per sequence (`pref.loss: bradley_terry`): a config whose `architectures` name
# a `...ForSequenceClassification` class.
REWARD_MODEL = Family(
    "reward_model", (), "AutoModelForSequenceClassification", "veomni_lite.models.hf_reward_model:HFRewardModel"
)


def register_family(family: Family) -> Family:
    """Add `family` to `FAMILIES` (a `model_type` another family covers is an error); returns it."""
    taken = {t: f.name for f in FAMILIES for t in f.model_types}
    if family.name in {f.name for f in FAMILIES} or any(t in taken for t in family.model_types):
        raise ValueError(f"family {family.name!r}: its name or a model_type of {family.model_types} is registered")
    FAMILIES.append(family)
    return family


def family_of(config_or_model_type: Any) -> Family:
    """The family of a transformers config (or a `model_type` string): a listed one, `REWARD_MODEL` for a config of a
    `...ForSequenceClassification`, else `CAUSAL_LM`."""
    model_type = getattr(config_or_model_type, "model_type", config_or_model_type)
    architectures = getattr(config_or_model_type, "architectures", None) or []
    if any(name.endswith("ForSequenceClassification") for name in architectures):
        return REWARD_MODEL
    for family in FAMILIES:
        if model_type in family.model_types:
            return family
    return CAUSAL_LM


def is_model_type(name: str) -> bool:
    """Whether `name` is a `model_type` some family trains (a listed one, or a causal LM transformers ships)."""
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    listed = any(name in family.model_types for family in FAMILIES)
    return listed or (name in CONFIG_MAPPING and name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def dtype_of(config: Any) -> torch.dtype:
    """The dtype a transformers config says its weights are stored in (float32 when it says none)."""
    dtype = getattr(config, "dtype", None) or torch.float32
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype
