"""The policy's weights as a rollout engine takes them: transformers' own names, whole, LoRA merged.

`full_hf_state(model, lora)` gathers the FSDP2-sharded trainer model into whole tensors (collective over the model's
mesh: every rank calls it; `get_model_state_dict` with `full_state_dict`), keeps the transformers model inside the
trainer's wrapper (`hf_child`; an extra head such as the digits' image head is not the engine's), strips the
wrapper's prefix and merges each LoRA adapter into its base weight (W + alpha / rank B A). `engine_model(config)`
builds the plain transformers model of the same architecture that an embedded engine generates with.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from veomni_lite.models.lora import LoraSettings
from veomni_lite.models.pretrained import hf_child
from veomni_lite.models.registry import DTYPES, family_of

__all__ = ["engine_model", "full_hf_state"]


def engine_model(config: Any, dtype: str = "fp32") -> nn.Module:
    """A randomly initialized transformers model of `config`'s family (its weights come from `sync_weights`), eval."""
    cls = family_of(config).hf_class()
    build = cls.from_config if cls.__name__.startswith("Auto") else cls._from_config  # an Auto class, or a model's
    return build(config, attn_implementation="sdpa", dtype=DTYPES[dtype]).eval()


@torch.no_grad()
def full_hf_state(model: nn.Module, lora: LoraSettings | None = None) -> dict[str, torch.Tensor]:
    """Whole weights of the transformers model in `model`, by its own parameter names, adapters merged (collective)."""
    name, _ = hf_child(getattr(model, "module", model))
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    prefix = f"{name}."
    weights = {key[len(prefix) :]: value for key, value in state.items() if key.startswith(prefix)}
    if lora is None:
        return weights
    for key in [k for k in weights if k.endswith(".lora_A.weight")]:
        module = key[: -len(".lora_A.weight")]
        a, b = weights.pop(key), weights.pop(f"{module}.lora_B.weight")
        base = weights[f"{module}.weight"]
        weights[f"{module}.weight"] = (base.double() + lora.scaling * (b.double() @ a.double())).to(base.dtype)
    return weights
